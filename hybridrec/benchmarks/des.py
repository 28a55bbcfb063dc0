"""`hybridrec bench des`: DES against the Persia preset, on real jobs.

Two parts, each skippable:

**Quality and speed** (`--config`, default configs/des_criteo_sample.yaml: the Criteo sample) for
each model of `--models` (lr, wide_deep, deepfm): the DES job (`strategy.preset: des`, fully
synchronous, `--trainers` trainers each computing its fields' part of every batch of
`data.batch_size` rows) against the Persia async discipline (`preset: persia`, consistency
bounded, dense ps_async; 2 PS servers, 1 embedding worker, the same number of trainers, each
taking its own batches of `data.batch_size` rows). Both make one update per batch of
`data.batch_size` rows, as many per epoch: DES applies each synchronously, the PS trainers
apply theirs as they come. Reported per job (medians over `--runs`, the variants interleaved):
test `auc` and `logloss`, training `samples_per_s` (samples of the whole job over the slowest
trainer's training seconds) and `bytes_per_step` on the wire per update (a batch of
`data.batch_size` rows):
- DES: the AllReduce of the partial results, from the trainers' counters (`des.wire_bytes_per_step`,
  a ring AllReduce's bytes, each byte once);
- PS async: the trainers' bytes with the embedding worker (its counters: IDs, rows, gradients)
  plus the dense parameters a trainer pulls and pushes every step, counted from the model's
  size (2 x 4 bytes per parameter; the PS client's framing not included).

**Bytes per step by batch size** (`--bytes-config`, default configs/des_synthetic.yaml: shaped like
DES Table 2, 100 fields of 3 IDs per sample on average over a large vocabulary) for each model
and each global batch of `--batches` (512 to 8192), `--bytes-trainers` trainers (4, as in the
paper), `--steps` training steps per job:
- `des`: 2 (N - 1) x B x P x 4 bytes (P: the partial results' width), the ring AllReduce's bytes,
  exact, and checked against the counters of one real DES job per model at the smallest batch;
- `ps`: a real Persia-preset job (sync, so it is deterministic; bytes do not depend on the
  discipline) at B / N rows per trainer: the counters' bytes between trainers and embedding worker
  per step (one job per table layout and batch: Wide&Deep and DeepFM have the same tables, so the
  same embedding bytes), plus the dense AllReduce (DDP) of every dense parameter, 2 (N - 1) x 4
  bytes each (exact for a ring). The embedding workers' own traffic with the PS servers is not counted, so
  the PS figure is a lower bound;
- `sharded`: a real job of the sharded placement (PICASSO's, consistency sync: the paper's "mesh")
  whose trainers count the bytes they send, plus the same dense AllReduce; null when that
  placement is not built.
Also `input_bytes_by_batch`: what the trainers read per step (DES: every trainer its fields' IDs
of every row plus the dense features and labels of every row; PS: each trainer all fields of its
rows), counted on the workload's first batch of each size.

`--json` prints one line: {"models": {model: {"des": R, "ps_async": R}}, "bytes_by_batch":
{model: {"512": {"des": b, "ps": b, "sharded": b or null}, ...}}, ...}.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from hybridrec.benchmarks.hybrid import JobFailed, add_ray_argument, check_ray
from hybridrec.benchmarks.hybrid import run_job as launch_job
from hybridrec.benchmarks.timing import positive_int
from hybridrec.benchmarks.results import pick

DEFAULT_CONFIG = "configs/des_criteo_sample.yaml"
DEFAULT_BYTES_CONFIG = "configs/des_synthetic.yaml"
MODELS = ("lr", "wide_deep", "deepfm")
BATCHES = (512, 1024, 2048, 4096, 8192)
PS_ASYNC = ["strategy.preset=persia", "strategy.consistency=bounded", "strategy.dense=ps_async"]
PS_SYNC = ["strategy.preset=persia", "strategy.consistency=sync", "strategy.dense=allreduce"]
SHARDED = ["strategy.preset=picasso", "strategy.consistency=sync"]
PAPER_SAVING = 0.687  # DES §1 and §7: 68.7% fewer bytes than the PS on average


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybridrec bench des", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=DEFAULT_CONFIG, help=f"quality job config (default {DEFAULT_CONFIG})")
    parser.add_argument("--bytes-config", default=DEFAULT_BYTES_CONFIG,
                        help=f"paper-shaped workload for the bytes (default {DEFAULT_BYTES_CONFIG})")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated (default lr,wide_deep,deepfm)")
    parser.add_argument("--trainers", type=positive_int, default=2, help="trainers of the quality jobs (default 2)")
    parser.add_argument("--runs", type=positive_int, default=1, help="quality jobs per variant (default 1)")
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)), help="global batch sizes of the bytes part")
    parser.add_argument("--bytes-trainers", type=positive_int, default=4, help="trainers of the bytes jobs (default 4)")
    parser.add_argument("--steps", type=positive_int, default=3, help="training steps per bytes job (default 3)")
    parser.add_argument("--skip-quality", action="store_true", help="only the bytes by batch size")
    parser.add_argument("--skip-bytes", action="store_true", help="only the quality and speed jobs")
    parser.add_argument("--no-sharded", action="store_true", help="do not run the sharded placement's jobs")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="config override for every quality job (repeatable)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per job (default 3600)")
    parser.add_argument("--keep", metavar="DIR", help="keep the jobs' output directories under DIR")
    parser.add_argument("--verbose", action="store_true", help="show every job's launcher output")
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    add_ray_argument(parser)
    return parser


def _log(text: str) -> None:
    print(f"[bench des] {text}", file=sys.stderr, flush=True)


def run_job(args, config: str, overrides: list[str], output_dir: Path, trainers: int, servers: bool,
            label: str) -> dict:
    """One `hybridrec launch` of `config` with `overrides` (2 PS servers and an embedding worker
    when `servers`; on the Ray cluster of --ray, when given); its final metrics."""
    job = argparse.Namespace(config=config, set=[], ps=2 if servers else None, embedding_workers=1 if servers else None,
                             trainers=trainers, timeout=args.timeout, verbose=args.verbose, ray=args.ray)
    return launch_job(job, label, overrides, output_dir)


def dense_parameters(config: str, overrides: list[str]) -> int:
    from hybridrec.config import load_config
    from hybridrec.job.tables import job_dense_model, job_tables

    cfg = load_config(config, overrides)
    return sum(p.numel() for p in job_dense_model(cfg, job_tables(cfg)).parameters())


def partial_width(config: str, overrides: list[str]) -> int:
    from hybridrec.config import load_config
    from hybridrec.job.tables import job_dense_model, job_tables
    from hybridrec.des.substitution import SubstitutedModel

    cfg = load_config(config, overrides)
    return SubstitutedModel(job_dense_model(cfg, job_tables(cfg)), [0]).partial_width


def model_sets(model: str) -> list[str]:
    return ["model.name=lr", "model.hparams={}"] if model == "lr" else [f"model.name={model}"]


def des_wire_bytes(batch: int, width: int, trainers: int) -> int:
    """Bytes on the wire (each once) of one ring AllReduce of [batch, width] float32 among `trainers`."""
    return 2 * (trainers - 1) * batch * width * 4


def ring_dense_bytes(parameters: int, trainers: int) -> int:
    """Bytes on the wire (each once) of a ring AllReduce of every dense gradient (DDP), per step."""
    return 2 * (trainers - 1) * parameters * 4


def _median(values):
    values = [v for v in values if isinstance(v, (int, float))]
    return statistics.median(values) if values else None


# ---------------------------------------------------------------------------------- quality
def quality(args, models: list[str], root: Path) -> tuple[dict, dict]:
    """({model: {"des": R, "ps_async": R}}, {model: comparisons, "settings": ...})."""
    from hybridrec.config import load_config

    base = load_config(args.config, args.set)
    batch, trainers = base.data.batch_size, args.trainers
    report, summary = {}, {}
    for model in models:
        sets = [*args.set, *model_sets(model)]
        runs = {"des": [], "ps_async": []}
        for run in range(args.runs):
            des = run_job(args, args.config, [*sets, "strategy.preset=des", "strategy.roles.trainers=%d" % trainers],
                          root / f"{model}-des-{run}", trainers, False, f"{model} des")
            runs["des"].append({"auc": des["auc"], "logloss": des["logloss"],
                                "samples_per_s": des["train_samples_per_s"],
                                "bytes_per_step": des["des"]["wire_bytes_per_step"],
                                "input_bytes_per_step": des["des"]["input_bytes_per_step"]})
            _log(f"{model} des run {run + 1}: auc {des['auc']:.4f} samples/s {des['train_samples_per_s']:.0f} "
                 f"bytes/step {des['des']['wire_bytes_per_step']:.0f}")
            ps_sets = [*sets, *PS_ASYNC]
            ps = run_job(args, args.config, ps_sets, root / f"{model}-ps-{run}", trainers, True, f"{model} ps_async")
            dense = 2 * 4 * dense_parameters(args.config, ps_sets)  # a trainer's pull and push per step
            embedding = ps["bytes_per_sample"] * batch
            runs["ps_async"].append({"auc": ps["auc"], "logloss": ps["logloss"],
                                     "samples_per_s": ps["train_samples_per_s"],
                                     "bytes_per_step": embedding + dense, "embedding_bytes_per_step": embedding,
                                     "dense_bytes_per_step": dense})
            _log(f"{model} ps_async run {run + 1}: auc {ps['auc']:.4f} samples/s {ps['train_samples_per_s']:.0f} "
                 f"bytes/step {embedding + dense:.0f}")
        report[model] = {name: {**{key: _median([r[key] for r in rs]) for key in rs[0]}, "runs": rs}
                         for name, rs in runs.items()}
        des_r, ps_r = report[model]["des"], report[model]["ps_async"]
        summary[model] = {"auc_des_minus_ps_async": des_r["auc"] - ps_r["auc"],
                          "logloss_des_minus_ps_async": des_r["logloss"] - ps_r["logloss"],
                          "samples_per_s_des_over_ps_async": des_r["samples_per_s"] / ps_r["samples_per_s"],
                          "bytes_saving": 1 - des_r["bytes_per_step"] / ps_r["bytes_per_step"]}
    summary["settings"] = {"config": args.config, "set": args.set, "trainers": trainers, "batch_size": batch,
                           "runs": args.runs}
    return report, summary


# ---------------------------------------------------------------------------------- bytes
def input_bytes(config: str, batch: int, trainers: int, overrides: list[str]) -> dict:
    """What the trainers read for one global batch (the workload's first of that size)."""
    from hybridrec.config import load_config
    from hybridrec.job.sources import build_sources
    from hybridrec.job.tables import job_tables
    from hybridrec.des.fields import input_bytes_of
    from hybridrec.strategy.placement.field_sharded import assign_fields

    cfg = load_config(config, [*overrides, f"data.batch_size={batch}"])
    tables = job_tables(cfg)
    first = next(iter(build_sources(cfg.data, cfg.seed, with_best_auc=False).train))
    owned = assign_fields(tables, trainers)
    des = sum(input_bytes_of(first, [tables.sparse_names[i] for i in fields]) for fields in owned)
    ps = input_bytes_of(first, tables.sparse_names)  # each row read once, by the trainer it is dealt to
    return {"des": des, "ps": ps}


def bytes_by_batch(args, models: list[str], batches: list[int], root: Path) -> dict:
    from hybridrec.config import load_config

    config, trainers, steps = args.bytes_config, args.bytes_trainers, args.steps
    load_config(config)  # a wrong config fails here, before any job
    out, breakdown, inputs, checks = {}, {}, {}, {}
    measured: dict = {}  # (tables, batch) -> embedding bytes of the ps and sharded jobs
    for model in models:
        sets = model_sets(model)
        layout = _table_layout(config, sets)
        width = partial_width(config, sets)
        parameters = dense_parameters(config, sets)
        out[model], breakdown[model], inputs[model] = {}, {}, {}
        for batch in batches:
            if batch % trainers:
                raise ValueError(f"--batches: {batch} does not divide among {trainers} trainers")
            capacity = steps * batch * 6 + 1000  # every ID of every step fits (no eviction changes the bytes)
            # synthetic rows are dealt to the PS jobs' trainers in blocks of 4,096: enough for `steps` each
            rows = trainers * 4096 * -(-steps * batch // (trainers * 4096))
            common = [*sets, f"train.max_steps={steps}", f"data.synthetic.train_rows={rows}",
                      "data.synthetic.test_rows=512", f"embedding.default.capacity={capacity}",
                      f"strategy.roles.trainers={trainers}"]
            des = des_wire_bytes(batch, width, trainers)
            if batch == batches[0] and model not in checks:  # the counters of a real DES job agree
                job = run_job(args, config, [*common, "strategy.preset=des", f"data.batch_size={batch}"],
                              root / f"bytes-{model}-des-{batch}", trainers, False,
                              f"{model} des (bytes)")
                counted = job["des"]["wire_bytes_per_step"]
                checks[model] = {"batch": batch, "counted": counted, "formula": des}
                if abs(counted - des) > 1e-6 * des:
                    raise JobFailed(f"{model}: the DES job counted {counted} bytes per step, the formula {des}")
            if (layout, batch) not in measured:  # models with the same tables move the same rows
                ps_job = run_job(args, config, [*common, *PS_SYNC, f"data.batch_size={batch // trainers}"],
                                 root / f"bytes-{model}-ps-{batch}", trainers, True,
                                 f"{model} ps (bytes, batch {batch})")
                measured[layout, batch] = (ps_job["bytes_per_sample"] * batch, None if args.no_sharded else
                                           _sharded_bytes(args, config, common, batch, trainers, root, model))
            ps_embedding, sharded_embedding = measured[layout, batch]
            dense = ring_dense_bytes(parameters, trainers)
            sharded = None if sharded_embedding is None else sharded_embedding + dense
            out[model][str(batch)] = {"des": des, "ps": ps_embedding + dense, "sharded": sharded}
            breakdown[model][str(batch)] = {"des_partial_width": width, "ps_embedding": ps_embedding,
                                            "ps_dense_allreduce": dense, "sharded_embedding": sharded_embedding,
                                            "dense_parameters": parameters}
            inputs[model][str(batch)] = input_bytes(config, batch, trainers, sets)
            saving = 1 - des / (ps_embedding + dense)
            _log(f"{model} batch {batch}: des {des:.0f} ps {ps_embedding + dense:.0f} "
                 f"(embedding {ps_embedding:.0f}) sharded {sharded} bytes/step; saving {100 * saving:.1f}%")
    savings = [1 - v["des"] / v["ps"] for m in out.values() for v in m.values()]
    savings_embedding = [1 - out[m][b]["des"] / breakdown[m][b]["ps_embedding"] for m in out for b in out[m]]
    sharded_savings = [1 - v["des"] / v["sharded"] for m in out.values() for v in m.values() if v["sharded"]]
    summary = {"mean_saving_vs_ps": statistics.mean(savings),
               "mean_saving_vs_ps_embedding_only": statistics.mean(savings_embedding),
               "mean_saving_vs_sharded": statistics.mean(sharded_savings) if sharded_savings else None,
               "paper_target": PAPER_SAVING, "target_met": statistics.mean(savings) >= PAPER_SAVING,
               "trainers": trainers, "steps_per_job": steps, "config": config, "des_counter_checks": checks}
    return {"bytes_by_batch": out, "bytes_breakdown": breakdown, "input_bytes_by_batch": inputs,
            "bytes_summary": summary}


def _table_layout(config: str, overrides: list[str]) -> tuple:
    """The job's tables (names and dims): jobs with the same ones move the same embedding bytes."""
    from hybridrec.config import load_config
    from hybridrec.job.tables import job_tables

    tables = job_tables(load_config(config, overrides)).all_tables()
    return tuple(sorted((name, table.dim) for name, table in tables.items()))


def _sharded_bytes(args, config, common, batch, trainers, root, model) -> float | None:
    """Bytes per step between the sharded placement's trainers (counted by their senders), or
    None when that placement is not built here."""
    from hybridrec.axes import AXES

    if AXES["placement"]["sharded"].module is None:
        return None
    try:
        job = run_job(args, config, [*common, *SHARDED, f"data.batch_size={batch // trainers}"],
                      root / f"bytes-{model}-sharded-{batch}", trainers, False,
                      f"{model} sharded (bytes, batch {batch})")
    except (JobFailed, ValueError) as exc:
        _log(f"the sharded job failed, reported as null: {str(exc)[-2000:]}")
        return None
    return job["bytes_per_sample"] * batch


# ---------------------------------------------------------------------------------- report
def print_report(report: dict) -> None:
    for model, r in report.get("models", {}).items():
        d, p, c = r["des"], r["ps_async"], report["quality_summary"][model]
        print(f"{model:<10} des auc {d['auc']:.4f} logloss {d['logloss']:.4f} samples/s {d['samples_per_s']:.0f} "
              f"bytes/step {d['bytes_per_step']:.0f} | ps_async auc {p['auc']:.4f} logloss {p['logloss']:.4f} "
              f"samples/s {p['samples_per_s']:.0f} bytes/step {p['bytes_per_step']:.0f} | "
              f"auc des - ps_async {c['auc_des_minus_ps_async']:+.4f}, bytes saving {100 * c['bytes_saving']:.1f}%")
    for model, by_batch in report.get("bytes_by_batch", {}).items():
        for batch, v in by_batch.items():
            sharded = "-" if v["sharded"] is None else f"{v['sharded']:.0f}"
            print(f"{model:<10} batch {batch:>5}: des {v['des']:>12.0f}  ps {v['ps']:>12.0f}  sharded {sharded:>12}  "
                  f"saving vs ps {100 * (1 - v['des'] / v['ps']):5.1f}%")
    summary = report.get("bytes_summary")
    if summary:
        print(f"mean saving vs ps {100 * summary['mean_saving_vs_ps']:.1f}% (embedding traffic only: "
              f"{100 * summary['mean_saving_vs_ps_embedding_only']:.1f}%); target >= {100 * PAPER_SAVING:.1f}%: "
              f"{'met' if summary['target_met'] else 'NOT met'}")


def headline(report: dict) -> dict:
    """The figures of the results table: per model, DES's AUC and bytes per update against PS-async;
    the mean saving of bytes by batch size against the PS and the sharded placement."""
    figures = {}
    for model in report.get("models", {}):
        figures.update(pick(report["quality_summary"][model], {"AUC DES - PS-async": "auc_des_minus_ps_async",
                                                               "bytes saved vs PS-async": "bytes_saving"},
                            f"{model} "))
    figures.update(pick(report.get("bytes_summary"), {"mean bytes saved vs PS": "mean_saving_vs_ps",
                                                      "mean bytes saved vs sharded": "mean_saving_vs_sharded",
                                                      "target met": "target_met"}))
    return figures


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_ray(parser, args)
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in ("lr", "fm", "wide_deep", "deepfm")]
    if unknown:
        parser.error(f"--models: DES substitutes lr, fm, wide_deep and deepfm; got {unknown}")
    try:
        batches = sorted(int(b) for b in args.batches.split(","))
    except ValueError:
        parser.error(f"--batches: expected comma-separated integers, got {args.batches!r}")
    for path in ([] if args.skip_quality else [args.config]) + ([] if args.skip_bytes else [args.bytes_config]):
        if not Path(path).is_file():
            parser.error(f"{path}: no such file (paths are relative to {Path.cwd()})")
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="hybridrec-bench-des-"))
    root.mkdir(parents=True, exist_ok=True)
    report: dict = {}
    try:
        if not args.skip_quality:
            report["models"], report["quality_summary"] = quality(args, models, root)
        if not args.skip_bytes:
            report.update(bytes_by_batch(args, models, batches, root))
    except (JobFailed, ValueError) as exc:
        parser.exit(1, f"{parser.prog}: error: {exc}\n")
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    print_report(report)
    if args.json:
        print(json.dumps(report))
    return report
