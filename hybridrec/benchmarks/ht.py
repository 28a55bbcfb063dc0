"""`hybridrec bench ht`: Hierarchical Training against its EASGD baseline on real jobs.

The same distributed job (PS servers, an embedding worker, T trainers under torchrun; same data
and seed) runs with T dense replicas (`easgd_T`: dense easgd, every trainer its own replica)
and with fewer, larger Hogwild groups (`ht_GxS`: dense groups, G groups of S trainers), all with
the same total number of trainer processes, `--runs` times each, interleaved. Reported per
variant (medians over the runs): test `auc` and `logloss` of the final centre copy, training
`samples_per_s`, the dense replicas and the dense staleness measured inside the groups, the
elastic syncs and their bytes per training sample, and `final_logloss`: the leader's
progressive training logloss (each batch scored before it is trained on) over the last quarter
of the run. HT Figure 7 plots this loss relative to the EASGD baseline over the run;
`--plot FILE.png` draws the same from the jobs' metrics.jsonl (median over the runs at each
logged step), with samples/s beside it (Figure 8).

The codecs section (`--codecs`, default every wire codec; `--codecs ""` skips it) runs the HT
variant with the most groups once more per wire codec with one group PS per group
(strategy.ht.group_ps=1: the layers the operator placement puts on it run there) and reports
the bytes between trainers and group PSs per training step (activations forward, gradients
back, both directions) and test AUC.

`--json` prints one line: {"easgd_4": R, "ht_2x2": R, "ht_1x4": R, ..., "codecs": {"none": C,
"bf16": C, "int8": C, "topk": C}} (names follow --trainers), each R with `final_logloss`, `auc`,
`logloss`, `samples_per_s` and the rest, each C with `bytes_per_step`, `auc` and `logloss`.
"""
from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

from hybridrec.benchmarks.figures import png_figure
from hybridrec.benchmarks.hybrid import (JobFailed, _fmt, _median, add_ray_argument, check_config_and_plot,
                                         check_ray, run_variants, summarize_variant)
from hybridrec.benchmarks.results import pick
from hybridrec.benchmarks.timing import positive_int

DEFAULT_CONFIG = "configs/persia_synthetic.yaml"
WIRE_CODECS = ("none", "bf16", "int8", "topk")
FACTS = ("dense_replicas", "trainers_per_group", "max_dense_staleness", "mean_dense_staleness", "elastic_syncs")
LATE_FRACTION = 0.25  # final_logloss: the mean training loss over the last quarter of the logged steps


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hybridrec bench ht",
        description="Runs one job as EASGD (a dense replica per trainer) and as Hierarchical Training "
                    "(Hogwild groups) with the same trainers; compares loss, AUC, samples/s and bytes.")
    parser.add_argument("--config", default=DEFAULT_CONFIG, help=f"job config, default {DEFAULT_CONFIG}")
    parser.add_argument("--trainers", type=positive_int, default=4, help="trainer processes (default 4)")
    parser.add_argument("--groups", default=None, metavar="G,G,...",
                        help="HT group counts to run (default: every divisor of --trainers between 1 and "
                             "trainers/2)")
    parser.add_argument("--runs", type=positive_int, default=3, help="jobs per variant (default 3)")
    parser.add_argument("--ps", type=positive_int, default=1, help="PS servers (default 1)")
    parser.add_argument("--embedding-workers", type=positive_int, default=1, help="embedding workers (default 1)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="config override for every job (repeatable)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per job (default 3600)")
    parser.add_argument("--keep", metavar="DIR", help="keep the jobs' output directories under DIR")
    parser.add_argument("--verbose", action="store_true", help="show the launcher's output of every job")
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    parser.add_argument("--plot", metavar="FILE.png", help="draw relative loss over the run and samples/s")
    parser.add_argument("--codecs", default=",".join(WIRE_CODECS), metavar="C,C,...",
                        help="wire codecs to run with a group PS per group (default: all of "
                             f"{','.join(WIRE_CODECS)}; empty: skip the codecs section)")
    add_ray_argument(parser)
    return parser


def codec_list(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str]:
    codecs = [c for c in args.codecs.split(",") if c]
    unknown = [c for c in codecs if c not in WIRE_CODECS]
    if unknown:
        parser.error(f"--codecs {args.codecs}: unknown codec(s) {unknown}; allowed: {', '.join(WIRE_CODECS)}")
    return codecs


def codec_variants(trainers: int, groups: int, codecs: list[str]) -> dict[str, list[str]]:
    """The HT variant with `groups` groups, one group PS each, once per wire codec."""
    return {f"codec_{c}": ["strategy.preset=ht", "strategy.dense=groups", f"strategy.ht.groups={groups}",
                           "strategy.ht.group_ps=1", f"strategy.ht.wire_codec={c}"] for c in codecs}


def summarize_codec(runs: list[dict]) -> dict:
    summary = summarize_variant(runs)
    return {"bytes_per_step": _median([r.get("wire_bytes_per_step") for r in runs]), "auc": summary["auc"],
            "logloss": summary["logloss"], "samples_per_s": summary["samples_per_s"],
            "elastic_sync_bytes_per_sample": _median([r["elastic_sync_bytes"] / r["samples"] for r in runs
                                                      if r.get("samples")]),
            "max_dense_staleness": _median([r.get("max_dense_staleness") for r in runs])}


def group_counts(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[int]:
    if args.groups is None:
        return [g for g in range(args.trainers // 2, 0, -1) if args.trainers % g == 0]
    try:
        counts = [int(g) for g in args.groups.split(",")]
    except ValueError:
        counts = []
    if not counts or any(g < 1 or args.trainers % g for g in counts):
        parser.error(f"--groups {args.groups}: expected group counts that divide --trainers {args.trainers}, "
                     "separated by commas")
    return counts


def variants(trainers: int, groups: list[int]) -> dict[str, list[str]]:
    out = {f"easgd_{trainers}": ["strategy.preset=ht", "strategy.dense=easgd"]}
    for g in groups:
        out[f"ht_{g}x{trainers // g}"] = ["strategy.preset=ht", "strategy.dense=groups", f"strategy.ht.groups={g}"]
    return out


def loss_curve(run_dir: Path) -> list[tuple[int, float]]:
    """(samples seen by the leader, training loss) at every logged step of one job."""
    points = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("split") == "train" and record.get("loss") is not None:
            points.append((record["step"], record["loss"]))
    return points


def late_loss(curve: list[tuple[int, float]]) -> float | None:
    if not curve:
        return None
    tail = curve[-max(1, round(len(curve) * LATE_FRACTION)):]
    return sum(loss for _, loss in tail) / len(tail)


def summarize(runs: list[dict], curves: list[list[tuple[int, float]]]) -> dict:
    summary = summarize_variant(runs)
    summary["final_logloss"] = _median([late_loss(c) for c in curves])
    for key in FACTS:
        summary[key] = _median([r.get(key) for r in runs])
    summary["elastic_sync_bytes_per_sample"] = _median([r["elastic_sync_bytes"] / r["samples"] for r in runs
                                                        if r.get("samples")])
    summary["curve"] = _median_curve(curves)
    return summary


def _median_curve(curves: list[list[tuple[int, float]]]) -> list[tuple[int, float]]:
    steps = sorted(set.intersection(*(set(s for s, _ in c) for c in curves))) if curves else []
    by_run = [dict(c) for c in curves]
    return [(step, _median([run[step] for run in by_run])) for step in steps]


def print_report(report: dict, names: list[str]) -> None:
    base = report[names[0]]
    print(f"EASGD vs Hierarchical Training, {report['settings']['trainers']} trainers, medians of "
          f"{report['settings']['runs']} job(s) each")
    print(f"{'variant':<10} {'replicas':>8} {'final loss':>10} {'vs easgd':>9} {'auc':>8} {'logloss':>8} "
          f"{'samples/s':>10} {'max stale':>9} {'mean stale':>10} {'sync B/sample':>13}")
    for name in names:
        r = report[name]
        relative = (r["final_logloss"] / base["final_logloss"] - 1
                    if r["final_logloss"] is not None and base["final_logloss"] else None)
        print(f"{name:<10} {_fmt(r['dense_replicas'], 0):>8} {_fmt(r['final_logloss']):>10} "
              f"{'-' if relative is None else f'{100 * relative:+.2f}%':>9} {_fmt(r['auc']):>8} "
              f"{_fmt(r['logloss']):>8} {_fmt(r['samples_per_s'], 0):>10} {_fmt(r['max_dense_staleness'], 0):>9} "
              f"{_fmt(r['mean_dense_staleness'], 2):>10} {_fmt(r['elastic_sync_bytes_per_sample'], 0):>13}")


def print_codecs(codecs: dict, groups: int, trainers: int) -> None:
    if not codecs:
        return
    base = codecs.get("none", {}).get("bytes_per_step")
    print(f"wire codecs: ht_{groups}x{trainers // groups} with one group PS per group; bytes between trainers and "
          "group PSs per training step")
    print(f"{'codec':<6} {'bytes/step':>12} {'vs none':>8} {'auc':>8} {'logloss':>8} {'samples/s':>10}")
    for name, c in codecs.items():
        ratio = c["bytes_per_step"] / base if base and c["bytes_per_step"] is not None else None
        print(f"{name:<6} {_fmt(c['bytes_per_step'], 0):>12} {'-' if ratio is None else f'{ratio:.3f}':>8} "
              f"{_fmt(c['auc']):>8} {_fmt(c['logloss']):>8} {_fmt(c['samples_per_s'], 0):>10}")


def plot(report: dict, names: list[str], path: str) -> None:
    with png_figure(path, 1, 2, figsize=(10, 4)) as (figure, (left, right)):
        base = dict(report[names[0]]["curve"])
        for name in names:
            curve = [(s, loss / base[s] - 1) for s, loss in report[name]["curve"] if base.get(s)]
            left.plot([s for s, _ in curve], [100 * v for _, v in curve], marker=".", label=name)
        left.set_xlabel("leader's training step")
        left.set_ylabel(f"training logloss relative to {names[0]} (%)")
        left.set_title("relative loss over the run (lower is better)")
        left.grid(alpha=0.3)
        left.legend()
        right.bar(names, [report[n]["samples_per_s"] or 0 for n in names])
        right.set_title("training samples/s (median)")
        figure.suptitle(f"bench ht: {report['settings']['trainers']} trainers, {report['settings']['runs']} job(s) "
                        f"per variant, {report['settings']['config']}", fontsize=9)


def headline(report: dict) -> dict:
    """The figures of the results table: each variant's test AUC and late training logloss against
    the EASGD baseline (the first variant); each wire codec's bytes and AUC against float32."""
    variants = [name for name in report if name not in ("codecs", "settings")]
    base = report[variants[0]]["final_logloss"] if variants else None
    figures = {}
    for name in variants:
        figures.update(pick(report[name], {"AUC": "auc"}, f"{name} "))
        if name != variants[0] and base and report[name]["final_logloss"] is not None:
            figures[f"{name} late loss / {variants[0]}"] = report[name]["final_logloss"] / base
    codecs = report.get("codecs") or {}
    none = codecs.get("none") or {}
    for name, codec in codecs.items():
        if name != "none" and none.get("bytes_per_step") and codec["bytes_per_step"] is not None:
            figures[f"{name} bytes / none"] = codec["bytes_per_step"] / none["bytes_per_step"]
        if name != "none" and none.get("auc") is not None and codec["auc"] is not None:
            figures[f"{name} AUC - none"] = codec["auc"] - none["auc"]
    return figures


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_config_and_plot(parser, args)
    check_ray(parser, args)
    counts = group_counts(args, parser)
    chosen = variants(args.trainers, counts)
    coded = codec_variants(args.trainers, max(counts), codec_list(args, parser))
    args.seeds = None
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="hybridrec-bench-ht-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        raw = run_variants(args, {**chosen, **coded}, root, label="bench ht")
        report = {name: summarize(raw[name], [loss_curve(root / f"{name}-run{i}") for i in range(args.runs)])
                  for name in chosen}
        report["codecs"] = {name.removeprefix("codec_"): summarize_codec(raw[name]) for name in coded}
    except (JobFailed, ValueError) as exc:
        parser.exit(1, f"{parser.prog}: error: {exc}\n")
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    report["settings"] = {"config": args.config, "set": args.set, "runs": args.runs, "trainers": args.trainers,
                          "ps": args.ps, "embedding_workers": args.embedding_workers}
    names = list(chosen)
    print_report(report, names)
    print_codecs(report["codecs"], max(counts), args.trainers)
    if args.plot:
        plot(report, names, args.plot)
        print(f"plot: {args.plot}")
    if args.json:
        print(json.dumps(report))
    return report
