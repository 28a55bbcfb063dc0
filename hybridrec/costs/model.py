"""The throughput cost model: a job's samples/s on a described cluster, from a calibration of
per-operation costs (`hybridrec calibrate`, hybridrec.costs.calibrate) and the job's traffic.

A job (`Job`) is one side of a strategy pair as `hybridrec bench speedups` runs it: its config
(whose dense model the calibration timed), its trainers and all its processes (PS servers,
embedding workers, group PSs), the embedding payload it moves per sample, how many hosts' links
share its busiest hop, the request round trips (or collectives) a trainer step makes between
processes, how its dense model is kept in step (a ring allreduce, fp32 copies through servers:
Persia's PS-async pull and push every step, EASGD's and Hierarchical Training's elastic syncs
every `period` steps of each copy, or nothing beyond the payload: DES), and whether it overlaps
communication with compute. A cluster (`Cluster`) gives the link rate, the cores, whether every
process shares those cores (emulated hosts on one machine) or each trainer has its own, the cores
other work takes from a shared machine, the one-way latency, and how much faster than one
calibrated core a trainer's dense compute runs (a GPU).

Per sample, three bounds (each a samples/s ceiling of the whole job):
  cpu      the CPU seconds every process of the job spends on a sample: a whole local training
           step (calibrated; its dense forward/backward/step on the cluster's dense hardware) +
           the embedding engine's lookup and update of the sample's keys on the servers' side +
           serialising its payload and its dense traffic at both ends (the calibrated transport
           bytes per CPU second) + its share of the step's requests or collectives (each the
           calibrated CPU of a loopback round trip, both ends), over the cores the job can use:
           on shared cores its processes' up to the cores other work leaves it, else trainers x
           cores per trainer;
  latency  ROUND_TRIPS request round trips per step per trainer (a lookup and a push, a read and
           an allreduce), each the calibrated loopback round trip plus twice the one-way latency;
  link     the payload on the busiest hop at the link rate (none on loopback): the embedding
           payload over the hosts sharing that hop, twice through an embedding worker's (it relays
           each request: in from the trainers, out to the servers, in turn; `crossings`), plus a
           trainer's share of its dense traffic unless the trainers share a host (`dense_on_link`:
           HET's GPU workers in one node).
A job that overlaps communication with compute (HET's read-ahead, Persia's bounded pipeline, the
asynchronous baselines) runs at the slower of cpu and communication (latency + link); one that
does not (sync) pays their sum.
"""
from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, replace
from pathlib import Path

ROUND_TRIPS = 2
# (strategy, side) -> whether the job overlaps its communication with compute
OVERLAPS = {("het", "baseline"): False, ("het", "strategy"): True,
            ("hybrid", "baseline"): False, ("hybrid", "strategy"): True,
            ("picasso", "baseline"): False, ("picasso", "strategy"): False,
            ("des", "baseline"): True, ("des", "strategy"): False,
            ("ht", "baseline"): True, ("ht", "strategy"): True}


@dataclass(frozen=True)
class Job:
    config: str  # its dense model's entry in the calibration (`calibrate.dense_key`)
    trainers: int
    batch_size: int
    keys_per_sample: float  # embedding IDs a sample looks up, every table together
    bytes_per_sample: float  # embedding payload between processes per training sample
    busiest_share: int  # hosts whose links carry that payload side by side
    overlaps: bool
    processes: int = 0  # every process of the job (0: its trainers alone)
    requests_per_step: float = 0.0  # round trips or collectives between processes per trainer step
    dense: str = "allreduce"  # allreduce | servers (fp32 copies through servers) | none
    dense_copies_per_step: float = 0.0  # servers: fp32 dense models moved per trainer step
    dense_on_link: bool = True  # the dense traffic crosses the trainers' links (False: trainers share a host)
    crossings: float = 1.0  # times the payload crosses the busiest hop in turn (2: an embedding worker relays it)


@dataclass(frozen=True)
class Cluster:
    rate_bits: float | None  # each host's link, bits/s; None: loopback
    cores: float  # shared: the machine's cores; else each trainer's
    shared: bool  # every process of the job runs on the same `cores`
    latency_s: float = 0.0  # one way, between two hosts
    dense_speedup: float = 1.0  # a trainer's dense compute against one calibrated core
    background_cores: float = 0.0  # shared: the cores other work on the machine takes


def keys_per_sample(cfg) -> float:
    """Embedding IDs one sample looks up (every deep and wide table; multi-hot fields at their
    mean length)."""
    from hybridrec.job.tables import job_tables

    tables = job_tables(cfg)
    per_feature = {name: 1.0 for name in tables.sparse_names}
    synthetic = cfg.data.synthetic
    if cfg.data.format == "synthetic" and synthetic.n_multi_hot:
        mean = (1 + synthetic.multi_hot_max_length) / 2
        for name in tables.sparse_names[synthetic.n_categorical:]:
            per_feature[name] = mean
    return float(sum(per_feature[f] for f in tables.deep_map) + sum(per_feature[f] for f in tables.wide_map))


def collectives_per_step(metrics: dict) -> float | None:
    """The collectives a trainer step issued, as a job's final metrics count them (PICASSO's
    `ops_per_step`, DES's `allreduces_per_step`), None where they are not counted."""
    found = [metrics.get("ops_per_step"), (metrics.get("des") or {}).get("allreduces_per_step")]
    for value in found:
        if isinstance(value, dict) and value.get("collectives") is not None:
            return float(value["collectives"])
        if isinstance(value, (int, float)):
            return float(value)
    return None


def traffic_of(cfg, trainers: int, ps: int | None, embedding_workers: int | None,
               collectives: float | None) -> dict:
    """A job's processes, request round trips per trainer step and dense traffic, from its config
    and its role counts (None: the config's `strategy.roles`). Per trainer step: through embedding
    workers a lookup and a push to one of them, which each asks every PS server; directly, a lookup
    and a push to every PS server; with the tables on the trainers, the collectives the job counted
    (else a lookup and a gradient round); plus the dense model's own: one allreduce, or a pull and
    a push of each dense copy (every step under PS-async, every `strategy.ht.period` steps under
    EASGD, one copy per trainer, and Hierarchical Training, one per group, whose group PSs add a
    round trip every step)."""
    from hybridrec.axes import server_roles

    strategy = cfg.strategy
    servers = server_roles(strategy.resolved)
    ps = (strategy.roles.ps_servers if ps is None else ps) if "ps_servers" in servers else 0
    workers = ((strategy.roles.embedding_workers if embedding_workers is None else embedding_workers)
               if "embedding_workers" in servers else 0)
    dense = strategy.resolved["dense"]
    groups = strategy.ht.groups if dense == "groups" else trainers if dense == "easgd" else 0
    group_ps = groups * strategy.ht.group_ps if dense == "groups" else 0
    if ps:
        requests = 2.0 + 2 * ps if workers else 2.0 * ps
    else:
        requests = collectives if collectives is not None else 2.0
    copies = 2.0 if dense == "ps_async" else 2.0 * groups / trainers / strategy.ht.period if groups else 0.0
    requests += copies + (2.0 if group_ps else 0.0) + (1.0 if dense == "allreduce" else 0.0)
    mode = "allreduce" if dense == "allreduce" else "servers" if copies else "none"
    # an embedding worker relays each request: the payload comes in from the trainers and goes out
    # to the servers (the rows back the other way), one after the other on its link
    return {"processes": trainers + ps + workers + group_ps, "requests_per_step": requests, "dense": mode,
            "dense_copies_per_step": copies, "crossings": 2.0 if workers else 1.0}


def job_of(config: str, overrides: list[str], dense_overrides: list[str], strategy: str, side: str, trainers: int,
           bytes_per_sample: float, busiest_share: int, ps: int | None = None, embedding_workers: int | None = None,
           collectives: float | None = None, dense_on_link: bool = True) -> Job:
    """One side of a pair as the model sees it: `overrides` make the job's config, `dense_overrides`
    (a part of them) name its dense model's calibration; `ps` / `embedding_workers` its servers
    (None: the config's), `collectives` the collectives per trainer step it counted, `dense_on_link`
    whether its dense traffic crosses the trainers' links (not when they share a host)."""
    from hybridrec.config import load_config
    from hybridrec.costs.calibrate import dense_key

    cfg = load_config(config, overrides)
    return Job(dense_key(config, dense_overrides), trainers, cfg.data.batch_size, keys_per_sample(cfg),
               float(bytes_per_sample or 0.0), busiest_share, OVERLAPS[(strategy, side)],
               **traffic_of(cfg, trainers, ps, embedding_workers, collectives), dense_on_link=dense_on_link)


def dense_bytes_per_sample(calibration: dict, job: Job) -> float:
    """The dense traffic every trainer together moves per sample (fp32): a ring allreduce of the
    gradients, or the dense copies pulled and pushed through servers."""
    parameters = calibration["dense"][job.config]["parameters"]
    if job.dense == "servers":
        return job.dense_copies_per_step * 4 * parameters / job.batch_size
    if job.dense == "allreduce" and job.trainers > 1:
        return 2 * (job.trainers - 1) / job.trainers * 4 * parameters / job.batch_size
    return 0.0


def bounds(calibration: dict, job: Job, cluster: Cluster) -> dict:
    """Each bound in samples/s (see the module doc)."""
    dense = calibration["dense"][job.config]
    transport = calibration["transport"]
    dense_part = dense["s_per_sample"] + dense["s_per_step"] / job.batch_size
    # one process's whole step, with its dense part on the cluster's dense hardware
    compute = max(dense["local_s_per_sample"] - dense_part, 0.0) + dense_part / cluster.dense_speedup
    dense_bytes = dense_bytes_per_sample(calibration, job)
    request_cpu = transport.get("round_trip_cpu_s", 0.0)
    cpu_per_sample = (compute + 2 * job.keys_per_sample * calibration["kernel"]["s_per_key"]
                      + 2 * (job.bytes_per_sample + dense_bytes) / transport["bytes_per_s"]
                      + job.requests_per_step * request_cpu / job.batch_size)
    if cluster.shared:  # every process on the cores other work leaves (a tenth of them at the least)
        cores = min(max(cluster.cores - cluster.background_cores, 0.1 * cluster.cores),
                    job.processes or job.trainers)
    else:
        cores = cluster.cores * job.trainers
    round_trip = transport["round_trip_s"] + 2 * cluster.latency_s
    # the busiest hop carries the embedding payload shared by busiest_share hosts and, on a
    # trainer's link, its share of the dense traffic (none when the trainers share a host)
    on_link = (job.crossings * job.bytes_per_sample / job.busiest_share
               + (dense_bytes / job.trainers if job.dense_on_link else 0.0))
    link = cluster.rate_bits / 8 / on_link if cluster.rate_bits and on_link else float("inf")
    return {"cpu": cores / cpu_per_sample, "latency": job.trainers * job.batch_size / (ROUND_TRIPS * round_trip),
            "link": link}


def predict(calibration: dict, job: Job, cluster: Cluster) -> float:
    """The job's samples/s on the cluster."""
    b = bounds(calibration, job, cluster)
    communication = 1 / b["latency"] + 1 / b["link"]
    seconds = max(1 / b["cpu"], communication) if job.overlaps else 1 / b["cpu"] + communication
    return 1 / seconds


def other_work(run: dict) -> float:
    """The cores other work took from a recorded run: while the job trained where that was
    measured (`training_background_cores`), else over the job's whole life (`background_cores`)."""
    measured = run.get("training_background_cores")
    return measured if measured is not None else (run.get("background_cores") or 0.0)


def load(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())


# ---------------------------------------------------------------- the papers' clusters
# Each paper's own setup as far as it describes it; the jobs are ours (our data, our models).
def _paper(cluster: Cluster, described: str, reported: str, direction: int = 1) -> dict:
    return {"cluster": cluster, "described": described, "reported": reported, "direction": direction}


PAPERS = {
    "het": _paper(Cluster(1e9, 8, False, 0.0001, 20.0), "HET §5 cluster A: GPU workers and CPU servers on 1 Gbit/s "
                  "Ethernet", "HET 1.37-20.68x over the baselines (no cache: Fig. 9)"),
    "hybrid": _paper(Cluster(100e9, 16, False, 0.00005, 100.0), "Persia §5: GPU trainers, CPU embedding PS, "
                     "100 Gbit/s", "Persia Fig. 7: hybrid faster than sync"),
    "picasso": _paper(Cluster(100e9, 8, False, 0.00005, 50.0), "PICASSO §V: 8-GPU servers on 100 Gbit/s (RDMA)",
                      "PICASSO: 1.9-10x over plain model parallelism, 6x on average in production"),
    "des": _paper(Cluster(10e9, 32, False, 0.0001, 1.0), "DES: CPU servers on 10 Gbit/s",
                  "DES: faster than the PS (fewer bytes, synchronous)"),
    "ht": _paper(Cluster(25e9, 32, False, 0.0001, 1.0), "Hierarchical Training: CPU trainers on 25 Gbit/s",
                 "HT: faster than flat EASGD-style training"),
}


def validate_and_project(calibration_path: str, runs: dict, rate_bits: float | None) -> dict:
    """The cost model against every run of `hybridrec bench speedups` (its `runs`: setting ->
    strategy -> {"baseline": [...], "strategy": [...], "jobs": {side: Job fields}}; each run with
    the cores other work took meanwhile, `other_work`): the median absolute relative error, each
    run's prediction (`predicted`: "setting strategy side" -> one per run); and each paper's
    cluster projected with the loopback runs' traffic."""
    from hybridrec.picasso.switches import machine_cores

    calibration = load(calibration_path)
    cores = calibration["machine"]["cores"] or machine_cores()
    settings = {"loopback": Cluster(None, cores, True), "link_bound": Cluster(rate_bits, cores, True)}
    errors, predicted, by_setting = [], {}, {}
    for setting, by_strategy in runs.items():
        for name, result in by_strategy.items():
            for side in ("baseline", "strategy"):
                job = Job(**result["jobs"][side])
                guesses = predicted[f"{setting} {name} {side}"] = []
                for run in result[side]:  # each with the cores other work left it
                    cluster = replace(settings[setting], background_cores=other_work(run))
                    guesses.append(predict(calibration, job, cluster))
                    if run["samples_per_s"]:
                        errors.append(abs(guesses[-1] - run["samples_per_s"]) / run["samples_per_s"])
                        by_setting.setdefault(setting, []).append(errors[-1])
    papers = {}
    for name, paper in PAPERS.items():
        result = runs.get("loopback", {}).get(name)
        if not result:
            continue
        jobs = {side: Job(**{**result["jobs"][side], "trainers": 8}) for side in ("baseline", "strategy")}
        ratio = predict(calibration, jobs["strategy"], paper["cluster"]) / predict(calibration, jobs["baseline"],
                                                                                   paper["cluster"])
        papers[name] = {"projected": ratio, "cluster": paper["described"], "reported": paper["reported"],
                        "cluster_model": asdict(paper["cluster"]),
                        "direction_reproduced": (ratio > 1) == (paper["direction"] > 0)}
    return {"median_abs_error": statistics.median(errors) if errors else None, "predicted_runs": len(errors),
            "median_abs_error_by_setting": {setting: statistics.median(e) for setting, e in by_setting.items()},
            "predicted": predicted, "papers": papers, "calibration": calibration,
            "clusters": {setting: asdict(cluster) for setting, cluster in settings.items()}}
