"""`hybridrec bench staleness`: the papers' accuracy claims at scale, by exact emulation
(hybridrec.lab), and the emulation checked against real distributed jobs.

The sweep: for every W in `--workers`, seed in `--seeds` and bound tau (or s) in `--taus`, one
emulated run of every discipline in `--disciplines` (hybrid, async, het, ssp, ht with G in
`--groups`), and one sync run per (W, seed), on `--samples` training rows of the config's data
(synthetic: `data.synthetic.train_rows`; a file: its rows, `train.epochs` times). Reported per run:
test AUC and logloss, and the discipline's staleness (per key and per read, the dense copies',
HET's clock gaps); per cell the medians over seeds and the relative AUC gap to sync at the same W
and seed. `--lr-scales 1,0.5` runs the sweep at each scale of the embedding tables' learning rates
(`--dense-lr-scale` scales the dense optimizer's); `--tune` first picks, per W, the scales of
`--tune-grid` x `--tune-dense-grid` whose sync run (the first seed) has the best AUC on a
validation split (`data.valid_fraction` 0.05 of the training rows), and runs the sweep at those
(and at `--lr-scales`, when given).

The claims (Persia §6.2): at W=16, tau=4 the hybrid's gap to sync and the async's, in percent
(relative AUC; medians over seeds at the largest scale measured there: "hybrid within 0.1%,
async at least 0.3% below").

`--oracle`: real jobs of `bench hybrid`'s setup (`--oracle-ps` PS servers, one embedding worker,
`--oracle-trainers` trainers; sync, hybrid and async, or those `--oracle-disciplines` names, per
seed in `--oracle-seeds`, on `--oracle-samples` rows) record the staleness each lookup had (final_metrics.json's
`staleness_cross` and the job's staleness_trace.npz); the emulator replays each job's recorded
reads (hybridrec.lab.trace) with the same config and seed. Reported: the AUCs of both, their
medians per discipline and the largest difference of medians (target: within 0.005).

`--out FILE.jsonl` appends every run (and oracle check) as it finishes and skips the runs it
already holds, so a long sweep continues where it stopped. `--plot FILE.png`: the gap to sync against tau per W and
discipline, and at the claims' cell AUC against samples seen and its difference to sync's. `--json`: one line, `runs`,
`claims` and `oracle`.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from hybridrec.benchmarks.figures import png_figure
from hybridrec.benchmarks.results import pick
from hybridrec.benchmarks.timing import positive_int
from hybridrec.errors import UserError

DEFAULT_CONFIG = "configs/persia_synthetic.yaml"
CLAIM_WORKERS, CLAIM_TAU = 16, 4
HYBRID_TARGET_PCT, ASYNC_TARGET_PCT = 0.1, 0.3  # hybrid within 0.1% of sync; async at least 0.3% below


def _ints(text: str) -> list[int]:
    try:
        values = [int(item) for item in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected integers >= 0 separated by commas, got {text!r}")
    return values


def _floats(text: str) -> list[float]:
    try:
        values = [float(item) for item in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected numbers > 0 separated by commas, got {text!r}")
    return values


def _groups(text: str) -> list:
    items = [item.strip() for item in text.split(",")]
    if not items or any(item != "W" and not item.isdigit() for item in items) or "0" in items:
        raise argparse.ArgumentTypeError(f"expected group counts >= 1 or W separated by commas, got {text!r}")
    return [item if item == "W" else int(item) for item in items]


ORACLE_DISCIPLINES = ("sync", "hybrid", "async")  # bench hybrid's jobs


def _oracle_names(text: str) -> list[str]:
    names = [item.strip() for item in text.split(",")]
    if not names or any(name not in ORACLE_DISCIPLINES for name in names):
        raise argparse.ArgumentTypeError(f"expected some of {','.join(ORACLE_DISCIPLINES)} separated by commas, "
                                         f"got {text!r}")
    return [name for name in ORACLE_DISCIPLINES if name in names]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hybridrec bench staleness",
                                description="Emulated W-worker runs of sync, hybrid, async, HET, SSP and HT against "
                                            "sync (hybridrec.lab), and the emulation checked against real jobs.")
    p.add_argument("--config", default=DEFAULT_CONFIG, help=f"job config (data, model, rates), default {DEFAULT_CONFIG}")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    p.add_argument("--samples", type=positive_int, default=2_000_000,
                   help="synthetic training rows (data.synthetic.train_rows), default 2,000,000")
    p.add_argument("--workers", type=_ints, default=[4, 16, 64], help="W values, default 4,16,64")
    p.add_argument("--taus", type=_ints, default=[1, 4, 16, 64], help="bounds tau (s for het, ssp), default 1,4,16,64")
    p.add_argument("--seeds", type=_ints, default=[0, 1, 2], help="config seeds, default 0,1,2")
    p.add_argument("--disciplines", default="hybrid,async,het,ssp,ht",
                   help="besides sync: any of hybrid, async, het, ssp, ht, easgd (default hybrid,async,het,ssp,ht)")
    p.add_argument("--groups", type=_groups, default=[1, 2, 4, "W"], help="ht's group counts, default 1,2,4,W")
    p.add_argument("--ht-taus", type=_ints, default=None,
                   help="the bounds of --taus ht runs at (default: all); its own axis is G, its embeddings are hybrid's")
    p.add_argument("--tau-dense", type=int, default=1, help="async: steps of every worker the dense copy may miss")
    p.add_argument("--visibility", type=float, default=0.0,
                   help="chance a read sees each update beyond the required ones (0: the bound's worst case)")
    p.add_argument("--schedule-seed", type=int, default=None, help="the schedule's seed (default: the config seed)")
    p.add_argument("--lr-scales", type=_floats, default=None,
                   help="scales of the embedding tables' learning rates (every table section's); default 1, "
                        "or with --tune none (only the tuned rates)")
    p.add_argument("--dense-lr-scale", type=float, default=1.0, help="scale of the dense optimizer's rate, default 1")
    p.add_argument("--tune", action="store_true", help="also run at the rates sync's validation AUC picks per W "
                   "from --tune-grid x --tune-dense-grid")
    p.add_argument("--tune-grid", type=_floats, default=[1.0, 0.25, 0.0625],
                   help="embedding rate scales to tune over, default 1,0.25,0.0625")
    p.add_argument("--tune-dense-grid", type=_floats, default=[1.0, 4.0],
                   help="dense rate scales to tune over, default 1,4")
    p.add_argument("--claims-only", action="store_true",
                   help=f"only the claims' cell: sync, hybrid and async at W={CLAIM_WORKERS}, tau={CLAIM_TAU}")
    p.add_argument("--curve-points", type=int, default=8, help="evaluations along each run for the curves (0: none)")
    p.add_argument("--curve-batches", type=int, default=20, help="test batches of each curve evaluation")
    p.add_argument("--oracle", action="store_true", help="also run real jobs and replay their recorded staleness")
    p.add_argument("--oracle-only", action="store_true", help="only the oracle check")
    p.add_argument("--oracle-seeds", type=_ints, default=[0, 1, 2], help="default 0,1,2")
    p.add_argument("--oracle-disciplines", type=_oracle_names, default=list(ORACLE_DISCIPLINES),
                   help="the oracle's jobs, default sync,hybrid,async")
    p.add_argument("--oracle-samples", type=positive_int, default=None,
                   help="training rows of the oracle's jobs (default: the config's)")
    p.add_argument("--oracle-trainers", type=positive_int, default=4, help="default 4")
    p.add_argument("--oracle-ps", type=positive_int, default=2, help="default 2")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per real job (default 3600)")
    p.add_argument("--out", metavar="FILE.jsonl", help="append every run; reuse the runs the file holds")
    p.add_argument("--keep", metavar="DIR", help="keep the oracle jobs' output directories under DIR")
    p.add_argument("--plot", metavar="FILE.png", help="draw the gaps and curves (needs matplotlib)")
    p.add_argument("--json", action="store_true", help="print one JSON line")
    p.add_argument("--verbose", action="store_true", help="show the oracle launcher's output")
    return p


# ---------------------------------------------------------------- configs

def rate_overrides(cfg, scale: float, dense_scale: float = 1.0) -> list[str]:
    """--set overrides that multiply the learning rate of every table section of `cfg` that sets
    one by `scale`, and the dense optimizer's by `dense_scale`."""
    sets = [] if dense_scale == 1.0 else [f"train.dense_optimizer.lr={cfg.train.dense_optimizer.lr * dense_scale!r}"]
    if scale == 1.0:
        return sets
    emb = cfg.embedding
    if emb.default.optimizer.lr is None:
        raise UserError("--lr-scales / --tune: embedding.default.optimizer.lr is not set in the config; "
                        "set it to scale it")
    sets.append(f"embedding.default.optimizer.lr={emb.default.optimizer.lr * scale!r}")
    sections = [("embedding.wide", emb.wide)] if emb.wide is not None else []
    sections += [(f"embedding.per_feature.{n}", s) for n, s in emb.per_feature.items()]
    sections += [(f"embedding.shared.{n}", s) for n, s in emb.shared.items()]
    for key, section in sections:
        if "optimizer" in section.model_fields_set and section.optimizer.lr is not None:
            sets.append(f"{key}.optimizer.lr={section.optimizer.lr * scale!r}")
    return sets


def load(args, *extra: str):
    from hybridrec.config import load_config

    base = load_config(args.config, args.set)
    sets = list(args.set)
    if base.data.format == "synthetic":
        sets.append(f"data.synthetic.train_rows={args.samples}")
    return load_config(args.config, [*sets, *extra])


# ---------------------------------------------------------------- runs

def _key(run: dict) -> tuple:
    return (run["label"], run["workers"], run["seed"], run["lr_scale"], run["dense_lr_scale"], run["samples_asked"],
            run["visibility"], run["evaluated_on"])


class RunLog:
    """The runs of this sweep, appended to `path` (JSON lines) as they finish; runs already there
    are reused."""

    def __init__(self, path: str | None):
        self.path = Path(path) if path else None
        self.done: dict[tuple, dict] = {}
        if self.path is not None and self.path.is_file():
            for number, line in enumerate(self.path.read_text().splitlines(), 1):
                if line.strip():
                    try:
                        run = json.loads(line)
                        self.done[_key(run)] = run
                    except (json.JSONDecodeError, KeyError):
                        raise UserError(f"{self.path}:{number}: not a run of this bench") from None

    def add(self, run: dict) -> None:
        self.done[_key(run)] = run
        if self.path is not None:
            with self.path.open("a") as handle:
                handle.write(json.dumps(run) + "\n")


def emulated_run(args, log: RunLog, spec: str, workers: int, seed: int, scale: tuple[float, float], *,
                 valid: bool = False, replay=None) -> dict:
    """One emulated run (or the logged one with the same key)."""
    from hybridrec.lab import Schedule, emulate, parse

    discipline = parse(spec, tau_dense=args.tau_dense)
    label = spec if replay is None else f"{spec} replay"
    # every sync read sees every earlier update whatever the schedule's visibility, so one sync run
    # serves the sweeps at every visibility
    visibility = 0.0 if spec == "sync" else args.visibility
    key = (label, workers, seed, *scale, args.samples, visibility, "valid" if valid else "test")
    if replay is None and key in log.done:
        return log.done[key]
    base = load(args, f"seed={seed}")
    cfg = load(args, f"seed={seed}", *rate_overrides(base, *scale), *(["data.valid_fraction=0.05"] if valid else []))
    schedule = replay if replay is not None else Schedule(seed if args.schedule_seed is None else args.schedule_seed,
                                                          visibility)
    points = args.curve_points if not valid else 0
    result = emulate(cfg, discipline, workers, schedule, curve_every=max(args.samples // points, 1) if points else None,
                     curve_batches=args.curve_batches, evaluate_on="valid" if valid else "test").result
    run = {**result, "label": label, "tau": discipline.bound, "seed": seed, "lr_scale": scale[0],
           "dense_lr_scale": scale[1],
           "samples_asked": args.samples, "visibility": visibility, "evaluated_on": "valid" if valid else "test"}
    print(f"[bench staleness] {label} W={workers} seed={seed} rates x{scale[0]:g}/x{scale[1]:g}"
          f"{' (valid)' if valid else ''}: "
          f"auc {run['auc']:.5f} logloss {run['logloss']:.5f}, {run['samples']} samples in {run['seconds']:.0f}s",
          file=sys.stderr, flush=True)
    if replay is None:
        log.add(run)
    return run


def specs(args, workers: int) -> list[str]:
    """The disciplines of one (W, tau) cell besides sync, as `parse` specs (ht once per G)."""
    names = [n.strip() for n in args.disciplines.split(",") if n.strip()]
    out = []
    for tau in args.taus:
        for name in names:
            if name == "ht":
                if args.ht_taus is not None and tau not in args.ht_taus:
                    continue
                for g in args.groups:
                    groups = workers if g == "W" else g
                    if groups <= workers and workers % groups == 0:
                        out.append(f"ht:groups={groups},tau={tau}")
            elif name in ("het", "ssp"):
                out.append(f"{name}:s={tau}")
            elif name == "sync":
                continue
            else:
                out.append(f"{name}:tau={tau}")
    return list(dict.fromkeys(out))  # ht's G=4 and G=W are one run at W=4


def tuned_scales(args, log: RunLog) -> dict[int, tuple[float, float]]:
    """Per W: the (embedding, dense) rate scales of --tune-grid x --tune-dense-grid whose sync run
    (the first seed) has the best AUC on the validation rows."""
    chosen = {}
    for workers in args.workers:
        runs = {(e, d): emulated_run(args, log, "sync", workers, args.seeds[0], (e, d), valid=True)
                for e in args.tune_grid for d in args.tune_dense_grid}
        chosen[workers] = max(runs, key=lambda s: runs[s]["auc"])
    return chosen


def sweep(args, log: RunLog) -> tuple[list[dict], dict]:
    given = args.lr_scales if args.lr_scales is not None else ([] if args.tune else [1.0])
    scales = {w: [(s, args.dense_lr_scale) for s in given] for w in args.workers}
    tuned = {}
    if args.tune:
        tuned = tuned_scales(args, log)
        for w, scale in tuned.items():
            scales[w] = list(dict.fromkeys([*scales[w], scale]))
    runs = []
    for workers in args.workers:
        cells = ([f"hybrid:tau={CLAIM_TAU}", f"async:tau={CLAIM_TAU}"] if args.claims_only
                 else specs(args, workers))
        for scale in scales[workers]:
            for seed in args.seeds:
                runs.append(emulated_run(args, log, "sync", workers, seed, scale))
                runs.extend(emulated_run(args, log, spec, workers, seed, scale) for spec in cells)
    return runs, tuned


# ---------------------------------------------------------------- report

def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def with_gaps(runs: list[dict]) -> list[dict]:
    """Each run with `gap_pct`: its relative AUC difference to the sync run of the same W, seed
    and scale, in percent."""
    sync = {(r["workers"], r["seed"], r["lr_scale"], r["dense_lr_scale"]): r["auc"] for r in runs
            if r["label"] == "sync"}
    out = []
    for r in runs:
        base = sync.get((r["workers"], r["seed"], r["lr_scale"], r["dense_lr_scale"]))
        out.append({**r, "gap_pct": None if base is None else 100.0 * (r["auc"] - base) / base})
    return out


def cells(runs: list[dict]) -> list[dict]:
    """Medians over seeds per (label, W, scale)."""
    groups: dict[tuple, list] = {}
    for r in runs:
        groups.setdefault((r["label"], r["workers"], rates(r)), []).append(r)
    return [{"label": label, "discipline": rs[0]["discipline"], "workers": w, "tau": rs[0]["tau"], "rates": scale,
             "seeds": len(rs), "auc": _median([r["auc"] for r in rs]), "logloss": _median([r["logloss"] for r in rs]),
             "auc_min": min(r["auc"] for r in rs), "auc_max": max(r["auc"] for r in rs),
             "gap_pct": _median([r["gap_pct"] for r in rs])} for (label, w, scale), rs in groups.items()]


def rates(run: dict) -> str:
    """The learning rates of a run, as scales of the config's: "x<embedding>/x<dense>"."""
    return f"x{run['lr_scale']:g}/x{run['dense_lr_scale']:g}"


def claims(runs: list[dict], samples: int, tuned: dict) -> dict:
    """Hybrid's and async's gap to sync at the claims' cell (medians over seeds), at the rates
    tuned for W=16 when they were, else at the config's; and at every rates measured there."""
    at = [c for c in cells(runs) if c["workers"] == CLAIM_WORKERS and c["tau"] == CLAIM_TAU
          and c["discipline"] in ("hybrid", "async")]
    per_rates = {}
    for c in at:
        per_rates.setdefault(c["rates"], {})[f"{c['discipline']}_gap_pct"] = c["gap_pct"]
    wanted = (f"x{tuned[CLAIM_WORKERS][0]:g}/x{tuned[CLAIM_WORKERS][1]:g}" if CLAIM_WORKERS in tuned else None)
    chosen_rates = next((r for r in (wanted, "x1/x1", *per_rates) if r in per_rates), None)
    chosen = per_rates.get(chosen_rates, {})
    hybrid, async_ = chosen.get("hybrid_gap_pct"), chosen.get("async_gap_pct")
    return {"hybrid_gap_pct": hybrid, "async_gap_pct": async_, "workers": CLAIM_WORKERS, "tau": CLAIM_TAU,
            "samples": samples, "rates": chosen_rates, "per_rates": per_rates,
            "hybrid_within_target": None if hybrid is None else abs(hybrid) <= HYBRID_TARGET_PCT,
            "async_below_target": None if async_ is None else async_ <= -ASYNC_TARGET_PCT}


def public_run(run: dict) -> dict:
    """A run as --json's `runs` lists it: the issue's fields first, then the rest."""
    first = {k: run.get(k) for k in ("discipline", "workers", "tau", "seed", "samples", "auc", "logloss")}
    return {**first, **{k: v for k, v in run.items() if k not in first}}


def print_report(report: dict) -> None:
    rows = report["cells"]
    print(f"{'run':<28} {'W':>3} {'rates':>12} {'seeds':>5} {'auc':>8} {'min-max':>15} {'gap %':>8} {'logloss':>8}")
    for c in sorted(rows, key=lambda c: (c["workers"], c["rates"], c["tau"], c["label"])):
        gap = "-" if c["gap_pct"] is None else f"{c['gap_pct']:+.3f}"
        print(f"{c['label']:<28} {c['workers']:>3} {c['rates']:>12} {c['seeds']:>5} {c['auc']:>8.5f} "
              f"{c['auc_min']:.4f}-{c['auc_max']:.4f} {gap:>8} {c['logloss']:>8.5f}")
    cl = report.get("claims")
    if cl and (cl["hybrid_gap_pct"] is not None or cl["async_gap_pct"] is not None):
        def gap(value):  # a sweep without one of the two disciplines has no gap for it
            return "not run" if value is None else f"{value:+.3f}%"

        print(f"claims at W={cl['workers']}, tau={cl['tau']}, {cl['samples']} samples (rates {cl['rates']}): "
              f"hybrid {gap(cl['hybrid_gap_pct'])} (target within {HYBRID_TARGET_PCT}%), "
              f"async {gap(cl['async_gap_pct'])} (target <= -{ASYNC_TARGET_PCT}%)")
    if report.get("tuned_lr_scales"):
        print(f"tuned learning-rate scales (sync's validation AUC): {report['tuned_lr_scales']}")
    oracle = report.get("oracle")
    if oracle:
        for name, row in oracle["disciplines"].items():
            print(f"oracle {name}: emulated {row['emulated_auc']} distributed {row['distributed_auc']} "
                  f"(medians {row['emulated_median']:.5f} / {row['distributed_median']:.5f})")
        print(f"oracle: largest difference of medians {oracle['max_median_difference']:.5f} "
              f"(target {oracle['target']})")


CURVE_COLOURS = {"sync": "tab:blue", "hybrid": "tab:orange", "async": "tab:green"}
CURVE_STYLES = ("-", "--", ":", "-.")


def _claims_curves(report: dict, scale: str | None) -> list[dict]:
    """The runs of the claims' cell (sync, hybrid and async at W=16, tau=4) that carry a curve."""
    return [r for r in report["runs"]
            if r["workers"] == CLAIM_WORKERS and r["tau"] in (0, CLAIM_TAU) and r["curve"]
            and r["discipline"] in CURVE_COLOURS and (scale is None or rates(r) == scale)]


def curve_gaps(runs: list[dict], name=lambda run: run["discipline"]) -> dict[str, list[tuple[int, float]]]:
    """Per `name(run)` (default: the discipline), (samples seen, median over seeds of its curve AUC
    minus sync's) at the curve points where the sync run of the same seed was evaluated within 2%
    of the same samples."""
    sync = {r["seed"]: r["curve"] for r in runs if r["discipline"] == "sync" and r["curve"]}
    points: dict[str, dict[int, list[float]]] = {}
    for r in runs:
        if r["discipline"] == "sync" or r["seed"] not in sync:
            continue
        for point in r["curve"]:
            near = min(sync[r["seed"]], key=lambda p: abs(p["samples"] - point["samples"]))
            if abs(near["samples"] - point["samples"]) <= 0.02 * point["samples"]:
                points.setdefault(name(r), {}).setdefault(near["samples"], []).append(point["auc"] - near["auc"])
    return {key: sorted((samples, statistics.median(gaps)) for samples, gaps in by.items())
            for key, by in points.items()}


def series_name(label: str) -> str:
    """A run's line in the sweep's plots: its discipline, with G for ht ("ht G=2")."""
    name = label.split(":")[0]
    return name + (f" G={label.split('groups=')[1].split(',')[0]}" if name == "ht" else "")


def plot_sweep(report: dict, path: str) -> None:
    """One row per W: left, the median gap to sync against tau (s for het, ssp) per discipline
    (ht per G); right, at the tau nearest the claims' (4), the median over seeds of each
    discipline's curve AUC minus sync's against samples seen."""
    scale = report["claims"].get("rates") if report.get("claims") else None
    runs = [r for r in report["runs"] if scale is None or rates(r) == scale]
    workers = sorted({r["workers"] for r in runs})
    names = sorted({series_name(r["label"]) for r in runs if r["discipline"] != "sync"})
    colour = {name: f"C{i % 10}" if i < 10 else "black" for i, name in enumerate(names)}
    with png_figure(path, len(workers), 2, figsize=(13, 4 * len(workers)), squeeze=False) as (figure, axes):
        for row, w in enumerate(workers):
            series: dict[str, list] = {}
            for c in report["cells"]:
                if c["workers"] == w and c["discipline"] != "sync" and c["gap_pct"] is not None \
                        and (scale is None or c["rates"] == scale):
                    series.setdefault(series_name(c["label"]), []).append((c["tau"], c["gap_pct"]))
            left, right = axes[row]
            for name, points in sorted(series.items()):
                points.sort()
                left.plot([max(t, 0.5) for t, _ in points], [g for _, g in points], marker="o", color=colour[name],
                          label=name)
            left.set_xscale("log", base=2)
            left.axhline(-HYBRID_TARGET_PCT, color="grey", linestyle=":")
            left.axhline(0.0, color="grey", linewidth=0.5)
            left.set_xlabel("tau (s for het, ssp)")
            left.set_ylabel(f"test AUC gap to sync, % (W={w})")
            left.legend(fontsize=7, ncol=2)
            left.grid(alpha=0.3)
            taus = sorted({r["tau"] for r in runs if r["workers"] == w and r["discipline"] != "sync"})
            tau = min(taus, key=lambda t: abs(t - CLAIM_TAU)) if taus else None
            at = [r for r in runs if r["workers"] == w and (r["discipline"] == "sync" or r["tau"] == tau)]
            for name, points in sorted(curve_gaps(at, lambda r: series_name(r["label"])).items()):
                right.plot([s for s, _ in points], [g for _, g in points], marker="o", color=colour[name], label=name)
            right.axhline(0.0, color="grey", linestyle=":")
            right.set_xlabel("samples seen")
            right.set_ylabel("AUC difference to sync (curve batches)")
            right.set_title(f"W={w}, tau (s) = {tau}, median over seeds", fontsize=8)
            right.legend(fontsize=7, ncol=2)
            right.grid(alpha=0.3)
        figure.suptitle(f"bench staleness: {report['settings']['config']}, {report['settings']['samples']} samples, "
                        f"visibility {report['settings']['visibility']}, rates {scale or 'as configured'}", fontsize=9)


def plot(report: dict, path: str) -> None:
    """The claims' figure, or the sweep's (`plot_sweep`) when the runs hold more than the claims'
    cell (another W, or disciplines besides sync, hybrid and async)."""
    if any(r["workers"] != CLAIM_WORKERS or r["discipline"] not in CURVE_COLOURS for r in report["runs"]):
        plot_sweep(report, path)
    else:
        plot_claims(report, path)


def plot_claims(report: dict, path: str) -> None:
    """Left: the gap to sync against tau, per discipline and W (median over seeds, one scale);
    middle: AUC against samples seen at the claims' cell (colour: discipline, line: seed); right:
    there, the median AUC difference to sync against samples seen."""
    rows = [c for c in report["cells"] if c["discipline"] != "sync" and c["gap_pct"] is not None]
    scale = report["claims"].get("rates") if report.get("claims") else None
    with png_figure(path, 1, 3, figsize=(16, 4.5)) as (figure, axes):
        series: dict[tuple, list] = {}
        for c in rows:
            if scale is None or c["rates"] == scale:
                series.setdefault((series_name(c["label"]), c["workers"]), []).append((c["tau"], c["gap_pct"]))
        for (name, workers), points in sorted(series.items()):
            points.sort()
            axes[0].plot([max(t, 0.5) for t, _ in points], [g for _, g in points], marker="o",
                         color=CURVE_COLOURS.get(name), label=f"{name} W={workers}")
        axes[0].set_xscale("log", base=2)
        axes[0].axhline(-HYBRID_TARGET_PCT, color="grey", linestyle=":")
        axes[0].set_xlabel("tau (s for het, ssp)")
        axes[0].set_ylabel(f"AUC gap to sync, % (rates {scale})")
        axes[0].legend(fontsize=6, ncol=2)
        axes[0].grid(alpha=0.3)
        curves = _claims_curves(report, scale)
        seeds = sorted({r["seed"] for r in curves})
        for r in curves:
            axes[1].plot([p["samples"] for p in r["curve"]], [p["auc"] for p in r["curve"]],
                         color=CURVE_COLOURS[r["discipline"]],
                         linestyle=CURVE_STYLES[seeds.index(r["seed"]) % len(CURVE_STYLES)],
                         label=f"{r['label']} seed {r['seed']}", alpha=0.85)
        axes[1].set_xlabel("samples seen")
        axes[1].set_ylabel("test AUC (curve batches)")
        axes[1].set_title(f"W={CLAIM_WORKERS}, tau={CLAIM_TAU}", fontsize=8)
        axes[1].legend(fontsize=6)
        axes[1].grid(alpha=0.3)
        for name, points in curve_gaps(curves).items():
            axes[2].plot([s for s, _ in points], [g for _, g in points], marker="o", color=CURVE_COLOURS[name],
                         label=f"{name} - sync (median of {len(seeds)} seeds)")
        axes[2].axhline(0.0, color="grey", linestyle=":")
        axes[2].set_xlabel("samples seen")
        axes[2].set_ylabel("AUC difference to sync (curve batches)")
        axes[2].set_title(f"W={CLAIM_WORKERS}, tau={CLAIM_TAU}", fontsize=8)
        axes[2].legend(fontsize=6)
        axes[2].grid(alpha=0.3)
        figure.suptitle(f"bench staleness: {report['settings']['config']}, {report['settings']['samples']} samples",
                        fontsize=9)


def sweep_figures(report: dict) -> dict:
    """A sweep without the claims' cell: each discipline's median gap to sync (ht per G) at the W
    nearest the claims' 16 and the tau (s) nearest their 4."""
    cells_ = [c for c in report.get("cells", []) if c["discipline"] != "sync" and c["gap_pct"] is not None]
    if not cells_:
        return {}
    w = min({c["workers"] for c in cells_}, key=lambda w: (abs(w - CLAIM_WORKERS), -w))
    tau = min({c["tau"] for c in cells_ if c["workers"] == w}, key=lambda t: (abs(t - CLAIM_TAU), -t))
    return {f"{series_name(c['label'])} - sync AUC % (W={w}, tau/s {tau})": c["gap_pct"]
            for c in sorted(cells_, key=lambda c: c["label"]) if c["workers"] == w and c["tau"] == tau}


def headline(report: dict) -> dict:
    figures = pick(report.get("claims"), {"hybrid - sync AUC %": "hybrid_gap_pct", "async - sync AUC %": "async_gap_pct",
                                          "samples": "samples"})
    if (report.get("claims") or {}).get("hybrid_gap_pct") is None:
        figures.update(sweep_figures(report))
    oracle = report.get("oracle") or {}
    figures.update(pick(oracle, {"oracle: largest difference of median AUCs": "max_median_difference"}))
    return figures


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not Path(args.config).is_file():
        parser.error(f"--config {args.config}: no such file (paths are relative to {Path.cwd()})")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error(f"--plot {args.plot}: needs matplotlib (pip install 'hybridrec[bench]')")
    if not 0.0 <= args.visibility <= 1.0:
        parser.error(f"--visibility {args.visibility}: allowed: a probability in [0, 1]")
    started = time.time()
    try:
        load(args)  # a wrong config or --set fails here, before any run
        log = RunLog(args.out)
        runs, tuned = ([], {}) if args.oracle_only else sweep(args, log)
        report = {"settings": {k: v for k, v in vars(args).items() if k not in ("json", "plot", "out", "keep")}}
        report["runs"] = [public_run(r) for r in with_gaps(runs)]
        report["cells"] = cells(report["runs"])
        report["tuned_lr_scales"] = {w: list(scale) for w, scale in tuned.items()}
        report["claims"] = claims(report["runs"], args.samples, tuned)
        if args.oracle or args.oracle_only:
            from hybridrec.benchmarks.staleness_oracle import oracle_check

            report["oracle"] = oracle_check(args, log)
    except UserError as exc:
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
    report["seconds"] = time.time() - started
    print_report(report)
    if args.plot:
        plot(report, args.plot)
        print(f"plot: {args.plot}")
    if args.json:
        print(json.dumps({"runs": report["runs"], "claims": report["claims"], "oracle": report.get("oracle"),
                          "cells": report["cells"], "tuned_lr_scales": report["tuned_lr_scales"],
                          "settings": report["settings"]}))
    return report
