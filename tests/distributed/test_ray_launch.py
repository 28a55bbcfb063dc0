"""`hybridrec launch --ray`: a tiny Persia job (1 PS, 1 embedding worker, 2 trainers) on a local Ray
instance of 2 CPUs that this module starts: it converges and leaves no actor or shared memory
behind; a PS actor killed mid-run comes back on its shared memory with every update it had
applied, and the job still takes every step; with replicas, one that cannot come back is failed
over and replaced."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ray = pytest.importorskip("ray", reason="the Ray tests need hybridrec[ray] (pip install -e '.[ray]')")

from hybridrec.comm.auth import AUTH_KEY_ENV, AUTH_KEY_FILE_ENV, JobKey  # noqa: E402
from hybridrec.parallel.ray_launch import NAMESPACE  # noqa: E402
from helpers import elastic_status, finish, interrupt, scale_job, steps_of_one_epoch, trained_steps, wait_for

JOB_SECONDS = 240  # bound on one job (the launcher's --timeout; `finish` kills it some time later)


@pytest.fixture(scope="module")
def ray_address(tmp_path_factory):
    """A new local Ray instance with 2 CPUs; the jobs attach to it from their own process. Its workers
    run at normal priority, as in the instance `--ray auto` starts (Ray's default is nice 15)."""
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             _temp_dir=str(tmp_path_factory.mktemp("ray")), _system_config={"worker_niceness": 0})
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


def write_config(tmp_path: Path, **train) -> Path:
    config = {
        "seed": 3,
        "data": {"format": "synthetic", "batch_size": 256,
                 "synthetic": {"vocab_size": 300, "zipf_exponent": 1.05, "train_rows": 12_000,
                               "test_rows": 3_000, "n_dense": 4, "n_categorical": 8, "id_weight_std": 0.6}},
        "model": {"name": "deepfm", "embedding_dim": 4, "hparams": {"hidden": [16]}},
        "embedding": {"default": {"capacity": 10_000, "optimizer": {"name": "adagrad", "lr": 0.1}},
                      "wide": {"optimizer": {"lr": 0.3}}},
        "train": {"epochs": 1, "dense_optimizer": {"name": "adam", "lr": 0.02}, "log_every": 2,
                  "progress": False, "output_dir": str(tmp_path / "run"), **train},
        # the PS is down for a few seconds when it is killed: lookups wait, retry, go on
        "strategy": {"preset": "persia", "tau": 2, "request_timeout": 10, "retries": 5,
                     "roles": {"ps_servers": 1, "embedding_workers": 1, "trainers": 2},
                     "resources": {"ps_servers": {"cpus": 0.25}, "embedding_workers": {"cpus": 0.25},
                                   "trainers": {"cpus": 0.5}}},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


# the job's key, configured in the launcher's environment so that the test reaches its servers too
JOB_KEY = JobKey.new()


def start_job(config: Path, address: str, log: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "hybridrec.cli", "launch", str(config), "--ray", address, "--overwrite",
               "--timeout", str(JOB_SECONDS)]
    env = {**{k: v for k, v in os.environ.items() if k != AUTH_KEY_FILE_ENV}, AUTH_KEY_ENV: JOB_KEY.secret}
    return subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True, env=env)


def job_id(log: Path) -> str | None:
    text = log.read_text()
    return text.split("[launch] job ", 1)[1].split(" ", 1)[0] if "[launch] job " in text else None


def job_actors(job: str) -> list[str]:
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == NAMESPACE and job in a["name"]]


def applied_updates(address: str) -> int:
    """Pushes the PS server has applied, all its tables together (a counter in its shared memory)."""
    from hybridrec.ps.client import PSClient

    client = PSClient([address], timeout=2.0, retries=0, key=JOB_KEY)
    try:
        return sum(table["step"] for table in client.stats()[0]["tables"].values())
    finally:
        client.close()


def test_a_job_on_ray_converges_and_leaves_nothing_behind(tmp_path, ray_address):
    config, log = write_config(tmp_path), tmp_path / "launch.log"
    code = finish(start_job(config, ray_address, log), log)
    text = log.read_text()
    assert code == 0, text[-3000:]
    result = json.loads((tmp_path / "run" / "final_metrics.json").read_text())
    assert result["auc"] > 0.65, result  # chance is 0.5; the planted model reaches ~0.86 on this data
    assert result["step"] == steps_of_one_epoch(config) and result["trainers"] == 2
    assert result["strategy"]["preset"] == "persia" and result["strategy"]["consistency"] == "bounded"
    assert result["route"] == "embedding_workers"
    assert "[ps0] hybridrec-ps listening on" in text and "[ew0] hybridrec-embedding-worker listening on" in text
    assert "[nn] final " in text
    job = job_id(log)
    assert not job_actors(job)
    assert not list(Path("/dev/shm").glob(f"hybridrec-hybridrec-{job}-ps*"))


def test_a_job_of_trainers_alone_runs_on_ray_and_counts_its_trainers_on_the_machine(tmp_path, ray_address):
    """PICASSO's sharded tables: no server role, so no node agent; both trainer actors run on this
    machine, which `auto` interleaving counts (HYBRIDREC_MACHINE_TRAINERS), not one per actor."""
    config, log = write_config(tmp_path), tmp_path / "launch.log"
    job = yaml.safe_load(config.read_text())
    job["strategy"] = {"preset": "picasso", "roles": {"trainers": 2}, "resources": {"trainers": {"cpus": 0.5}},
                       "picasso": {"micro_batches": 2}}
    config.write_text(yaml.safe_dump(job))
    code = finish(start_job(config, ray_address, log), log)
    assert code == 0, log.read_text()[-3000:]
    result = json.loads((tmp_path / "run" / "final_metrics.json").read_text())
    assert result["step"] == steps_of_one_epoch(config) and result["trainers"] == 2
    assert "for 2 trainers on this machine (the launcher's count" in result["interleaving"]["why"], result["interleaving"]
    assert not job_actors(job_id(log))


EPOCHS = 4  # long enough that the job is still training when the killed PS comes back


def test_a_ps_actor_killed_mid_run_keeps_its_updates_and_the_job_completes(tmp_path, ray_address):
    config, log = write_config(tmp_path, epochs=EPOCHS), tmp_path / "launch.log"
    process = start_job(config, ray_address, log)
    try:
        address = wait_for(lambda: next((line.split(" serves at ")[1].split()[0] for line in log.read_text().splitlines()
                                         if line.startswith("[launch] ps0 serves at ")), None),
                           JOB_SECONDS, "the PS to serve", log)
        wait_for(lambda: trained_steps(tmp_path / "run") >= 4, JOB_SECONDS, "4 training steps", log)
        victim = ray.get_actor(f"hybridrec-{job_id(log)}-ps0", namespace=NAMESPACE)
        before = applied_updates(f"tcp://{address}")
        ray.kill(victim, no_restart=False)  # Ray restarts it, on the same node, port and shared memory
        # the kill takes effect a moment later: the updates are counted once the launcher saw it die
        wait_for(lambda: "ps0 died; Ray restarts it" in log.read_text(), 60, "the launcher to see ps0 die", log)
        after = wait_for(lambda: _answer(applied_updates, f"tcp://{address}"), 60, "the restarted PS", log)
        assert after >= before > 0  # every update it had applied (and so acknowledged) is still there
    finally:
        code = finish(process, log)
    text = log.read_text()
    assert code == 0, text[-3000:]
    assert "ps0 died; Ray restarts it" in text
    result = json.loads((tmp_path / "run" / "final_metrics.json").read_text())
    assert result["step"] == EPOCHS * steps_of_one_epoch(config), result
    assert result["auc"] > 0.6, result
    assert not job_actors(job_id(log))


def test_hybridrec_scale_starts_and_retires_ps_actors_while_the_job_trains(tmp_path, ray_address):
    """Made longer than the test needs, the job is interrupted once it trained on after the events."""
    config, log, run = write_config(tmp_path, epochs=1000), tmp_path / "launch.log", tmp_path / "run"
    process = start_job(config, ray_address, log)
    try:
        wait_for(lambda: trained_steps(run) >= 2 and (run / "control.json").is_file(), JOB_SECONDS, "2 steps", log)
        assert len(scale_job(run, 2, log)["servers"]) == 2
        assert len(scale_job(run, 1, log)["servers"]) == 1
        wait_for(lambda: "ps1 retired" in log.read_text(), 60, "the emptied PS actor to stop", log)
        steps = trained_steps(run)
        wait_for(lambda: trained_steps(run) >= steps + 4, JOB_SECONDS, "training after the scale events", log)
        status = elastic_status(run)
        assert status["scale_events"] == 2 and status["buckets_moved"] == 4096, status
    finally:
        code = interrupt(process, log)
    check_interrupted(code, log, run, "[launch] ps1 serves at ", "scale: 1 -> 2 PS servers")



def test_a_ps_actor_that_cannot_come_back_is_failed_over_and_replaced_while_the_job_trains(tmp_path, ray_address):
    """ps_replicas 2 on 2 PS actors: ps1 is killed with its restart refused (as when its node is lost
    for good); its buckets fail over to their backups on ps0, a new PS actor takes its place, and
    the job trains on. Made longer than the test needs, the job is interrupted once it trained on."""
    config, log, run = write_config(tmp_path, epochs=1000), tmp_path / "launch.log", tmp_path / "run"
    job = yaml.safe_load(config.read_text())
    job["strategy"]["roles"]["ps_servers"], job["strategy"]["ps_replicas"] = 2, 2
    config.write_text(yaml.safe_dump(job))
    process = start_job(config, ray_address, log)
    try:
        wait_for(lambda: trained_steps(run) >= 2 and (run / "control.json").is_file(), JOB_SECONDS, "2 steps", log)
        ray.kill(ray.get_actor(f"hybridrec-{job_id(log)}-ps1", namespace=NAMESPACE), no_restart=True)
        wait_for(lambda: "ps2 replaces ps1" in log.read_text(), JOB_SECONDS, "a PS actor in place of ps1", log)
        steps = trained_steps(run)
        wait_for(lambda: trained_steps(run) >= steps + 4, JOB_SECONDS, "training after the loss", log)
        status = elastic_status(run)
        assert status["failovers"] == 1 and len(status["servers"]) == 2, status
    finally:
        code = interrupt(process, log)
    check_interrupted(code, log, run, "ps1 is lost for good", "[launch] ps2 serves at ")


def check_interrupted(code: int, log: Path, run: Path, *lines: str) -> None:
    """A job interrupted by its test ended as it should: exit 130, `lines` in its log, no actor and
    no control file left."""
    text = log.read_text()
    assert code == 130 and all(line in text for line in lines), text[-3000:]
    assert not job_actors(job_id(log)) and not (run / "control.json").exists()

def _answer(ask, *args):
    """ask(*args), or None while the server does not answer."""
    try:
        return ask(*args)
    except (TimeoutError, OSError, RuntimeError):
        return None


def run_cli(*args: str, python_prelude: str = "") -> subprocess.CompletedProcess:
    code = f"{python_prelude}\nimport sys\nfrom hybridrec.cli import main\nsys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)


def test_bad_ray_arguments_are_one_line_with_exit_code_2(tmp_path, ray_address):
    config = write_config(tmp_path)
    host = run_cli("launch", str(config), "--ray", ray_address, "--host", "0.0.0.0")
    assert host.returncode == 2 and host.stderr.strip().splitlines() == [
        "hybridrec launch: error: --host 0.0.0.0 does not apply with --ray: each role binds its node's address "
        "(loopback on a one-node cluster)"]
    too_big = run_cli("launch", str(config), "--ray", ray_address, "--set", "strategy.resources.trainers.cpus=8")
    assert too_big.returncode == 2, too_big.stderr
    assert "strategy.resources" in too_big.stderr and "16.5 CPU" in too_big.stderr and "has 2" in too_big.stderr
    assert "Traceback" not in too_big.stderr
    without_ray = run_cli("launch", str(config), "--ray", "auto", python_prelude="import sys; sys.modules['ray'] = None")
    assert without_ray.returncode == 2 and "pip install 'hybridrec[ray]'" in without_ray.stderr


def test_a_ray_cluster_across_emulated_hosts_runs_the_job_on_several_nodes(tmp_path):
    """The multi-node case: a head node and two worker nodes, each in its own emulated host; Ray
    places the roles on them, the job converges over the shaped links, and no namespace is left."""
    from hybridrec.parallel.emulated_hosts import check_support, list_namespaces

    try:
        check_support()
    except ValueError as why:
        pytest.skip(f"emulated hosts unavailable here: {why}")
    config = write_config(tmp_path)
    log = tmp_path / "launch.log"
    before = set(list_namespaces())
    command = [sys.executable, "-m", "hybridrec.cli", "launch", str(config), "--ray", "auto", "--emulate-hosts", "3",
               "--bandwidth", "1gbit", "--overwrite", "--timeout", str(JOB_SECONDS),
               # 3 Ray nodes and the roles share this machine's cores: give a first lookup time
               "--set", "strategy.request_timeout=60"]
    code = subprocess.run(command, stdout=log.open("w"), stderr=subprocess.STDOUT, timeout=JOB_SECONDS + 400).returncode
    text = log.read_text()
    assert code == 0, text[-4000:]
    assert "Ray cluster of 3 nodes" in text
    serving = set(re.findall(r"serves at (10\.213\.0\.[0-9]+):", text))
    nodes = set(re.findall(r"serves at [0-9.]+:[0-9]+ \(pid [0-9]+, node ([0-9a-f]+)\)", text))
    assert serving and len(nodes) == len(serving)  # each node serves on its own host's address
    result = json.loads((tmp_path / "run" / "final_metrics.json").read_text())
    assert result["step"] == steps_of_one_epoch(config)
    assert result["auc"] > 0.55
    assert set(list_namespaces()) <= before
    with pytest.raises(subprocess.CalledProcessError):  # --ray ADDRESS and --emulate-hosts exclude each other
        subprocess.run([sys.executable, "-m", "hybridrec.cli", "launch", str(config), "--ray", "10.0.0.1:6379",
                        "--emulate-hosts", "2"], check=True, capture_output=True, timeout=120)
