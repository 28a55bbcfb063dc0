"""Tests of the training loop: a small run learns and leaves metrics and a checkpoint; a run
interrupted after a checkpoint and resumed ends bit-identical to an uninterrupted one; a
checkpoint evaluates to the run's final AUC; several label columns train as several tasks;
malformed CSV rows are counted and skipped; misuse of output directories is refused."""
import copy
import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from hybridrec.config import ConfigError, load_config, parse_config
from hybridrec.job.tables import embedding_tables
from hybridrec.train.checkpoint import latest_checkpoint
from hybridrec.train.evaluation import evaluate_checkpoint, load_local
from hybridrec.train.trainer import train
from helpers import small_config, trained_state

torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[2]
CRITEO_SAMPLE = Path(__file__).resolve().parents[3] / "shared/data/criteo-sample/criteo_first_9999.tsv"

def records(out_dir) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_small_synthetic_run_learns_and_leaves_metrics_and_a_checkpoint(tmp_path):
    cfg = small_config(tmp_path, **{"train.eval_every": 20})
    before = time.time()
    result = train(cfg)
    first, last = result["training_window"]  # when it trained, in wall-clock seconds
    assert before <= first < last <= time.time()
    assert result["auc"] > 0.65, result
    assert result["auc"] <= result["best_auc"] + 0.01  # the planted model is the ceiling
    assert result["step"] == 40 and result["samples"] == 20_000  # ceil(20000 / 512) batches
    out = tmp_path / "run"
    lines = records(out)
    train_lines = [r for r in lines if r["split"] == "train"]
    assert [r["step"] for r in train_lines] == [10, 20, 30, 40]
    test_lines = [r for r in lines if r["split"] == "test"]
    assert [r["step"] for r in test_lines] == [20, 40] and test_lines[0]["auc"] > 0.5
    assert lines[-1]["split"] == "final" and lines[-1]["auc"] == result["auc"]
    checkpoint = latest_checkpoint(out)
    assert checkpoint is not None
    assert json.loads((checkpoint / "progress.json").read_text())["step"] == 40
    assert json.loads((out / "final_metrics.json").read_text())["auc"] == result["auc"]


class Crash(RuntimeError):
    """Stands for the process dying in the middle of training."""


def crash_at(step_to_die):
    def on_step(step, model):
        if step == step_to_die:
            raise Crash(f"killed at step {step}")
    return on_step


@pytest.mark.parametrize("model, prefetch", [("deepfm", 2), ("dlrm", 0)])
def test_resume_after_a_crash_ends_exactly_like_an_uninterrupted_run(tmp_path, model, prefetch):
    # two epochs of 16 batches; checkpoint every 7 steps; die at step 24, i.e. 3 steps after
    # the checkpoint at step 21 (in the second epoch), so resuming must redo steps 22-24.
    # Dropout (torch RNG) and probabilistic admission (store state) must both carry over.
    hparams = {"hidden": [16], "dropout": 0.1} if model == "deepfm" else {"top_mlp": [16], "dropout": 0.1}
    changes = {"model.name": model, "model.hparams": hparams, "data.prefetch": prefetch,
               "data.synthetic.train_rows": 8_000, "data.synthetic.test_rows": 2_000, "train.epochs": 2,
               "train.checkpoint_every": 7, "embedding.default.admit_probability": 0.9}
    whole = small_config(tmp_path, "whole", **changes)
    broken = small_config(tmp_path, "broken", **changes)
    expected = train(whole)
    with pytest.raises(Crash):
        train(broken, on_step=crash_at(24))
    assert latest_checkpoint(broken.train.output_dir).name.endswith("21")
    kept = sorted(p.name for p in (tmp_path / "broken" / "checkpoints").glob("step-*"))
    assert kept == ["step-000000014", "step-000000021"]  # train.keep_checkpoints: the newest 2
    resumed = train(broken, resume=True)

    assert resumed["step"] == expected["step"] == 32
    assert resumed["auc"] == expected["auc"]
    dense_a, rows_a = trained_state(whole)
    dense_b, rows_b = trained_state(broken)
    assert dense_a.keys() == dense_b.keys()
    for name in dense_a:
        assert torch.equal(dense_a[name], dense_b[name]), name
    assert rows_a.keys() == rows_b.keys()
    if model == "deepfm":
        assert any(c == "wide" for c, _ in rows_a)  # first-order tables are checked too
    for table in rows_a:
        for field in rows_a[table]:
            np.testing.assert_array_equal(rows_a[table][field], rows_b[table][field], err_msg=f"{table} {field}")


def test_evaluating_a_checkpoint_reproduces_the_final_test_auc(tmp_path):
    cfg = small_config(tmp_path, **{"train.max_steps": 15})
    result = train(cfg)
    evaluated = evaluate_checkpoint(cfg, cfg.train.output_dir)
    assert evaluated["step"] == 15
    assert evaluated["auc"] == result["auc"] and evaluated["logloss"] == result["logloss"]


def test_a_fresh_run_refuses_a_directory_holding_another_runs_checkpoints_unless_overwriting(tmp_path):
    train(small_config(tmp_path, **{"train.max_steps": 5}))
    cfg = small_config(tmp_path, **{"train.max_steps": 2})
    with pytest.raises(FileExistsError, match="--resume.*--overwrite"):
        train(cfg)
    assert train(cfg, overwrite=True)["step"] == 2
    assert latest_checkpoint(cfg.train.output_dir).name.endswith("2")  # the old step-5 one is gone
    assert [r["step"] for r in records(tmp_path / "run") if r["split"] == "final"] == [2]


def test_resume_needs_a_checkpoint_and_the_same_data_and_model(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        train(small_config(tmp_path, "empty"), resume=True)
    train(small_config(tmp_path, **{"train.max_steps": 2}))
    with pytest.raises(ConfigError, match="data.batch_size: checkpoint 512, config 256"):
        train(small_config(tmp_path, **{"data.batch_size": 256}), resume=True)


def test_resume_with_more_steps_continues_and_appends_metrics(tmp_path):
    train(small_config(tmp_path, **{"train.max_steps": 20}))
    result = train(small_config(tmp_path, **{"train.max_steps": 30}), resume=True)
    assert result["step"] == 30
    steps = [r["step"] for r in records(tmp_path / "run") if r["split"] == "train"]
    assert steps == [10, 20, 30]


def write_events(path, rows: int, bad_lines: dict[int, str], seed: int = 0) -> None:
    """A CSV with two tasks: `click` depends on the user, `buy` on the item and the price."""
    rng = np.random.default_rng(seed)
    user_bias = rng.normal(0, 1.5, 50)
    item_bias = rng.normal(0, 1.5, 40)
    lines = ["click,buy,price,user,item,tags"]
    for r in range(rows):
        if r in bad_lines:
            lines.append(bad_lines[r])
            continue
        user, item = rng.integers(50), rng.integers(40)
        price = float(rng.exponential(20))
        click = rng.random() < 1 / (1 + np.exp(-user_bias[user]))
        buy = rng.random() < 1 / (1 + np.exp(-(item_bias[item] - 0.03 * price)))
        tags = "|".join(f"t{t}" for t in rng.choice(8, size=rng.integers(0, 4), replace=False))
        lines.append(f"{int(click)},{int(buy)},{price:.2f},u{user},i{item},{tags}")
    path.write_text("\n".join(lines) + "\n")


def tabular_config(tmp_path, csv, **changes):
    data = {"format": "tabular", "path": str(csv), "train_rows": 4_000, "batch_size": 256, "prefetch": 2,
            "schema": {"labels": ["click", "buy"], "dense": ["price"], "dense_transform": "log1p",
                       "categorical": ["user", "item"], "multi_categorical": ["tags"]}}
    return small_config(tmp_path, **{"data": data, "model.name": "dcn", "model.embedding_dim": 4,
                               "model.hparams": {"hidden": [16], "cross_layers": 1}, "train.epochs": 3,
                               **changes})


def test_two_label_columns_train_two_tasks_with_metrics_for_each(tmp_path):
    csv = tmp_path / "events.csv"
    write_events(csv, 5_000, {})
    result = train(tabular_config(tmp_path, csv))
    assert result["click/auc"] > 0.7 and result["buy/auc"] > 0.7, result
    assert result["count"] == 1_000
    final = records(tmp_path / "run")[-1]
    assert {"click/auc", "click/logloss", "buy/auc", "buy/ne"} <= final.keys()


def test_bad_csv_rows_are_counted_and_skipped_not_fatal_each_in_the_one_split_it_belongs_to(tmp_path, caplog):
    csv = tmp_path / "events.csv"
    bad = {10: "1,0,cheap,u1,i1,t1", 20: "1,0,3.5,u1", 30: "yes,0,1.0,u2,i2,", 4_500: "no,1,2.0,u3,i3,"}
    write_events(csv, 5_000, bad)
    result = train(tabular_config(tmp_path, csv, **{"train.epochs": 2, "train.eval_every": 16}))
    assert result["bad_rows"] == {"train": 3, "test": 1}
    assert result["samples"] == 2 * (4_000 - 3)  # train_rows counts data lines, bad ones included
    assert result["click/auc"] > 0.6
    warned = [r.getMessage() for r in caplog.records if "skipping bad row" in r.getMessage()]
    assert len(warned) == 4 and all(any(f"events.csv:{line + 2}:" in w for w in warned) for line in bad)


def test_strict_data_stops_at_the_first_bad_row_naming_file_and_line(tmp_path):
    csv = tmp_path / "events.csv"
    write_events(csv, 100, {10: "1,0,cheap,u1,i1,t1"})
    cfg = tabular_config(tmp_path, csv, **{"data.strict": True, "data.train_rows": 50})
    with pytest.raises(ValueError, match=rf"{csv}:12"):
        train(cfg)


def test_a_missing_data_file_is_a_config_error_naming_the_key_and_the_directory(tmp_path):
    cfg = small_config(tmp_path, **{"data": {"format": "criteo", "path": "no/such.tsv", "train_rows": 10}})
    with pytest.raises(ConfigError, match=r"data.path: file 'no/such.tsv' does not exist .*current directory"):
        train(cfg)


def test_table_settings_for_unknown_features_are_refused_with_the_closest_name(tmp_path):
    cfg = small_config(tmp_path, **{"embedding.per_feature": {"c1": {"capacity": 5}}})
    with pytest.raises(ConfigError, match="did you mean 'C1'"):
        train(cfg)


def test_per_feature_shared_and_wide_sections_change_only_what_they_name(tmp_path):
    cfg = small_config(tmp_path, **{"embedding": {
        "default": {"capacity": 777, "admit_min_frequency": 3, "optimizer": {"name": "adam", "lr": 0.01, "beta1": 0.8}},
        "per_feature": {"C1": {"capacity": 55, "optimizer": {"lr": 0.5}}},
        "shared": {"both": {"features": ["C2", "C3"], "optimizer": {"name": "sgd", "lr": 0.2}}},
        "wide": {"admit_min_frequency": 1}}})
    names = ["C1", "C2", "C3", "C4"]
    deep, mapping = embedding_tables(cfg, names, 4, wide=False)
    assert mapping == {"C1": "C1", "C2": "both", "C3": "both", "C4": "C4"}
    assert (deep["C1"].capacity, deep["C1"].admit_min_frequency) == (55, 3)
    assert deep["C1"].optimizer.name == "adam" and deep["C1"].optimizer.lr == 0.5
    assert deep["C1"].optimizer.params["beta1"] == 0.8
    assert deep["both"].optimizer.name == "sgd" and deep["both"].capacity == 777
    assert deep["C4"].optimizer.lr == 0.01
    wide, _ = embedding_tables(cfg, names, 1, wide=True)
    assert all(t.admit_min_frequency == 1 and t.capacity == 777 and t.dim == 1 for t in wide.values())
    assert len({t.seed for t in list(deep.values()) + list(wide.values())}) == len(deep) + len(wide)


@pytest.mark.parametrize("name", ["deepfm_criteo_sample", "dcn_criteo_sample"])
def test_the_criteo_sample_configs_beat_auc_0_70_on_the_held_out_rows(tmp_path, name):
    if not CRITEO_SAMPLE.is_file():
        pytest.skip(f"the Criteo sample is not at {CRITEO_SAMPLE}")
    cfg = load_config(REPO / "configs" / f"{name}.yaml",
                      [f"data.path={CRITEO_SAMPLE}", f"train.output_dir={tmp_path / 'run'}", "train.progress=false"])
    result = train(cfg)
    assert result["count"] == 1_999  # rows 8,000.. of the 9,999 are the test set
    assert result["auc"] >= 0.70, result


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_asking_for_cuda_without_it_is_a_clear_error(tmp_path):
    cfg = small_config(tmp_path, **{"train.device": "cuda"})
    with pytest.raises(ValueError, match="train.device: 'cuda' was asked for"):
        train(cfg)


def test_auto_device_trains_on_the_cpu_here_and_results_come_back_as_numbers(tmp_path):
    cfg = small_config(tmp_path, **{"train.device": "auto"})
    result = train(cfg)
    assert 0.5 < result["auc"] <= 1.0
