"""`hybridrec bench speedups` beyond its jobs: HET's pair runs on emulated hosts laid out as HET's
cluster (its trainers on one host, each PS server on its own), which the cost model follows, and
`--reevaluate` predicts a recorded result's runs again from a calibration without running a job."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from hybridrec.benchmarks import speedups
from hybridrec.costs.model import Cluster, Job, bounds

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"


def _args(**given) -> argparse.Namespace:
    return argparse.Namespace(**{"emulate_hosts": None, "bandwidth": "5mbit", "latency": None, "trainers": 2, **given})


def test_hets_trainers_share_a_host_and_each_server_has_its_own_unless_hosts_are_given():
    het, hybrid = speedups.pairs()["het"], speedups.pairs()["hybrid"]
    laid_out = speedups.emulation_for(_args(), het.baseline)
    assert laid_out.hosts == 3 and dict(laid_out.place) == {"trainer0": 0, "trainer1": 0, "ps0": 1, "ps1": 2}
    assert speedups.emulation_for(_args(), hybrid.baseline).hosts == 5  # one role per host
    given = speedups.emulation_for(_args(emulate_hosts=2), het.baseline)
    assert given.hosts == 2 and not given.place  # the user's hosts, roles round-robin


def test_the_model_keeps_the_dense_traffic_of_trainers_on_one_host_off_the_link():
    calibration = {"kernel": {"s_per_key": 40e-9}, "transport": {"round_trip_s": 250e-6, "bytes_per_s": 800e6},
                   "dense": {"m": {"s_per_sample": 10e-6, "s_per_step": 1e-3, "parameters": 100_000,
                                   "local_s_per_sample": 50e-6}}}
    apart = Job("m", trainers=2, batch_size=128, keys_per_sample=8, bytes_per_sample=700, busiest_share=1,
                overlaps=False)
    together = Job(**{**apart.__dict__, "dense_on_link": False})
    link = Cluster(5e6, 2, True)
    assert bounds(calibration, together, link)["link"] == pytest.approx(5e6 / 8 / 700)
    # 2 x 1/2 x 400 kB of gradients per 128-sample step, half of it on each trainer's link
    assert bounds(calibration, apart, link)["link"] == pytest.approx(5e6 / 8 / (700 + 400_000 / 128 / 2))


# the re-evaluation of the recorded runs by the model as it is (`--reevaluate ... --record=model`)
MODEL = RESULTS / "speedups-model.json"


@pytest.mark.skipif(not MODEL.is_file(), reason="no recorded re-evaluation of bench speedups' runs")
def test_a_recorded_results_runs_are_predicted_again_from_its_calibration_without_a_job(tmp_path, monkeypatch,
                                                                                       capsys):
    monkeypatch.setattr("hybridrec.parallel.launch.launch", lambda *a, **k: pytest.fail("a job ran"))
    path = MODEL
    projection = json.loads(path.read_text())["report"]["projection"]
    calibration = tmp_path / "calibration.json"
    calibration.write_text(json.dumps(projection["calibration"]))
    again = speedups.main(["--reevaluate", str(path), "--calibration", str(calibration)])
    predicted = again["projection"]["predicted"]
    assert predicted.keys() == projection["predicted"].keys()
    for key, guesses in projection["predicted"].items():
        assert predicted[key] == pytest.approx(guesses, rel=1e-9)
    assert again["projection"]["median_abs_error"] == pytest.approx(projection["median_abs_error"], rel=1e-9)
    assert "cost model: median absolute error" in capsys.readouterr().out


def test_a_file_without_runs_is_a_one_line_error(tmp_path, capsys):
    result = tmp_path / "other.json"
    result.write_text(json.dumps({"report": {"figures": {}}}))
    calibration = tmp_path / "calibration.json"
    calibration.write_text("{}")
    with pytest.raises(SystemExit) as exit_info:
        speedups.main(["--reevaluate", str(result), "--calibration", str(calibration)])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and err[-1].endswith(f"--reevaluate {result}: no \"runs\" of bench speedups in "
                                                          "it (a docs/results/speedups*.json file or this bench's "
                                                          "--json line is)")
