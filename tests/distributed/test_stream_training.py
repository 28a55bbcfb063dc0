"""Training on streams (issue 33), with real processes: `hybridrec train` on a `files` directory
and on a Redis stream is killed with SIGKILL at random moments and resumed, and the records its
checkpoints say were trained (record_sample_ids) are exactly the records produced, each once; a
2-trainer job of a lockstep strategy (PICASSO's sharded placement with AllReduce) finishes, and
trains every record, when one trainer's share of the files runs dry long before the other's."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import yaml

from helpers import redis_server  # noqa: F401 (a fixture)
from hybridrec.data.stream.backends.files import file_sample_ids
from hybridrec.data.synthetic import write_synthetic

ROWS, FILES, BATCH = 900, 5, 128
KILLS = 2  # SIGKILLs per test, each at a random moment of a run
RUN_SECONDS = 180  # bound on one run of `hybridrec train`


def _config(tmp_path: Path, stream: dict, **train) -> Path:
    write_synthetic(tmp_path / "test.tsv", 500, seed=0, first_row=100_000)
    config = {
        "seed": 0,
        "data": {"format": "criteo", "batch_size": BATCH, "test_path": str(tmp_path / "test.tsv"), "prefetch": 2,
                 "stream": {"idle_timeout": 2.0, "poll_interval": 0.1, "record_sample_ids": True, **stream}},
        "model": {"name": "deepfm", "embedding_dim": 4, "hparams": {"hidden": [16]}},
        "embedding": {"default": {"capacity": 50_000, "optimizer": {"name": "adagrad", "lr": 0.1}}},
        "train": {"output_dir": str(tmp_path / "run"), "checkpoint_every": 2, "progress": False, "log_every": 5,
                  "threads": 1, **train},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _train(config: Path, log: Path, resume: bool) -> subprocess.Popen:
    again = "--resume" if resume and (config.parent / "run" / "checkpoints" / "latest").exists() else "--overwrite"
    return subprocess.Popen([sys.executable, "-m", "hybridrec.cli", "train", str(config), again],
                            stdout=log.open("a"), stderr=subprocess.STDOUT)


def _trained_ids(run: Path) -> Counter:
    """The sample ids the run's checkpoints cover, every trainer's, each as often as it was trained."""
    files = sorted((run / "sample_ids").glob("rank-*/step-*.npy"))
    return Counter(np.concatenate([np.load(f) for f in files]).tolist() if files else [])


def _kill_and_resume(config: Path, tmp_path: Path, feed=None) -> subprocess.CompletedProcess:
    """KILLS runs each killed (SIGKILL) at a random moment, then one run left to end by itself
    (the stream goes idle); `feed(i)` runs before run i (more data arriving meanwhile)."""
    log = tmp_path / "train.log"
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    for attempt in range(KILLS):
        if feed is not None:
            feed(attempt)
        process = _train(config, log, resume=attempt > 0)
        time.sleep(rng.uniform(2.0, 7.0))  # start-up, training, checkpoints: any of them
        process.send_signal(signal.SIGKILL)
        process.wait(30)
    if feed is not None:
        feed(KILLS)
    process = _train(config, log, resume=True)
    assert process.wait(RUN_SECONDS) == 0, log.read_text()[-3000:]
    return log


def test_files_stream_killed_at_random_moments_trains_every_record_once(tmp_path):
    incoming = tmp_path / "incoming"
    produced = Counter()

    def arrive(index: int) -> None:  # partitions keep arriving between the runs
        for part in range(index * FILES // (KILLS + 1), (index + 1) * FILES // (KILLS + 1)):
            directory = incoming / f"dt={part:02d}"
            directory.mkdir(parents=True)
            write_synthetic(directory / "part-0.tsv", ROWS, seed=0, first_row=part * ROWS)
            (directory / "_SUCCESS").touch()
            produced.update(file_sample_ids(f"dt={part:02d}/part-0.tsv", np.arange(ROWS)).tolist())

    log = _kill_and_resume(_config(tmp_path, {"backend": "files", "path": str(incoming)}), tmp_path, arrive)
    assert _trained_ids(tmp_path / "run") == produced, log.read_text()[-2000:]


def test_redis_stream_killed_at_random_moments_trains_every_record_once(tmp_path, redis_server):
    from hybridrec.data.stream.backends.redis import entry_sample_ids
    from hybridrec.data.stream.producer import produce, synthetic_lines

    url = redis_server.url("clicks")
    produced = Counter()

    def arrive(index: int) -> None:
        lines = synthetic_lines(ROWS, seed=0, first_row=index * ROWS)
        produced.update(entry_sample_ids(produce(url, lines, keep_ids=True).ids).tolist())

    config = _config(tmp_path, {"backend": "redis", "url": url})
    log = _kill_and_resume(config, tmp_path, arrive)
    assert _trained_ids(tmp_path / "run") == produced, log.read_text()[-2000:]
    import redis

    assert redis.Redis(port=redis_server.port).xpending("clicks", f"hybridrec:{tmp_path / 'run'}")["pending"] == 0


def _lockstep_worker(rank: int, size: int, port: int, cfg: dict) -> None:
    import torch
    import torch.distributed as dist

    from hybridrec.config import parse_config
    from hybridrec.train.trainer import train

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=size)
    torch.set_num_threads(1)
    try:
        result = train(parse_config(cfg), overwrite=True)
    except BaseException:
        dist.destroy_process_group()
        raise
    Path(cfg["train"]["output_dir"], f"result-{rank}.yaml").write_text(yaml.safe_dump(
        {"step": result["step"], "empty_steps": result["stream"]["stream_empty_steps"]}))
    os._exit(0)  # as test_des_distributed's workers: no interpreter teardown, where a gloo rank has aborted


def test_lockstep_trainers_finish_and_train_everything_when_one_share_runs_dry(tmp_path):
    """PICASSO (sharded tables over AllToAll, AllReduce): trainer 0's share is 4 files, trainer
    1's one; trainer 1 steps with empty batches once dry, trainer 0 trains all of its share, and
    the job ends when trainer 1's stream has been idle for idle_timeout."""
    import socket

    import torch.multiprocessing as mp

    from hybridrec.data.stream.backends.files import name_key

    incoming = tmp_path / "incoming"
    incoming.mkdir()
    shares, produced, index = {0: 0, 1: 0}, Counter(), 0
    while shares[0] < 4 or shares[1] < 1:
        name = f"part-{index:03d}.tsv"
        rank = name_key(name) % 2
        if shares[rank] < (4 if rank == 0 else 1):
            write_synthetic(incoming / name, 300, seed=0, first_row=index * 300)
            produced.update(file_sample_ids(name, np.arange(300)).tolist())
            shares[rank] += 1
        index += 1
    config = yaml.safe_load(_config(tmp_path, {"backend": "files", "path": str(incoming), "complete": "rename",
                                               "idle_timeout": 4.0}, checkpoint_every=4).read_text())
    config["data"]["batch_size"] = 100
    config["strategy"] = {"preset": "picasso", "roles": {"trainers": 2}}
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = mp.start_processes(_lockstep_worker, args=(2, port, config), nprocs=2, start_method="spawn", join=False)
    deadline = time.monotonic() + 2 * RUN_SECONDS  # two spawned trainers compile their kernels first
    while not context.join(timeout=5):
        assert time.monotonic() < deadline, "the 2-trainer job did not finish: deadlocked?"
    results = [yaml.safe_load((tmp_path / "run" / f"result-{r}.yaml").read_text()) for r in range(2)]
    # trainer 0's 4 x 3 batches; trainer 1 stepped empty 9 times, and no step was taken while both were dry
    assert results[0]["step"] == results[1]["step"] == 12
    assert results[1]["empty_steps"] >= 9
    assert _trained_ids(tmp_path / "run") == produced
