"""A 2-trainer Persia job under `hybridrec launch` with strategy.ps_replicas 2 survives, while it
trains, a scale-out (2 -> 3 PS servers), a scale-in (3 -> 2) and the loss of a PS host (its
process SIGKILLed and its shared memory removed): it goes on training after each, and its
launcher reports the events. The job is made longer than the test needs and interrupted once
it trained on after the failover, so the test takes as long as the events, whatever the load.
(What moves preserve, update by update, is tests/distributed/test_elastic_ps.py's.)"""
import json
import os
import shutil
import signal

import yaml
from helpers import (elastic_status, interrupt, job_shared_memory, no_role_left, processes_with, scale_job,
                     start_launch, trained_steps, wait_for, write_config)

SECONDS = 300


def test_a_two_trainer_job_survives_scale_out_scale_in_and_a_host_loss(tmp_path):
    config = write_config(tmp_path, epochs=1000)
    data = yaml.safe_load(config.read_text())
    data["strategy"]["ps_replicas"] = 2
    config.write_text(yaml.safe_dump(data))
    run, log = tmp_path / "run", tmp_path / "launch.log"
    launcher = start_launch(config, log, seconds=SECONDS)
    try:
        wait_for(lambda: trained_steps(run) >= 5 and (run / "control.json").is_file(), SECONDS, "5 steps", log)
        assert len(scale_job(run, 3, log)["servers"]) == 3
        assert len(scale_job(run, 2, log)["servers"]) == 2
        job = log.read_text().split("[launch] job ", 1)[1].split(":", 1)[0]
        ps0 = processes_with("serve-ps", f"hybridrec-{job}-ps0")
        assert ps0, log.read_text()[-3000:]
        os.kill(ps0[0], signal.SIGKILL)  # the host is lost: its process and its memory
        for path in job_shared_memory(log):
            if f"-{job}-ps0." in path.name:
                shutil.rmtree(path, ignore_errors=True)
        wait_for(lambda: "failover done" in log.read_text(), SECONDS, "the failover", log)
        steps = trained_steps(run)
        wait_for(lambda: trained_steps(run) >= steps + 10, SECONDS, "training after the failover", log)
        status = elastic_status(run)
        assert status["failovers"] == 1 and status["scale_events"] >= 2 and status["buckets_moved"] >= 2 * 1365
        assert interrupt(launcher, log) == 130, log.read_text()[-3000:]
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait(10)
    last = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()][-1]
    assert last["auc"] > 0.6, last  # it learned (chance is 0.5)
    assert not (run / "control.json").exists() and not (run / "control.key").exists() and no_role_left(config)
