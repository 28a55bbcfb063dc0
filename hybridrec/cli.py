"""The `hybridrec` command: train, eval, export, predict, serve, data synth, models, calibrate,
plan, bench, serve-ps, embedding-worker, group-ps, launch, scale.

Each subcommand parses its own arguments and calls one function of the library; errors a
user can fix (a `UserError`: bad config, data that does not fit its reader, missing file) are
printed as one clear message with exit code 2. A traceback means a bug of ours.
"""
from __future__ import annotations

import argparse
import json
import sys

BENCHMARKS = {
    "embedding": ("hybridrec.benchmarks.embedding", "lookup + pooled forward + backward + fused Adagrad vs torch and TorchRec"),
    "e2e": ("hybridrec.benchmarks.e2e", "DLRM end-to-end training samples/s vs torch and TorchRec"),
    "reader": ("hybridrec.benchmarks.reader", "Criteo TSV reader rows/s vs pandas.read_csv"),
    "small-data": ("hybridrec.benchmarks.small_data", "the defaults on small generated CSV files: LR and DeepFM test AUC "
                   "vs scikit-learn's LogisticRegression"),
    "tiers": ("hybridrec.benchmarks.tiers", "a table 5x its memory tier on a disk tier vs all in memory: samples/s, "
              "peak RSS, bytes on disk, hit rate, lost rows; the store evicting vs never evicting"),
    "ps": ("hybridrec.benchmarks.ps_throughput", "PS lookup GB/s over loopback vs an in-process gather"),
    "elastic": ("hybridrec.benchmarks.elastic", "the elastic PS tier: scale 2->3->2 and a lost PS (ps_replicas 2) while "
                "a model trains vs the fixed job: AUC, samples/s, longest pause, lost / doubled SGD updates"),
    "hybrid": ("hybridrec.benchmarks.hybrid", "distributed jobs: sync vs hybrid vs async (or --codecs) AUC, samples/s, bytes"),
    "picasso": ("hybridrec.benchmarks.picasso", "PICASSO's ablation (sharded, +packing, +interleaving, +hot/cold) vs local "
                "and Persia; samples/s against fields"),
    "het": ("hybridrec.benchmarks.het", "HET's cache: BSP / ASP / SSP / no cache / HET s=0..inf jobs, miss rates of LRU / LFU / light LFU"),
    "des": ("hybridrec.benchmarks.des", "DES vs the Persia preset: AUC, samples/s, bytes per step by batch size"),
    "stream": ("hybridrec.benchmarks.stream", "online training on streams: file vs Redis samples/s and progressive AUC; "
               "duplicates and missing records across SIGKILL + --resume, arriving files, a 2-trainer Persia job"),
    "ht": ("hybridrec.benchmarks.ht", "Hierarchical Training (Hogwild groups) vs EASGD replicas: loss, AUC, samples/s, bytes"),
    "serve": ("hybridrec.benchmarks.serve", "hybridrec serve vs a plain PyTorch server: QPS, p50/p99, bundle bytes and "
              "AUC by precision, delta bytes, freshness, failures during swaps"),
    "staleness": ("hybridrec.benchmarks.staleness", "emulated W-worker sync / hybrid / async / HET / SSP / HT runs "
                  "(hybridrec.lab): AUC gaps to sync by tau and W, the claims, the oracle check against real jobs"),
    "speedups": ("hybridrec.benchmarks.speedups", "each strategy's samples/s against its paper's baseline on loopback and "
                 "on emulated hosts where the baseline is link-bound; the cost model's error (--calibration)"),
}
JSON_HELP = ("print the final metrics (final_metrics.json) as one JSON line instead of the summary; the "
             "other lines go to stderr")
# `hybridrec bench` commands that measure nothing
BENCH_TOOLS = {
    "report": ("hybridrec.benchmarks.report", "rewrite docs/benchmarks.md's results table from docs/results/"),
}


def _say(args, text: str) -> None:
    """A line for the reader: stdout, or stderr when --json keeps stdout for the JSON."""
    print(text, file=sys.stderr if getattr(args, "json", False) else sys.stdout, flush=True)


def _finished(args, command: str, result: dict, output_dir: str) -> None:
    """The end of a training command: the summary (hybridrec.train.summary), or with --json the
    final metrics as one JSON line."""
    from hybridrec.train.reporting import json_text
    from hybridrec.train.summary import summary_lines

    if args.json:
        print(json_text(result))
    else:
        print("\n".join(summary_lines(command, result, output_dir)))
    if result.get("count") == 0:
        print(f"hybridrec {command}: warning: the test set is empty, so the metrics are nan; check data.test_path, "
              "data.train_rows (it may cover every row) or data.test_fraction", file=sys.stderr)


def _final_metrics(output_dir) -> dict:
    from pathlib import Path

    return json.loads((Path(output_dir) / "final_metrics.json").read_text())


def cmd_train(args) -> int:
    from hybridrec.config import load_config
    from hybridrec.train.summary import start_line

    cfg = load_config(args.config, args.set)
    if cfg.strategy.distributed:
        return _train_distributed(args, cfg)
    from hybridrec.train.trainer import train

    _say(args, start_line("train", cfg.strategy.record(), trainers=1))
    result = train(cfg, resume=args.resume, overwrite=args.overwrite)
    _finished(args, "train", result, cfg.train.output_dir)
    return 0


def _train_distributed(args, cfg) -> int:
    """A distributed strategy's roles started on this machine, as `hybridrec launch` would."""
    from hybridrec.parallel.launch import launch
    from hybridrec.parallel.roles import command_line, role_counts
    from hybridrec.train.summary import start_line

    counts = role_counts(cfg)
    _say(args, f"{start_line('train', cfg.strategy.record(), counts['trainers'])}: runs as several processes; "
               f"starting them here: {command_line(args.config, counts, args.set)}"
               f"{' --no-job-key' if args.no_job_key else ''}")
    code = launch(args.config, **counts, overrides=args.set, resume=args.resume, overwrite=args.overwrite,
                  job_key=not args.no_job_key, out=sys.stderr if args.json else None)
    if code == 0:
        _finished(args, "train", _final_metrics(cfg.train.output_dir), cfg.train.output_dir)
    return code


def cmd_eval(args) -> int:
    from hybridrec.config import load_config
    from hybridrec.errors import UserError
    from hybridrec.train.checkpoint import config_for_checkpoint
    from hybridrec.train.evaluation import checkpoint_directory, evaluate_checkpoint
    from hybridrec.train.reporting import json_text
    from hybridrec.train.summary import eval_lines, start_line

    if args.config is None and args.set:
        raise UserError("--set changes a config file: give the config too, or leave --set out to use "
                        "the config saved with the checkpoint")
    cfg = None if args.config is None else load_config(args.config, args.set)
    cfg = config_for_checkpoint(checkpoint_directory(args.checkpoint), cfg, args.config or "the config")
    _say(args, start_line("eval", cfg.strategy.record()) + f" (the checkpoint's), test data {_test_data(cfg)}")
    result = {**evaluate_checkpoint(cfg, args.checkpoint, config_name=args.config or "the config"),
              "strategy": cfg.strategy.record()}
    print(json_text(result) if args.json else "\n".join(eval_lines(result)))
    if args.predictions is not None:
        from hybridrec.serving.predict_file import checkpoint_predictions

        written = checkpoint_predictions(cfg, args.checkpoint, args.predictions)
        print(f"hybridrec eval: wrote the scores of {written['rows']} test rows to {args.predictions}", file=sys.stderr)
    return 0


def _test_data(cfg) -> str:
    """Where a config's test rows come from, in a few words."""
    data = cfg.data
    if data.test_path:
        return str(data.test_path)
    if data.format == "synthetic":
        return "synthetic rows of the planted model"
    return f"rows held out of {data.path}"


def cmd_export(args) -> int:
    from hybridrec.config import load_config
    from hybridrec.serving.export import export

    cfg = None if args.config is None else load_config(args.config, args.set)
    path = export(args.source, args.out, precision=args.precision, config=cfg, config_name=args.config or "the config")
    print(f"hybridrec export: wrote bundle {path} ({args.precision})")
    return 0


def cmd_predict(args) -> int:
    from hybridrec.bundle.chain import resolve
    from hybridrec.bundle.format import read_manifest
    from hybridrec.serving.predict_file import predict_file
    from hybridrec.train.summary import start_line

    manifest = read_manifest(resolve(args.bundle, args.version))
    _say(args, start_line("predict", manifest.get("strategy", {})) + f" (the bundle's: {manifest.get('source')})")
    done = predict_file(args.bundle, args.data, args.out, version=args.version, strict=args.strict)
    if args.json:
        print(json.dumps({**done, "out": args.out}))
    else:
        print(f"hybridrec predict: {done['rows']} rows ({done['scored']} scored, {done['bad_rows']} bad) with version "
              f"{done['version']} -> {args.out}")
    return 0


def cmd_serve(args) -> int:
    from hybridrec.serving.server import main as serve_main

    return serve_main(args)


def cmd_data_synth(args) -> int:
    from hybridrec.data import criteo_like, write_synthetic

    overrides = {k: v for k, v in (("vocab_size", args.vocab_size), ("zipf_exponent", args.zipf_exponent)) if v is not None}
    write_synthetic(args.out, args.rows, seed=args.seed, config=criteo_like(**overrides))
    print(f"wrote {args.rows} Criteo-format rows to {args.out} (seed {args.seed})")
    return 0


def cmd_data_stream(args) -> int:
    from hybridrec.data.stream.producer import file_lines, parse_rate, produce, synthetic_lines
    from hybridrec.errors import UserError

    if (args.source is None) == (args.synthetic is None):
        raise UserError("hybridrec data stream: give --from FILE or --synthetic N (one of them)")
    lines = (file_lines(args.source, args.skip_header) if args.source is not None
             else synthetic_lines(args.synthetic, seed=args.seed, first_row=args.first_row))
    produced = produce(args.to, lines, parse_rate(args.rate), field_name=args.field, maxlen=args.maxlen)
    print(f"wrote {produced.count} entries to {args.to} in {produced.seconds:.2f} s"
          + (f" (IDs {produced.first_id} .. {produced.last_id})" if produced.count else ""))
    return 0


def cmd_models(args) -> int:
    from hybridrec.models import describe_models

    print("Models (model.name) and their hyper-parameters (model.hparams) with defaults:")
    print(describe_models())
    print("A model of your own: model.name 'package.module:Factory' (or 'path/to/file.py:Factory'), called as "
          "Factory(inputs, **model.hparams); model.loss likewise (docs/python-api.md)")
    return 0


def cmd_bench(args) -> int:
    import importlib

    from hybridrec.benchmarks.results import record_bench, split_record_flag

    if args.name in BENCH_TOOLS:
        return importlib.import_module(BENCH_TOOLS[args.name][0]).main(args.rest)
    module = importlib.import_module(BENCHMARKS[args.name][0])
    arguments, label = split_record_flag(args.rest)
    report = module.main(arguments)
    if label is not None:
        path = record_bench(args.name, module, arguments, report, label)
        print(f"hybridrec bench: recorded {path}; `hybridrec bench report` puts it in docs/benchmarks.md",
              file=sys.stderr)
    return 0


def cmd_server_role(args) -> int:
    """serve-ps, embedding-worker, group-ps: the server role's own entry (hybridrec.parallel.roles)."""
    from hybridrec.parallel.roles import server_role

    return server_role(args.command).run(args.rest)


def cmd_launch(args) -> int:
    from hybridrec.parallel import emulated_hosts
    from hybridrec.parallel.launch import launch
    from hybridrec.parallel.roles import check_config, role_counts
    from hybridrec.train.summary import start_line

    try:
        cfg = check_config(args.config, args.set)
        trainers = role_counts(cfg, args.ps, args.embedding_workers, args.trainers)["trainers"]
        _say(args, start_line("launch", cfg.strategy.record(), trainers))
        code = launch(args.config, ps=args.ps, embedding_workers=args.embedding_workers, trainers=args.trainers,
                      overrides=args.set, host=args.host, resume=args.resume, overwrite=args.overwrite,
                      max_restarts=args.max_restarts, role_restarts=args.role_restarts, timeout=args.timeout,
                      emulation=emulated_hosts.from_arguments(args), job_key=not args.no_job_key,
                      out=sys.stderr if args.json else None, ray=args.ray)  # ray: the roles on a Ray cluster
    except ValueError as exc:  # bad counts or flags (ConfigError is one too, reported the same way)
        print(f"hybridrec launch: error: {exc}", file=sys.stderr)
        return 2
    if code == 0:
        _finished(args, "launch", _final_metrics(cfg.train.output_dir), cfg.train.output_dir)
    return code


def cmd_scale(args) -> int:
    from hybridrec.parallel.scale import scale

    status = scale(args.run, args.ps)
    print(json.dumps(status) if args.json else
          f"hybridrec scale: {len(status['servers'])} PS servers ({', '.join(status['servers'])}), routing version "
          f"{status['version']}; {status['buckets_moved']} buckets and {status['bytes_moved']} bytes moved so far, "
          f"longest pause {status['longest_pause_s']:.3f}s")
    return 0


def cmd_calibrate(args) -> int:
    from hybridrec.costs.calibrate import calibrate, write

    if args.configs:
        jobs = [(config, args.set) for config in args.configs]
    else:
        from hybridrec.benchmarks.speedups import calibration_jobs

        jobs = calibration_jobs()
    calibration = calibrate(jobs, args.repeats)
    path = write(calibration, args.out)
    print(json.dumps(calibration) if args.json else
          f"calibration: {path}\n  kernel {calibration['kernel']['s_per_key'] * 1e9:.0f} ns per key; round trip "
          f"{calibration['transport']['round_trip_s'] * 1e6:.0f} us ({calibration['transport']['round_trip_cpu_s'] * 1e6:.0f}"
          f" us of CPU); transport {calibration['transport']['bytes_per_s'] / 1e6:.0f} MB per CPU second; "
          f"{calibration['machine']['cores']} cores\n"
          + "\n".join(f"  {c}: dense {d['s_per_sample'] * 1e6:.1f} us per sample + {d['s_per_step'] * 1e3:.2f} ms "
                      f"per step (batch {d['batch_size']}); a local step {d['local_s_per_sample'] * 1e6:.1f} us per sample"
                      for c, d in calibration["dense"].items()))
    return 0


def cmd_plan(args) -> int:
    from hybridrec.config import load_config
    from hybridrec.hierarchical.operator_placement import plan_for_config

    plan = plan_for_config(load_config(args.config, args.set), args.group_ps)
    print(json.dumps(plan.to_json()) if args.json else plan.format())
    return 0


def _add_job_key_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-job-key", action="store_true",
                        help="distributed jobs: serve without the job key that every role otherwise gets, new per "
                             "job (loopback only; any local user can then call the servers: see docs/distributed.md, "
                             "Security)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybridrec", description="Train CTR models whose embeddings outgrow one machine.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train a model from a YAML config", description="Train a model from a YAML job config.")
    p.add_argument("config", help="YAML job file (see configs/)")
    again = p.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in train.output_dir")
    again.add_argument("--overwrite", action="store_true",
                       help="start over in a train.output_dir that holds an earlier run (deletes its checkpoints)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set train.max_steps=100 (repeatable)")
    _add_job_key_argument(p)
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("eval", help="evaluate a checkpoint on the test data",
                       description="Evaluate a checkpoint with the config saved in it, or with CONFIG (which must "
                                   "build the same model: its data, say, may differ).")
    p.add_argument("config", nargs="?", help="YAML job file (default: the config saved with the checkpoint)")
    p.add_argument("--checkpoint", required=True, help="a step-N checkpoint directory or a run's output_dir")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--predictions", metavar="FILE", help="also write the test rows' scores to this CSV (header "
                   "`score`, or `score_<task>` per task; one line per test row, in order), as `hybridrec predict` "
                   "writes them")
    p.add_argument("--json", action="store_true", help="print the metrics as one JSON line instead of the summary")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("export", help="write a checkpoint of any strategy as an inference bundle",
                       description="Write a training checkpoint (local, persia, het, picasso, des or ht) as a "
                       "self-contained bundle: each table's keys and weights, the dense model, the feature pipeline "
                       "and a manifest (see docs/serving.md).")
    p.add_argument("source", metavar="RUN_OR_CHECKPOINT", help="a run's output_dir (its latest checkpoint) or a step-N "
                   "checkpoint directory")
    p.add_argument("--out", required=True, metavar="BUNDLE", help="the bundle directory to write (must not exist)")
    p.add_argument("--precision", choices=["fp32", "fp16", "int8"], default="fp32",
                   help="the tables' weights: fp32 as trained, fp16, or int8 row-wise (a scale and bias per row)")
    p.add_argument("--config", help="YAML job file building the same model (default: the config saved with the "
                   "checkpoint)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("predict", help="score a data file with a bundle",
                       description="Score every row of a data file in the training data's format (the label "
                       "column may be empty or absent) in constant memory; the CSV has a header (`score`, or "
                       "`score_<task>` per task) and one line per data row, in order (rows that cannot be parsed "
                       "get an empty score and are reported).")
    p.add_argument("bundle", metavar="BUNDLE", help="a bundle directory, or a directory of published versions")
    p.add_argument("--data", required=True, metavar="FILE", help="the rows to score")
    p.add_argument("--out", required=True, metavar="PREDICTIONS.csv")
    p.add_argument("--version", type=int, metavar="V", help="in a directory of versions: this one (default: the newest)")
    p.add_argument("--strict", action="store_true", help="the first row that cannot be parsed is an error")
    p.add_argument("--json", action="store_true", help="print the counts as one JSON line")
    p.set_defaults(func=cmd_predict)

    from hybridrec.serving.options import add_serve_arguments

    p = sub.add_parser("serve", help="serve a bundle over HTTP (POST /predict)",
                       description="Serve a bundle, or the newest version of a directory of published versions "
                       "(followed as new ones appear), over HTTP: POST /predict, GET /health, /version, /metrics, "
                       "POST /rollback. Needs hybridrec[serve]; --ray runs it as a Ray Serve deployment "
                       "(hybridrec[ray]).")
    add_serve_arguments(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("data", help="data utilities", description="Data utilities.")
    dsub = p.add_subparsers(dest="data_command", required=True)
    s = dsub.add_parser("synth", help="write a synthetic Criteo-format TSV with a planted model",
                        description="Write synthetic Criteo-format rows (label, I1..I13, C1..C26) to a TSV file.")
    s.add_argument("--out", required=True, help="output .tsv path")
    s.add_argument("--rows", type=int, default=100_000)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--vocab-size", type=int, default=None, help="distinct IDs per field")
    s.add_argument("--zipf-exponent", type=float, default=None)
    s.set_defaults(func=cmd_data_synth)
    s = dsub.add_parser("stream", help="write records into a Redis stream (one entry per line)",
                        description="Write the lines of a data file, or synthetic Criteo-format rows with a planted "
                                    "model, into a Redis stream as entries {line: ...}: what data.stream.backend "
                                    "redis reads. Needs the Redis client: pip install 'hybridrec[stream]'.")
    s.add_argument("--to", required=True, metavar="redis://HOST:PORT/STREAM", help="the stream (created if absent)")
    s.add_argument("--from", dest="source", metavar="FILE", help="a text data file: one entry per non-blank line")
    s.add_argument("--skip-header", action="store_true", help="the file's first line is a header: not written")
    s.add_argument("--synthetic", type=int, metavar="N", help="write N synthetic Criteo-format rows instead")
    s.add_argument("--seed", type=int, default=0, help="--synthetic: the planted model's seed")
    s.add_argument("--first-row", type=int, default=0, help="--synthetic: the generator's first row")
    s.add_argument("--rate", metavar="N/s", help="at most N entries per second (default: as fast as Redis takes them)")
    s.add_argument("--field", default="line", help="the entry field holding the line (data.stream.line_field)")
    s.add_argument("--maxlen", type=int, help="trim the stream to about this many entries as it grows")
    s.set_defaults(func=cmd_data_stream)

    p = sub.add_parser("models", help="list the models and their hyper-parameters with defaults",
                       description="Print every model (model.name) with its hyper-parameters (model.hparams), "
                       "their defaults and what they do.")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("calibrate", help="measure this machine's per-operation costs for the throughput cost model",
                       description="Time the dense models of job configs, the embedding kernels and the PS transport "
                       "on this machine and write them to a calibration file, which `hybridrec bench speedups "
                       "--calibration FILE` predicts every run from (hybridrec.costs).")
    p.add_argument("configs", nargs="*", help="job configs whose dense models to time (default: those of bench "
                   "speedups' jobs, with their overrides)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    p.add_argument("--repeats", type=int, default=5, help="timings per measurement, their median (default 5)")
    p.add_argument("--out", default="calibration.json", help="the calibration file (default calibration.json)")
    p.add_argument("--json", action="store_true", help="print the calibration as one JSON line")
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("plan", help="print where Hierarchical Training places the dense model's operators",
                       description="Place the dense model's operators on a group's trainers and group PSs "
                       "(strategy.ht.group_ps) with the cost model of strategy.ht.plan: rule-based tags, then "
                       "greedy refinement; prints module -> device, each device's utilisation and the bottleneck.")
    p.add_argument("config", help="YAML job file")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set strategy.ht.group_ps=2 (repeatable)")
    p.add_argument("--group-ps", type=int, metavar="P", help="group PSs per group to plan for (default: "
                   "strategy.ht.group_ps; with 0 every operator stays on the trainers)")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON line")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("bench", help="benchmarks against peers", description="Benchmarks; each prints ratios "
                       "against peers measured in the same run. Options after the name go to the benchmark "
                       "(e.g. hybridrec bench embedding --help), and --record[=LABEL] among them writes the "
                       "result to docs/results/NAME[-LABEL].json (see docs/benchmarks.md, Adding a result).")
    p.add_argument("name", choices=sorted({**BENCHMARKS, **BENCH_TOOLS}),
                   help="; ".join(f"{k}: {v[1]}" for k, v in {**BENCHMARKS, **BENCH_TOOLS}.items()))
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_bench)

    # every option after serve-ps belongs to the server's own parser (see main)
    p = sub.add_parser("serve-ps", help="run an embedding parameter-server process", add_help=False,
                       description="Run an embedding PS server (options: hybridrec serve-ps --help).")
    p.set_defaults(func=cmd_server_role, rest=[])

    # likewise, every option after embedding-worker belongs to the worker's own parser
    p = sub.add_parser("embedding-worker", help="run a Persia embedding-worker process", add_help=False,
                       description="Run an embedding worker (options: hybridrec embedding-worker --help).")
    p.set_defaults(func=cmd_server_role, rest=[])

    # and after group-ps, the group PS's own
    p = sub.add_parser("group-ps", help="run a Hierarchical Training group PS process", add_help=False,
                       description="Run a group PS (options: hybridrec group-ps --help).")
    p.set_defaults(func=cmd_server_role, rest=[])

    p = sub.add_parser("launch", help="run every role of a distributed job on this machine",
                       description="Start N PS servers, E embedding workers and K trainers (under torchrun) "
                       "for a config whose strategy places embeddings on PS servers (e.g. strategy.preset: "
                       "persia); counts not given come from strategy.roles; restart PS servers and embedding "
                       "workers that "
                       "die; stop everything and delete the job's shared memory when the job ends. Exit code: "
                       "0 done, 1 a role failed, 2 bad arguments, 124 --timeout, 130 interrupted.")
    p.add_argument("config", help="YAML job file with a distributed strategy (e.g. strategy.preset: persia)")
    p.add_argument("--ps", type=int, metavar="N", help="embedding PS servers (default: strategy.roles.ps_servers)")
    p.add_argument("--embedding-workers", type=int, metavar="E",
                   help="embedding workers; 0: trainers talk to the PS directly (default: strategy.roles)")
    p.add_argument("--trainers", "--nn-workers", dest="trainers", type=int, metavar="K",
                   help="trainer processes under torchrun (default: strategy.roles.trainers)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value in every role, e.g. --set train.max_steps=100 (repeatable)")
    again = p.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true", help="trainers continue from the latest checkpoint")
    again.add_argument("--overwrite", action="store_true", help="start over in a train.output_dir holding a run")
    p.add_argument("--max-restarts", type=int, default=0, metavar="R", help="torchrun's restarts of the trainers")
    p.add_argument("--role-restarts", type=int, default=3, metavar="M",
                   help="restarts of each PS server and embedding worker before the job fails (default 3)")
    p.add_argument("--host", default="127.0.0.1", help="interface the PS servers and embedding workers bind")
    _add_job_key_argument(p)
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help="stop the whole job after this long (exit code 124); default: no limit")
    p.add_argument("--ray", metavar="ADDRESS",
                   help="place the roles on the Ray cluster at ADDRESS (HOST:6379 of its head) or `auto` "
                        "(the Ray instance on this machine, started if none runs); needs hybridrec[ray]; each "
                        "role asks Ray for strategy.resources")
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    from hybridrec.parallel.emulated_hosts import add_arguments as add_emulation_arguments

    add_emulation_arguments(p)
    p.set_defaults(func=cmd_launch)

    p = sub.add_parser("scale", help="add or remove PS servers of a job running under hybridrec launch (also --ray)",
                       description="Ask the launcher of the job running in RUN (its train.output_dir) for N PS "
                       "servers: new ones start and buckets of embeddings move to them, or off the last ones, "
                       "which stop, while the job trains (docs/distributed.md, Elastic PS servers).")
    p.add_argument("run", metavar="RUN", help="the job's train.output_dir (its launcher writes control.json there)")
    p.add_argument("--ps", type=int, required=True, metavar="N", help="PS servers the job should have")
    p.add_argument("--json", action="store_true", help="print the launcher's status as one JSON line")
    p.set_defaults(func=cmd_scale)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command in ("serve-ps", "embedding-worker", "group-ps"):
        args.rest = extra  # argparse's REMAINDER does not take leading options such as --port
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    from hybridrec.errors import UserError

    if args.command not in ("bench", "data", "models", "plan"):
        from hybridrec.kernel_cache import announce_compilation

        announce_compilation(f"hybridrec {args.command}")
    try:
        return args.func(args)
    except (UserError, FileNotFoundError, FileExistsError) as exc:
        print(f"hybridrec {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if args.command == "train":
            print("hybridrec train: interrupted; `hybridrec train CONFIG --resume` continues from the latest "
                  "checkpoint (train.checkpoint_every sets how often they are written)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
