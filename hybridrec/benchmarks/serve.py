"""`hybridrec bench serve`: a DeepFM trained on planted synthetic data, exported and served on
loopback, measured by the bench's own load generator (hybridrec/benchmarks/loadgen.py, a process
of its own, bounded in requests and seconds):

* QPS and p50/p99 latency at 1 and 256 rows per request, hybridrec serve against the peer (the
  same model in plain PyTorch: `nn.EmbeddingBag` tables fed by a Python dict of key -> row, behind
  the same HTTP layer, benchmarks/serve_peer.py), interleaved in the same run, medians of --runs;
* bundle bytes at fp32, fp16 and int8 and the test AUC of each (hybridrec predict);
* the bytes of a delta version when 1% of every table's rows changed, against a full version;
* freshness: seconds from a publish starting to the first answer that carries the new version;
* failed requests while versions swap under load.

Targets (2-core CPU): p99 <= 5 ms at 1 row; >= 2x the peer's rows/s at 256 rows; int8 >= 3.5x
smaller than fp32; delta <= 3% of full at 1% changed; freshness <= 2 s; 0 failed requests.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

from hybridrec.benchmarks.results import pick

SIZES = (1, 256)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hybridrec bench serve", description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON line")
    p.add_argument("--train-rows", type=int, default=200_000)
    p.add_argument("--test-rows", type=int, default=20_000)
    p.add_argument("--vocab", type=int, default=20_000, help="distinct IDs per field")
    p.add_argument("--dim", type=int, default=64, help="embedding dim")
    p.add_argument("--runs", type=int, default=3, help="load runs per server and size (medians are reported)")
    p.add_argument("--seconds", type=float, default=5.0, help="bound of one load run")
    p.add_argument("--requests", type=int, default=20_000, help="bound of one load run's requests")
    p.add_argument("--clients", type=int, default=4, help="concurrent clients of a load run")
    p.add_argument("--publishes", type=int, default=4, help="versions published under load (freshness, failures)")
    p.add_argument("--keep", metavar="DIR", help="work here and keep it (default: a temporary directory)")
    return p


def job_config(args, root: Path):
    from hybridrec.config import parse_config

    return parse_config({
        "seed": 0,
        "data": {"format": "synthetic", "batch_size": 1024, "synthetic": {
            "vocab_size": args.vocab, "train_rows": args.train_rows, "test_rows": args.test_rows,
            "id_weight_std": 0.4}},
        "model": {"name": "deepfm", "embedding_dim": args.dim, "hparams": {"hidden": [128, 64]}},
        "embedding": {"default": {"capacity": 4 * args.vocab, "optimizer": {"name": "adagrad", "lr": 0.05}},
                      "wide": {"optimizer": {"lr": 0.2}}},
        "train": {"epochs": 1, "progress": False, "dense_optimizer": {"name": "adam", "lr": 0.005},
                  "output_dir": str(root / "run"), "publish_dir": str(root / "published"),
                  "publish_full_every": 1000}})


def directory_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def test_auc(bundle: Path, rows: Path, out: Path) -> float:
    from hybridrec.metrics import auc
    from hybridrec.serving.predict_file import predict_file

    predict_file(bundle, rows, out)
    labels = np.loadtxt(rows, delimiter="\t", usecols=0)
    scores = np.loadtxt(out, delimiter=",", skiprows=1)
    return float(auc(labels, scores))


class Server:
    """A prediction server process (hybridrec serve, or the peer) on a free loopback port."""

    def __init__(self, module: str, bundle: Path, *extra: str, seconds: float = 3600):
        command = [sys.executable, "-m", module, str(bundle), "--port", "0", "--threads", "1", "--timeout",
                   str(seconds), *extra]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        first = self.process.stdout.readline()
        if "http://" not in first:
            self.stop()
            raise RuntimeError(f"{module} did not start: {first}")
        self.url = first.split(" on ", 1)[1].split()[0]

    def predict(self, body: bytes) -> dict:
        request = urllib.request.Request(self.url + "/predict", data=body, method="POST")
        with urllib.request.urlopen(request, timeout=30) as answer:
            return json.loads(answer.read())

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self.process.stdout.close()


def load(url: str, body: Path, rows: int, args, seconds: float | None = None) -> dict:
    command = [sys.executable, "-m", "hybridrec.benchmarks.loadgen", url, str(body), "--rows-per-request", str(rows),
               "--clients", str(args.clients), "--requests", str(args.requests), "--seconds",
               str(seconds or args.seconds)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=(seconds or args.seconds) + 120)
    if done.returncode != 0:
        raise RuntimeError(f"the load generator failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def serving_figures(args, bundle: Path, bodies: dict) -> dict:
    """{system: S} with S's medians over --runs, the systems' runs interleaved."""
    servers = {"hybridrec": Server("hybridrec.serving.server", bundle),
               "torch_peer": Server("hybridrec.benchmarks.serve_peer", bundle)}
    runs = {(name, rows): [] for name in servers for rows in SIZES}
    try:
        for name, server in servers.items():  # warm both up (numba, torch, first requests)
            for rows in SIZES:
                load(server.url, bodies[rows], rows, args, seconds=1.0)
        for _ in range(args.runs):
            for rows in SIZES:
                for name, server in servers.items():
                    runs[(name, rows)].append(load(server.url, bodies[rows], rows, args))
    finally:
        for server in servers.values():
            server.stop()
    median = lambda name, rows, key: statistics.median(r[key] for r in runs[(name, rows)])  # noqa: E731
    out = {}
    for name in servers:
        out[name] = {"qps_1": median(name, 1, "qps"), "p50_ms_1": median(name, 1, "p50_ms"),
                     "p99_ms_1": median(name, 1, "p99_ms"), "rows_per_s_256": median(name, 256, "rows_per_s"),
                     "p99_ms_256": median(name, 256, "p99_ms"),
                     "failed": sum(r["failed"] for rows in SIZES for r in runs[(name, rows)])}
    return out


def change_rows(placement, fraction: float, rng: np.random.Generator) -> None:
    """An optimizer step on `fraction` of every table's rows."""
    for store in placement.stores().values():
        keys = store.keys()
        chosen = rng.choice(keys, size=max(1, int(round(fraction * len(keys)))), replace=False)
        store.push(chosen, rng.normal(size=(len(chosen), store.dim)).astype(np.float32))


def publishing_figures(args, cfg, root: Path, body: Path) -> dict:
    """Delta against full bytes at 1% changed; freshness and failed requests while versions swap."""
    from hybridrec.train.evaluation import load_local
    from hybridrec.job.tables import job_tables
    from hybridrec.strategy.world import World
    from hybridrec.train.publisher import DeltaPublisher

    model, placement, progress = load_local(cfg, cfg.train.output_dir)
    publisher = DeltaPublisher(cfg, job_tables(cfg), World())
    rng = np.random.default_rng(0)
    state = {"model": model.state_dict()}
    full = publisher.publish(progress["step"], state, placement)
    publisher.wait()
    change_rows(placement, 0.01, rng)
    delta = publisher.publish(progress["step"] + 1, state, placement)
    publisher.wait()
    versions = Path(cfg.train.publish_dir)
    figures = {"full_bytes": directory_bytes(versions / f"v-{full:09d}"),
               "delta_bytes": directory_bytes(versions / f"v-{delta:09d}")}
    server = Server("hybridrec.serving.server", versions, "--poll-seconds", "0.2")
    payload = body.read_bytes()
    background: dict = {}
    loader = threading.Thread(target=lambda: background.update(
        load(server.url, body, 1, args, seconds=args.publishes * 2.5 + 2)))
    freshness, failed_here = [], 0
    try:
        loader.start()
        time.sleep(1.0)
        for _ in range(args.publishes):
            change_rows(placement, 0.01, rng)
            started = time.perf_counter()
            number = publisher.publish(progress["step"], state, placement)
            while True:
                try:
                    if server.predict(payload)["version"] >= number:
                        break
                except OSError:
                    failed_here += 1
                if time.perf_counter() - started > 60:
                    raise RuntimeError(f"version {number} was not served within 60 s")
            freshness.append(time.perf_counter() - started)
            publisher.wait()
            time.sleep(1.0)
        loader.join()
    finally:
        server.stop()
    figures.update(freshness_s=statistics.median(freshness), freshness_runs=freshness,
                   failed_during_swap=background.get("failed", 0) + failed_here,
                   requests_during_swap=background.get("requests", 0), versions_seen=background.get("versions"))
    return figures


def run(args) -> dict:
    from hybridrec.data.synthetic import SyntheticConfig, write_synthetic
    from hybridrec.serving.export import export
    from hybridrec.train.trainer import train

    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="hybridrec-bench-serve-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        cfg = job_config(args, root)
        shutil.rmtree(root / "run", ignore_errors=True)
        shutil.rmtree(root / "published", ignore_errors=True)
        trained = train(cfg)
        syn = cfg.data.synthetic
        fields = {k: v for k, v in syn.model_dump().items() if k not in ("train_rows", "test_rows")}
        rows = root / "test.tsv"
        write_synthetic(rows, syn.test_rows, seed=cfg.seed, config=SyntheticConfig(**fields), first_row=syn.train_rows)
        report = {"train_auc_at_end": trained.get("auc"), "bundle_bytes": {}, "auc": {}}
        for precision in ("fp32", "fp16", "int8"):
            bundle = root / f"bundle-{precision}"
            shutil.rmtree(bundle, ignore_errors=True)
            export(cfg.train.output_dir, bundle, precision=precision)
            report["bundle_bytes"][precision] = directory_bytes(bundle)
            report["auc"][precision] = test_auc(bundle, rows, root / f"{precision}.csv")
        lines = [line.split("\t", 1)[1] for line in rows.read_text().splitlines()[:256]]
        bodies = {}
        for size in SIZES:
            bodies[size] = root / f"body-{size}.json"
            bodies[size].write_text(json.dumps({"lines": lines[:size]}))
        report.update(serving_figures(args, root / "bundle-fp32", bodies))
        report.update(publishing_figures(args, cfg, root, bodies[1]))
        return report
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


def summary(report: dict) -> dict:
    h, p = report["hybridrec"], report["torch_peer"]
    return {"p99_ms_1": h["p99_ms_1"], "rows_per_s_256 / peer": h["rows_per_s_256"] / p["rows_per_s_256"],
            "qps_1 / peer": h["qps_1"] / p["qps_1"],
            "fp32 / int8 bytes": report["bundle_bytes"]["fp32"] / report["bundle_bytes"]["int8"],
            "auc int8 - fp32": report["auc"]["int8"] - report["auc"]["fp32"],
            "delta / full": report["delta_bytes"] / report["full_bytes"], "freshness_s": report["freshness_s"],
            "failed_during_swap": report["failed_during_swap"]}


def headline(report: dict) -> dict:
    return pick(summary(report), {"p99 ms at 1 row": "p99_ms_1", "rows/s at 256 vs peer": "rows_per_s_256 / peer",
                                  "int8 smaller by": "fp32 / int8 bytes", "delta / full at 1%": "delta / full",
                                  "freshness s": "freshness_s", "failed during swap": "failed_during_swap"})


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    report = run(args)
    keys = ("hybridrec", "torch_peer", "bundle_bytes", "auc", "delta_bytes", "full_bytes", "freshness_s",
            "failed_during_swap")
    if args.json:
        print(json.dumps({k: report[k] for k in keys}))
    else:
        for name in ("hybridrec", "torch_peer"):
            print(f"{name:>10}: " + ", ".join(f"{k} {v:.4g}" for k, v in report[name].items()))
        print("bundle bytes " + ", ".join(f"{k} {v}" for k, v in report["bundle_bytes"].items())
              + "; AUC " + ", ".join(f"{k} {v:.5f}" for k, v in report["auc"].items()))
        print(f"delta {report['delta_bytes']} B vs full {report['full_bytes']} B at 1% changed; freshness "
              f"{report['freshness_s']:.3f} s; failed during swap {report['failed_during_swap']}")
        print("summary: " + ", ".join(f"{k} {v:.4g}" for k, v in summary(report).items()))
    return {**report, "summary": summary(report)}
