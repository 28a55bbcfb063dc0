"""What several test files share: small job configs, starting and awaiting `hybridrec launch`
jobs and their processes, and raw requests to a server. Tests import it as `helpers` (tests/ is
on sys.path, see conftest.py)."""
import copy
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml
import zmq

from hybridrec.config import parse_config
from hybridrec.train.evaluation import load_local

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


def scale_job(run: Path, count: int, log: Path, seconds: float = JOB_SECONDS) -> dict:
    """`hybridrec scale RUN --ps COUNT --json`: the launcher's status once the buckets moved."""
    done = subprocess.run([sys.executable, "-m", "hybridrec.cli", "scale", str(run), "--ps", str(count), "--json"],
                          capture_output=True, text=True, timeout=seconds)
    assert done.returncode == 0, done.stderr + log.read_text()[-3000:]
    return json.loads(done.stdout)


def elastic_status(run: Path) -> dict:
    """The status the launcher's control channel answers (servers, routing version, moves,
    failovers), asked with the job key the launcher wrote."""
    from hybridrec.comm.transport import Client
    from hybridrec.parallel.scale import control_channel

    address, key = control_channel(run)
    with Client(address, timeout=60, retries=0, key=key) as client:
        return client.request("status").meta


def interrupt(launcher: subprocess.Popen, log: Path, seconds: float = 120) -> int:
    """SIGTERM a launcher (a job made longer than the test needs) and its exit code (130)."""
    launcher.send_signal(signal.SIGTERM)
    return finish(launcher, log, int(seconds) - 60)


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


class PredictionServer:
    """`hybridrec serve` in a subprocess on a free loopback port, stopped by `stop()` (or its own
    --timeout); `post`/`get` send one request and return (status, parsed JSON or text)."""

    def __init__(self, bundle, *extra: str, seconds: int = 240, env: dict | None = None):
        command = [sys.executable, "-m", "hybridrec.cli", "serve", str(bundle), "--port", "0", "--timeout",
                   str(seconds), *extra]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        env=env, start_new_session=True)
        seen = []
        for line in self.process.stdout:  # Ray prints its own lines first
            seen.append(line)
            if line.startswith("hybridrec serve:") and " on http://" in line:
                break
        else:
            self.stop()
            pytest.fail("hybridrec serve did not start: " + "".join(seen)[-3000:])
        self.url = line.split(" on ", 1)[1].split()[0]
        self.headers: dict = {}
        self.output = seen  # the rest is read on, so that a chatty server never blocks on a full pipe
        self._reader = threading.Thread(target=lambda: [seen.append(x) for x in self.process.stdout], daemon=True)
        self._reader.start()

    def request(self, method: str, path: str, body=None, raw: bytes | None = None, timeout: float = 30):
        import urllib.error
        import urllib.request

        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        request = urllib.request.Request(self.url + path, data=data, method=method, headers=self.headers)
        try:
            with urllib.request.urlopen(request, timeout=timeout) as answer:
                status, text = answer.status, answer.read().decode()
        except urllib.error.HTTPError as error:
            status, text = error.code, error.read().decode()
        try:
            return status, json.loads(text)
        except ValueError:
            return status, text

    def post(self, path: str, body=None, raw: bytes | None = None):
        return self.request("POST", path, body, raw)

    def get(self, path: str):
        return self.request("GET", path)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
        self._reader.join(10)


def write_test_rows(cfg, path: Path) -> Path:
    """The test rows of a synthetic job `cfg` written as the TSV `hybridrec data synth` writes."""
    from hybridrec.data.synthetic import SyntheticConfig, write_synthetic

    syn = cfg.data.synthetic
    fields = {k: v for k, v in syn.model_dump().items() if k not in ("train_rows", "test_rows")}
    write_synthetic(path, syn.test_rows, seed=cfg.seed, config=SyntheticConfig(**fields), first_row=syn.train_rows)
    return path


def predictions(path: Path):
    """(header, float scores [rows, tasks]) of a predictions CSV (empty fields as NaN)."""
    import numpy as np

    lines = Path(path).read_text().splitlines()
    rows = [[float(x) if x else float("nan") for x in line.split(",")] for line in lines[1:]]
    return lines[0].split(","), np.array(rows, dtype=np.float64).reshape(len(rows), -1)


class PublishingJob:
    """A local job's tables trained by hand (lookups with insertion, then a gradient through the
    pooled rows) and published with `DeltaPublisher`, without the training loop: what delta
    publishing and the version swaps are tested with."""

    def __init__(self, root: Path, **train):
        from hybridrec.data.synthetic import SyntheticConfig, SyntheticReader
        from hybridrec.job.tables import job_dense_model, job_tables
        from hybridrec.strategy.placement.local import LocalPlacement
        from hybridrec.strategy.world import World
        from hybridrec.train.publisher import DeltaPublisher

        changes = {"data.synthetic.train_rows": 4096, "data.synthetic.vocab_size": 5000, "embedding.default.capacity": 3000,
                   "train.publish_dir": str(root / "published"), "train.publish_every": 1, **train}
        self.cfg = small_config(root, **changes)
        self.tables = job_tables(self.cfg)
        self.placement = LocalPlacement(self.cfg, self.tables, World())
        self.model = job_dense_model(self.cfg, self.tables)
        self.publisher = DeltaPublisher(self.cfg, self.tables, World())
        syn = self.cfg.data.synthetic
        fields = {k: v for k, v in syn.model_dump().items() if k not in ("train_rows", "test_rows")}
        reader = SyntheticReader(SyntheticConfig(**fields), syn.train_rows, 256, seed=self.cfg.seed)
        self.batches = itertools.cycle(list(reader))
        self.step = 0

    def train(self, batches: int = 1, scale: float = 1.0) -> None:
        for _, batch in zip(range(batches), self.batches):
            inputs = self.placement.inputs(batch, batch, requires_grad=True)
            directions = torch.Generator().manual_seed(self.step)  # a loss whose gradient points anywhere
            loss = sum((part * torch.randn(part.shape, generator=directions)).sum() for part in (inputs.deep, inputs.wide))
            (scale * loss).backward()
            self.step += 1

    def publish(self) -> int:
        return self.publisher.publish(self.step, {"model": self.model.state_dict()}, self.placement)


def publish_forever(root: str) -> None:
    """Train and publish a version after every batch until killed (tests/unit/test_publishing.py)."""
    job = PublishingJob(Path(root))
    print("started", flush=True)
    while True:
        job.train()
        job.publish()


def summary_of(out: str, title: str = "") -> dict:
    """The `key: value` lines of a command's summary (hybridrec.train.summary) in its output,
    after the line holding `title` when given."""
    if title:
        out = out.split(title, 1)[1]
    pairs = (line.split(":", 1) for line in out.splitlines() if line.startswith("  ") and ":" in line)
    return {key.strip(): value.strip() for key, value in pairs}
