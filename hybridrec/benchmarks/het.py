"""`hybridrec bench het`: HET's cache and consistency model on real jobs.

Jobs (`hybridrec.parallel.launch.launch`: 2 PS servers and 2 trainers under torchrun talking to
them directly, same data and seed), each a value of the one consistency switch:
  bsp       consistency ssp with staleness 0: every lookup sees every update of every earlier
            iteration of every trainer;
  asp       consistency asp: no cache, no waiting;
  ssp       consistency ssp with `--ssp-staleness` (worker clocks, the classic SSP);
  no_cache  consistency sync over the direct route: every step fetches every row it reads and
            pushes every gradient (HET's "Hybrid w/o cache");
  het       consistency het with s = 0, 10, 100 and inf, a cache of `--cache-fraction` of each
            table's distinct training keys and `--policy` (10% LFU by default);
  persia    the Persia preset (bounded staleness, tau 4, through 1 embedding worker), for its
            embedding bytes per sample.
Each R holds the test `auc` and `logloss`, training `samples_per_s` and
`embedding_bytes_per_sample` (payload between a trainer and the embedding service per training
sample, both ways; for HET its vectors and its clocks), and for het the `hit_rate` and the rest
of its cache figures; medians over `--runs` jobs per variant, interleaved.

Miss rates (HET Figure 8): the training key stream of each trainer (each batch's distinct keys
per table, exactly what a job's cache reads) is replayed through the cache kernels a job uses
(`hybridrec.het.cache`) for LRU, LFU and light LFU at 3, 5, 10 and 15% of each
table's distinct training keys. A miss depends only on the order of the keys and the policy,
not on clocks or values, so the replay gives what a job's cache would see, without the job
(invalidations are not misses: an entry that fails a bound stays cached). The kernels' time per
read is measured for each policy, the policies interleaved (`--repeats` times), for the upkeep.
A cache smaller than a batch's distinct keys of a table cannot serve it; such a table's cache is
raised to the batch's size, and the report counts the tables raised.

Targets: at s = 100 and a 10% cache, at least 80% fewer embedding bytes per sample
than no cache at a test AUC within 0.001 of BSP; LFU's miss rate at or below LRU's at every size.
`--plot FILE.png` draws the miss rates against the cache size per policy. `--json` prints one
line: {"bsp": R, "asp": R, "ssp": R, "no_cache": R, "het": {"s0": R, "s10": R, "s100": R,
"sinf": R}, "miss_rate": {"lru": {"0.03": m, ...}, "lfu": {...}, "light_lfu": {...}}, ...}.
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from hybridrec.benchmarks.figures import png_figure
from hybridrec.benchmarks.hybrid import JobFailed, add_ray_argument, check_config_and_plot, check_ray
from hybridrec.benchmarks.hybrid import run_job as launch_job
from hybridrec.benchmarks.results import pick
from hybridrec.benchmarks.timing import positive_int

DEFAULT_CONFIG = "configs/het_synthetic.yaml"
POLICIES = ("lru", "lfu", "light_lfu")
SIZES = (0.03, 0.05, 0.1, 0.15)
STALENESS = {"s0": 0, "s10": 10, "s100": 100, "sinf": "inf"}
BYTES_TARGET = 0.8  # at least this much fewer embedding bytes per sample than no cache
AUC_BUDGET = 0.001  # s = 100 within this of BSP
METRICS = {"auc": "auc", "logloss": "logloss", "train_samples_per_s": "samples_per_s",
           "bytes_per_sample": "embedding_bytes_per_sample"}
HET_METRICS = {"cache_hit_rate": "hit_rate", "cache_miss_rate": "miss_rate", "cache_invalidations": "invalidations",
               "cache_evictions": "evictions", "max_staleness": "max_staleness",
               "embedding_vector_bytes": "vector_bytes", "embedding_clock_bytes": "clock_bytes",
               "dropped_updates": "dropped_updates"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hybridrec bench het",
        description="HET's cache: BSP, ASP, SSP, no cache and HET at s = 0, 10, 100, inf on 2 trainers + 2 PS "
                    "(AUC, samples/s, embedding bytes per sample), and miss rates of LRU / LFU / light LFU.")
    parser.add_argument("--config", default=DEFAULT_CONFIG, help=f"job config, default {DEFAULT_CONFIG}")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="config override for every job and the key streams (repeatable)")
    parser.add_argument("--runs", type=positive_int, default=1, help="jobs per variant (default 1)")
    parser.add_argument("--cache-fraction", type=float, default=0.1,
                        help="het jobs: each table's cache as a fraction of its distinct training keys (0.1)")
    parser.add_argument("--policy", choices=POLICIES, default="lfu", help="het jobs: the cache policy (lfu)")
    parser.add_argument("--ssp-staleness", type=int, default=4, help="the ssp job's staleness (4)")
    parser.add_argument("--repeats", type=positive_int, default=3,
                        help="timed replays per policy for the upkeep time (default 3)")
    parser.add_argument("--skip-jobs", action="store_true", help="only the miss rates (no job is run)")
    parser.add_argument("--no-persia", action="store_true", help="leave out the Persia preset's job")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per job (default 3600)")
    parser.add_argument("--keep", metavar="DIR", help="keep the jobs' output directories under DIR")
    parser.add_argument("--verbose", action="store_true", help="show the launcher's output of every job")
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    parser.add_argument("--plot", metavar="FILE.png", help="miss rate against cache size per policy (matplotlib)")
    add_ray_argument(parser)
    return parser


# ---------------------------------------------------------------- key streams and miss rates

def key_streams(cfg, trainers: int) -> list[list[dict[str, np.ndarray]]]:
    """Each trainer's training batches as its cache reads them: the distinct keys per table."""
    from hybridrec.job.sources import build_sources
    from hybridrec.job.tables import job_tables

    tables = job_tables(cfg)
    streams = []
    for rank in range(trainers):
        sources = build_sources(cfg.data, cfg.seed, rank, trainers, with_best_auc=False)
        stream = []
        for _ in range(cfg.train.epochs):
            for index, batch in enumerate(sources.train):
                if cfg.train.max_steps is not None and index >= cfg.train.max_steps:
                    break
                layout = tables.layout(batch.sparse)
                stream.append({t: layout.unique[t] for t in layout.tables()})
        streams.append(stream)
    return streams


def distinct_keys(streams) -> dict[str, int]:
    tables = list(streams[0][0])
    return {t: len(np.unique(np.concatenate([batch[t] for stream in streams for batch in stream]))) for t in tables}


def cache_rows(streams, distinct: dict[str, int], fraction: float) -> tuple[dict[str, int], int]:
    """Rows of each table's cache at `fraction` of its distinct keys, raised to its largest batch
    where that is more; and the number of tables raised."""
    largest = {t: max(len(batch[t]) for stream in streams for batch in stream) for t in distinct}
    rows = {t: max(1, math.ceil(fraction * distinct[t])) for t in distinct}
    raised = sum(rows[t] < largest[t] for t in rows)
    return {t: max(rows[t], largest[t]) for t in rows}, raised


def replay(streams, rows: dict[str, int], policy: str, light_threshold: int = 10) -> tuple[int, int, float]:
    """(misses, reads, kernel seconds) of every trainer's stream through its own caches."""
    from hybridrec.het.cache import MISS, CacheTable

    misses = reads = 0
    seconds = 0.0
    for stream in streams:
        caches = {t: CacheTable(rows[t], 1, policy, light_threshold=light_threshold) for t in rows}
        start = time.perf_counter()
        for batch in stream:
            for table, keys in batch.items():
                _, status, *_ = caches[table].begin_read(keys, None)
                misses += int(np.count_nonzero(status == MISS))
                reads += len(keys)
        seconds += time.perf_counter() - start
    return misses, reads, seconds


def miss_rates(streams, repeats: int) -> dict:
    """Miss rate per policy and size, and each policy's kernel time per read (median of
    `repeats` interleaved replays at 10%)."""
    distinct = distinct_keys(streams)
    rates, raised = {p: {} for p in POLICIES}, {}
    for size in SIZES:
        rows, raised[str(size)] = cache_rows(streams, distinct, size)
        for policy in POLICIES:
            misses, reads, _ = replay(streams, rows, policy)
            rates[policy][str(size)] = misses / reads
    rows, _ = cache_rows(streams, distinct, 0.1)
    replay(streams, rows, "lru")  # compiled and warm before anything is timed
    times = {p: [] for p in POLICIES}
    for _ in range(repeats):
        for policy in POLICIES:
            _, reads, seconds = replay(streams, rows, policy)
            times[policy].append(seconds / reads)
    reads = sum(len(keys) for stream in streams for batch in stream for keys in batch.values())
    return {"miss_rate": rates, "ns_per_read": {p: 1e9 * statistics.median(t) for p, t in times.items()},
            "tables_raised": raised, "distinct_keys": sum(distinct.values()), "reads": reads,
            "tables": len(distinct)}


# ---------------------------------------------------------------- jobs

def variants(args, cache: dict[str, int]) -> dict[str, tuple[list[str], int]]:
    """name -> (config overrides, embedding workers)."""
    rows = json.dumps(cache)
    het = [f"strategy.het.cache_rows={rows}", f"strategy.het.policy={args.policy}"]
    direct = ["strategy.preset=het", "strategy.dense=allreduce"]
    out = {"bsp": ([*direct, "strategy.consistency=ssp", "strategy.ssp.staleness=0"], 0),
           "asp": ([*direct, "strategy.consistency=asp"], 0),
           "ssp": ([*direct, "strategy.consistency=ssp", f"strategy.ssp.staleness={args.ssp_staleness}"], 0),
           "no_cache": ([*direct, "strategy.consistency=sync"], 0)}
    for name, s in STALENESS.items():
        out[f"het_{name}"] = ([*direct, "strategy.consistency=het", f"strategy.het.staleness={s}", *het], 0)
    if not args.no_persia:
        out["persia"] = (["strategy.preset=persia", "strategy.tau=4"], 1)
    return out


def run_job(args, label: str, overrides: list[str], embedding_workers: int, output_dir: Path) -> dict:
    """One launch of the job (2 PS servers, `embedding_workers`, 2 trainers); its final metrics."""
    job = argparse.Namespace(**{**vars(args), "ps": 2, "trainers": 2, "embedding_workers": embedding_workers})
    return launch_job(job, label, overrides, output_dir)


def _median(values) -> float | None:
    finite = [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    return statistics.median(finite) if finite else None


def summarize(runs: list[dict], het: bool) -> dict:
    keys = {**METRICS, **(HET_METRICS if het else {})}
    summary = {name: _median([r.get(key) for r in runs]) for key, name in keys.items()}
    summary["runs"] = [{name: r.get(key) for key, name in keys.items()} for r in runs]
    summary["strategy"] = runs[0].get("strategy") if runs else None
    summary["best_auc"] = _median([r.get("best_auc") for r in runs])
    return summary


def report(raw: dict[str, list[dict]], rates: dict | None) -> dict:
    out = {name: summarize(raw[name], False) for name in ("bsp", "asp", "ssp", "no_cache", "persia") if name in raw}
    out["het"] = {name: summarize(raw[f"het_{name}"], True) for name in STALENESS if f"het_{name}" in raw}
    if rates is not None:
        out.update(rates)
    targets = {}
    if "s100" in out["het"] and "no_cache" in out and "bsp" in out:
        het, base = out["het"]["s100"], out["no_cache"]
        if het["embedding_bytes_per_sample"] and base["embedding_bytes_per_sample"]:
            targets["bytes_reduction_vs_no_cache"] = 1 - het["embedding_bytes_per_sample"] / base["embedding_bytes_per_sample"]
        if het["auc"] is not None and out["bsp"]["auc"] is not None:
            targets["auc_minus_bsp"] = het["auc"] - out["bsp"]["auc"]
        targets["bytes_met"] = targets.get("bytes_reduction_vs_no_cache", 0) >= BYTES_TARGET
        targets["auc_met"] = abs(targets.get("auc_minus_bsp", 1)) <= AUC_BUDGET
    if rates is not None:
        targets["lfu_at_or_below_lru"] = all(rates["miss_rate"]["lfu"][s] <= rates["miss_rate"]["lru"][s]
                                             for s in rates["miss_rate"]["lru"])
    out["targets"] = targets
    return out


def run_benchmark(args) -> dict:
    from hybridrec.parallel.roles import check_config

    cfg = check_config(args.config, args.set)
    if cfg.strategy.roles.trainers != 2:
        print(f"[bench het] the jobs run 2 trainers (the config says {cfg.strategy.roles.trainers})", file=sys.stderr)
    print("[bench het] reading the trainers' key streams", file=sys.stderr, flush=True)
    streams = key_streams(cfg, 2)
    rates = miss_rates(streams, args.repeats)
    print(f"[bench het] miss rates: {json.dumps(rates['miss_rate'])}", file=sys.stderr, flush=True)
    raw: dict[str, list[dict]] = {}
    if not args.skip_jobs:
        cache, _ = cache_rows(streams, distinct_keys(streams), args.cache_fraction)
        root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="hybridrec-bench-het-"))
        root.mkdir(parents=True, exist_ok=True)
        try:
            plan = variants(args, cache)
            for run in range(args.runs):
                for name, (overrides, workers) in plan.items():
                    metrics = run_job(args, name, overrides, workers, root / f"{name}-run{run}")
                    raw.setdefault(name, []).append(metrics)
                    print(f"[bench het] {name} run {run + 1}/{args.runs}: auc {metrics.get('auc', 0):.5f} "
                          f"samples/s {metrics.get('train_samples_per_s') or 0:.0f} "
                          f"bytes/sample {metrics.get('bytes_per_sample') or 0:.1f}"
                          + (f" hit rate {metrics['cache_hit_rate']:.3f}" if metrics.get("cache_hit_rate") else ""),
                          file=sys.stderr, flush=True)
        finally:
            if not args.keep:
                shutil.rmtree(root, ignore_errors=True)
    result = report(raw, rates)
    result["settings"] = {"config": args.config, "set": args.set, "runs": args.runs, "ps": 2, "trainers": 2,
                          "cache_fraction": args.cache_fraction, "policy": args.policy,
                          "ssp_staleness": args.ssp_staleness}
    return result


# ---------------------------------------------------------------- output

def _fmt(value, digits: int = 4) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def print_report(result: dict) -> None:
    rows = [(name, result[name]) for name in ("bsp", "asp", "ssp", "no_cache", "persia") if name in result]
    rows += [(f"het {name}", r) for name, r in result.get("het", {}).items()]
    if rows:
        print(f"{'variant':<10} {'auc':>8} {'logloss':>8} {'samples/s':>10} {'bytes/sample':>12} {'hit rate':>8} "
              f"{'clock B/s':>9} {'max stale':>9}")
        samples = lambda r: r["embedding_bytes_per_sample"]  # noqa: E731
        for name, r in rows:
            clock = (r.get("clock_bytes") / (r["vector_bytes"] + r["clock_bytes"]) * samples(r)
                     if r.get("clock_bytes") is not None and samples(r) else None)
            print(f"{name:<10} {_fmt(r['auc']):>8} {_fmt(r['logloss']):>8} {_fmt(r['samples_per_s'], 0):>10} "
                  f"{_fmt(samples(r), 1):>12} {_fmt(r.get('hit_rate'), 3):>8} {_fmt(clock, 1):>9} "
                  f"{_fmt(r.get('max_staleness')):>9}")
    if "miss_rate" in result:
        print(f"miss rate by cache size (fraction of each table's {result['distinct_keys']} distinct keys, "
              f"{result['reads']} reads):")
        print(f"{'policy':<10} " + " ".join(f"{s:>7}" for s in result["miss_rate"]["lru"]) + f" {'ns/read':>8}")
        for policy, by_size in result["miss_rate"].items():
            print(f"{policy:<10} " + " ".join(f"{m:>7.4f}" for m in by_size.values())
                  + f" {result['ns_per_read'][policy]:>8.1f}")
    for key, value in result.get("targets", {}).items():
        print(f"{key}: {_fmt(value)}")


def plot(result: dict, path: str) -> None:
    with png_figure(path, figsize=(5.5, 4)) as (figure, axis):
        # lfu and light lfu may coincide, so their markers differ in shape and size
        styles = {"lru": ("o", "-", 7), "lfu": ("s", "-", 9), "light_lfu": ("^", "--", 6)}
        for policy, by_size in result["miss_rate"].items():
            sizes = [100 * float(s) for s in by_size]
            marker, line, size = styles.get(policy, ("o", "-", 7))
            axis.plot(sizes, list(by_size.values()), marker=marker, linestyle=line, markersize=size,
                      label=f"{policy} ({result['ns_per_read'][policy]:.0f} ns/read)")
        axis.set_xlabel("cache size (% of each table's distinct training keys)")
        axis.set_ylabel("miss rate")
        axis.set_title(f"bench het: {Path(result['settings']['config']).name}, 2 trainers' key streams", fontsize=9)
        axis.grid(alpha=0.3)
        axis.legend()


def headline(report: dict) -> dict:
    """The figures of the results table: the targets at s = 100 (bytes against no cache, AUC
    against BSP), s = 0's and s = inf's AUC against BSP, the miss rates at a 10% cache and HET's samples/s
    against no cache."""
    figures = pick(report.get("targets"), {"s=100 bytes saved vs no cache": "bytes_reduction_vs_no_cache",
                                           "s=100 AUC - BSP": "auc_minus_bsp"})
    het, bsp, no_cache = report.get("het", {}), report.get("bsp") or {}, report.get("no_cache") or {}
    for name in ("s0", "sinf"):
        if (het.get(name) or {}).get("auc") is not None and bsp.get("auc") is not None:
            figures[f"s={name[1:]} AUC - BSP"] = het[name]["auc"] - bsp["auc"]
    if (het.get("s100") or {}).get("samples_per_s") and no_cache.get("samples_per_s"):
        figures["s=100 / no cache samples/s"] = het["s100"]["samples_per_s"] / no_cache["samples_per_s"]
    for policy, by_size in (report.get("miss_rate") or {}).items():
        figures.update(pick(by_size, {f"{policy} miss rate at 10%": "0.1"}))
    figures.update(pick(report.get("targets"), {"LFU misses at most LRU": "lfu_at_or_below_lru"}))
    return figures


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_config_and_plot(parser, args)
    check_ray(parser, args)
    if not 0 < args.cache_fraction <= 1:
        parser.error(f"--cache-fraction must be in (0, 1], got {args.cache_fraction}")
    try:
        result = run_benchmark(args)
    except (JobFailed, ValueError) as exc:
        parser.exit(1, f"{parser.prog}: error: {exc}\n")
    print_report(result)
    if args.plot:
        plot(result, args.plot)
        print(f"plot: {args.plot}")
    if args.json:
        print(json.dumps(result))
    return result
