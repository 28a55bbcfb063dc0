"""`hybridrec bench tiers`: a table with more distinct keys than its memory holds, on a disk tier.

The same stream of batches (Zipf keys hashed over 2^64, pull + push of a fixed gradient with
Adagrad, one thread) runs through three stores, each in a process of its own so that its peak
RSS is its own: `tiered` (a memory tier of `--memory-fraction` of the stream's distinct keys and a
disk tier for the rest), `in_memory` (capacity above the distinct keys: it never evicts) and
`evicting` (capacity `--eviction-capacity`, no tier: evicted rows are dropped, the figure of
issue 35's eviction target), and with `--read-ahead` `tiered_ahead`: the tiered store whose next
batch's cold records are faulted in on a second thread (`EmbeddingStore.read_ahead`, what a
trainer's data loader does when it has the next batch ready) once each batch's pull returns.
With `--dense-ms MS` each batch also runs a dense step between its pull and its push, as a
trainer does: forward and backward of an MLP (dim -> width -> width -> 1, BCE, SGD, one torch
thread) over the pulled rows, its width set once (in the parent, for every system alike) so
that a step takes about MS ms here; that step is the window a read-ahead has in training. The
processes take turns, `--segment` batches each, so that the machine's load affects them alike; a ratio is the median over the segments of the time the
in-memory store took for a segment over the time the other took for the same one. Once every
segment is done, one process at a time (so that none overlaps a timed segment), the tiered store's every key is pulled once more (read-only) and
its rows, optimizer state, counts and clocks are compared with the in-memory store's:
`lost_rows` counts the keys that differ or are missing (both tiered stores' with `--read-ahead`).

RSS: each process resets its peak RSS (/proc/self/clear_refs) once its stream and its store's
kernels are ready, right before it makes the store, and reports the peak above its RSS at that
moment, before the final check: the store's memory (prefaulted, as `bench embedding` builds its
tables) and whatever the stream adds.
`budget_bytes` is the tiered store's memory tier (`memory_bytes`) plus the disk tier's mapped
pages bound (disk_tier.PAGE_BUDGET) plus one batch's working arrays.

`--json` prints one line: {"tiered": {samples_per_s, rss_bytes, disk_bytes, hit_rate,
lost_rows}, "in_memory": {samples_per_s, rss_bytes}, "budget_bytes", "eviction_ratio",
"tiered_over_in_memory", "rss_over_budget", "distinct_keys", "memory_rows", ...}.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from hybridrec.benchmarks.results import pick
from hybridrec.benchmarks.timing import number_above, positive_int
from hybridrec.benchmarks.workload import mix64

SYSTEMS = ("tiered", "in_memory", "evicting", "tiered_ahead")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hybridrec bench tiers", description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=positive_int, default=600, help="batches in the stream (default 600)")
    p.add_argument("--batch-size", type=positive_int, default=4096, help="keys per batch (default 4096)")
    p.add_argument("--dim", type=positive_int, default=16, help="embedding width (default 16)")
    p.add_argument("--zipf", type=number_above(1.0), default=1.05, help="Zipf exponent of the key ranks (default 1.05)")
    p.add_argument("--memory-fraction", type=number_above(0.0), default=0.2,
                   help="the tiered store's memory rows, as a fraction of the distinct keys (default 0.2)")
    p.add_argument("--eviction-capacity", type=positive_int, default=200_000,
                   help="rows of the evicting store (default 200000)")
    p.add_argument("--segment", type=positive_int, default=50,
                   help="batches each system runs in its turn; ratios are medians over the segments (default 50)")
    p.add_argument("--read-ahead", action="store_true",
                   help="also run the tiered store with the next batch's cold records read ahead on a second thread")
    p.add_argument("--dense-ms", type=number_above(0.0), default=None,
                   help="run a dense step (an MLP forward + backward on one thread) of about this many ms between "
                        "each batch's pull and push, as a trainer does (default: none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON line")
    p.add_argument("--child", help=argparse.SUPPRESS)
    return p


def batch_keys(seed: int, index: int, size: int, zipf: float) -> np.ndarray:
    """Batch `index` of the stream: Zipf ranks mixed over the whole uint64 space."""
    ranks = np.random.default_rng([seed, index]).zipf(zipf, size)
    return mix64(ranks.astype(np.uint64), salt=1)


def distinct_keys(args) -> int:
    seen = np.unique(np.concatenate([batch_keys(args.seed, i, args.batch_size, args.zipf)
                                     for i in range(args.batches)]))
    return int(seen.shape[0])


class DenseStep:
    """A trainer's dense step on one thread: an MLP dim -> width -> width -> 1 over a batch's
    pulled rows, BCE against fixed labels, backward, SGD. Its result is not pushed: the stream's
    fixed gradient is, so every system's rows stay comparable."""

    def __init__(self, dim: int, width: int, batch_size: int):
        import torch

        torch.set_num_threads(1)
        generator = torch.Generator().manual_seed(0)
        self.torch = torch
        self.model = torch.nn.Sequential(torch.nn.Linear(dim, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                                         torch.nn.ReLU(), torch.nn.Linear(width, 1))
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.labels = (torch.rand(batch_size, 1, generator=generator) < 0.5).float()

    def __call__(self, rows: np.ndarray) -> None:
        torch = self.torch
        inputs = torch.from_numpy(rows).requires_grad_(True)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(self.model(inputs), self.labels[:len(rows)])
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()

    def seconds(self, rows: np.ndarray, steps: int = 7) -> float:
        """Median seconds of a step here and now."""
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            self(rows)
            times.append(time.perf_counter() - start)
        return statistics.median(times)


def dense_width(ms: float, dim: int, batch_size: int) -> tuple[int, float]:
    """(the MLP width whose step takes about `ms` ms on this machine, that step's ms). The
    middle layer dominates: a step's time grows about as the width squared."""
    rows = np.random.default_rng(0).standard_normal((batch_size, dim)).astype(np.float32)
    width = 128
    for _ in range(3):
        took = DenseStep(dim, width, batch_size).seconds(rows)
        width = int(min(8192, max(8, round(width * (ms / 1e3 / took) ** 0.5))))
    return width, 1e3 * DenseStep(dim, width, batch_size).seconds(rows)


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def run_child(spec: dict, commands, replies) -> dict:
    """One system's run over the stream, in this process, a segment of batches whenever the
    parent says "go" on `commands` (the systems take turns, so they share the machine's state
    alike); the seconds of each segment on `replies`, then what the parent reads back."""
    from hybridrec.embedding import EmbeddingStore
    from hybridrec.embedding.read_ahead import ReadAhead

    # prefault, as `bench embedding` builds its tables: no page fault of a fresh row in any step
    fields = {"dim": spec["dim"], "capacity": spec["capacity"], "optimizer": {"name": "adagrad", "lr": 0.05},
              "prefault": True}
    if spec.get("tier"):
        fields["tier"] = spec["tier"]
    batches = [batch_keys(spec["seed"], i, spec["batch_size"], spec["zipf"]) for i in range(spec["batches"])]
    grads = np.random.default_rng(1).standard_normal((spec["batch_size"], spec["dim"])).astype(np.float32) * 0.1
    warm_tier = {"tier": {**fields["tier"], "path": fields["tier"]["path"] + "-warm"}} if "tier" in fields else {}
    warm = EmbeddingStore(**{**fields, "capacity": 1024, "prefault": False, **warm_tier})
    for keys in batches[:2]:  # load the kernels from numba's cache before the clock starts
        warm.pull(keys[:256])
        warm.push(keys[:256], grads[:256])
    warm.close()
    dense = None
    if spec.get("dense_width"):  # built and run once before the clock and the RSS count start
        dense = DenseStep(spec["dim"], spec["dense_width"], spec["batch_size"])
        dense(np.zeros((spec["batch_size"], spec["dim"]), np.float32))
    Path("/proc/self/clear_refs").write_text("5")  # the peak RSS counts from here: the store's memory and more
    base = _status("VmRSS")
    store = EmbeddingStore(**fields)
    ahead = ReadAhead() if spec.get("read_ahead") else None
    elapsed = 0.0
    segment = spec["segment"]
    for first in range(0, len(batches), segment):
        commands.readline()
        start = time.perf_counter()
        for i in range(first, min(first + segment, len(batches))):
            rows = store.pull(batches[i])
            if ahead is not None and i + 1 < len(batches):  # the next batch is known: read its cold rows ahead
                ahead.submit(store.read_ahead, batches[i + 1])
            if dense is not None:
                dense(rows)
            store.push(batches[i], grads)
        took = time.perf_counter() - start
        elapsed += took
        print(took, file=replies, flush=True)
    if ahead is not None:
        ahead.close()
    commands.readline()  # (end of input) every system's segments are done: the export below runs alone
    peak = _status("VmHWM")
    stats = store.stats()
    out = {"samples_per_s": len(batches) * spec["batch_size"] / elapsed, "rss_bytes": peak - base,
           "memory_bytes": store.memory_bytes(), "stats": stats}
    if spec.get("export"):
        exported = store.export()
        keys = np.sort(exported["keys"])
        pulled = np.concatenate([store.pull(part, insert=False)
                                 for part in np.array_split(keys, max(1, len(keys) // (spec["capacity"] // 4)))])
        np.savez(spec["export"], pulled_keys=keys, pulled=pulled, **exported)
    store.close()
    return out


def lost_rows(tiered: Path, in_memory: Path) -> int:
    """Keys of the in-memory store whose row, optimizer state, count or clock the tiered store
    does not give back: by its export, and by a read-only pull of every key."""
    t, m = np.load(tiered), np.load(in_memory)
    order_t, order_m = np.argsort(t["keys"]), np.argsort(m["keys"])
    if not np.array_equal(t["keys"][order_t], m["keys"][order_m]):
        return int(np.setxor1d(t["keys"], m["keys"]).shape[0])
    differs = np.zeros(len(order_m), bool)
    for name in ("weights", "state", "counts", "clocks"):
        a, b = t[name][order_t], m[name][order_m]
        differs |= (a != b).reshape(len(a), -1).any(axis=1)
    pulled = t["pulled"]  # pulled_keys are sorted, as keys[order_m] are
    differs |= (pulled != m["weights"][order_m]).any(axis=1)
    return int(differs.sum())


def _run_together(specs: dict[str, dict]) -> tuple[dict[str, dict], dict[str, list[float]]]:
    """Start a process per system and let them run their stream segment by segment in turn;
    (each system's result, each system's seconds per segment)."""
    children = {system: subprocess.Popen([sys.executable, "-m", "hybridrec.benchmarks.tiers", "--child",
                                          json.dumps(spec)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         text=True) for system, spec in specs.items()}
    seconds: dict[str, list[float]] = {system: [] for system in specs}
    try:
        segments = -(-next(iter(specs.values()))["batches"] // next(iter(specs.values()))["segment"])
        for _ in range(segments):
            for system, child in children.items():
                child.stdin.write("go\n")
                child.stdin.flush()
                line = child.stdout.readline()
                if not line:
                    raise RuntimeError(f"bench tiers: the {system} process ended early (exit code {child.wait()})")
                seconds[system].append(float(line))
        results = {}
        for system, child in children.items():  # one at a time: each exports and checks its rows alone
            child.stdin.close()
            out = child.stdout.read()  # through the same reader as the segments' lines: it may hold the rest
            if child.wait(1800) != 0:
                raise RuntimeError(f"bench tiers: the {system} process failed (exit code {child.returncode})")
            results[system] = json.loads(out.strip().splitlines()[-1])
        return results, seconds
    finally:
        for child in children.values():
            if child.poll() is None:
                child.kill()
                child.wait()


def run(args) -> dict:
    distinct = distinct_keys(args)
    memory_rows = max(1, int(distinct * args.memory_fraction))
    base = {"dim": args.dim, "batch_size": args.batch_size, "zipf": args.zipf, "seed": args.seed,
            "batches": args.batches}
    base = {**base, "segment": args.segment}
    dense = None
    if args.dense_ms is not None:
        dense = dict(zip(("width", "ms"), dense_width(args.dense_ms, args.dim, args.batch_size)))
        base["dense_width"] = dense["width"]
    with tempfile.TemporaryDirectory(prefix="hybridrec-bench-tiers-") as tmp:
        specs = {
            "tiered": {**base, "capacity": memory_rows, "tier": {"path": f"{tmp}/tier", "capacity_rows": distinct},
                       "export": f"{tmp}/tiered.npz"},
            "in_memory": {**base, "capacity": int(distinct * 1.05) + 1024, "export": f"{tmp}/in_memory.npz"},
            "evicting": {**base, "capacity": args.eviction_capacity},
        }
        if args.read_ahead:
            specs["tiered_ahead"] = {**specs["tiered"], "tier": {**specs["tiered"]["tier"], "path": f"{tmp}/tier-ahead"},
                                     "export": f"{tmp}/tiered_ahead.npz", "read_ahead": True}
        results, seconds = _run_together(specs)
        lost = lost_rows(Path(tmp, "tiered.npz"), Path(tmp, "in_memory.npz"))
        if args.read_ahead:
            lost_ahead = lost_rows(Path(tmp, "tiered_ahead.npz"), Path(tmp, "in_memory.npz"))
    from hybridrec.embedding.disk_tier import PAGE_BUDGET

    tiered = results["tiered"]
    budget = tiered["memory_bytes"] + PAGE_BUDGET + args.batch_size * (8 * 6 + 4 * 3 * args.dim)
    # each segment's seconds against the same segment of the store that never evicts
    paired = lambda system: statistics.median(b / a for a, b in zip(seconds[system], seconds["in_memory"]))
    per_s = lambda system: results[system]["samples_per_s"]
    stats = tiered["stats"]
    report = {
        "tiered": {"samples_per_s": per_s("tiered"), "rss_bytes": tiered["rss_bytes"],
                   "disk_bytes": stats["disk_bytes"], "hit_rate": stats["hit_rate"], "lost_rows": lost,
                   "rows_in_memory": stats["rows_in_memory"], "rows_on_disk": stats["rows_on_disk"]},
        "in_memory": {"samples_per_s": per_s("in_memory"), "rss_bytes": results["in_memory"]["rss_bytes"]},
        "evicting": {"samples_per_s": per_s("evicting"), "evicted": results["evicting"]["stats"]["evicted"]},
        "budget_bytes": int(budget),
        "eviction_ratio": paired("evicting"),
        "tiered_over_in_memory": paired("tiered"),
        "rss_over_budget": tiered["rss_bytes"] / budget,
        "lost_rows": lost,
        "distinct_keys": distinct, "memory_rows": memory_rows, "batches": args.batches,
        "batch_size": args.batch_size, "segments": len(seconds["tiered"]),
        "segment_seconds": seconds,
    }
    if dense is not None:
        report["dense_step"] = dense
    if args.read_ahead:
        ahead = results["tiered_ahead"]
        report["tiered_ahead"] = {"samples_per_s": per_s("tiered_ahead"), "rss_bytes": ahead["rss_bytes"],
                                  "lost_rows": lost_ahead, "hit_rate": ahead["stats"]["hit_rate"]}
        report["tiered_ahead_over_in_memory"] = paired("tiered_ahead")
        # each segment's seconds without the read-ahead over the same segment's with it
        report["read_ahead_speedup"] = statistics.median(a / b for a, b in zip(seconds["tiered"], seconds["tiered_ahead"]))
        report["lost_rows"] = lost + lost_ahead
    return report


def headline(report: dict) -> dict:
    """The figures of the results table: the tiered and evicting stores against never evicting."""
    return pick(report, {"tiered / in memory": "tiered_over_in_memory", "evicting / in memory": "eviction_ratio",
                         "tiered RSS / budget": "rss_over_budget", "lost rows": "lost_rows",
                         "tiered read ahead / in memory": "tiered_ahead_over_in_memory",
                         "read ahead speedup": "read_ahead_speedup"})


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    if args.child:
        print(json.dumps(run_child(json.loads(args.child), sys.stdin, sys.stdout)))
        return {}
    report = run(args)
    if args.json:
        print(json.dumps(report))
    else:
        t, m = report["tiered"], report["in_memory"]
        print(f"bench tiers: {report['distinct_keys']} distinct keys, memory tier {report['memory_rows']} rows, "
              f"{report['batches']} batches of {report['batch_size']}, {report['segments']} segments in turn")
        print(f"  tiered     {t['samples_per_s']:12,.0f} samples/s  peak RSS {t['rss_bytes'] / 2**20:7.1f} MiB  "
              f"disk {t['disk_bytes'] / 2**20:7.1f} MiB  hit rate {t['hit_rate']:.3f}  lost rows {t['lost_rows']}")
        print(f"  in memory  {m['samples_per_s']:12,.0f} samples/s  peak RSS {m['rss_bytes'] / 2**20:7.1f} MiB")
        print(f"  evicting   {report['evicting']['samples_per_s']:12,.0f} samples/s")
        if "tiered_ahead" in report:
            a = report["tiered_ahead"]
            print(f"  tiered, read ahead {a['samples_per_s']:12,.0f} samples/s  peak RSS {a['rss_bytes'] / 2**20:7.1f} MiB  "
                  f"lost rows {a['lost_rows']}; / in memory {report['tiered_ahead_over_in_memory']:.3f}, "
                  f"/ tiered {report['read_ahead_speedup']:.2f}")
        if "dense_step" in report:
            d = report["dense_step"]
            print(f"  each batch with a dense step: MLP width {d['width']}, {d['ms']:.1f} ms per step")
        print(f"  tiered / in memory {report['tiered_over_in_memory']:.2f} (target >= 0.5); evicting / in memory "
              f"{report['eviction_ratio']:.2f} (target >= 0.9); tiered RSS / budget {report['rss_over_budget']:.2f} "
              f"(budget {report['budget_bytes'] / 2**20:.1f} MiB, target <= 1.1)")
    return report


if __name__ == "__main__":
    main()
