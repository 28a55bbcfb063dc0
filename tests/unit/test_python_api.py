"""hybridrec.api: a dense model and loss of the user's trained over hybridrec's tables, pandas
DataFrames as data, and what a custom model goes through (checkpoint, resume, eval, export) or is
refused with a reason."""
import importlib.util
import textwrap
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from hybridrec.api import Job
from hybridrec.config import ConfigError, parse_config
from hybridrec.errors import UserError
from hybridrec.metrics import auc
from hybridrec.train.evaluation import evaluate_checkpoint
from hybridrec.train.trainer import train

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "custom_model.py"
SCHEMA = {"labels": ["clicked"], "dense": ["price"], "categorical": ["user", "item", "device"]}
ARCH = """
import torch
from torch import nn


class TinyArch(nn.Module):
    def __init__(self, inputs, hidden=8):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(inputs.pooled_width + inputs.num_dense, hidden), nn.ReLU(),
                                 nn.Linear(hidden, inputs.num_tasks))

    def forward(self, dense, sparse):
        return self.mlp(torch.cat([dense, sparse.values()], dim=1))


def weighted_bce(logits, labels):
    return nn.functional.binary_cross_entropy_with_logits(logits, labels, pos_weight=torch.tensor(2.0))
"""


def _example():
    spec = importlib.util.spec_from_file_location("custom_model_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _frame(rows: int, seed: int) -> pd.DataFrame:
    """Rows whose click depends on the item: strings, integers with gaps (floats in pandas), NaN."""
    rng = np.random.default_rng(seed)
    item = rng.integers(0, 30, rows)
    logit = np.random.default_rng(0).normal(0, 1.5, 30)[item] - 0.5
    return pd.DataFrame({
        "user": [f"u{i}" for i in rng.integers(0, 50, rows)],
        "item": item,
        "device": pd.Series(rng.integers(0, 4, rows), dtype=float).where(rng.random(rows) > 0.2),
        "price": np.where(rng.random(rows) > 0.1, rng.normal(0, 1, rows), np.nan),
        "clicked": (rng.random(rows) < 1 / (1 + np.exp(-logit))).astype(np.float32),
        "ignored": "not in the schema",
    })


def _config(tmp_path, name="run", **train):
    return {"seed": 3, "data": {"schema": SCHEMA, "batch_size": 128, "prefetch": 0},
            "model": {"embedding_dim": 4},
            "embedding": {"default": {"capacity": 1000, "optimizer": {"name": "adagrad", "lr": 0.1}}},
            "train": {"progress": False, "output_dir": str(tmp_path / name), "dense_optimizer": {"lr": 0.01},
                      **train}}


@pytest.fixture()
def arch(tmp_path):
    """A module file of the user's with a model factory and a loss."""
    path = tmp_path / "arch.py"
    path.write_text(textwrap.dedent(ARCH))
    return path


def test_the_example_trains_its_own_model_and_loss_and_scores_a_dataframe(tmp_path):
    done = _example().main(["--out", str(tmp_path / "run"), "--rows", "4000"])
    new_rows = done["new_rows"]
    assert new_rows["auc"] > 0.65 and new_rows["auc"] < done["planted_auc"] + 0.02  # learnt, and no oracle
    # predict scores the same model on the same rows as evaluate does
    assert auc(done["labels"], done["scores"]) == pytest.approx(new_rows["auc"], abs=1e-6)
    assert done["scores"].shape == (2000,) and np.isfinite(done["scores"]).all()


def test_a_dataframe_trains_and_scores_as_the_same_rows_in_a_csv_file(tmp_path):
    train_rows, test_rows = _frame(1500, 1), _frame(500, 2)
    for rows, name in ((train_rows, "train.csv"), (test_rows, "test.csv")):  # as pandas users write CSV files
        rows.astype({"device": "Int64"}).to_csv(tmp_path / name, index=False)
    config = _config(tmp_path, "from-csv", epochs=2)
    config["model"]["name"] = "lr"
    from_csv = train(parse_config({**config, "data": {**config["data"], "format": "tabular",
                                                      "path": str(tmp_path / "train.csv"),
                                                      "test_path": str(tmp_path / "test.csv")}}))
    job = Job(_config(tmp_path, "from-frame", epochs=2), model="lr")
    from_frame = job.fit(train=train_rows, test=test_rows)
    assert from_frame["auc"] == from_csv["auc"] and from_frame["logloss"] == from_csv["logloss"]
    assert from_frame["auc"] > 0.65
    # the test rows scored one by one give the metrics' AUC
    assert auc(test_rows["clicked"], job.predict(test_rows)) == pytest.approx(from_frame["auc"], abs=1e-6)


def test_a_model_named_by_import_path_resumes_exactly_and_evaluates_and_exports_like_a_builtin(tmp_path, arch):
    rows, test_rows = _frame(1200, 1), _frame(400, 2)
    named = {"model": f"{arch}:TinyArch", "hparams": {"hidden": 6}, "loss": f"{arch}:weighted_bce"}
    whole = Job(_config(tmp_path, "whole", max_steps=12), **named)
    whole.fit(train=rows, test=test_rows)
    halves = Job(_config(tmp_path, "halves", max_steps=6), **named)
    halves.fit(train=rows, test=test_rows)
    halves = Job(_config(tmp_path, "halves", max_steps=12), **named)
    halves.fit(train=rows, test=test_rows, resume=True)
    assert np.array_equal(whole.predict(test_rows), halves.predict(test_rows))
    # `hybridrec eval` reads the checkpoint with the config saved in it, the model from its import path
    assert evaluate_checkpoint(None, whole.cfg.train.output_dir)["auc"] == whole.evaluate()["auc"]
    # an exported bundle scores the rows as the job does
    from hybridrec.serving.predict_file import predict_file

    bundle = whole.export(tmp_path / "bundle")
    test_rows.astype({"device": "Int64"}).to_csv(tmp_path / "rows.csv", index=False)
    predict_file(bundle, tmp_path / "rows.csv", tmp_path / "scores.csv")
    served = pd.read_csv(tmp_path / "scores.csv")["score"].to_numpy()
    np.testing.assert_allclose(served, whole.predict(test_rows), atol=1e-6)


class _Instance(torch.nn.Module):
    def __init__(self, width: int, outputs: int = 1):
        super().__init__()
        self.linear = torch.nn.Linear(width, outputs)

    def forward(self, dense, sparse):
        return self.linear(torch.cat([dense, sparse.values()], dim=1)).squeeze(1)  # [B]: one task


def test_a_module_instance_and_a_lambda_loss_train_here_and_are_refused_where_they_cannot_go(tmp_path):
    rows = _frame(600, 1)
    module = _Instance(1 + 3 * 4)
    job = Job(_config(tmp_path, epochs=1), model=module,
              loss=lambda logits, labels: torch.nn.functional.binary_cross_entropy_with_logits(logits, labels))
    job.fit(train=rows, test=rows)
    assert job.cfg.model.name == "object" and job.cfg.model.loss == "object"
    assert np.isfinite(job.predict(rows)).all()
    with pytest.raises(UserError, match="export: model.name is object.*import path"):
        job.export(tmp_path / "bundle")
    with pytest.raises(UserError, match="Job.load: .*pass model="):
        Job.load(tmp_path / "run")
    assert np.array_equal(Job.load(tmp_path / "run", model=_Instance(13)).predict(rows), job.predict(rows))
    distributed = Job(_config(tmp_path, "d"), model=_Instance(13), overrides=["strategy.preset=picasso"])
    with pytest.raises(UserError, match="every trainer process"):
        distributed.fit(train=rows, test=rows)


def test_mistakes_are_named(tmp_path, arch):
    with pytest.raises(ConfigError, match="model.name: cannot import 'no_such_package.models'"):
        Job(_config(tmp_path), model="no_such_package.models:Arch")
    with pytest.raises(ConfigError, match=r"model.hparams: 'depth' is not a hyper-parameter.*allowed: \['hidden'\]"):
        Job(_config(tmp_path), model=f"{arch}:TinyArch", hparams={"depth": 2})
    with pytest.raises(ConfigError, match="model.loss: .* has no 'focal'"):
        Job(_config(tmp_path), loss=f"{arch}:focal")
    job = Job(_config(tmp_path), model=f"{arch}:TinyArch")
    with pytest.raises(UserError, match=r"fit\(train=...\): the DataFrame has no columns \['device'\]"):
        job.fit(train=_frame(100, 1).drop(columns=["device"]), test=_frame(100, 2))
    with pytest.raises(UserError, match="fit: no train rows: give train=DataFrame"):
        job.fit(test=_frame(100, 2))
    with pytest.raises(UserError, match="categorical column 'device' holds numbers that are not whole"):
        job.fit(train=_frame(100, 1).assign(device=0.5), test=_frame(100, 2))
    wrong = Job(_config(tmp_path, "wrong"), model=_Instance(13, outputs=3))
    with pytest.raises(UserError, match=r"forward returned shape \[128, 3\]; it must return logits \[B, num_tasks\]"):
        wrong.fit(train=_frame(200, 1), test=_frame(100, 2))
