"""`hybridrec bench hybrid`: Persia's three update disciplines, and its wire codecs, on real jobs.

Default mode: the same distributed job (`hybridrec.parallel.launch.launch`: PS servers,
embedding workers, trainers under torchrun; same data and seed) is run under Persia's three
disciplines, each a point of the strategy axes (DISCIPLINES): sync (consistency sync, dense
allreduce), hybrid (bounded, allreduce) and async (bounded, ps_async), `--runs` times each,
interleaved (run 1 of every
discipline, then run 2, ...) so the machine's noise falls on all three alike. Reported per
discipline, from each job's final_metrics.json: test `auc` and `logloss`, training
`samples_per_s`, `max_staleness` / `mean_staleness` (batches between an embedding lookup and
its update) and `bytes_per_sample` (payload between trainers and embedding workers per
training sample); medians over the runs, the per-run values under `runs`. Plus the hybrid-sync
AUC difference and the samples/s ratios hybrid/sync and async/sync (medians of the per-run
paired ratios).

`--codecs`: (id_codec, value_codec) = (none, none), (unique, none), (unique, fp16): bytes per
sample of each, how many times fewer than none/none, and AUC/logloss (medians). These jobs run
under the sync discipline with 1 trainer by default: that training is deterministic, so an AUC
difference is the codec's own. With 2 workers the order in which updates reach the PS varies,
and run-to-run noise (~0.002 AUC) hides a cost of 0.0005. The issue's target: >= 3x fewer bytes
than int64 keys + fp32 rows, AUC cost < 0.0005.

`--json` prints one JSON line. A job that fails is an error naming the discipline (or codec
pair) and the launcher's exit code, with the launcher's output.
"""
from __future__ import annotations

import argparse
import io
import json
import math
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Sequence

from hybridrec.benchmarks.timing import positive_int

# Persia's disciplines as strategy axes: the bench's variants
DISCIPLINES = {"sync": ["strategy.consistency=sync", "strategy.dense=allreduce"],
               "hybrid": ["strategy.consistency=bounded", "strategy.dense=allreduce"],
               "async": ["strategy.consistency=bounded", "strategy.dense=ps_async"]}
CODECS = (("none", "none"), ("unique", "none"), ("unique", "fp16"))
DEFAULT_CONFIG = "configs/persia_synthetic.yaml"
# final_metrics.json key -> the name reported here
METRICS = {"auc": "auc", "logloss": "logloss", "train_samples_per_s": "samples_per_s",
           "max_staleness": "max_staleness", "mean_staleness": "mean_staleness",
           "bytes_per_sample": "bytes_per_sample"}
CODEC_BYTES_TARGET = 3.0    # times fewer bytes than none/none
CODEC_AUC_BUDGET = 0.0005   # largest acceptable AUC loss against none/none
OUTPUT_TAIL = 12_000        # characters of a failed job's output kept in the error


class JobFailed(RuntimeError):
    """One benchmark job did not finish: names the variant, the exit code, the launcher's output."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hybridrec bench hybrid",
        description="Runs one Persia-style job under sync, hybrid and async (or, with --codecs, "
                    "under three wire codecs) and compares AUC, samples/s, staleness and bytes.")
    parser.add_argument("--config", default=DEFAULT_CONFIG,
                        help=f"job config (strategy.preset persia), default {DEFAULT_CONFIG}")
    parser.add_argument("--runs", type=positive_int, default=3, help="jobs per variant (default 3)")
    parser.add_argument("--ps", type=positive_int, default=2, help="PS servers (default 2)")
    parser.add_argument("--embedding-workers", type=positive_int, default=1,
                        help="embedding workers (default 1)")
    parser.add_argument("--trainers", "--nn-workers", dest="trainers", type=positive_int, default=None,
                        help="trainers (default 2; 1 with --codecs)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="config override for every job (repeatable)")
    parser.add_argument("--codecs", action="store_true",
                        help="compare id/value codecs instead (sync discipline, deterministic with 1 trainer)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per job (default 3600)")
    parser.add_argument("--keep", metavar="DIR",
                        help="write the jobs' output directories under DIR and keep them "
                             "(default: a temporary directory, deleted at the end)")
    parser.add_argument("--verbose", action="store_true", help="show the launcher's output of every job")
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    return parser


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _median(values: Sequence) -> float | None:
    finite = [float(v) for v in values if _finite(v)]
    return statistics.median(finite) if finite else None


def run_job(args: argparse.Namespace, label: str, overrides: list[str], output_dir: Path) -> dict:
    """One launch of the job with `overrides` after the user's --set; its final metrics."""
    from hybridrec.parallel.launch import launch

    log = io.StringIO()
    sets = [*args.set, *overrides, f"train.output_dir={output_dir}"]
    code = launch(args.config, ps=args.ps, embedding_workers=args.embedding_workers,
                  trainers=args.trainers, overrides=sets, overwrite=True,
                  timeout=args.timeout, out=log)
    text = log.getvalue()
    if args.verbose:
        print(text, file=sys.stderr, end="", flush=True)
    if code != 0:
        shown = text if len(text) <= OUTPUT_TAIL else "...\n" + text[-OUTPUT_TAIL:]
        raise JobFailed(f"the {label} job failed: hybridrec launch exited with code {code} "
                        f"(config {args.config}, --set {' '.join(sets)}); its output:\n{shown}")
    metrics_file = output_dir / "final_metrics.json"
    if not metrics_file.is_file():
        raise JobFailed(f"the {label} job exited 0 but wrote no {metrics_file}; its output:\n"
                        f"{text[-OUTPUT_TAIL:]}")
    metrics = json.loads(metrics_file.read_text())
    if not metrics.get("step"):
        raise JobFailed(f"the {label} job trained no step (every trainer needs a share of the training "
                        f"data: synthetic rows come in blocks of 4,096, one block per rank at the least); "
                        f"its metrics: {metrics}")
    return metrics


def run_variants(args: argparse.Namespace, variants: dict[str, list[str]], root: Path) -> dict[str, list[dict]]:
    """Every variant `--runs` times, interleaved; the per-run metrics of each variant."""
    results: dict[str, list[dict]] = {name: [] for name in variants}
    for run in range(args.runs):
        for name, overrides in variants.items():
            metrics = run_job(args, name, overrides, root / f"{name}-run{run}")
            results[name].append(metrics)
            print(f"[bench hybrid] {name} run {run + 1}/{args.runs}: auc {_fmt(metrics.get('auc'), 5)} "
                  f"samples/s {_fmt(metrics.get('train_samples_per_s'), 0)} "
                  f"bytes/sample {_fmt(metrics.get('bytes_per_sample'), 0)}", file=sys.stderr, flush=True)
    return results


def summarize_variant(runs: list[dict]) -> dict:
    """Medians of the reported metrics over the runs, plus the per-run values under `runs`."""
    summary = {name: _median([r.get(key) for r in runs]) for key, name in METRICS.items()}
    summary["max_staleness"] = max((r["max_staleness"] for r in runs), default=None)  # worst, not median
    summary["best_auc"] = _median([r.get("best_auc") for r in runs])
    summary["lost_batches"] = sum(r.get("lost_batches") or 0 for r in runs)
    summary["dropped_updates"] = sum(r.get("dropped_updates") or 0 for r in runs)
    summary["tau"] = (runs[0].get("strategy") or {}).get("tau") if runs else None
    summary["strategy"] = runs[0].get("strategy") if runs else None
    summary["runs"] = [{name: r.get(key) for key, name in METRICS.items()} for r in runs]
    return summary


def paired(runs_a: list[dict], runs_b: list[dict], key: str, op) -> float | None:
    """Median over runs i of op(a_i[key], b_i[key]) (runs paired by their index)."""
    return _median([op(a[key], b[key]) for a, b in zip(runs_a, runs_b)
                    if _finite(a.get(key)) and _finite(b.get(key)) and (op is not _ratio or b[key])])


def _ratio(a: float, b: float) -> float:
    return a / b


def _difference(a: float, b: float) -> float:
    return a - b


def _fmt(value, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def disciplines_report(raw: dict[str, list[dict]]) -> dict:
    report = {name: summarize_variant(raw[name]) for name in DISCIPLINES}
    sync, hybrid = report["sync"], report["hybrid"]
    report["hybrid_minus_sync_auc"] = (hybrid["auc"] - sync["auc"]
                                       if _finite(hybrid["auc"]) and _finite(sync["auc"]) else None)
    report["hybrid_minus_sync_auc_relative"] = (report["hybrid_minus_sync_auc"] / sync["auc"]
                                                if report["hybrid_minus_sync_auc"] is not None else None)
    report["async_minus_sync_auc"] = (report["async"]["auc"] - sync["auc"]
                                      if _finite(report["async"]["auc"]) and _finite(sync["auc"]) else None)
    report["hybrid_vs_sync_samples_per_s"] = paired(raw["hybrid"], raw["sync"], "train_samples_per_s", _ratio)
    report["async_vs_sync_samples_per_s"] = paired(raw["async"], raw["sync"], "train_samples_per_s", _ratio)
    return report


def print_disciplines(report: dict, runs: int) -> None:
    print(f"sync vs hybrid vs async, medians of {runs} run(s)")
    print(f"{'discipline':<10} {'auc':>8} {'logloss':>8} {'samples/s':>10} {'max stale':>9} "
          f"{'mean stale':>10} {'bytes/sample':>12}")
    for name in DISCIPLINES:
        r = report[name]
        print(f"{name:<10} {_fmt(r['auc']):>8} {_fmt(r['logloss']):>8} {_fmt(r['samples_per_s'], 0):>10} "
              f"{_fmt(r['max_staleness']):>9} {_fmt(r['mean_staleness'], 2):>10} "
              f"{_fmt(r['bytes_per_sample'], 0):>12}")
    if report["sync"]["best_auc"] is not None:
        print(f"planted model's test AUC (the best achievable): {report['sync']['best_auc']:.4f}")
    rel = report["hybrid_minus_sync_auc_relative"]
    print(f"hybrid - sync AUC: {_fmt(report['hybrid_minus_sync_auc'], 5)}"
          f" ({'-' if rel is None else f'{100 * rel:+.3f}%'}); "
          f"async - sync AUC: {_fmt(report['async_minus_sync_auc'], 5)}")
    print(f"samples/s hybrid/sync: {_fmt(report['hybrid_vs_sync_samples_per_s'], 2)}; "
          f"async/sync: {_fmt(report['async_vs_sync_samples_per_s'], 2)}")


def codec_name(ids: str, values: str) -> str:
    return f"{ids}/{values}"


def codecs_report(raw: dict[str, list[dict]]) -> dict:
    base_name = codec_name(*CODECS[0])
    report = {}
    for ids, values in CODECS:
        name = codec_name(ids, values)
        summary = summarize_variant(raw[name])
        summary["id_codec"], summary["value_codec"] = ids, values
        summary["bytes_reduction_vs_none"] = paired(raw[base_name], raw[name], "bytes_per_sample", _ratio)
        summary["auc_minus_none"] = paired(raw[name], raw[base_name], "auc", _difference)
        report[name] = summary
    best = report[codec_name(*CODECS[-1])]
    report["target_met"] = (_finite(best["bytes_reduction_vs_none"]) and _finite(best["auc_minus_none"])
                            and best["bytes_reduction_vs_none"] >= CODEC_BYTES_TARGET
                            and -best["auc_minus_none"] < CODEC_AUC_BUDGET)
    return report


def print_codecs(report: dict, runs: int) -> None:
    print(f"wire codecs under the sync discipline, medians of {runs} run(s)")
    print(f"{'ids/values':<12} {'bytes/sample':>12} {'x fewer':>8} {'auc':>8} {'auc - none':>10} "
          f"{'logloss':>8} {'samples/s':>10}")
    for ids, values in CODECS:
        r = report[codec_name(ids, values)]
        print(f"{codec_name(ids, values):<12} {_fmt(r['bytes_per_sample'], 0):>12} "
              f"{_fmt(r['bytes_reduction_vs_none'], 2):>8} {_fmt(r['auc']):>8} "
              f"{_fmt(r['auc_minus_none'], 5):>10} {_fmt(r['logloss']):>8} {_fmt(r['samples_per_s'], 0):>10}")
    print(f"target (>= {CODEC_BYTES_TARGET:g}x fewer bytes, AUC cost < {CODEC_AUC_BUDGET}): "
          f"{'met' if report['target_met'] else 'NOT met'}")


def run_benchmark(args: argparse.Namespace) -> dict:
    """Runs every job and returns the report; JobFailed when one of them fails."""
    from hybridrec.parallel.launch import check_config

    check_config(args.config, args.set)  # a wrong config or --set fails here, before any job
    if args.keep:
        root = Path(args.keep)
        root.mkdir(parents=True, exist_ok=True)
    else:
        root = Path(tempfile.mkdtemp(prefix="hybridrec-bench-hybrid-"))
    try:
        if args.codecs:
            variants = {codec_name(ids, values): [*DISCIPLINES["sync"], f"strategy.id_codec={ids}",
                                                  f"strategy.value_codec={values}"]
                        for ids, values in CODECS}
            report = codecs_report(run_variants(args, variants, root))
        else:
            variants = dict(DISCIPLINES)
            report = disciplines_report(run_variants(args, variants, root))
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    report["settings"] = {"config": args.config, "set": args.set, "runs": args.runs, "ps": args.ps,
                          "embedding_workers": args.embedding_workers, "trainers": args.trainers}
    return report


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.trainers is None:
        args.trainers = 1 if args.codecs else 2
    if not Path(args.config).is_file():
        parser.error(f"--config {args.config}: no such file (paths are relative to {Path.cwd()})")
    try:
        report = run_benchmark(args)
    except (JobFailed, ValueError) as exc:  # ValueError: ConfigError, bad counts
        parser.exit(1, f"{parser.prog}: error: {exc}\n")
    (print_codecs if args.codecs else print_disciplines)(report, args.runs)
    if args.json:
        print(json.dumps(report))
    return report
