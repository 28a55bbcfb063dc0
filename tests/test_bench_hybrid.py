"""Tests of `hybridrec bench hybrid` (hybridrec/benchmarks/hybrid.py): a tiny real job per
discipline (PS + embedding worker + 2 trainers under torchrun) gives a JSON report with the
three disciplines, finite numbers, no staleness under sync and at most tau otherwise; a failed
job is an error naming the discipline, the exit code and the launcher's output; the codec report
computes its ratios and target from per-run metrics. No timing is asserted."""
from __future__ import annotations

import json
import math
import pathlib

import pytest

from hybridrec.benchmarks import hybrid

REPO = pathlib.Path(__file__).resolve().parents[1]
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
