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

`--seeds 0,1,2` runs every variant once per seed (`--set seed=S`: data, dense and embedding
initialisation; `--runs` times each, default 1 with seeds), and reports medians with their spread
(`auc_min` / `auc_max`, `samples_per_s_min` / `_max`) and the per-seed paired AUC differences.

`--emulate-hosts N --bandwidth RATE[,RATE...] --latency MS --place ...` run every job on emulated
hosts (`hybridrec.parallel.emulated_hosts`); several rates make a sweep, one report per rate
(the JSON line then holds them under `points`). `--plot FILE.png` draws the sweep (needs
matplotlib, in the `bench` extra): AUC and samples/s of each discipline, or samples/s and bytes
per sample of each codec, per rate, medians with min-max bars.

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

from hybridrec.benchmarks.figures import png_figure
from hybridrec.benchmarks.results import pick
from hybridrec.benchmarks.timing import positive_int
from hybridrec.parallel.emulated_hosts import add_arguments as add_emulation_arguments

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
    parser.add_argument("--runs", type=positive_int, default=None,
                        help="jobs per variant (and seed); default 3, 1 with --seeds")
    parser.add_argument("--seeds", type=_seed_list, default=None, metavar="S,S,...",
                        help="run every variant once per seed (config key seed); medians with min/max")
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
    parser.add_argument("--plot", metavar="FILE.png", help="draw the results per bandwidth (needs matplotlib)")
    add_emulation_arguments(parser, sweep=True)
    add_ray_argument(parser)
    return parser


def _seed_list(text: str) -> list[int]:
    try:
        seeds = [int(item) for item in text.split(",")]
    except ValueError:
        seeds = []
    if not seeds or min(seeds) < 0 or len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"expected distinct seeds >= 0 separated by commas (e.g. 0,1,2), got {text!r}")
    return seeds


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _median(values: Sequence) -> float | None:
    finite = [float(v) for v in values if _finite(v)]
    return statistics.median(finite) if finite else None


def add_ray_argument(parser: argparse.ArgumentParser) -> None:
    """--ray, on every bench whose jobs `run_job` launches."""
    parser.add_argument("--ray", metavar="ADDRESS",
                        help="run every job on the Ray cluster at ADDRESS as `hybridrec launch --ray` does (auto: "
                             "this machine's, started if none runs; with --emulate-hosts, auto only: a Ray cluster "
                             "across the emulated hosts per job); needs hybridrec[ray]")


def check_ray(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """parser.error when --ray cannot be had: no ray package, or an address with emulated hosts."""
    if getattr(args, "ray", None) is None:
        return
    try:
        import ray  # noqa: F401
    except ImportError:
        parser.error(f"--ray {args.ray}: needs the ray package (pip install 'hybridrec[ray]')")
    if getattr(args, "emulate_hosts", None) is not None and args.ray != "auto":
        parser.error(f"--ray {args.ray} with --emulate-hosts: the emulated hosts get a Ray cluster of their own; "
                     "allowed: --ray auto")


def run_job(args: argparse.Namespace, label: str, overrides: list[str], output_dir: Path,
            emulation=None) -> dict:
    """One launch of the job with `overrides` after the user's --set (on `emulation`'s hosts when
    given; on the Ray cluster `args.ray` names, when given); its final metrics."""
    from hybridrec.parallel.launch import launch

    log = io.StringIO()
    sets = [*args.set, *overrides, f"train.output_dir={output_dir}"]
    code = launch(args.config, ps=args.ps, embedding_workers=args.embedding_workers,
                  trainers=args.trainers, overrides=sets, overwrite=True,
                  timeout=args.timeout, out=log, emulation=emulation, ray=getattr(args, "ray", None))
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



def check_config_and_plot(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """parser.error when --config names no file, or --plot is asked for without matplotlib."""
    if not Path(args.config).is_file():
        parser.error(f"--config {args.config}: no such file (paths are relative to {Path.cwd()})")
    if getattr(args, "plot", None):
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error(f"--plot {args.plot}: needs matplotlib (pip install 'hybridrec[bench]')")


def run_variants(args: argparse.Namespace, variants: dict[str, list[str]], root: Path,
                 emulation=None, label: str = "bench hybrid") -> dict[str, list[dict]]:
    """Every variant `--runs` times per seed, interleaved (seed, run, then variant: the i-th jobs of
    the variants pair up); the per-job metrics of each variant, each with its `seed`. Progress
    lines on stderr start with `[label]`."""
    results: dict[str, list[dict]] = {name: [] for name in variants}
    seeds = args.seeds or [None]
    for seed in seeds:
        for run in range(args.runs):
            for name, overrides in variants.items():
                tag = f"{name}-run{run}" if seed is None else f"{name}-seed{seed}-run{run}"
                seeded = overrides if seed is None else [*overrides, f"seed={seed}"]
                metrics = run_job(args, name, seeded, root / tag.replace("/", "_"), emulation)
                metrics["seed"] = seed
                results[name].append(metrics)
                where = "" if seed is None else f"seed {seed} "
                print(f"[{label}] {name} {where}run {run + 1}/{args.runs}: auc {_fmt(metrics.get('auc'), 5)} "
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
    for key, name in (("auc", "auc"), ("train_samples_per_s", "samples_per_s")):
        finite = [float(r[key]) for r in runs if _finite(r.get(key))]
        summary[f"{name}_min"], summary[f"{name}_max"] = (min(finite), max(finite)) if finite else (None, None)
    summary["runs"] = [{**{name: r.get(key) for key, name in METRICS.items()}, "seed": r.get("seed")} for r in runs]
    return summary


def spread(values: Sequence) -> dict:
    """Median, min and max of the finite values."""
    finite = [float(v) for v in values if _finite(v)]
    return {"median": _median(finite), "min": min(finite, default=None), "max": max(finite, default=None)}


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
    for name in ("hybrid", "async"):  # job by job (same seed): the seeds' own spread cancels
        report[f"{name}_minus_sync_auc_paired"] = spread(
            [a["auc"] - b["auc"] for a, b in zip(raw[name], raw["sync"]) if _finite(a.get("auc")) and _finite(b.get("auc"))])
    report["hybrid_vs_sync_samples_per_s"] = paired(raw["hybrid"], raw["sync"], "train_samples_per_s", _ratio)
    report["async_vs_sync_samples_per_s"] = paired(raw["async"], raw["sync"], "train_samples_per_s", _ratio)
    return report


def _range(summary: dict, name: str, digits: int) -> str:
    low, high = summary.get(f"{name}_min"), summary.get(f"{name}_max")
    return "" if low is None or low == high else f" ({_fmt(low, digits)}-{_fmt(high, digits)})"


def print_disciplines(report: dict) -> None:
    jobs = len(report["sync"]["runs"])
    print(f"sync vs hybrid vs async{_where(report)}, medians of {jobs} job(s) each (min-max)")
    print(f"{'discipline':<10} {'auc':>24} {'logloss':>8} {'samples/s':>18} {'max stale':>9} "
          f"{'mean stale':>10} {'bytes/sample':>12}")
    for name in DISCIPLINES:
        r = report[name]
        print(f"{name:<10} {_fmt(r['auc']) + _range(r, 'auc', 4):>24} {_fmt(r['logloss']):>8} "
              f"{_fmt(r['samples_per_s'], 0) + _range(r, 'samples_per_s', 0):>18} "
              f"{_fmt(r['max_staleness']):>9} {_fmt(r['mean_staleness'], 2):>10} "
              f"{_fmt(r['bytes_per_sample'], 0):>12}")
    if report["sync"]["best_auc"] is not None:
        print(f"planted model's test AUC (the best achievable): {report['sync']['best_auc']:.4f}")
    rel = report["hybrid_minus_sync_auc_relative"]
    print(f"hybrid - sync AUC: {_fmt(report['hybrid_minus_sync_auc'], 5)}"
          f" ({'-' if rel is None else f'{100 * rel:+.3f}%'}); "
          f"async - sync AUC: {_fmt(report['async_minus_sync_auc'], 5)}")
    for name in ("hybrid", "async"):
        d = report[f"{name}_minus_sync_auc_paired"]
        print(f"{name} - sync AUC job by job: median {_fmt(d['median'], 5)}, min {_fmt(d['min'], 5)}, "
              f"max {_fmt(d['max'], 5)}")
    print(f"samples/s hybrid/sync: {_fmt(report['hybrid_vs_sync_samples_per_s'], 2)}; "
          f"async/sync: {_fmt(report['async_vs_sync_samples_per_s'], 2)}")


def _where(report: dict) -> str:
    return f" on {report['emulation']}" if report.get("emulation") else ""


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
        summary["samples_per_s_vs_none"] = paired(raw[name], raw[base_name], "train_samples_per_s", _ratio)
        report[name] = summary
    best = report[codec_name(*CODECS[-1])]
    report["target_met"] = (_finite(best["bytes_reduction_vs_none"]) and _finite(best["auc_minus_none"])
                            and best["bytes_reduction_vs_none"] >= CODEC_BYTES_TARGET
                            and -best["auc_minus_none"] < CODEC_AUC_BUDGET)
    return report


def print_codecs(report: dict) -> None:
    jobs = len(report[codec_name(*CODECS[0])]["runs"])
    print(f"wire codecs under the sync discipline{_where(report)}, medians of {jobs} job(s)")
    print(f"{'ids/values':<12} {'bytes/sample':>12} {'x fewer':>8} {'auc':>8} {'auc - none':>10} "
          f"{'logloss':>8} {'samples/s':>10} {'x none':>7}")
    for ids, values in CODECS:
        r = report[codec_name(ids, values)]
        print(f"{codec_name(ids, values):<12} {_fmt(r['bytes_per_sample'], 0):>12} "
              f"{_fmt(r['bytes_reduction_vs_none'], 2):>8} {_fmt(r['auc']):>8} "
              f"{_fmt(r['auc_minus_none'], 5):>10} {_fmt(r['logloss']):>8} {_fmt(r['samples_per_s'], 0):>10} "
              f"{_fmt(r['samples_per_s_vs_none'], 2):>7}")
    print(f"target (>= {CODEC_BYTES_TARGET:g}x fewer bytes, AUC cost < {CODEC_AUC_BUDGET}): "
          f"{'met' if report['target_met'] else 'NOT met'}")


def sweep(args: argparse.Namespace) -> list:
    """The emulated hosts of each --bandwidth rate (one None: this machine's loopback);
    ValueError naming the flag when they cannot be had."""
    from hybridrec.parallel.emulated_hosts import check_support, from_arguments

    rates = args.bandwidth.split(",") if args.bandwidth else [None]
    points = [from_arguments(argparse.Namespace(**{**vars(args), "bandwidth": rate})) for rate in rates]
    if points[0] is not None:
        check_support()
    return points


def run_benchmark(args: argparse.Namespace, points: Sequence = (None,)) -> list[dict]:
    """Runs every job at each point of the sweep; one report per point. JobFailed when a job fails."""
    from hybridrec.parallel.roles import check_config

    check_config(args.config, args.set)  # a wrong config or --set fails here, before any job
    if args.keep:
        root = Path(args.keep)
        root.mkdir(parents=True, exist_ok=True)
    else:
        root = Path(tempfile.mkdtemp(prefix="hybridrec-bench-hybrid-"))
    reports = []
    try:
        for index, emulation in enumerate(points):
            where = root / f"point{index}" if len(points) > 1 else root
            if args.codecs:
                variants = {codec_name(ids, values): [*DISCIPLINES["sync"], f"strategy.id_codec={ids}",
                                                      f"strategy.value_codec={values}"]
                            for ids, values in CODECS}
                report = codecs_report(run_variants(args, variants, where, emulation))
            else:
                report = disciplines_report(run_variants(args, dict(DISCIPLINES), where, emulation))
            report["bandwidth"] = None if emulation is None or emulation.rate is None else f"{emulation.rate / 1e6:g} Mbit/s"
            report["emulation"] = None if emulation is None else emulation.describe()
            report["settings"] = {"config": args.config, "set": args.set, "runs": args.runs, "seeds": args.seeds,
                                  "ps": args.ps, "embedding_workers": args.embedding_workers,
                                  "trainers": args.trainers}
            reports.append(report)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    return reports


def plot(reports: Sequence[dict], path: str, codecs: bool) -> None:
    """One PNG of the sweep: per variant, the median and min-max of two metrics at each point."""
    names = [codec_name(*c) for c in CODECS] if codecs else list(DISCIPLINES)
    panels = ([("samples_per_s", "training samples/s"), ("bytes_per_sample", "payload bytes per sample")] if codecs
              else [("auc", "test AUC"), ("samples_per_s", "training samples/s")])
    labels = [r["bandwidth"] or ("unshaped" if r.get("emulation") else "loopback") for r in reports]
    with png_figure(path, 1, len(panels), figsize=(5 * len(panels), 4)) as (figure, axes):
        for axis, (key, title) in zip(axes, panels):
            for j, name in enumerate(names):
                x = [i + (j - (len(names) - 1) / 2) * 0.12 for i in range(len(reports))]
                values = [spread([run.get(key) for run in r[name]["runs"]]) for r in reports]
                medians = [v["median"] for v in values]
                errors = [[m - v["min"] for m, v in zip(medians, values)],
                          [v["max"] - m for m, v in zip(medians, values)]]
                axis.errorbar(x, medians, yerr=errors, marker="o", capsize=4, label=name)
            axis.set_xticks(range(len(reports)), labels)
            axis.set_title(title)
            axis.grid(alpha=0.3)
        axes[0].legend()
        settings = reports[0]["settings"]
        jobs = "/".join(dict.fromkeys(str(len(r[names[0]]["runs"])) for r in reports))  # per point, when they differ
        where = (reports[0].get("emulation") or "loopback") if len(reports) == 1 else f"{len(reports)} link rates"
        figure.suptitle(f"bench hybrid{' --codecs' if codecs else ''}: {settings['trainers']} trainer(s), {where}; "
                        f"median and min-max of {jobs} job(s)", fontsize=9)


def headline(report: dict) -> dict:
    """The figures of the results table: per link rate of a sweep, the disciplines' AUC differences
    and samples/s ratios against sync, or each codec's bytes and AUC against none/none."""
    figures = {}
    for point in report.get("points", [report]):
        at = f"{point['bandwidth']}: " if point.get("bandwidth") else ""
        if "target_met" in point:  # --codecs
            for ids, values in CODECS[1:]:
                figures.update(pick(point[codec_name(ids, values)],
                                    {"bytes x fewer": "bytes_reduction_vs_none", "AUC - none": "auc_minus_none",
                                     "samples/s / none": "samples_per_s_vs_none"}, f"{at}{codec_name(ids, values)} "))
            figures[f"{at}target met"] = point["target_met"]
        else:
            figures.update(pick(point, {"hybrid - sync AUC": "hybrid_minus_sync_auc",
                                        "async - sync AUC": "async_minus_sync_auc",
                                        "hybrid / sync samples/s": "hybrid_vs_sync_samples_per_s",
                                        "async / sync samples/s": "async_vs_sync_samples_per_s"}, at))
            figures.update(pick(point["sync"], {"sync AUC": "auc"}, at))
    return figures


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.trainers is None:
        args.trainers = 1 if args.codecs else 2
    if args.runs is None:
        args.runs = 1 if args.seeds else 3
    check_config_and_plot(parser, args)
    check_ray(parser, args)
    try:
        points = sweep(args)
    except ValueError as exc:  # a bad emulation flag, or no privilege to emulate hosts
        parser.error(str(exc))
    try:
        reports = run_benchmark(args, points)
    except (JobFailed, ValueError) as exc:  # ValueError: ConfigError, bad counts
        parser.exit(1, f"{parser.prog}: error: {exc}\n")
    for report in reports:
        (print_codecs if args.codecs else print_disciplines)(report)
    if args.plot:
        plot(reports, args.plot, args.codecs)
        print(f"plot: {args.plot}")
    result = reports[0] if len(reports) == 1 else {"points": reports}
    if args.json:
        print(json.dumps(result))
    return result
