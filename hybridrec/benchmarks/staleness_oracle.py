"""The oracle check of `hybridrec bench staleness --oracle`: real distributed jobs against their
exact emulation.

Each job is `bench hybrid`'s (hybridrec.benchmarks.hybrid.run_job: PS servers, one embedding
worker and the trainers under torchrun; sync, hybrid or async as points of the strategy axes),
run once per seed. Every job records the staleness its lookups had (and async its dense pulls:
hybridrec.persia.staleness); the emulator replays the job (hybridrec.lab.trace.RecordedSchedule:
the same config, seed and workers, each PS store's updates applied in the order that store
applied them, each read seeing on each store the updates the job's read saw there) and, for
comparison, runs it with the seeded schedule at the sweep's visibility under the discipline's
nominal bound. Per discipline: the AUCs of the jobs and of the replays, their medians, and how
many of the job's lookups missed more steps of some trainer than the discipline's bound allows
(`reads_beyond_bound`: the pipeline bounds a trainer's own updates in flight, not the others'; sync's
trainers meet at a barrier after each update, so none of sync's may). With `--out`, each check
(one discipline, one seed) is appended to the file as it finishes and reused from it, as the
sweep's runs are: seeds run apart (in parallel) are reported together by one run over the file.
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

ORACLE_TARGET = 0.005  # the medians of emulated and distributed AUC within this
UNBOUNDED = 1 << 30  # a replay's bound: the recording decides what each read saw


def _job_args(args) -> argparse.Namespace:
    """The arguments `bench hybrid`'s run_job reads, for the oracle's jobs."""
    return argparse.Namespace(config=args.config, set=list(args.set), ps=args.oracle_ps, embedding_workers=1,
                              trainers=args.oracle_trainers, timeout=args.timeout, verbose=args.verbose)


def _reads_beyond(directory: Path, bound: int) -> tuple[int, int]:
    """(lookups of the job that missed more than `bound` steps of some trainer, lookups)."""
    from hybridrec.lab.trace import load_trace
    from hybridrec.persia.staleness import TRACE_FILE, missed_steps

    missed = missed_steps(load_trace(directory / TRACE_FILE))
    beyond = sum(int(np.count_nonzero(m.max(axis=1) > bound)) for m in missed if m.size)
    return beyond, sum(len(m) for m in missed)


def oracle_check(args, log) -> dict:
    from hybridrec.benchmarks.hybrid import DISCIPLINES, run_job
    from hybridrec.config import load_config
    from hybridrec.lab import Schedule, emulate, parse
    from hybridrec.lab.trace import RecordedSchedule

    base = load_config(args.config, args.set)
    rows = ([f"data.synthetic.train_rows={args.oracle_samples}"]
            if args.oracle_samples and base.data.format == "synthetic" else [])
    tau = base.strategy.tau
    nominal = {"sync": ("sync", 0), "hybrid": (f"hybrid:tau={tau}", tau),
               "async": (f"async:tau={tau},tau_dense={args.tau_dense}", tau)}
    # a replay's reads see what the job's saw, whatever the discipline's bound (sync's included)
    replayed = {"sync": f"hybrid:tau={UNBOUNDED}", "hybrid": f"hybrid:tau={UNBOUNDED}",
                "async": f"async:tau={UNBOUNDED},tau_dense={UNBOUNDED}"}
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="hybridrec-bench-staleness-"))
    root.mkdir(parents=True, exist_ok=True)
    job_args = _job_args(args)
    out = {}
    try:
        for name in args.oracle_disciplines:
            row = {"emulated_auc": [], "distributed_auc": [], "seeded_auc": [], "departures": [],
                   "reads_beyond_bound": [], "staleness_cross": [], "seeds": list(args.oracle_seeds)}
            spec, bound = nominal[name]
            for seed in args.oracle_seeds:
                key = (f"oracle {name}", args.oracle_trainers, seed, 1.0, 1.0, args.oracle_samples, args.visibility,
                       "test")
                check = log.done.get(key)
                if check is None:
                    directory = root / f"oracle-{name}-seed{seed}"
                    sets = [*DISCIPLINES[name], f"seed={seed}", *rows]
                    metrics = run_job(job_args, name, sets, directory)
                    cfg = load_config(args.config, [*args.set, f"seed={seed}", *rows])
                    schedule = RecordedSchedule.from_job(directory, seed)
                    replay = emulate(cfg, parse(replayed[name]), args.oracle_trainers, schedule).result
                    seeded = emulate(cfg, parse(spec), args.oracle_trainers, Schedule(seed, args.visibility)).result
                    check = dict(zip(("label", "workers", "seed", "lr_scale", "dense_lr_scale", "samples_asked",
                                      "visibility", "evaluated_on"), key),
                                 distributed_auc=metrics["auc"], emulated_auc=replay["auc"], seeded_auc=seeded["auc"],
                                 departures=schedule.departures + replay.get("embedding_departures", 0),
                                 embedding_plan=schedule.describe()["embedding_plan"],
                                 read_inversions=replay.get("embedding_inversions"),
                                 dense_plan=schedule.describe().get("dense_plan"),
                                 reads_beyond_bound=list(_reads_beyond(directory, bound)),
                                 staleness_cross=metrics.get("staleness_cross"))
                    log.add(check)
                beyond, lookups = check["reads_beyond_bound"]
                for field in ("distributed_auc", "emulated_auc", "seeded_auc", "departures", "reads_beyond_bound",
                              "staleness_cross"):
                    row[field].append(check[field])
                print(f"[bench staleness] oracle {name} seed {seed}: distributed auc {check['distributed_auc']:.5f}, "
                      f"replayed {check['emulated_auc']:.5f}, seeded {check['seeded_auc']:.5f}; {check['departures']} "
                      f"departures; {beyond}/{lookups} lookups beyond the bound", file=sys.stderr, flush=True)
            row["emulated_median"] = statistics.median(row["emulated_auc"])
            row["distributed_median"] = statistics.median(row["distributed_auc"])
            row["difference"] = row["emulated_median"] - row["distributed_median"]
            out[name] = row
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    worst = max(abs(r["difference"]) for r in out.values())
    return {"disciplines": out, "emulated_auc": [a for r in out.values() for a in r["emulated_auc"]],
            "distributed_auc": [a for r in out.values() for a in r["distributed_auc"]],
            "max_median_difference": worst, "within_target": worst <= ORACLE_TARGET, "target": ORACLE_TARGET,
            "trainers": args.oracle_trainers, "ps": args.oracle_ps, "samples": args.oracle_samples}
