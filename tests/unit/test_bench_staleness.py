"""hybridrec bench staleness: one JSON line with every run, the claims at W=16, tau=4 and the
rates; a sweep written to --out continues where it stopped instead of running again."""
import json
from pathlib import Path

import pytest

from hybridrec.benchmarks import staleness
from hybridrec.config import load_config

CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "persia_synthetic.yaml")
TINY = ["--config", CONFIG, "--samples", "16384", "--workers", "4", "--taus", "1", "--seeds", "0", "--set", "train.threads=1",
        "--set", "data.synthetic.test_rows=1024", "--set", "data.batch_size=512", "--curve-points", "2",
        "--curve-batches", "1"]


def test_the_sweep_reports_every_run_and_continues_from_its_file(tmp_path, capsys):
    out = tmp_path / "runs.jsonl"
    argv = [*TINY, "--disciplines", "hybrid,ht", "--groups", "2,W", "--json", "--out", str(out)]
    first = staleness.main(argv)
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    labels = sorted(r["label"] for r in line["runs"])
    assert labels == ["ht:groups=2,tau=1", "ht:groups=4,tau=1", "hybrid:tau=1", "sync"]
    for run in line["runs"]:
        assert list(run)[:7] == ["discipline", "workers", "tau", "seed", "samples", "auc", "logloss"]
        assert run["workers"] == 4 and run["samples"] == 16384 and 0 < run["auc"] < 1
        assert len(run["curve"]) == 2
    sync = next(r for r in line["runs"] if r["label"] == "sync")
    assert sync["gap_pct"] == 0.0
    assert set(line["claims"]) >= {"hybrid_gap_pct", "async_gap_pct", "workers", "tau", "samples"}
    assert line["claims"]["hybrid_gap_pct"] is None  # W=16 was not run
    assert len(out.read_text().splitlines()) == 4
    again = staleness.main(argv)  # every run is in the file: nothing runs again
    assert [r["auc"] for r in again["runs"]] == [r["auc"] for r in first["runs"]]
    assert len(out.read_text().splitlines()) == 4


def test_the_claims_are_the_median_relative_gaps_to_sync_at_w16_tau4():
    def run(label, seed, auc):
        return {"label": label, "discipline": label.split(":")[0], "workers": 16, "tau": 4 if ":" in label else 0,
                "seed": seed, "auc": auc, "logloss": 0.4, "lr_scale": 1.0, "dense_lr_scale": 1.0}
    runs = staleness.with_gaps([run("sync", 0, 0.80), run("sync", 1, 0.82), run("hybrid:tau=4", 0, 0.8),
                                run("hybrid:tau=4", 1, 0.8118), run("async:tau=4", 0, 0.78),
                                run("async:tau=4", 1, 0.80)])
    claims = staleness.claims(runs, 2_000_000, {})
    assert claims["hybrid_gap_pct"] == pytest.approx(-0.5)  # median of 0% and -1%
    assert claims["async_gap_pct"] == pytest.approx((-2.5 - 100 * 0.02 / 0.82) / 2)
    assert claims["hybrid_within_target"] is False and claims["async_below_target"] is True
    assert claims["rates"] == "x1/x1"


def test_rate_scales_multiply_every_table_section_that_sets_one_and_the_dense_rate():
    cfg = load_config(CONFIG)
    sets = staleness.rate_overrides(cfg, 0.25, 2.0)
    assert sorted(sets) == sorted(["train.dense_optimizer.lr=0.04", "embedding.default.optimizer.lr=0.0125",
                                   "embedding.wide.optimizer.lr=0.05"])
    assert staleness.rate_overrides(cfg, 1.0, 1.0) == []


def test_the_curve_gaps_are_median_differences_to_sync_at_matching_samples():
    def run(discipline, seed, points):
        return {"discipline": discipline, "seed": seed, "curve": [{"samples": s, "auc": a} for s, a in points]}
    runs = [run("sync", 0, [(1000, 0.70), (2000, 0.80)]), run("sync", 1, [(1000, 0.72), (2000, 0.78)]),
            run("hybrid", 0, [(1000, 0.60), (2000, 0.79)]), run("hybrid", 1, [(1000, 0.62), (2000, 0.77)]),
            run("async", 0, [(1010, 0.68), (1500, 0.5)])]  # 1500 is near no sync point: left out
    gaps = staleness.curve_gaps(runs)
    assert gaps["hybrid"] == [(1000, pytest.approx(-0.10)), (2000, pytest.approx(-0.01))]
    assert gaps["async"] == [(1000, pytest.approx(-0.02))]


def test_a_sweep_without_async_reports_the_hybrid_claim_and_async_as_not_run(capsys):
    runs = staleness.with_gaps([{"label": label, "discipline": label.split(":")[0], "workers": 16,
                                 "tau": 4 if ":" in label else 0, "seed": 0, "auc": auc, "logloss": 0.4,
                                 "lr_scale": 1.0, "dense_lr_scale": 1.0}
                                for label, auc in (("sync", 0.80), ("hybrid:tau=4", 0.79))])
    staleness.print_report({"cells": staleness.cells(runs), "claims": staleness.claims(runs, 1000, {})})
    assert "hybrid -1.250% (target within 0.1%), async not run" in capsys.readouterr().out


def test_oracle_checks_of_seeds_run_apart_are_reported_together_from_the_file(tmp_path):
    """Each oracle check (a discipline's real job and its replay, one seed) is kept in --out; a run
    over the file with every seed runs no job and reports the medians of all of them."""
    from hybridrec.benchmarks.staleness_oracle import oracle_check

    out = tmp_path / "oracle.jsonl"
    args = staleness.build_parser().parse_args([*TINY, "--oracle-only", "--oracle-seeds", "0,1,2",
                                                "--oracle-samples", "16384", "--out", str(out)])
    log = staleness.RunLog(str(out))
    for seed in (0, 1, 2):
        for name in ("sync", "hybrid", "async"):
            log.add({"label": f"oracle {name}", "workers": 4, "seed": seed, "lr_scale": 1.0, "dense_lr_scale": 1.0,
                     "samples_asked": 16384, "visibility": 0.0, "evaluated_on": "test",
                     "distributed_auc": 0.7 + 0.01 * seed, "emulated_auc": 0.7 + 0.01 * seed + (0.002 if name == "async"
                                                                                            else 0.0),
                     "seeded_auc": 0.7, "departures": 0, "reads_beyond_bound": [0, 64], "staleness_cross": None})
    oracle = oracle_check(args, staleness.RunLog(str(out)))
    assert oracle["disciplines"]["hybrid"]["distributed_auc"] == pytest.approx([0.7, 0.71, 0.72])
    assert oracle["max_median_difference"] == pytest.approx(0.002)
    assert oracle["within_target"]
    args.oracle_disciplines = ["sync", "hybrid"]  # those named only
    assert list(oracle_check(args, staleness.RunLog(str(out)))["disciplines"]) == ["sync", "hybrid"]


def test_an_oracle_discipline_outside_bench_hybrids_jobs_is_refused_naming_them(capsys):
    with pytest.raises(SystemExit):
        staleness.build_parser().parse_args([*TINY, "--oracle-disciplines", "sync,het"])
    assert "sync,hybrid,async" in capsys.readouterr().err


def test_the_sweep_runs_ht_once_per_distinct_g_and_only_at_the_ht_taus():
    args = staleness.build_parser().parse_args(["--taus", "1,4", "--disciplines", "hybrid,ht", "--groups", "1,4,W",
                                                "--ht-taus", "4"])
    assert staleness.specs(args, 4) == ["hybrid:tau=1", "hybrid:tau=4", "ht:groups=1,tau=4", "ht:groups=4,tau=4"]
    assert staleness.specs(args, 16)[-1] == "ht:groups=16,tau=4"


def test_a_sweep_over_several_w_is_drawn_one_row_per_w(tmp_path):
    def run(label, workers, seed, auc):
        name = label.split(":")[0]
        return {"label": label, "discipline": name, "workers": workers, "seed": seed, "auc": auc, "logloss": 0.4,
                "tau": 0 if name == "sync" else int(label.split("=")[-1]), "lr_scale": 1.0, "dense_lr_scale": 1.0,
                "curve": [{"samples": s, "auc": auc - 0.1 + s / 1e5} for s in (1000, 2000)]}
    runs = staleness.with_gaps([run(label, w, seed, 0.8 - 0.01 * n)
                                for w in (4, 16) for seed in (0, 1)
                                for n, label in enumerate(["sync", "hybrid:tau=1", "hybrid:tau=4", "ssp:s=4"])])
    report = {"settings": {"config": "c", "samples": 2000, "visibility": 0.5}, "runs": runs,
              "cells": staleness.cells(runs), "claims": staleness.claims(runs, 2000, {})}
    staleness.plot(report, str(tmp_path / "sweep.png"))
    from matplotlib.image import imread

    height, width = imread(tmp_path / "sweep.png").shape[:2]
    assert height > 0.55 * width  # two rows of panels (the claims' figure is one row, 16 x 4.5)


def test_a_sweep_without_the_claims_cell_headlines_each_disciplines_gap_near_w16_tau4():
    runs = staleness.with_gaps([{"label": label, "discipline": label.split(":")[0], "workers": 4, "seed": 0,
                                 "tau": 0 if label == "sync" else int(label.split("=")[-1]), "auc": auc,
                                 "logloss": 0.4, "lr_scale": 1.0, "dense_lr_scale": 1.0}
                                for label, auc in (("sync", 0.80), ("hybrid:tau=1", 0.79), ("hybrid:tau=4", 0.78),
                                                   ("ht:groups=2,tau=4", 0.81))])
    report = {"runs": runs, "cells": staleness.cells(runs), "claims": staleness.claims(runs, 1000, {})}
    assert staleness.headline(report) == {"samples": 1000,
                                          "ht G=2 - sync AUC % (W=4, tau/s 4)": pytest.approx(1.25),
                                          "hybrid - sync AUC % (W=4, tau/s 4)": pytest.approx(-2.5)}
