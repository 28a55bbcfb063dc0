"""`hybridrec bench speedups`: each strategy's samples/s against its paper's baseline, on loopback
and on emulated hosts at a link rate where the baseline is link-bound, with the cost model's
prediction of every run beside it.

Pairs (strategy against baseline, the same config, data and seed, 2 trainers; each job a
`hybridrec launch` through `hybridrec.benchmarks.hybrid.run_job`, the runner the other benches use):
  het      HET at s = 100 with its 10% LFU cache (`bench het`'s het_s100) against no cache
           (`bench het`'s no_cache: every step fetches and pushes every row), 2 PS servers;
  hybrid   Persia's hybrid (bounded staleness, dense allreduce) against sync (`bench hybrid`'s
           disciplines), 2 PS servers and 1 embedding worker;
  picasso  the picasso preset as a user gets it (packing, HybridHash; interleaving auto) against
           plain sharding (`bench picasso`'s sharded: one AllToAll round per table);
  des      DES (the des preset: no servers) against the PS (`bench des`'s ps_async: Persia's async
           discipline, 2 PS servers, 1 embedding worker);
  ht       Hierarchical Training (one group of the trainers: `bench ht`'s ht_1x2) against EASGD
           (a dense replica per trainer), 1 PS server and 1 embedding worker.
Each pair runs `--runs` times on loopback and `--runs` times on `--emulate-hosts` hosts at
`--bandwidth` (one role per host unless fewer hosts are given; HET's pair as HET's cluster A is
laid out, its trainers on one host, whose dense AllReduce then stays inside it as the GPU workers'
does over PCIe, and each PS server on a host of its own), the baseline and the strategy
alternating; a ratio is the median of the runs' paired ratios (strategy / baseline samples/s).
Before them, every side's job runs once for 2 steps, untimed, on loopback (`--no-warmup` skips
it), so that no timed job compiles the kernels. With `--ray ADDRESS` every job runs on that Ray
cluster as `hybridrec launch --ray` runs it; with `--ray auto --emulate-hosts N`, each
emulated-host job on a Ray cluster of its own across the hosts (a head node and a worker node
per host; Ray, not the bench, places the roles). Each run also records the cores other work on
the machine took over the job's life and while it trained (hybridrec.costs.machine; not measured
for Ray's roles, which are not the bench's children); the cost model's prediction of that run
leaves the latter to other work.
Link-bound is shown by the baseline's payload on its busiest link: its embedding bytes per sample
times samples/s, over the hosts that share the busiest hop (the embedding worker's link carries
all of Persia's payload; the trainers' links share HET's and the sharded placements'), against
the shaped rate (dense allreduce traffic comes on top; it is not counted).

With `--calibration FILE` (`hybridrec calibrate`'s) every run is also predicted by the cost model
(`hybridrec.costs.model`) and the median absolute error of the predictions is reported, and the
papers' own clusters are projected. `--reevaluate RESULT --calibration FILE` runs no job: it
predicts the runs a recorded result holds (after a change of the model or a new calibration).

`--json` prints one line: {"loopback": {"het": r, "hybrid": r, "picasso": r, "des": r, "ht": r},
"link_bound": {"rate": "...", "het": r, ...}, "projection": {"median_abs_error": e, "papers": {...}},
"runs": {...}}.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hybridrec.benchmarks import des as des_bench
from hybridrec.benchmarks import ht as ht_bench
from hybridrec.benchmarks import picasso as picasso_bench
from hybridrec.benchmarks.het import STALENESS
from hybridrec.benchmarks.hybrid import DISCIPLINES, JobFailed, add_ray_argument, check_ray, run_job
from hybridrec.benchmarks.results import pick
from hybridrec.benchmarks.timing import positive_int
from hybridrec.costs.machine import MachineUse
from hybridrec.costs.model import collectives_per_step, job_of

STRATEGIES = ("het", "hybrid", "picasso", "des", "ht")
HET_DIRECT = ["strategy.preset=het", "strategy.dense=allreduce"]
TARGETS = {"loopback": {name: 0.95 for name in STRATEGIES},
           "link_bound": {"het": 2.0, "hybrid": 1.3, "picasso": 1.3, "des": 2.0, "ht": 1.0}}
# every job's data and length: 12 steps per trainer (HET, at batch 128: 48), about 12k samples a
# job, so that the bench's 20 jobs per run end within minutes on 2 shared cores even where a link
# binds; a first lookup over a slow link on shared cores can take long
SAMPLE_EVERY = 0.25  # seconds between samples of the machine's use while a job runs
SIZE = ["data.synthetic.train_rows=16384", "data.synthetic.test_rows=4096", "train.max_steps=12",
        "strategy.request_timeout=300"]


@dataclass(frozen=True)
class Side:
    """One job of a pair: its overrides, its roles, how many hosts share its busiest hop, and on
    emulated hosts whether its trainers share one host with every server on a host of its own
    (else one role per host)."""

    overrides: list
    ps: int | None
    embedding_workers: int | None
    busiest_share: int  # hosts whose links carry the counted payload side by side
    trainers_together: bool = False


@dataclass(frozen=True)
class Pair:
    config: str
    baseline: Side
    strategy: Side
    claim: str  # what the paper says the strategy buys
    extra: list = field(default_factory=list)  # overrides of both sides


def pairs() -> dict[str, Pair]:
    het_s100 = [*HET_DIRECT, "strategy.consistency=het", f"strategy.het.staleness={STALENESS['s100']}"]
    easgd, ht = (ht_bench.variants(2, [1])[name] for name in ("easgd_2", "ht_1x2"))
    return {
        # HET's cluster A: the GPU workers' dense AllReduce runs inside their node (PCIe), and the
        # embeddings cross the 1 Gbit/s Ethernet to the CPU servers (HET §5)
        "het": Pair("configs/het_synthetic.yaml", Side([*HET_DIRECT, "strategy.consistency=sync"], 2, 0, 1, True),
                    Side(het_s100, 2, 0, 1, True), "HET: the cache cuts communication, 1.37-20.68x over the baselines",
                    extra=["train.max_steps=48"]),
        "hybrid": Pair("configs/persia_synthetic.yaml", Side(DISCIPLINES["sync"], 2, 1, 1),
                       Side(DISCIPLINES["hybrid"], 2, 1, 1), "Persia Fig. 7: hybrid up to 7.12x over sync"),
        "picasso": Pair("configs/picasso_synthetic.yaml", Side(picasso_bench.ABLATION["sharded"], None, None, 2),
                        Side(["strategy.preset=picasso"], None, None, 2),
                        "PICASSO Fig. 13: packing, interleaving and caching 1.9-10x over plain model parallelism",
                        # the hot rows chosen after the 4th step
                        extra=["data.batch_size=512", "strategy.picasso.warmup_iters=4",
                               "strategy.picasso.flush_iters=4"]),
        "des": Pair("configs/des_synthetic.yaml", Side(des_bench.PS_ASYNC, 2, 1, 1),
                    Side(["strategy.preset=des"], None, None, 2),
                    "DES Table 3: 1.1-2.4x the PS's throughput (68.7% fewer bytes)",
                    extra=["data.synthetic.n_multi_hot=26"]),  # 52 tables, not 200: a PS lookup of 200 is slow here
        "ht": Pair("configs/persia_synthetic.yaml", Side(easgd, 1, 1, 1), Side(ht, 1, 1, 1),
                   "Hierarchical Training: at least EASGD's throughput at better loss"),
    }


DESCRIPTION = ("Each strategy's samples/s against its paper's baseline (HET / no cache, Persia hybrid / sync, "
               "PICASSO / plain sharded, DES / PS, HT / EASGD) on loopback and on emulated hosts at a link rate "
               "where the baseline is link-bound; medians of paired ratios.")


def calibration_jobs() -> list[tuple[str, list[str]]]:
    """(config, overrides) of every pair's dense model: what `hybridrec calibrate` times."""
    seen = {}
    for pair in pairs().values():
        seen.setdefault((pair.config, tuple(pair.extra)), None)
    return [(config, list(extra)) for config, extra in seen]


def build_parser() -> argparse.ArgumentParser:
    from hybridrec.parallel.emulated_hosts import add_arguments

    parser = argparse.ArgumentParser(prog="hybridrec bench speedups", description=DESCRIPTION)
    for flag, options in (
            ("--strategies", {"default": ",".join(STRATEGIES), "help": f"subset of {','.join(STRATEGIES)}"}),
            ("--runs", {"type": positive_int, "default": 3, "help": "jobs per side and setting (default 3)"}),
            ("--trainers", {"type": positive_int, "default": 2, "help": "trainers of every job (default 2)"}),
            ("--set", {"action": "append", "default": [], "metavar": "KEY=VALUE",
                       "help": "config override for every job, after the bench's own sizes (repeatable)"}),
            ("--no-loopback", {"action": "store_true", "help": "only the emulated-host runs"}),
            ("--no-warmup", {"action": "store_true",
                             "help": "skip the untimed 2-step job of every side that compiles the kernels first"}),
            ("--calibration", {"metavar": "FILE", "help": "`hybridrec calibrate`'s file: predict every run"}),
            ("--reevaluate", {"metavar": "RESULT", "action": "append",
                              "help": "run no job: predict the runs of a recorded result (a docs/results/speedups*.json "
                                      "file or this bench's --json line) with --calibration; repeatable (each "
                                      "strategy's runs of a setting from the last file that has them)"}),
            ("--timeout", {"type": float, "default": 900.0, "help": "seconds per job (default 900)"}),
            ("--keep", {"metavar": "DIR", "help": "keep the jobs' output directories under DIR"}),
            ("--verbose", {"action": "store_true", "help": "show the launcher's output of every job"}),
            ("--json", {"action": "store_true", "help": "print one JSON line"})):
        parser.add_argument(flag, **options)
    add_arguments(parser)
    add_ray_argument(parser)
    parser.set_defaults(emulate_hosts=None, bandwidth=None)
    return parser


def _log(text: str) -> None:
    print(f"[bench speedups] {text}", file=sys.stderr, flush=True)


def side_job(args, pair: Pair, side: Side, label: str, output_dir: Path, emulation, extra: tuple = ()) -> dict:
    """One launch of one side of a pair (`extra`: overrides after every other); its final metrics."""
    job = argparse.Namespace(config=pair.config, set=[*SIZE, *pair.extra, *args.set, *extra], ps=side.ps,
                             embedding_workers=side.embedding_workers, trainers=args.trainers,
                             timeout=args.timeout, verbose=args.verbose, ray=args.ray)
    return run_job(job, label, side.overrides, output_dir, emulation)


def roles_of(side: Side, trainers: int) -> int:
    """Processes of one job: the trainers and the servers it is given (presets without servers
    run the trainers alone)."""
    return trainers + (side.ps or 0) + (side.embedding_workers or 0)


def emulation_for(args, side: Side):
    """The emulated hosts of one job: --emulate-hosts hosts (roles round-robin); without it one
    host per role, or for a side whose trainers go together, their host and one per server."""
    from hybridrec.parallel.emulated_hosts import MAX_HOSTS, HostEmulation, parse_rate

    rate, latency = parse_rate(args.bandwidth), (args.latency or 0.0)
    if args.emulate_hosts:
        return HostEmulation(args.emulate_hosts, rate, latency, {})
    if side.trainers_together:
        servers = [f"ps{i}" for i in range(side.ps or 0)] + [f"ew{i}" for i in range(side.embedding_workers or 0)]
        place = {**{f"trainer{k}": 0 for k in range(args.trainers)},
                 **{server: host for host, server in enumerate(servers, start=1)}}
        return HostEmulation(1 + len(servers), rate, latency, place)
    return HostEmulation(min(roles_of(side, args.trainers), MAX_HOSTS), rate, latency, {})


def figures_of(metrics: dict, side: Side) -> dict:
    rate = metrics.get("train_samples_per_s")
    per_sample = metrics.get("bytes_per_sample")
    busiest = 8 * per_sample * rate / side.busiest_share if rate and per_sample is not None else None
    return {"samples_per_s": rate, "bytes_per_sample": per_sample, "busiest_link_bits_per_s": busiest,
            "auc": metrics.get("auc"), "interleaving": (metrics.get("interleaving") or {}).get("why"),
            "collectives_per_step": collectives_per_step(metrics)}


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def warm_up(args, names: list[str], root: Path) -> None:
    """Every side's job once, 2 steps on loopback, untimed: numba compiles the kernels a job uses
    on their first use after any source change (then keeps them per source version), which would
    otherwise land in the first timed job of each kind."""
    every, here = pairs(), argparse.Namespace(**{**vars(args), "ray": None})  # this machine's kernels
    for name in names:
        for which in ("baseline", "strategy"):
            side_job(here, every[name], getattr(every[name], which), f"{name} {which} (warm-up)",
                     root / f"{name}-{which}-warmup", None, ("train.max_steps=2",))
    _log(f"warm-up done: {2 * len(names)} jobs of 2 steps")


def model_jobs(name: str, runs: dict, trainers: int, overrides: list[str], recorded: dict | None = None) -> dict:
    """{side: the cost model's Job fields} of a pair's runs (their median payload and collectives);
    `recorded`: the jobs a result recorded, whose hosts' layout (busiest_share, dense_on_link) the
    runs were taken on."""
    pair = pairs()[name]
    jobs = {}
    for which in ("baseline", "strategy"):
        side = getattr(pair, which)
        layout = {"busiest_share": side.busiest_share, "dense_on_link": not side.trainers_together}
        if recorded:
            layout = {key: recorded[which].get(key, default) for key, default in
                      (("busiest_share", side.busiest_share), ("dense_on_link", True))}
        jobs[which] = asdict(job_of(pair.config, [*SIZE, *pair.extra, *overrides, *side.overrides], pair.extra, name,
                                    which, trainers, _median([r["bytes_per_sample"] for r in runs[which]]),
                                    layout["busiest_share"], side.ps, side.embedding_workers,
                                    _median([r["collectives_per_step"] for r in runs[which]]),
                                    dense_on_link=layout["dense_on_link"]))
    return jobs


def run_setting(args, names: list[str], root: Path, emulated: bool) -> dict:
    """{strategy: {"ratio": median paired ratio, "baseline": [runs], "strategy": [runs]}}."""
    out = {}
    every = pairs()
    for name in names:
        pair = every[name]
        runs = {"baseline": [], "strategy": []}
        for run in range(args.runs):
            for which in ("baseline", "strategy"):
                side = getattr(pair, which)
                emulation = emulation_for(args, side) if emulated else None
                tag = f"{name}-{which}-{'emulated' if emulated else 'loopback'}-run{run}"
                # a Ray cluster's roles are not our children
                with MachineUse(counts_job=args.ray is None, sample_every=SAMPLE_EVERY) as use:
                    metrics = side_job(args, pair, side, f"{name} {which}", root / tag, emulation)
                figures = figures_of(metrics, side)
                figures["hosts"] = emulation.hosts if emulation else None
                use_figures = use.figures(metrics.get("training_window"))
                figures["background_cores"] = use_figures["background_cores"]
                figures["training_background_cores"] = use_figures["training_background_cores"]
                runs[which].append(figures)
                other = figures["training_background_cores"]
                _log(f"{tag}: samples/s {figures['samples_per_s'] or 0:.0f} bytes/sample "
                     f"{figures['bytes_per_sample'] or 0:.0f}"
                     + (f" busiest link {figures['busiest_link_bits_per_s'] / 1e6:.1f} Mbit/s"
                        if figures["busiest_link_bits_per_s"] else "")
                     + (f"; other work took {other:.2f} cores while it trained" if other is not None else ""))
        ratios = [s["samples_per_s"] / b["samples_per_s"] for b, s in zip(runs["baseline"], runs["strategy"])
                  if s["samples_per_s"] and b["samples_per_s"]]
        out[name] = {"ratio": _median(ratios), "ratios": ratios, "claim": pair.claim,
                     "jobs": model_jobs(name, runs, args.trainers, args.set),
                     "baseline_busiest_link_bits_per_s": _median([b["busiest_link_bits_per_s"]
                                                                  for b in runs["baseline"]]),
                     **runs}
    return out


def report(loopback: dict, link: dict, rate: str | None, projection: dict | None) -> dict:
    from hybridrec.parallel.emulated_hosts import parse_rate

    out = {"loopback": {n: r["ratio"] for n, r in loopback.items()},
           "link_bound": {"rate": rate, **{n: r["ratio"] for n, r in link.items()}},
           "projection": projection or {}, "runs": {"loopback": loopback, "link_bound": link}}
    if rate:
        shaped = parse_rate(rate)
        out["link_bound"]["baseline_link_use"] = {
            n: (r["baseline_busiest_link_bits_per_s"] / shaped if r["baseline_busiest_link_bits_per_s"] else None)
            for n, r in link.items()}
    out["targets"] = {setting: {n: (out[setting][n] is not None and out[setting][n] >= t)
                                for n, t in TARGETS[setting].items() if n in out[setting]}
                      for setting in TARGETS}
    return out


def print_report(result: dict) -> None:
    link = result["link_bound"]
    print(f"{'strategy':<9} {'loopback':>9} {'at ' + str(link.get('rate')):>14} {'baseline link use':>18}")
    for name in STRATEGIES:
        if name not in result["loopback"] and name not in link:
            continue
        use = (link.get("baseline_link_use") or {}).get(name)
        loop, bound = result["loopback"].get(name), link.get(name)
        print(f"{name:<9} {'-' if loop is None else f'{loop:.2f}x':>9} {'-' if bound is None else f'{bound:.2f}x':>14} "
              f"{'-' if use is None else f'{use:.2f}':>18}")
    projection = result.get("projection") or {}
    if projection.get("median_abs_error") is not None:
        by_setting = projection.get("median_abs_error_by_setting") or {}
        print(f"cost model: median absolute error {projection['median_abs_error']:.2f} over "
              f"{projection['predicted_runs']} runs"
              + ("" if len(by_setting) < 2 else " (" + ", ".join(f"{setting} {error:.2f}" for setting, error
                                                                  in by_setting.items()) + ")"))
    for name, paper in (projection.get("papers") or {}).items():
        print(f"paper {name}: projected {paper['projected']:.2f}x on {paper['cluster']} "
              f"(paper: {paper['reported']}; direction "
              f"{'reproduced' if paper['direction_reproduced'] else 'not reproduced'})")
    for setting, met in result.get("targets", {}).items():
        print(f"targets {setting}: " + ", ".join(f"{n} {'met' if ok else 'missed'}" for n, ok in met.items()))


def recorded_report(parser, path: str) -> dict:
    """The report of a recorded result file (its "report") or of a saved --json line."""
    try:
        recorded = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        parser.error(f"--reevaluate {path}: not a readable JSON file ({exc})")
    report_ = recorded.get("report", recorded) if isinstance(recorded, dict) else None
    if not isinstance(report_, dict) or not isinstance(report_.get("runs"), dict):
        parser.error(f"--reevaluate {path}: no \"runs\" of bench speedups in it (a docs/results/speedups*.json "
                     "file or this bench's --json line is)")
    return report_


def reevaluate(parser, args) -> dict:
    """The cost model of this code and `--calibration` against the runs of recorded results: their
    jobs made again from the recorded payloads, collectives and settings, no job run."""
    if not args.calibration:
        parser.error("--reevaluate needs --calibration FILE (the calibration to predict the runs with)")
    from hybridrec.costs.model import validate_and_project
    from hybridrec.parallel.emulated_hosts import parse_rate

    runs, rate, sources = {"loopback": {}, "link_bound": {}}, None, {}
    for path in args.reevaluate:
        recorded = recorded_report(parser, path)
        settings = recorded.get("settings") or {}
        overrides = [o for o in settings.get("set", SIZE) if o not in SIZE]
        found = recorded["runs"].get("link_bound") or {}
        recorded_rate = (recorded.get("link_bound") or {}).get("rate")
        if found and rate is not None and recorded_rate != rate:
            parser.error(f"--reevaluate {path}: its link-bound runs are at {recorded_rate}, those before at {rate}; "
                         "allowed: results of one rate")
        rate = recorded_rate if found else rate
        for setting in runs:
            for name, result in (recorded["runs"].get(setting) or {}).items():
                runs[setting][name] = {**result, "jobs": model_jobs(name, result, settings.get("trainers", 2),
                                                                    overrides, result.get("jobs"))}
                sources[f"{setting} {name}"] = path
    projection = validate_and_project(args.calibration, runs, parse_rate(rate) if rate else None)
    result = report(runs["loopback"], runs["link_bound"], rate, projection)
    result["settings"] = {"reevaluated": sources, "calibration": args.calibration}
    print_report(result)
    if args.json:
        print(json.dumps(result))
    return result


def model_figures(result: dict) -> dict:
    """The cost model's median absolute errors: over every run, and per setting when both ran."""
    projection = result.get("projection") or {}
    figures = pick(projection, {"cost model median abs error": "median_abs_error"})
    by_setting = projection.get("median_abs_error_by_setting") or {}
    if len(by_setting) > 1:
        rate = (result.get("link_bound") or {}).get("rate")
        figures.update({f"cost model median abs error {rate if setting == 'link_bound' else setting}": error
                        for setting, error in by_setting.items()})
    return figures


def headline(result: dict) -> dict:
    if (result.get("settings") or {}).get("reevaluated"):  # the runs' ratios are the recorded result's figures
        return model_figures(result)
    figures = {f"loopback {n} / baseline": r for n, r in result.get("loopback", {}).items()}
    link = result.get("link_bound", {})
    figures.update({f"{link.get('rate')} {n} / baseline": link[n] for n in STRATEGIES if n in link})
    figures.update(model_figures(result))
    return figures


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.strategies.split(",") if n.strip()]
    unknown = sorted(set(names) - set(STRATEGIES))
    if unknown:
        parser.error(f"--strategies: unknown {unknown}; allowed: {','.join(STRATEGIES)}")
    if args.bandwidth is None and args.emulate_hosts is not None:
        parser.error("--emulate-hosts needs --bandwidth here (the rate where the baselines are link-bound)")
    check_ray(parser, args)
    if args.calibration and not Path(args.calibration).is_file():
        parser.error(f"--calibration {args.calibration}: no such file")
    if args.reevaluate:
        return reevaluate(parser, args)
    if args.bandwidth is not None:
        from hybridrec.parallel.emulated_hosts import check_support, parse_rate
        try:
            parse_rate(args.bandwidth)
            check_support()
        except ValueError as exc:
            parser.error(str(exc))
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="hybridrec-bench-speedups-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        if not args.no_warmup:
            warm_up(args, names, root)
        loopback = {} if args.no_loopback else run_setting(args, names, root, emulated=False)
        link = run_setting(args, names, root, emulated=True) if args.bandwidth else {}
    except (JobFailed, ValueError) as exc:
        parser.exit(1, f"{parser.prog}: error: {exc}\n")
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    projection = None
    if args.calibration:
        from hybridrec.costs.model import validate_and_project
        from hybridrec.parallel.emulated_hosts import parse_rate

        projection = validate_and_project(args.calibration, {"loopback": loopback, "link_bound": link},
                                          parse_rate(args.bandwidth) if args.bandwidth else None)
    result = report(loopback, link, args.bandwidth, projection)
    result["settings"] = {"runs": args.runs, "trainers": args.trainers, "set": [*SIZE, *args.set],
                          "bandwidth": args.bandwidth, "emulate_hosts": args.emulate_hosts, "ray": args.ray}
    print_report(result)
    if args.json:
        print(json.dumps(result))
    return result
