"""The throughput cost model (hybridrec.costs.model): its bounds behave as the module says, a
job's processes, requests and dense traffic come from its config and roles, and a recorded
`bench speedups` result's predictions come back from the calibration it holds."""
import json
from dataclasses import replace
from pathlib import Path

import pytest

from hybridrec.config import load_config
from hybridrec.costs.model import Cluster, Job, bounds, other_work, predict, traffic_of

CALIBRATION = {"machine": {"cores": 2}, "kernel": {"s_per_key": 40e-9},
               "transport": {"round_trip_s": 250e-6, "round_trip_cpu_s": 200e-6, "bytes_per_s": 800e6},
               "dense": {"job.yaml": {"s_per_sample": 50e-6, "s_per_step": 2e-3, "batch_size": 512, "parameters": 20_000,
                                      "local_s_per_sample": 120e-6}}}
JOB = Job("job.yaml", trainers=2, batch_size=512, keys_per_sample=26, bytes_per_sample=1500, busiest_share=1,
          overlaps=False)
RECORDED = Path(__file__).resolve().parents[2] / "docs" / "results" / "speedups.json"


def test_a_slow_link_bounds_the_job_and_overlap_hides_what_it_can():
    loopback = predict(CALIBRATION, JOB, Cluster(None, 2, True))
    slow = predict(CALIBRATION, JOB, Cluster(10e6, 2, True))
    assert slow < loopback
    link_bound = 10e6 / 8 / 1500  # samples/s the one busiest link carries
    assert slow < link_bound < loopback
    relayed = bounds(CALIBRATION, replace(JOB, crossings=2.0), Cluster(10e6, 2, True))["link"]
    assert relayed == pytest.approx(bounds(CALIBRATION, JOB, Cluster(10e6, 2, True))["link"] / 2, rel=0.05)
    overlapped = predict(CALIBRATION, replace(JOB, overlaps=True), Cluster(10e6, 2, True))
    assert slow < overlapped <= link_bound
    # fewer bytes per sample pay only where the link binds
    light = replace(JOB, bytes_per_sample=150)
    assert predict(CALIBRATION, light, Cluster(10e6, 2, True)) / slow > 5
    assert predict(CALIBRATION, light, Cluster(None, 2, True)) / loopback < 1.1
    # a trainer with cores of its own scales with the trainers; shared cores do not
    own = Cluster(None, 2, False)
    assert predict(CALIBRATION, replace(JOB, trainers=4), own) > 1.5 * predict(CALIBRATION, JOB, own)


def test_on_shared_cores_every_process_and_request_counts_and_other_work_takes_its_cores():
    job = replace(JOB, dense="none")  # no allreduce: its bytes would change with the trainers
    alone = bounds(CALIBRATION, job, Cluster(None, 2, True))["cpu"]
    # one trainer's work can still use both cores when servers run beside it
    one_trainer = replace(job, trainers=1, processes=4)
    assert bounds(CALIBRATION, one_trainer, Cluster(None, 2, True))["cpu"] == pytest.approx(alone)
    assert bounds(CALIBRATION, replace(job, trainers=1), Cluster(None, 2, True))["cpu"] == pytest.approx(alone / 2)
    # every request a step makes costs CPU of both ends: 8 more per step of 512 samples
    chatty = bounds(CALIBRATION, replace(job, requests_per_step=8), Cluster(None, 2, True))["cpu"]
    assert 1 / chatty - 1 / alone == pytest.approx(8 * 200e-6 / 512 / 2)
    # a machine whose other work takes 1.5 of its 2 cores leaves the job a quarter of them
    busy = bounds(CALIBRATION, job, Cluster(None, 2, True, background_cores=1.5))["cpu"]
    assert busy == pytest.approx(alone / 4)
    # dense copies through servers instead of an allreduce: their bytes are serialised and sent
    through_servers = replace(JOB, dense="servers", dense_copies_per_step=2.0)
    slow = Cluster(10e6, 2, True)
    assert bounds(CALIBRATION, through_servers, slow)["link"] == pytest.approx(
        10e6 / 8 / (1500 + 2 * 4 * 20_000 / 512 / 2))


def test_a_jobs_processes_requests_and_dense_traffic_come_from_its_config_and_roles():
    persia = load_config("configs/persia_synthetic.yaml", ["strategy.consistency=sync", "strategy.dense=allreduce"])
    # a lookup and a push to the embedding worker, each asking both PS servers; one allreduce; the
    # worker's link carries the payload in from the trainers and out to the servers
    assert traffic_of(persia, 2, 2, 1, None) == {"processes": 5, "requests_per_step": 7.0, "dense": "allreduce",
                                                 "dense_copies_per_step": 0.0, "crossings": 2.0}
    direct = traffic_of(persia, 2, 2, 0, None)
    assert direct["processes"] == 4 and direct["requests_per_step"] == 5.0 and direct["crossings"] == 1.0
    ps_async = traffic_of(load_config("configs/persia_synthetic.yaml", ["strategy.dense=ps_async"]), 2, 2, 1, None)
    assert ps_async["dense"] == "servers" and ps_async["dense_copies_per_step"] == 2.0
    easgd, groups = (traffic_of(load_config("configs/persia_synthetic.yaml",
                                            ["strategy.preset=ht", f"strategy.dense={dense}", "strategy.ht.groups=1"]),
                                2, 1, 1, None) for dense in ("easgd", "groups"))
    # EASGD syncs a copy per trainer, Hierarchical Training one per group, every ht.period steps
    assert groups["dense_copies_per_step"] > 0
    assert easgd["dense_copies_per_step"] == pytest.approx(2 * groups["dense_copies_per_step"])
    # the tables on the trainers: the collectives the job counted, and no server
    sharded = traffic_of(load_config("configs/picasso_synthetic.yaml", ["strategy.preset=picasso"]), 2, None, None, 9.0)
    assert sharded["processes"] == 2 and sharded["requests_per_step"] == 10.0


@pytest.mark.skipif(not RECORDED.is_file(), reason="no recorded bench speedups result")
def test_a_recorded_runs_predictions_come_back_from_its_calibration():
    report = json.loads(RECORDED.read_text())["report"]
    projection = report["projection"]
    assert projection, "docs/results/speedups.json holds no projection: record it with --calibration"
    clusters = {name: Cluster(**fields) for name, fields in projection["clusters"].items()}
    checked = 0
    for setting, by_strategy in report["runs"].items():
        for name, result in by_strategy.items():
            for side, fields in result["jobs"].items():
                recorded = projection["predicted"][f"{setting} {name} {side}"]
                for run, guess in zip(result[side], recorded):
                    cluster = replace(clusters[setting], background_cores=other_work(run))
                    assert predict(projection["calibration"], Job(**fields), cluster) == pytest.approx(guess, rel=1e-12)
                    checked += 1
    assert checked >= 2


def test_a_jobs_own_cpu_is_the_jobs_and_not_other_works():
    import subprocess
    import sys

    from hybridrec.costs.machine import MachineUse

    burn = "import time\nwhile time.process_time() < 0.3: pass"  # 0.3 s of CPU, however loaded the machine
    with MachineUse() as use:
        subprocess.run([sys.executable, "-c", burn], check=True, timeout=120)
    figures = use.figures()
    assert figures["job_cpu_s"] >= 0.3 and figures["background_cores"] >= 0.0
    with MachineUse(counts_job=False) as use:  # the job's processes are not our children (Ray's)
        pass
    assert use.figures()["background_cores"] is None


def test_while_a_job_trains_its_live_processes_cpu_is_the_jobs_and_not_other_works():
    import subprocess
    import sys
    import time

    from hybridrec.costs.machine import MachineUse

    # a child that burns 0.6 s of CPU and then waits, alive (not reaped), for its parent to let it end
    burn = "import sys, time\nwhile time.process_time() < 0.6: pass\nprint('burnt', flush=True)\nsys.stdin.read()"
    with MachineUse(sample_every=0.05) as use:
        start = time.time()
        child = subprocess.Popen([sys.executable, "-c", burn], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout.readline() == "burnt\n"
            time.sleep(0.2)  # samples taken while it lives
            end = time.time()
        finally:
            child.communicate("", timeout=60)
    inside = [job for at, _, job in use.samples if start <= at <= end]
    assert inside[-1] - inside[0] >= 0.3  # its CPU counted while it lived, before it was reaped
    figures = use.figures((start, end))
    assert figures["training_background_cores"] is not None and figures["training_background_cores"] >= 0.0
    assert use.background_between(end + 3600, end + 7200) is None  # no samples: not measured
    with MachineUse(counts_job=False, sample_every=0.05) as use:  # the job's processes are not our children
        pass
    assert use.samples == [] and use.figures((start, end))["training_background_cores"] is None
