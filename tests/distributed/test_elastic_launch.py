"""A 2-trainer Persia job under `hybridrec launch` with strategy.ps_replicas 2 survives, while it
trains, a scale-out (2 -> 3 PS servers), a scale-in (3 -> 2) and the loss of a PS host (its
process SIGKILLed and its shared memory removed): it finishes, learns, and reports the moves."""
import json
import os
import shutil
import signal
import subprocess
import sys

import yaml
from helpers import finish, job_shared_memory, processes_with, start_launch, trained_steps, wait_for, write_config

SECONDS = 600


def scale(run, count, log):
    done = subprocess.run([sys.executable, "-m", "hybridrec.cli", "scale", str(run), "--ps", str(count), "--json"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr + log.read_text()[-3000:]
    return json.loads(done.stdout)


def test_a_two_trainer_job_survives_scale_out_scale_in_and_a_host_loss(tmp_path):
    config = write_config(tmp_path, epochs=2)
    data = yaml.safe_load(config.read_text())
    data["strategy"]["ps_replicas"] = 2
    config.write_text(yaml.safe_dump(data))
    run, log = tmp_path / "run", tmp_path / "launch.log"
    launcher = start_launch(config, log, seconds=SECONDS)
    try:
        wait_for(lambda: trained_steps(run) >= 10 and (run / "control.json").is_file(), SECONDS, "10 steps", log)
        out = scale(run, 3, log)
        assert len(out["servers"]) == 3 and out["buckets_moved"] >= 1365
        wait_for(lambda: trained_steps(run) >= 25, SECONDS, "training after the scale-out", log)
        back = scale(run, 2, log)
        assert len(back["servers"]) == 2 and back["buckets_moved"] > out["buckets_moved"]
        steps = trained_steps(run)
        wait_for(lambda: trained_steps(run) >= steps + 10, SECONDS, "training after the scale-in", log)
        job = log.read_text().split("[launch] job ", 1)[1].split(":", 1)[0]
        ps0 = processes_with("serve-ps", f"hybridrec-{job}-ps0")
        assert ps0, log.read_text()[-3000:]
        os.kill(ps0[0], signal.SIGKILL)  # the host is lost: its process and its memory
        for path in job_shared_memory(log):
            if f"-{job}-ps0." in path.name:
                shutil.rmtree(path, ignore_errors=True)
        wait_for(lambda: "failover done" in log.read_text(), 120, "the failover", log)
        assert finish(launcher, log, SECONDS) == 0, log.read_text()[-4000:]
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait(10)
    final = json.loads((run / "final_metrics.json").read_text())
    assert final["ps_failovers"] == 1 and final["ps_buckets_moved"] > back["buckets_moved"] - 1
    assert final["ps_routing_version"] > back["version"] and final["auc"] > 0.6
    assert not (run / "control.json").exists()
