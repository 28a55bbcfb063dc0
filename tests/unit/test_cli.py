"""Tests of the `hybridrec` command: help for every subcommand, user errors as one message on
stderr with exit code 2, train / resume / eval end to end, and `data synth` files that the
Criteo reader reads."""
import json
import subprocess
import sys

import numpy as np
import pytest
import torch
import yaml

from hybridrec.cli import main
from hybridrec.data import Batch, CriteoReader, SyntheticReader, criteo_like
from hybridrec.train.summary import EVAL_KEYS, SUMMARY_KEYS
from helpers import summary_of

torch.set_num_threads(1)


@pytest.mark.parametrize("argv, expected", [
    ([], "{train,eval,export,predict,serve,data,models,calibrate,plan,bench,serve-ps,embedding-worker,group-ps,launch,scale}"),
    (["export"], "--precision"),
    (["predict"], "--data"),
    (["serve"], "--batch-wait-ms"),
    (["eval"], "--predictions"),
    (["plan"], "--group-ps"),
    (["train"], "--resume"),
    (["eval"], "--checkpoint"),
    (["data"], "synth"),
    (["data", "synth"], "--rows"),
    (["bench"], "embedding"),
    (["serve-ps"], "--port"),  # the PS server's own options
])
def test_help_of_every_subcommand(capsys, argv, expected):
    with pytest.raises(SystemExit) as info:
        main(argv + ["--help"])
    assert info.value.code == 0
    assert expected in capsys.readouterr().out


def test_the_command_line_run_with_a_bad_config_exits_2_with_the_message_on_stderr(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  name: deepfn\n")
    done = subprocess.run([sys.executable, "-m", "hybridrec.cli", "train", str(bad)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2
    assert f"{bad}:2: model.name" in done.stderr and "did you mean 'deepfm'" in done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""


def test_missing_config_and_unknown_options_are_usage_errors(tmp_path, capsys):
    assert main(["train", str(tmp_path / "nope.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["train", "x.yaml", "--bogus"])
    assert info.value.code == 2


def small_job(tmp_path) -> str:
    job = {
        "data": {"format": "synthetic", "batch_size": 512,
                 "synthetic": {"vocab_size": 100, "train_rows": 5_000, "test_rows": 2_000}},
        "model": {"name": "fm", "embedding_dim": 4},
        "embedding": {"default": {"capacity": 10_000}},
        "train": {"output_dir": str(tmp_path / "run"), "progress": False},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return str(path)


def test_train_set_resume_and_eval_end_to_end(tmp_path, capsys):
    job = small_job(tmp_path)
    assert main(["train", job, "--set", "train.max_steps=4"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("hybridrec train: strategy local (placement local")  # the strategy first
    said = summary_of(out)
    assert set(SUMMARY_KEYS) <= set(said) and said["steps"] == "4" and said["samples"] == "2,048"
    assert "planted model's" in said["test AUC"] and said["staleness"].startswith("max 0, mean 0.00")
    assert main(["train", job]) == 2  # a fresh run would overwrite the first one's checkpoints
    assert "--resume" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", job, "--resume", "--overwrite"])
    capsys.readouterr()
    assert main(["train", job, "--resume", "--json"]) == 0
    captured = capsys.readouterr()
    assert captured.err.startswith("hybridrec train: strategy local")  # --json keeps stdout for the JSON
    final = json.loads((tmp_path / "run" / "final_metrics.json").read_text())
    assert json.loads(captured.out) == final and final["step"] == 10  # 5,000 rows in batches of 512
    assert main(["eval", job, "--checkpoint", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    said = summary_of(out)  # words, not JSON
    assert out.startswith("hybridrec eval: strategy local") and set(EVAL_KEYS) <= set(said)
    assert said["test AUC"] == f"{final['auc']:.5f}" and said["test rows"] == "2,000" and "(step 10)" in said["checkpoint"]
    assert main(["eval", job, "--checkpoint", str(tmp_path / "run"), "--json"]) == 0
    evaluated = json.loads(capsys.readouterr().out)  # --json: stdout is the JSON alone
    assert evaluated["step"] == 10 and evaluated["auc"] == final["auc"]


def test_eval_of_a_directory_without_checkpoints_is_a_usage_error(tmp_path, capsys):
    assert main(["eval", small_job(tmp_path), "--checkpoint", str(tmp_path)]) == 2
    assert "no training checkpoint" in capsys.readouterr().err


def test_data_synth_writes_criteo_rows_equal_to_the_generator(tmp_path, capsys):
    out = tmp_path / "synth.tsv"
    assert main(["data", "synth", "--out", str(out), "--rows", "3000", "--seed", "5", "--vocab-size", "300"]) == 0
    assert "3000" in capsys.readouterr().out
    read = Batch.concat(list(CriteoReader(out, batch_size=1024)))
    made = Batch.concat(list(SyntheticReader(criteo_like(vocab_size=300), 3000, 1024, seed=5)))
    assert len(read) == 3000 and read.dense.shape == (3000, 13)
    assert read.sparse.names == [f"C{i}" for i in range(1, 27)]
    np.testing.assert_array_equal(read.labels, made.labels)
    np.testing.assert_array_equal(read.sparse.values, made.sparse.values)


def test_an_empty_test_set_is_pointed_out(tmp_path, capsys):
    job = small_job(tmp_path)
    csv = tmp_path / "d.tsv"
    assert main(["data", "synth", "--out", str(csv), "--rows", "600"]) == 0
    assert main(["train", job, "--set", "data.format=criteo", "--set", f"data.path={csv}",
                 "--set", "data.train_rows=1000"]) == 0
    assert "the test set is empty" in capsys.readouterr().err
