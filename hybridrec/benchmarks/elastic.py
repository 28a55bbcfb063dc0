"""`hybridrec bench elastic`: the elastic, replicated PS tier while a model trains on it.

A logistic model whose weights all live on PS servers (one embedding of width 1 per (field, id)
of a planted synthetic task) is trained with plain SGD by one trainer thread over loopback
ZeroMQ, against servers in this process. Three jobs of the same seed and batches:

  fixed      2 servers throughout;
  scaled     2 servers, scaled to 3 while it trains (at a third of the steps), back to 2 (at
             two thirds), the buckets moving in the background (`Coordinator.scale_to`);
  host_loss  2 servers with `ps_replicas` 2 (3 with `--servers 3`), one of them stopped for
             good at half the steps (its memory with it) and failed over (`Coordinator.fail_over`).

Reported per job (medians over `--runs`): test AUC, samples/s in the steady state and during
the scale events or failover, the longest step (the longest pause training saw; a lost server
is noticed when its connection closes or is refused, not after a timeout), and, from
plain-SGD sums, how many keys lost an update or got one twice (a key's row must equal its first
value minus lr times the sum of every gradient the trainer pushed to it), and buckets moved.
`--json` prints one line {"fixed": R, "scaled": R, "host_loss": R}.
"""
from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import numpy as np

from hybridrec.benchmarks.results import pick
from hybridrec.benchmarks.timing import number_above, positive_int
from hybridrec.metrics import auc as roc_auc
from hybridrec.ps import PSClient, serve
from hybridrec.ps.migration import Coordinator

TABLE = "w"
WARMUP = 3  # steps not timed (numba compiles the kernels of a new table in them)
CLIENT_TIMEOUT = 60.0  # the trainer's wait on a slow server (a lost one refuses its connection at once)
JOBS = ("fixed", "scaled", "host_loss")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybridrec bench elastic", description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=positive_int, default=300, help="training steps per job (default 300)")
    parser.add_argument("--batch", type=positive_int, default=1024, help="samples per step (default 1024)")
    parser.add_argument("--fields", type=positive_int, default=8, help="categorical fields (default 8)")
    parser.add_argument("--vocab", type=positive_int, default=5000, help="ids per field (default 5000)")
    parser.add_argument("--test-rows", type=positive_int, default=20_000, help="held-out rows (default 20000)")
    parser.add_argument("--lr", type=number_above(0.0), default=0.05, help="SGD learning rate (default 0.05)")
    parser.add_argument("--runs", type=positive_int, default=3, help="runs of each job; medians reported (default 3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the report as one JSON line")
    return parser


class Task:
    """A planted logistic task: y ~ Bernoulli(sigmoid(sum of one weight per field's id))."""

    def __init__(self, args: argparse.Namespace):
        rng = np.random.default_rng(args.seed)
        self.args = args
        self.weights = rng.normal(0, 0.6, (args.fields, args.vocab))
        rows = args.steps * args.batch + args.test_rows
        ranks = np.minimum(rng.zipf(1.2, (rows, args.fields)) - 1, args.vocab - 1)
        self.ids = (rng.permutation(args.vocab)[ranks]).astype(np.int64)
        logits = self.weights[np.arange(args.fields), self.ids].sum(axis=1)
        self.labels = (rng.random(rows) < 1 / (1 + np.exp(-logits))).astype(np.float32)
        self.keys = ((np.arange(args.fields, dtype=np.uint64) << np.uint64(32))
                     + self.ids.astype(np.uint64))  # [rows, fields]

    def batch(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        part = slice(step * self.args.batch, (step + 1) * self.args.batch)
        return self.keys[part], self.labels[part]

    def test(self) -> tuple[np.ndarray, np.ndarray]:
        start = self.args.steps * self.args.batch
        return self.keys[start:], self.labels[start:]


def run_job(job: str, task: Task, args: argparse.Namespace) -> dict:
    replicas = 2 if job == "host_loss" else 1
    sgd = {"name": "sgd", "lr": args.lr}
    tables = {TABLE: {"dim": 1, "capacity": 4 * args.fields * args.vocab, "optimizer": sgd, "seed": args.seed}}
    servers = [serve(tables=tables, block=False, key=None, routed=replicas > 1) for _ in range(3)]
    addresses = [s.address for s in servers]
    coordinator = Coordinator(addresses[:2], [TABLE], replicas=replicas, key=None)
    events: list[threading.Thread] = []
    try:
        coordinator.start()
        schedule = {"fixed": {}, "scaled": {args.steps // 3: lambda: coordinator.scale_to(addresses),
                                            2 * args.steps // 3: lambda: coordinator.scale_to(addresses[:2])},
                    "host_loss": {args.steps // 2: lambda: (servers[1].stop(timeout=5),
                                                            coordinator.fail_over(addresses[1]))}}[job]
        with PSClient(addresses[:2], key=None, timeout=CLIENT_TIMEOUT) as client:
            all_keys = np.unique(task.keys)
            first_rows = client.lookup(TABLE, all_keys)[:, 0]
            sums = np.zeros(len(all_keys))
            durations, busy = [], []
            for step in range(args.steps):
                if step in schedule:
                    events.append(threading.Thread(target=schedule[step], daemon=True))
                    events[-1].start()
                keys, labels = task.batch(step)
                start = time.perf_counter()
                flat = keys.reshape(-1)
                rows = client.lookup(TABLE, flat)[:, 0].reshape(keys.shape)
                p = 1 / (1 + np.exp(-rows.sum(axis=1)))
                grads = np.repeat(((p - labels) / len(labels)).astype(np.float32), keys.shape[1])[:, None]
                client.push(TABLE, flat, grads)
                durations.append(time.perf_counter() - start)
                busy.append(any(e.is_alive() for e in events))
                np.add.at(sums, np.searchsorted(all_keys, flat), grads[:, 0].astype(np.float64))
            for event in events:
                event.join(120)
            final = client.lookup(TABLE, all_keys)[:, 0]
            test_keys, test_labels = task.test()
            scores = client.lookup(TABLE, test_keys.reshape(-1)).reshape(test_keys.shape).sum(axis=1)
    finally:
        coordinator.close()
        for server in servers:
            server.stop(timeout=5)
    expected = first_rows - args.lr * sums
    wrong = np.abs(final - expected) > 1e-4 + 1e-4 * np.abs(expected)
    lost = wrong & (np.abs(final - first_rows) < np.abs(expected - first_rows))
    durations, busy = np.array(durations)[WARMUP:], np.array(busy)[WARMUP:]  # the first steps compile kernels
    steady = durations[~busy]
    return {"auc": float(roc_auc(test_labels, 1 / (1 + np.exp(-scores)))),
            "samples_per_s": float(args.batch / np.median(steady)) if len(steady) else None,
            "samples_per_s_during_events": float(args.batch / np.median(durations[busy])) if busy.any() else None,
            "max_pause_s": float(durations.max()), "lost_updates": int(lost.sum()),
            "doubled_updates": int((wrong & ~lost).sum()), "buckets_moved": coordinator.metrics.buckets_moved,
            "failovers": coordinator.metrics.failovers, "longest_bucket_pause_s": coordinator.metrics.longest_pause_s}


def median_report(runs: list[dict]) -> dict:
    out = {}
    for key in runs[0]:
        values = [r[key] for r in runs if r[key] is not None]
        out[key] = (max(values) if key in ("lost_updates", "doubled_updates", "max_pause_s")
                    else statistics.median(values)) if values else None
    return out


def run(args: argparse.Namespace) -> dict:
    task = Task(args)
    warm = argparse.Namespace(**{**vars(args), "steps": 3 * WARMUP})
    for job in JOBS[1:]:  # numba compiles the kernels of moves and failovers once per process: not in a timed job
        run_job(job, Task(warm), warm)
    runs = {job: [] for job in JOBS}
    for _ in range(args.runs):  # the jobs interleaved within each round, so load drifts hit them alike
        for job in JOBS:
            runs[job].append(run_job(job, task, args))
    report = {job: median_report(results) for job, results in runs.items()}
    fixed = report["fixed"]
    report["ratios"] = {
        "scaled_auc_minus_fixed": report["scaled"]["auc"] - fixed["auc"],
        "host_loss_auc_minus_fixed": report["host_loss"]["auc"] - fixed["auc"],
        "replicated_over_unreplicated_samples_per_s": report["host_loss"]["samples_per_s"] / fixed["samples_per_s"],
    }
    report["settings"] = {k: getattr(args, k) for k in ("steps", "batch", "fields", "vocab", "test_rows", "lr",
                                                         "runs", "seed")}
    return report


def headline(report: dict) -> dict:
    """The figures of the results table."""
    return {**pick(report["ratios"], {"scaled AUC - fixed": "scaled_auc_minus_fixed",
                                      "host loss AUC - fixed": "host_loss_auc_minus_fixed",
                                      "replicated / unreplicated samples/s": "replicated_over_unreplicated_samples_per_s"}),
            **pick(report["scaled"], {"scaled: longest pause s": "max_pause_s", "scaled: lost updates": "lost_updates",
                                      "scaled: doubled updates": "doubled_updates"}),
            **pick(report["host_loss"], {"host loss: longest pause s": "max_pause_s",
                                         "host loss: lost updates": "lost_updates",
                                         "host loss: doubled updates": "doubled_updates"})}


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    report = run(args)
    if args.json:
        print(json.dumps({job: report[job] for job in JOBS}))
    else:
        print(f"elastic PS tier, {args.steps} steps of {args.batch} samples, medians of {args.runs} runs")
        for job in JOBS:
            r = report[job]
            during = r["samples_per_s_during_events"]
            print(f"  {job:<10} auc {r['auc']:.4f}  {r['samples_per_s']:8.0f} samples/s steady"
                  f"{'' if during is None else f', {during:.0f} during events'}  longest step {r['max_pause_s']:.3f}s"
                  f"  lost {r['lost_updates']} doubled {r['doubled_updates']}  buckets moved {r['buckets_moved']}")
        for name, value in report["ratios"].items():
            print(f"  {name}: {value:.4f}")
    return report
