"""What several test files share: small job configs, starting and awaiting `hybridrec launch`
jobs and their processes, and raw requests to a server. Tests import it as `helpers` (tests/ is
on sys.path, see conftest.py)."""
import copy
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
import zmq

from hybridrec.config import parse_config
from hybridrec.train.loop import load_local

JOB_SECONDS = 300  # bound on one job here (cold numba caches compile the kernels in each role first)

HT_JOB_SECONDS = 420  # bound on one Hierarchical Training job (4 trainers and the group copies)
TAU = 2

LEARNT_GAP = 0.06  # how far below the planted model's test AUC a trained job may end


SMALL = {
    "seed": 0,
    "data": {"format": "synthetic", "batch_size": 512, "prefetch": 2,
             "synthetic": {"vocab_size": 200, "train_rows": 20_000, "test_rows": 5_000}},
    "model": {"name": "deepfm", "embedding_dim": 4, "hparams": {"hidden": [16]}},
    "embedding": {"default": {"capacity": 20_000, "optimizer": {"name": "adagrad", "lr": 0.1}}},
    "train": {"progress": False, "log_every": 10, "dense_optimizer": {"name": "adam", "lr": 0.01}},
}


def small_config(tmp_path, name="run", **changes):
    """SMALL with dotted-key changes, writing to tmp_path/name."""
    data = copy.deepcopy(SMALL)
    data["train"]["output_dir"] = str(tmp_path / name)
    for key, value in changes.items():
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return parse_config(data)


def trained_state(cfg):
    """Dense state dict and exported embedding rows of the latest checkpoint of `cfg`'s run."""
    model, placement, _ = load_local(cfg, cfg.train.output_dir)
    rows = {(c, t): store.export() for c, col in placement.collections.items() for t, store in col.stores.items()}
    return model.state_dict(), rows


def write_config(tmp_path: Path, **train) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    config = {
        "seed": 3,
        "data": {"format": "synthetic", "batch_size": 256,
                 "synthetic": {"vocab_size": 300, "zipf_exponent": 1.05, "train_rows": 40_000,
                               "test_rows": 4_000, "n_dense": 4, "n_categorical": 8,
                               "id_weight_std": 0.6}},
        "model": {"name": "deepfm", "embedding_dim": 4, "hparams": {"hidden": [16]}},
        "embedding": {"default": {"capacity": 10_000, "optimizer": {"name": "adagrad", "lr": 0.1}},
                      "wide": {"optimizer": {"lr": 0.3}}},
        "train": {"epochs": 1, "dense_optimizer": {"name": "adam", "lr": 0.02}, "log_every": 5,
                  "output_dir": str(tmp_path / "run"), **train},
        "strategy": {"preset": "persia", "tau": TAU, "request_timeout": 20, "retries": 3},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def start_launch(config: Path, log: Path, *extra: str, ps: int = 2, trainers: int = 2, embedding_workers: int = 1,
                 seconds: int = JOB_SECONDS) -> subprocess.Popen:
    """`hybridrec launch` of `config` in its own session, its output to `log`, bounded by `seconds`."""
    command = [sys.executable, "-m", "hybridrec.cli", "launch", str(config), "--ps", str(ps),
               "--embedding-workers", str(embedding_workers), "--trainers", str(trainers), "--overwrite",
               "--timeout", str(seconds), *extra]
    return subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)


def finish(process: subprocess.Popen, log: Path, seconds: int = JOB_SECONDS) -> int:
    """The launcher's exit code; it fails the test, killing the launcher, if it outlives its own
    `--timeout` of `seconds` by a minute."""
    try:
        return process.wait(seconds + 60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)
        pytest.fail("the launcher outlived its own --timeout:\n" + log.read_text()[-3000:])


def processes_with(*needles: str) -> list[int]:
    """Pids of live processes whose command line contains every needle."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().split(") ")[-1][:1]
        except OSError:
            continue
        if state != "Z" and all(n in cmdline for n in needles):
            found.append(int(entry.name))
    return found


def wait_for(condition, seconds: float, what: str, log: Path):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    pytest.fail(f"timed out waiting for {what}:\n" + log.read_text()[-3000:])


def trained_steps(run: Path) -> int:
    path = run / "metrics.jsonl"
    if not path.is_file():
        return 0
    steps = [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]
    return max(steps, default=0)


def steps_of_one_epoch(config: Path) -> int:
    """Steps every rank takes in one epoch: the batches of the shortest of the 2 ranks' shards."""
    from hybridrec.config import load_config
    from hybridrec.job.sources import build_sources

    cfg = load_config(config)
    return min(sum(1 for _ in build_sources(cfg.data, cfg.seed, rank, 2, with_best_auc=False).train)
               for rank in range(2))


def job_shared_memory(log: Path) -> list[Path]:
    """The job's shared-memory folders still present (the launcher logs its job id first)."""
    job = log.read_text().split("[launch] job ", 1)[1].split(":", 1)[0]
    return list(Path("/dev/shm").glob(f"hybridrec-hybridrec-{job}-ps*"))


def no_role_left(config: Path) -> bool:
    return not processes_with(str(config))


def kill_a_trainer_after_a_checkpoint(config: Path, run: Path, log: Path, steps: int = 25,
                                      seconds: float = JOB_SECONDS) -> None:
    """Once the run has a checkpoint and `steps` steps, SIGKILL one trainer process (not torchrun)."""
    latest = run / "checkpoints" / "latest"
    wait_for(lambda: latest.is_file() and trained_steps(run) >= steps, seconds,
             f"a checkpoint and {steps} steps", log)
    workers = [pid for pid in processes_with("hybridrec.parallel.trainer", str(config))
               if "torch.distributed.run" not in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")]
    assert workers, "no trainer process found"
    os.kill(workers[0], signal.SIGKILL)


def launch_ht_job(tmp_path: Path, ht: dict, trainers: int = 4, seconds: int = HT_JOB_SECONDS) -> dict:
    """Run the small test job with preset ht and strategy.ht = `ht` on loopback; its final metrics."""
    config = write_config(tmp_path)
    data = yaml.safe_load(config.read_text())
    data["strategy"] = {**data["strategy"], "preset": "ht", "ht": ht}
    config.write_text(yaml.safe_dump(data))
    log = tmp_path / "launch.log"
    code = subprocess.run([sys.executable, "-m", "hybridrec.cli", "launch", str(config), "--ps", "1",
                           "--embedding-workers", "1", "--trainers", str(trainers), "--overwrite", "--timeout",
                           str(seconds)], stdout=log.open("w"), stderr=subprocess.STDOUT,
                          timeout=seconds + 60).returncode
    assert code == 0, log.read_text()[-3000:]
    return json.loads((tmp_path / "run" / "final_metrics.json").read_text())


def raw_request(address, frames, timeout_ms=5000, key=None):
    """Send hand-made frames from a bare DEALER (a CURVE client with `key`) and return the
    parsed reply header."""
    context = zmq.Context.instance()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    if key is not None:
        key.secure_client(dealer)
    dealer.connect(address)
    try:
        dealer.send_multipart(frames)
        assert dealer.poll(timeout_ms), "the server did not answer a malformed request"
        return json.loads(dealer.recv_multipart()[0])
    finally:
        dealer.close()


@pytest.fixture
def redis_server():
    """A real redis-server on loopback (a free port, a temporary directory), stopped after the test;
    the test skips, saying why, where redis-server or the Redis client is not installed."""
    from hybridrec.data.stream.redis_server import LocalRedis, redis_server_path

    if redis_server_path() is None:
        pytest.skip("redis-server is not installed (scripts/test.sh installs Debian's redis-server)")
    pytest.importorskip("redis", reason="the Redis client is not installed: pip install 'hybridrec[stream]'")
    with LocalRedis() as server:
        yield server
