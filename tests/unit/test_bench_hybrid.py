"""Tests of `hybridrec bench hybrid` (hybridrec/benchmarks/hybrid.py): a tiny real job per
discipline (PS + embedding worker + 2 trainers under torchrun) gives a JSON report with the
three disciplines, finite numbers, no staleness under sync and at most tau otherwise; a failed
job is an error naming the discipline, the exit code and the launcher's output; the codec report
computes its ratios and target from per-run metrics; --seeds pairs jobs by seed and reports
spreads, each --bandwidth rate runs on its emulated hosts and --plot draws the sweep (fake
launches); emulation flags are checked before any job. No timing is asserted."""
from __future__ import annotations

import json
import math
import pathlib

import pytest

from hybridrec.benchmarks import hybrid

REPO = pathlib.Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "configs" / "persia_synthetic.yaml")
TINY = ["--config", CONFIG, "--runs", "1", "--ps", "1", "--trainers", "2", "--embedding-workers", "1",
        "--set", "data.synthetic.train_rows=8192", "--set", "data.synthetic.test_rows=1000",
        "--set", "data.synthetic.vocab_size=100", "--set", "data.batch_size=256",
        "--set", "embedding.default.capacity=5000", "--set", "strategy.tau=2", "--timeout", "120"]


def test_tiny_job_reports_three_disciplines(capsys):
    hybrid.main([*TINY, "--json"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for name in hybrid.DISCIPLINES:
        result = report[name]
        for key in ("auc", "logloss", "samples_per_s", "max_staleness", "mean_staleness", "bytes_per_sample"):
            assert isinstance(result[key], (int, float)) and math.isfinite(result[key]), (name, key, result[key])
        assert 0.5 < result["auc"] <= 1 and result["samples_per_s"] > 0 and result["bytes_per_sample"] > 0
        assert len(result["runs"]) == 1 and result["runs"][0]["auc"] == result["auc"]
        assert result["lost_batches"] == 0
    assert report["sync"]["max_staleness"] == 0 and report["sync"]["mean_staleness"] == 0
    for name in ("hybrid", "async"):
        assert report[name]["tau"] == 2 and 0 <= report[name]["max_staleness"] <= 2
    for key in ("hybrid_minus_sync_auc", "hybrid_vs_sync_samples_per_s", "async_vs_sync_samples_per_s"):
        assert math.isfinite(report[key])
    assert report["hybrid_minus_sync_auc"] == pytest.approx(report["hybrid"]["auc"] - report["sync"]["auc"])


def test_failed_job_names_discipline_exit_code_and_output(monkeypatch, capsys):
    """The sync job (a fake launch) succeeds, the hybrid one exits 1: the benchmark stops there."""
    def fake_launch(config, *, overrides, out, **kwargs):
        out.write("[ps0] Traceback: something broke\n")
        if "strategy.consistency=sync" not in overrides:
            return 1
        output_dir = pathlib.Path(next(o for o in overrides if o.startswith("train.output_dir="))
                                  .split("=", 1)[1])
        output_dir.mkdir(parents=True)
        (output_dir / "final_metrics.json").write_text(json.dumps({"auc": 0.7, "max_staleness": 0, "step": 3}))
        return 0

    monkeypatch.setattr("hybridrec.parallel.launch.launch", fake_launch)
    with pytest.raises(SystemExit) as exit_info:
        hybrid.main(TINY)
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert "the hybrid job failed" in err and "exited with code 1" in err and "something broke" in err
    assert "sync run 1/1: auc 0.70000" in err


def test_codec_report_ratios_and_target():
    def runs(bytes_per_sample, aucs):
        return [{"auc": a, "logloss": 0.4, "train_samples_per_s": 100.0, "max_staleness": 2,
                 "mean_staleness": 1.0, "bytes_per_sample": bytes_per_sample, "strategy": {"tau": 2}}
                for a in aucs]

    raw = {"none/none": runs(400.0, [0.80, 0.81]), "unique/none": runs(200.0, [0.80, 0.81]),
           "unique/fp16": runs(100.0, [0.7999, 0.8098])}
    report = hybrid.codecs_report(raw)
    assert report["unique/fp16"]["bytes_reduction_vs_none"] == pytest.approx(4.0)
    assert report["unique/none"]["bytes_reduction_vs_none"] == pytest.approx(2.0)
    assert report["unique/fp16"]["auc_minus_none"] == pytest.approx(-0.00015)
    assert report["target_met"]
    raw["unique/fp16"] = runs(100.0, [0.79, 0.80])  # AUC cost 0.01: over the budget
    assert not hybrid.codecs_report(raw)["target_met"]


def _fake_launch(calls):
    """A launch that writes final metrics from the job's seed, discipline and emulated hosts."""
    def fake_launch(config, *, overrides, out, emulation=None, **kwargs):
        calls.append((list(overrides), emulation))
        seed = int(next((o.split("=")[1] for o in overrides if o.startswith("seed=")), 0))
        bounded = "strategy.consistency=bounded" in overrides
        rate = emulation.rate if emulation is not None and emulation.rate else 10**9
        output_dir = pathlib.Path(next(o for o in overrides if o.startswith("train.output_dir=")).split("=", 1)[1])
        output_dir.mkdir(parents=True)
        (output_dir / "final_metrics.json").write_text(json.dumps(
            {"auc": 0.80 + 0.01 * seed - 0.002 * bounded, "logloss": 0.45, "step": 10,
             "train_samples_per_s": 1000.0 * (1 + bounded) * rate / 10**9, "max_staleness": 4 * bounded,
             "mean_staleness": 2.0 * bounded, "bytes_per_sample": 500.0, "strategy": {"tau": 4}}))
        return 0
    return fake_launch


def test_seeds_pair_jobs_by_seed_and_the_sweep_is_plotted(monkeypatch, capsys, tmp_path):
    """--seeds runs each discipline once per seed; spreads and job-by-job differences come out;
    each --bandwidth rate is one point run on its emulated hosts; --plot writes a PNG."""
    try:
        import matplotlib  # noqa: F401 (the bench extra)
        plotting = True
    except ImportError:
        plotting = False
    calls = []
    monkeypatch.setattr("hybridrec.parallel.launch.launch", _fake_launch(calls))
    monkeypatch.setattr("hybridrec.parallel.emulated_hosts.check_support", lambda: None)
    png = tmp_path / "sweep.png"
    hybrid.main(["--config", CONFIG, "--seeds", "0,1,2", "--emulate-hosts", "3", "--bandwidth", "1gbit,100mbit",
                 *(["--plot", str(png)] if plotting else []), "--json"])
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    assert len(calls) == 2 * 3 * 3 and (not plotting or png.read_bytes().startswith(b"\x89PNG"))
    assert [c[1].rate for c in calls[:9]] == [10**9] * 9 and calls[-1][1].rate == 10**8
    assert all(c[1].hosts == 3 for c in calls)
    first, second = result["points"]
    assert (first["bandwidth"], second["bandwidth"]) == ("1000 Mbit/s", "100 Mbit/s")
    assert first["sync"]["auc"] == pytest.approx(0.81)
    assert (first["sync"]["auc_min"], first["sync"]["auc_max"]) == (pytest.approx(0.80), pytest.approx(0.82))
    assert [r["seed"] for r in first["hybrid"]["runs"]] == [0, 1, 2]
    paired = first["hybrid_minus_sync_auc_paired"]
    assert paired["median"] == paired["min"] == paired["max"] == pytest.approx(-0.002)
    assert first["hybrid_vs_sync_samples_per_s"] == pytest.approx(2.0)
    assert second["sync"]["samples_per_s"] == pytest.approx(100.0)
    assert "hybrid - sync AUC job by job: median -0.00200" in out


def test_emulation_flags_are_checked_before_any_job(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr("hybridrec.parallel.launch.launch", _fake_launch(calls))
    for extra, expected in ((["--bandwidth", "1gbit"], "--bandwidth need(s) --emulate-hosts"),
                            (["--emulate-hosts", "3", "--bandwidth", "1gbit,fast"], "--bandwidth fast: expected"),
                            (["--seeds", "1,1"], "expected distinct seeds")):
        with pytest.raises(SystemExit) as exit_info:
            hybrid.main(["--config", CONFIG, *extra])
        assert exit_info.value.code == 2 and expected in capsys.readouterr().err, extra
    monkeypatch.setattr("hybridrec.parallel.emulated_hosts._capabilities", lambda: 0)
    with pytest.raises(SystemExit) as exit_info:
        hybrid.main(["--config", CONFIG, "--emulate-hosts", "3"])
    assert exit_info.value.code == 2 and "needs root" in capsys.readouterr().err
    assert calls == []
