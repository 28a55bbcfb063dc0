"""`hybridrec bench picasso`: PICASSO's optimisations measured on real jobs.

The same job (`--config`, default configs/picasso_synthetic.yaml) is run as:

- `local`: one process, the local placement, at the global batch (trainers x data.batch_size):
  the reference. Synthetic rows come in blocks of 4,096 and file rows in blocks of one batch,
  each trainer taking every W-th block, so with data.batch_size 4,096 (synthetic) or any batch
  size (files) the trainers' step t and the local step t train on the same rows.
- the ablation of PICASSO's Fig. 13 / §IV-C, each on `--trainers` trainers under torchrun
  (`hybridrec.parallel.launch`): `sharded` (the plain model-parallel lookup: every table on its
  own, consistency sync, dense allreduce), `packed` (+ D- and K-packing), `interleaved`
  (+ D-interleaving in micro-batches and `--k-groups` K-interleaving groups), `picasso` (+ the
  HybridHash hot/cold cache: the preset);
- `persia`: the Persia preset on the same job (2 PS servers, 1 embedding worker, the trainers;
  bounded staleness, its own defaults).

Reported per variant (medians over `--runs`): test `auc`, training `samples_per_s`,
`ops_per_step` (native kernel calls + collectives + torch operations on the embedding path per
step, PICASSO Table V; the split under `ops`), `bytes_per_sample` (embedding payload between
processes per training sample: keys, rows and gradients between trainers, counted once by their
sender; Persia: trainer <-> embedding worker) and `hot_hit_rate` (picasso). Checks: the AUC of
`picasso` (and each sharded variant) against `local` (target: within 0.001), the operations of
`sharded` over `packed` (target: at least 5x).

Scaling in fields (PICASSO Table VIII): with `--fields 26,52,104,208` (synthetic data only) the
`sharded` and `picasso` variants run again with that many categorical fields (n_categorical; each
field is another of the same kind, as Table VIII duplicates fields) for `--field-steps` steps; the
time per step must grow no faster than the fields (samples/s at F fields at least the arithmetic
progression samples/s(26) * 26 / F). `--plot FILE.png` draws samples/s against fields, with the
arithmetic progression.

`--json` prints one line: {"local": R, "sharded": R, "packed": R, "interleaved": R, "picasso": R,
"persia": R, "fields": {"26": {"sharded": sps, "picasso": sps}, ...}}.
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from hybridrec.benchmarks.figures import png_figure
from hybridrec.benchmarks.hybrid import OUTPUT_TAIL, JobFailed, add_ray_argument, check_config_and_plot, check_ray
from hybridrec.benchmarks.hybrid import run_job as launch_job
from hybridrec.benchmarks.results import pick
from hybridrec.benchmarks.timing import positive_int

DEFAULT_CONFIG = "configs/picasso_synthetic.yaml"
SYNC = ["strategy.preset=picasso", "strategy.consistency=sync"]
ABLATION = {
    "sharded": [*SYNC, "strategy.picasso.packing=false", "strategy.picasso.interleaving=false",
                "strategy.picasso.k_groups=1"],
    "packed": [*SYNC, "strategy.picasso.packing=true", "strategy.picasso.interleaving=false",
               "strategy.picasso.k_groups=1"],
    "interleaved": [*SYNC, "strategy.picasso.packing=true", "strategy.picasso.interleaving=true"],
    "picasso": ["strategy.preset=picasso", "strategy.picasso.packing=true"],  # interleaving as the preset has it (auto)
}
VARIANTS = ("local", *ABLATION, "persia")
AUC_TARGET = 0.001
OPS_TARGET = 5.0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hybridrec bench picasso",
        description="PICASSO's ablation (sharded, +packing, +interleaving, +hot/cold) against one local process "
                    "and the Persia preset on the same job: AUC, samples/s, operations and bytes per step; and "
                    "samples/s against the number of fields.")
    parser.add_argument("--config", default=DEFAULT_CONFIG, help=f"job config, default {DEFAULT_CONFIG}")
    parser.add_argument("--trainers", type=positive_int, default=2, help="trainers of the distributed jobs (2)")
    parser.add_argument("--runs", type=positive_int, default=1, help="jobs per variant, interleaved (default 1)")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated subset of {','.join(VARIANTS)} (default: all)")
    parser.add_argument("--k-groups", type=positive_int, default=2,
                        help="K-interleaving groups of the interleaved and picasso variants (default 2)")
    parser.add_argument("--fields", default="26,52,104,208",
                        help="field counts of the scaling runs (synthetic data), or 'none' (default 26,52,104,208)")
    parser.add_argument("--field-steps", type=positive_int, default=12, help="steps of each scaling run (12)")
    parser.add_argument("--field-batch", type=positive_int, default=4096,
                        help="rows per trainer and step in the scaling runs (4096)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="config override for every job (repeatable)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per job (default 3600)")
    parser.add_argument("--keep", metavar="DIR", help="keep the jobs' output directories under DIR")
    parser.add_argument("--verbose", action="store_true", help="show every job's output")
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    parser.add_argument("--plot", metavar="FILE.png", help="samples/s against fields (needs matplotlib)")
    add_ray_argument(parser)
    return parser


# ---------------------------------------------------------------- jobs
def _check(label: str, code: int, text: str, command: str, output_dir: Path, verbose: bool) -> dict:
    if verbose:
        print(text, file=sys.stderr, end="", flush=True)
    if code != 0:
        shown = text if len(text) <= OUTPUT_TAIL else "...\n" + text[-OUTPUT_TAIL:]
        raise JobFailed(f"the {label} job failed with exit code {code} ({command}); its output:\n{shown}")
    path = output_dir / "final_metrics.json"
    if not path.is_file():
        raise JobFailed(f"the {label} job exited 0 but wrote no {path}; its output:\n{text[-OUTPUT_TAIL:]}")
    metrics = json.loads(path.read_text())
    if not metrics.get("step"):
        raise JobFailed(f"the {label} job trained no step; its metrics: {metrics}")
    return metrics


def run_local(args, label: str, overrides: list[str], output_dir: Path) -> dict:
    """One process at the global batch (a subprocess, as `hybridrec train` runs it)."""
    from hybridrec.config import load_config

    cfg = load_config(args.config, [*args.set, *overrides])
    sets = [*args.set, *overrides, "strategy.preset=local", f"data.batch_size={cfg.data.batch_size * args.trainers}",
            f"train.output_dir={output_dir}"]
    command = [sys.executable, "-m", "hybridrec.cli", "train", args.config, "--overwrite",
               *[a for s in sets for a in ("--set", s)]]
    done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    return _check(label, done.returncode, done.stdout + done.stderr, " ".join(command), output_dir, args.verbose)


def run_distributed(args, label: str, overrides: list[str], output_dir: Path) -> dict:
    """One `hybridrec launch` (on the Ray cluster of --ray, when given); the Persia job with 2 PS
    servers and an embedding worker."""
    persia = "strategy.preset=persia" in overrides
    job = argparse.Namespace(**{**vars(args), "ps": 2 if persia else None, "embedding_workers": 1 if persia else None})
    return launch_job(job, label, overrides, output_dir)


def variant_overrides(args) -> dict[str, list[str]]:
    groups = f"strategy.picasso.k_groups={args.k_groups}"
    out = {"local": []}
    for name, sets in ABLATION.items():
        out[name] = [*sets, groups] if name in ("interleaved", "picasso") else list(sets)
    out["persia"] = ["strategy.preset=persia"]
    return out


def run_job(args, name: str, overrides: list[str], output_dir: Path) -> dict:
    runner = run_local if name == "local" else run_distributed
    return runner(args, name, overrides, output_dir)


# ---------------------------------------------------------------- report
def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _median(values) -> float | None:
    finite = [float(v) for v in values if _finite(v)]
    return statistics.median(finite) if finite else None


def summarize(runs: list[dict]) -> dict:
    """R of one variant: medians over its runs."""
    ops = [r.get("ops_per_step") for r in runs if isinstance(r.get("ops_per_step"), dict)]
    out = {"auc": _median([r.get("auc") for r in runs]),
           "logloss": _median([r.get("logloss") for r in runs]),
           "samples_per_s": _median([r.get("train_samples_per_s") for r in runs]),
           "ops_per_step": _median([o.get("total") for o in ops]) if ops else None,
           "bytes_per_sample": _median([r.get("bytes_per_sample") for r in runs]),
           "steps": runs[0].get("step") if runs else None,
           "runs": [{"auc": r.get("auc"), "samples_per_s": r.get("train_samples_per_s")} for r in runs]}
    if ops:
        out["ops"] = {k: _median([o.get(k) for o in ops]) for k in ("native", "collectives", "torch")}
    if any("hot_hit_rate" in r for r in runs):
        out["hot_hit_rate"] = _median([r.get("hot_hit_rate") for r in runs])
    if runs and runs[0].get("best_auc") is not None:
        out["best_auc"] = runs[0]["best_auc"]
    return out


def checks(report: dict) -> dict:
    out = {}
    local = (report.get("local") or {}).get("auc")
    for name in ABLATION:
        auc = (report.get(name) or {}).get("auc")
        if _finite(local) and _finite(auc):
            out[f"{name}_minus_local_auc"] = auc - local
    if "picasso_minus_local_auc" in out:
        out["auc_within_target"] = abs(out["picasso_minus_local_auc"]) <= AUC_TARGET
    plain, packed = (report.get("sharded") or {}).get("ops_per_step"), (report.get("packed") or {}).get("ops_per_step")
    if _finite(plain) and _finite(packed) and packed:
        out["ops_reduction"] = plain / packed
        out["ops_within_target"] = plain / packed >= OPS_TARGET
    base = (report.get("sharded") or {}).get("samples_per_s")
    for name in ("packed", "interleaved", "picasso", "persia"):
        sps = (report.get(name) or {}).get("samples_per_s")
        if _finite(base) and _finite(sps) and base:
            out[f"{name}_vs_sharded_samples_per_s"] = sps / base
    return out


def field_overrides(args, fields: int) -> list[str]:
    rows = args.field_batch * args.trainers * args.field_steps
    return [f"data.synthetic.n_categorical={fields}", f"data.synthetic.train_rows={rows}",
            "data.synthetic.test_rows=4096", f"data.batch_size={args.field_batch}",
            "embedding.default.capacity=50000", "strategy.picasso.warmup_iters=3", "strategy.picasso.flush_iters=3"]


def scaling_checks(fields: dict) -> dict:
    """Per variant: samples/s at each field count against the arithmetic progression from the
    smallest count (time per step growing as the fields do)."""
    out = {}
    counts = sorted(int(f) for f in fields)
    if not counts:
        return out
    for name in ("sharded", "picasso"):
        first = fields[str(counts[0])].get(name)
        if not _finite(first):
            continue
        ratios = {str(f): fields[str(f)][name] / (first * counts[0] / f) for f in counts
                  if _finite(fields[str(f)].get(name))}
        out[name] = {"vs_arithmetic_progression": ratios, "at_or_better": all(r >= 1.0 - 1e-9 for r in ratios.values())}
    return out


def plot(fields: dict, path: str, title: str) -> None:
    counts = sorted(int(f) for f in fields)
    with png_figure(path, figsize=(6, 4)) as (figure, axis):
        for name, marker in (("sharded", "s"), ("picasso", "o")):
            values = [fields[str(f)].get(name) for f in counts]
            axis.plot(counts, values, marker=marker, label=name)
            if _finite(values[0]):
                axis.plot(counts, [values[0] * counts[0] / f for f in counts], linestyle=":",
                          color=axis.lines[-1].get_color(), label=f"{name}: arithmetic progression")
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xticks(counts, [str(c) for c in counts])
        axis.set_xlabel("categorical fields")
        axis.set_ylabel("training samples/s")
        axis.grid(alpha=0.3, which="both")
        axis.legend(fontsize=8)
        axis.set_title(title, fontsize=9)


def print_report(report: dict) -> None:
    print(f"{'variant':<12} {'auc':>8} {'samples/s':>10} {'ops/step':>9} {'bytes/sample':>12} {'hot hit':>8}")
    for name in VARIANTS:
        r = report.get(name)
        if not r:
            continue
        fmt = lambda v, d: "-" if not _finite(v) else f"{v:.{d}f}"  # noqa: E731
        print(f"{name:<12} {fmt(r['auc'], 4):>8} {fmt(r['samples_per_s'], 0):>10} {fmt(r['ops_per_step'], 1):>9} "
              f"{fmt(r['bytes_per_sample'], 1):>12} {fmt(r.get('hot_hit_rate'), 3):>8}")
    for key, value in report.get("checks", {}).items():
        print(f"{key}: {value if not isinstance(value, float) else round(value, 5)}")
    fields = report.get("fields") or {}
    if fields:
        print("samples/s against fields: " + "; ".join(
            f"{f}: " + ", ".join(f"{n} {v:.0f}" for n, v in fields[f].items() if _finite(v)) for f in fields))
        for name, check in report.get("scaling", {}).items():
            print(f"{name}: samples/s / arithmetic progression = "
                  + ", ".join(f"{f}: {r:.2f}" for f, r in check["vs_arithmetic_progression"].items())
                  + f" ({'at or better' if check['at_or_better'] else 'NOT at or better'})")


def run_benchmark(args) -> dict:
    from hybridrec.config import load_config

    load_config(args.config, args.set)  # a wrong config or --set fails here, before any job
    wanted = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(wanted) - set(VARIANTS))
    if unknown:
        raise ValueError(f"--variants: unknown {unknown}; allowed: {','.join(VARIANTS)}")
    fields = [] if args.fields in ("", "none") else [int(f) for f in args.fields.split(",")]
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="hybridrec-bench-picasso-"))
    root.mkdir(parents=True, exist_ok=True)
    overrides = variant_overrides(args)
    raw: dict[str, list[dict]] = {name: [] for name in wanted}
    report: dict = {}
    try:
        for run in range(args.runs):
            for name in wanted:
                metrics = run_job(args, name, overrides[name], root / f"{name}-run{run}")
                raw[name].append(metrics)
                print(f"[bench picasso] {name} run {run + 1}/{args.runs}: auc {metrics.get('auc'):.5f} samples/s "
                      f"{metrics.get('train_samples_per_s') or 0:.0f} ops/step "
                      f"{(metrics.get('ops_per_step') or {}).get('total', '-')} bytes/sample "
                      f"{metrics.get('bytes_per_sample')}", file=sys.stderr, flush=True)
        report = {name: summarize(raw[name]) for name in wanted}
        report["checks"] = checks(report)
        report["fields"] = {}
        for count in fields:
            point = {}
            for name in ("sharded", "picasso"):
                sps = []
                for run in range(args.runs):
                    metrics = run_job(args, name, [*overrides[name], *field_overrides(args, count)],
                                      root / f"fields{count}-{name}-run{run}")
                    sps.append(metrics.get("train_samples_per_s"))
                    print(f"[bench picasso] {count} fields, {name}: samples/s {sps[-1] or 0:.0f} ops/step "
                          f"{(metrics.get('ops_per_step') or {}).get('total', '-')}", file=sys.stderr, flush=True)
                point[name] = _median(sps)
            report["fields"][str(count)] = point
        report["scaling"] = scaling_checks(report["fields"])
        report["settings"] = {"config": args.config, "set": args.set, "trainers": args.trainers, "runs": args.runs,
                              "k_groups": args.k_groups, "field_steps": args.field_steps,
                              "field_batch": args.field_batch}
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    return report


def headline(report: dict) -> dict:
    """The figures of the results table: the checks (AUC against local, operations saved by
    packing, samples/s against the plain sharded lookup), bytes against Persia and the largest
    field count's samples/s against the arithmetic progression."""
    figures = pick(report.get("checks"), {"picasso - local AUC": "picasso_minus_local_auc",
                                          "sharded / packed ops per step": "ops_reduction",
                                          "packed / sharded samples/s": "packed_vs_sharded_samples_per_s",
                                          "picasso / sharded samples/s": "picasso_vs_sharded_samples_per_s"})
    figures.update(pick(report.get("sharded"), {"sharded bytes per sample": "bytes_per_sample"}))
    figures.update(pick(report.get("picasso"), {"picasso bytes per sample": "bytes_per_sample",
                                                "hot hit rate": "hot_hit_rate"}))
    figures.update(pick(report.get("persia"), {"Persia bytes per sample": "bytes_per_sample"}))
    for name, check in (report.get("scaling") or {}).items():
        ratios = check["vs_arithmetic_progression"]
        if ratios:
            most = max(ratios, key=int)
            figures[f"{name} at {most} fields / arithmetic progression"] = ratios[most]
    return figures


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_config_and_plot(parser, args)
    check_ray(parser, args)
    try:
        report = run_benchmark(args)
    except (JobFailed, ValueError, subprocess.TimeoutExpired) as exc:
        parser.exit(1, f"{parser.prog}: error: {exc}\n")
    print_report(report)
    if args.plot and report.get("fields"):
        plot(report["fields"], args.plot, f"bench picasso: {args.trainers} trainers, {args.config}")
        print(f"plot: {args.plot}")
    if args.json:
        print(json.dumps(report))
    return report
