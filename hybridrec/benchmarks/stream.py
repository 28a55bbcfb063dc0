"""`hybridrec bench stream`: online training on streams (issue 33), on real jobs.

Planted synthetic records (`hybridrec data stream --synthetic`: Criteo-format rows of a planted
logistic model, sample ids known from their place in the stream), DeepFM, five scenarios:

- `file`: one pass over the records as one complete file, through the `files` stream backend
  (the file reader under it; `plain_file_samples_per_s` is the same file as plain `data.path`);
- `redis`: the same records from a Redis stream (a `redis-server` the bench starts on loopback);
- `redis_killed`: the Redis stream, the trainer killed (SIGKILL) at a random moment, then
  `--resume` (or a fresh start when no checkpoint was written yet) until the stream is done;
- `arriving_files`: a `files` directory into which the records arrive as 10 files while training
  runs (written under a hidden name, renamed into place), with a kill and a resume;
- `persia_redis`: a 2-trainer Persia job (PS servers, an embedding worker, two trainers under
  torchrun) reading the Redis stream through the job's consumer group.

For each: `samples_per_s` (the job's training samples/s, `final_metrics.json`, of the run that
finished), `trained` (records the checkpoints say were trained, from every trainer's
`record_sample_ids` files), `duplicates` (trained more than once) and `missing` (produced, never
trained), counted by sample id from what the trainers wrote, `progressive_auc` (test-then-train
over the whole stream, of the run that finished) and `test_auc` (held-out rows of the same planted
model). `file` and `redis` run `--repeats` times each, interleaved; their figures are medians.
Targets: 0 duplicates and 0 missing in the last three; redis at least 0.9x file's samples/s;
progressive AUC of redis within 0.005 of file's.

`--json` prints one line: {"file": R, "redis": R, "redis_killed": R, "arriving_files": R,
"persia_redis": R}.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import yaml

from hybridrec.benchmarks.results import pick
from hybridrec.benchmarks.timing import positive_int

SCENARIOS = ("file", "redis", "redis_killed", "arriving_files", "persia_redis")
RUN_SECONDS = 900  # bound on one training run


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybridrec bench stream", description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=positive_int, default=100_000, help="planted records in the stream")
    parser.add_argument("--test-rows", type=positive_int, default=20_000, help="held-out rows of the same model")
    parser.add_argument("--batch-size", type=positive_int, default=2048)
    parser.add_argument("--repeats", type=positive_int, default=3, help="runs of `file` and `redis` each")
    parser.add_argument("--checkpoint-every", type=positive_int, default=10, help="steps between checkpoints")
    parser.add_argument("--seed", type=int, default=0, help="the planted model's seed and the kills' moments")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated, of {','.join(SCENARIOS)}")
    parser.add_argument("--workdir", type=Path, default=None, help="where runs go (default: a temporary directory)")
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    return parser


class _Bench:
    def __init__(self, args, root: Path, redis) -> None:
        self.args, self.root, self.redis = args, root, redis
        self.rng = random.Random(args.seed)
        self.test = root / "test.tsv"
        from hybridrec.data.synthetic import write_synthetic

        write_synthetic(self.test, args.test_rows, seed=args.seed, first_row=10 * args.records)
        self.log = root / "bench.log"

    # -------------------------------------------------------------- jobs
    def config(self, name: str, stream: dict | None, strategy: dict | None = None, path: str | None = None) -> Path:
        a = self.args
        data = {"format": "criteo", "batch_size": a.batch_size, "test_path": str(self.test), "prefetch": 4}
        if stream is not None:
            data["stream"] = {"idle_timeout": 3.0, "poll_interval": 0.2, "record_sample_ids": True, **stream}
        else:
            data["path"] = path
        config = {"seed": a.seed, "data": data,
                  "model": {"name": "deepfm", "embedding_dim": 16, "hparams": {"hidden": [64, 32]}},
                  "embedding": {"default": {"capacity": 1_000_000, "optimizer": {"name": "adagrad", "lr": 0.05}}},
                  "train": {"output_dir": str(self.root / name), "checkpoint_every": a.checkpoint_every,
                            "progress": False, "log_every": 20, "window": 50_000,
                            "dense_optimizer": {"name": "adam", "lr": 0.002}},
                  **({"strategy": strategy} if strategy else {})}
        file = self.root / f"{name}.yaml"
        file.write_text(yaml.safe_dump(config))
        return file

    def start(self, config: Path, resume: bool) -> subprocess.Popen:
        run = Path(yaml.safe_load(config.read_text())["train"]["output_dir"])
        again = "--resume" if resume and (run / "checkpoints" / "latest").exists() else "--overwrite"
        with self.log.open("a") as log:
            log.write(f"\n=== {config.name} {again}\n")
        return subprocess.Popen([sys.executable, "-m", "hybridrec.cli", "train", str(config), again],
                                stdout=self.log.open("a"), stderr=subprocess.STDOUT, start_new_session=True)

    def finish(self, process: subprocess.Popen) -> None:
        try:
            code = process.wait(RUN_SECONDS)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(30)
            raise RuntimeError(f"bench stream: a run took more than {RUN_SECONDS} s; see {self.log}") from None
        if code != 0:
            raise RuntimeError(f"bench stream: a run failed (exit {code}); the end of {self.log}:\n"
                               + self.log.read_text()[-3000:])

    def kill_at_random(self, process: subprocess.Popen, run: Path, steps: int) -> int | None:
        """SIGKILL the run's process group at a random moment of its training: after a random one
        of the checkpoints it will write, a random 0-3 s later. The step of the newest checkpoint
        then (None: the run ended first)."""
        every = self.args.checkpoint_every
        target = self.rng.randint(1, max(1, steps // every - 1)) * every
        root = run / "checkpoints"
        while process.poll() is None and not any(int(p.name.removeprefix("step-")) >= target
                                                 for p in (root.glob("step-*") if root.is_dir() else [])):
            time.sleep(0.05)
        time.sleep(self.rng.uniform(0.0, 3.0))
        if process.poll() is not None:
            return None
        os.killpg(process.pid, signal.SIGKILL)  # the trainer and whatever it started
        process.wait(30)
        done = sorted(root.glob("step-*"))
        return int(done[-1].name.removeprefix("step-")) if done else 0

    def result(self, config: Path, produced: Counter) -> dict:
        run = Path(yaml.safe_load(config.read_text())["train"]["output_dir"])
        final = json.loads((run / "final_metrics.json").read_text())
        files = sorted((run / "sample_ids").glob("rank-*/step-*.npy"))
        trained = Counter(np.concatenate([np.load(f) for f in files]).tolist()) if files else Counter()
        return {"samples_per_s": final.get("train_samples_per_s"), "trained": sum(trained.values()),
                "duplicates": sum(n - 1 for n in trained.values() if n > 1) + sum(
                    n for k, n in trained.items() if k not in produced),
                "missing": sum(1 for k in produced if k not in trained),
                "progressive_auc": final["stream"]["progressive_auc"], "test_auc": final.get("auc"),
                "bad_records": final["stream"]["stream_bad_records"]}

    # -------------------------------------------------------------- data
    def lines(self) -> list[bytes]:
        from hybridrec.data.stream.producer import synthetic_lines

        return list(synthetic_lines(self.args.records, seed=self.args.seed))

    def fill(self, stream: str) -> Counter:
        from hybridrec.data.stream.backends.redis import entry_sample_ids
        from hybridrec.data.stream.producer import produce

        produced = produce(self.redis.url(stream), self.lines(), keep_ids=True)
        return Counter(entry_sample_ids(produced.ids).tolist())

    def write_files(self, directory: Path, parts: int, pause: float = 0.0, lines: list | None = None) -> Counter:
        """The records (or `lines`) as `parts` files in `directory`, each written under a hidden
        name and renamed into place, `pause` seconds apart; their sample ids."""
        from hybridrec.data.stream.backends.files import file_sample_ids

        directory.mkdir(parents=True, exist_ok=True)
        lines = self.lines() if lines is None else lines
        produced = Counter()
        for part in range(parts):
            chunk = lines[part * len(lines) // parts:(part + 1) * len(lines) // parts]
            name = f"part-{part:03d}.tsv"
            hidden = directory / f".{name}.tmp"
            hidden.write_bytes(b"\n".join(chunk) + b"\n")
            os.replace(hidden, directory / name)
            produced.update(file_sample_ids(name, np.arange(len(chunk))).tolist())
            if pause and part + 1 < parts:
                time.sleep(pause)
        return produced

    # -------------------------------------------------------------- scenarios
    def file_and_redis(self) -> dict:
        directory = self.root / "one-file"
        produced_file = self.write_files(directory, 1)
        plain = self.config("plain", None, path=str(directory / "part-000.tsv"))
        file_config = self.config("file", {"backend": "files", "path": str(directory), "complete": "rename"})
        runs = {"file": [], "redis": [], "plain": []}
        for repeat in range(self.args.repeats):  # interleaved, so that both see the same load
            process = self.start(file_config, resume=False)
            self.finish(process)
            runs["file"].append(self.result(file_config, produced_file))
            stream = f"records-{repeat}"
            produced = self.fill(stream)
            redis_config = self.config("redis", {"backend": "redis", "url": self.redis.url(stream)})
            self.finish(self.start(redis_config, resume=False))
            runs["redis"].append(self.result(redis_config, produced))
            self.finish(self.start(plain, resume=False))
            runs["plain"].append(json.loads((self.root / "plain" / "final_metrics.json").read_text())
                                 .get("train_samples_per_s"))
        out = {name: _median(runs[name]) for name in ("file", "redis")}
        out["file"]["plain_file_samples_per_s"] = statistics.median(runs["plain"])
        for name in ("file", "redis"):
            out[name]["runs"] = runs[name]
        return out

    def redis_killed(self) -> dict:
        produced = self.fill("killed")
        config = self.config("redis_killed", {"backend": "redis", "url": self.redis.url("killed")})
        process = self.start(config, resume=False)
        killed = self.kill_at_random(process, self.root / "redis_killed", self.args.records // self.args.batch_size)
        self.finish(self.start(config, resume=True))
        return {**self.result(config, produced), "killed_after_checkpoint": killed}

    def arriving_files(self) -> dict:
        directory = self.root / "arriving"
        produced: Counter = Counter()
        writer = threading.Thread(target=lambda: produced.update(self.write_files(directory, 10, pause=3.0)))
        config = self.config("arriving_files", {"backend": "files", "path": str(directory), "complete": "rename",
                                                 "idle_timeout": 8.0})
        writer.start()
        process = self.start(config, resume=False)
        killed = self.kill_at_random(process, self.root / "arriving_files", self.args.records // self.args.batch_size)
        self.finish(self.start(config, resume=True))
        writer.join()
        return {**self.result(config, produced), "killed_after_checkpoint": killed}

    def persia_redis(self) -> dict:
        produced = self.fill("persia")
        config = self.config("persia_redis", {"backend": "redis", "url": self.redis.url("persia")},
                             strategy={"preset": "persia", "roles": {"ps_servers": 1, "embedding_workers": 1,
                                                                     "trainers": 2}})
        self.finish(self.start(config, resume=False))
        return self.result(config, produced)


def _median(runs: list[dict]) -> dict:
    return {key: statistics.median(r[key] for r in runs) if all(isinstance(r[key], (int, float)) for r in runs)
            else runs[-1][key] for key in runs[0]}


def headline(report: dict) -> dict:
    """The results table's figures: redis over file samples/s, the progressive AUC gap, and the
    duplicates and missing records of the crash scenarios."""
    figures = {}
    file, redis = report.get("file"), report.get("redis")
    if file and redis and file.get("samples_per_s") and redis.get("samples_per_s"):
        figures["redis / file samples/s"] = round(redis["samples_per_s"] / file["samples_per_s"], 3)
        figures["progressive AUC redis - file"] = round(redis["progressive_auc"] - file["progressive_auc"], 4)
    for name in ("redis_killed", "arriving_files", "persia_redis"):
        figures.update(pick(report.get(name), {"duplicates": "duplicates", "missing": "missing"}, f"{name}: "))
    return figures


def main(argv: list[str] | None = None) -> dict:
    args = _parser().parse_args(argv)
    chosen = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in SCENARIOS]
    if unknown:
        raise SystemExit(f"--scenarios: {unknown} are not scenarios; choose from {','.join(SCENARIOS)}")
    from hybridrec.data.stream.redis_server import LocalRedis

    root = Path(tempfile.mkdtemp(prefix="hybridrec-bench-stream-")) if args.workdir is None else args.workdir
    root.mkdir(parents=True, exist_ok=True)
    report: dict = {}
    with LocalRedis() as redis:
        bench = _Bench(args, root, redis)
        warm = bench.config("warm-up", {"backend": "files", "path": str(root / "warm"), "complete": "rename",
                                        "idle_timeout": 1.0})
        bench.write_files(root / "warm", 1, lines=bench.lines()[:4 * args.batch_size])  # compiles the kernels once
        bench.finish(bench.start(warm, resume=False))
        if "file" in chosen or "redis" in chosen:
            report.update({k: v for k, v in bench.file_and_redis().items() if k in chosen})
        for name in ("redis_killed", "arriving_files", "persia_redis"):
            if name in chosen:
                report[name] = getattr(bench, name)()
    if args.json:
        print(json.dumps(report))
    else:
        print(f"{'scenario':<16} {'samples/s':>10} {'trained':>9} {'dup':>5} {'missing':>8} {'prog AUC':>9} "
              f"{'test AUC':>9}")
        number = lambda value, spec: "-" if value is None else format(value, spec)
        for name, r in report.items():
            print(f"{name:<16} {number(r['samples_per_s'], ',.0f'):>10} {r['trained']:>9} {r['duplicates']:>5} "
                  f"{r['missing']:>8} {number(r['progressive_auc'], '.4f'):>9} {number(r['test_auc'], '.4f'):>9}")
        for label, value in headline(report).items():
            print(f"{label}: {value}")
        print(f"runs and logs: {root}")
    return report
