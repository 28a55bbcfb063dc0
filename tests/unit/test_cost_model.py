"""The throughput cost model (hybridrec.costs.model): its bounds behave as the module says, and a
recorded `bench speedups` result's predictions come back from the calibration it holds."""
import json
from dataclasses import replace
from pathlib import Path

import pytest

from hybridrec.costs.model import Cluster, Job, predict

CALIBRATION = {"machine": {"cores": 2}, "kernel": {"s_per_key": 40e-9},
               "transport": {"round_trip_s": 250e-6, "bytes_per_s": 800e6},
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
    overlapped = predict(CALIBRATION, replace(JOB, overlaps=True), Cluster(10e6, 2, True))
    assert slow < overlapped <= link_bound
    # fewer bytes per sample pay only where the link binds
    light = replace(JOB, bytes_per_sample=150)
    assert predict(CALIBRATION, light, Cluster(10e6, 2, True)) / slow > 5
    assert predict(CALIBRATION, light, Cluster(None, 2, True)) / loopback < 1.1
    # a trainer with cores of its own scales with the trainers; shared cores do not
    own = Cluster(None, 2, False)
    assert predict(CALIBRATION, replace(JOB, trainers=4), own) > 1.5 * predict(CALIBRATION, JOB, own)


@pytest.mark.skipif(not RECORDED.is_file(), reason="no recorded bench speedups result")
def test_a_recorded_runs_predictions_come_back_from_its_calibration():
    report = json.loads(RECORDED.read_text())["report"]
    projection = report["projection"]
    clusters = {name: Cluster(**fields) for name, fields in projection["clusters"].items()}
    checked = 0
    for setting, by_strategy in report["runs"].items():
        for name, result in by_strategy.items():
            for side, fields in result["jobs"].items():
                again = predict(projection["calibration"], Job(**fields), clusters[setting])
                assert again == pytest.approx(projection["predicted"][f"{setting} {name} {side}"], rel=1e-12)
                checked += 1
    assert checked >= 2
