"""A user's own small file: the defaults that learn on it (batch size, rates, validation split,
early stopping with the best step kept, standardised dense columns, missing cells), evaluating a
checkpoint on other data, and switching the model with --set."""
import json

import numpy as np
import pytest
import yaml

from hybridrec.cli import main
from hybridrec.config import ConfigError, load_config, parse_config
from hybridrec.data.planted_table import PlantedTable, write_planted_table
from hybridrec.data.standardize import dense_statistics
from hybridrec.data.tabular import TabularSchema, tabular_reader
from hybridrec.train.data_defaults import batch_size_for
from hybridrec.train.evaluation import evaluate_checkpoint
from hybridrec.train.trainer import train


def own_config(tmp_path, csv, name="run", **train_section):
    """What a new user writes: data, schema, model (and where the run goes)."""
    return {"data": {"format": "tabular", "path": str(csv), "test_fraction": 0.2, "schema": PlantedTable.schema()},
            "model": {"name": "lr"},
            "train": {"output_dir": str(tmp_path / name), "progress": False, **train_section}}


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    return write_planted_table(tmp_path_factory.mktemp("own") / "table.csv", rows=1_500, seed=1)


@pytest.fixture(scope="module")
def trained(table, tmp_path_factory):
    """A run with every default but a shorter patience (seconds, not minutes)."""
    tmp = tmp_path_factory.mktemp("run")
    config = own_config(tmp, table.path, patience=1)
    return tmp, config, train(parse_config(config))


def test_a_config_naming_data_schema_and_model_learns_with_early_stopping_and_keeps_the_best_step(trained, table):
    tmp, _, result = trained
    assert result["auc"] > 0.65, (result["auc"], table.planted_auc)  # 0.5 with the defaults of old
    stopping, best = result["early_stopping"], result["best_valid"]
    assert stopping["stopped"] and result["step"] > best["step"] == stopping["model_of_step"]
    # the run's checkpoint holds the best step's model: scoring it gives the test metrics printed
    again = evaluate_checkpoint(None, tmp / "run")
    assert again["auc"] == pytest.approx(result["auc"], abs=1e-6)
    saved = json.loads(next((tmp / "run" / "checkpoints").glob("step-*/config.json")).read_text())
    assert saved["data"]["batch_size"] == batch_size_for(1_200) == 32
    assert saved["data"]["valid_fraction"] > 0 and saved["train"]["early_stopping"] is True
    assert len(saved["data"]["schema"]["dense_mean"]) == 3


def test_the_defaults_are_printed_and_an_explicit_epoch_count_trains_that_many_epochs(table, tmp_path, capsys):
    config = own_config(tmp_path, table.path, epochs=1)
    config["data"]["batch_size"] = 500
    result = train(parse_config(config))
    out = capsys.readouterr().out
    assert "defaults: embedding tables: adagrad lr" in out and "defaults: dense columns standardised" in out
    assert "early stopping" not in out and "batch size" not in out
    assert result["step"] == 3 and "best_valid" not in result and "early_stopping" not in result


def test_batch_size_grows_with_the_rows_to_the_big_data_default():
    sizes = [batch_size_for(rows) for rows in (500, 5_000, 50_000, 500_000, 50_000_000)]
    assert sizes == sorted(sizes) and sizes[0] == 32 and sizes[-1] == 4096
    assert all(s & (s - 1) == 0 for s in sizes)


def test_statistics_come_from_the_training_rows_and_an_empty_cell_reads_as_the_mean(tmp_path):
    csv = tmp_path / "t.csv"
    csv.write_text("y,a,b,c\n1,1,10,x\n0,,20,\n1,3,,y\n0,100,1000,z\n")
    schema = TabularSchema(labels=("y",), dense=("a", "b"), categorical=("c",))
    stats = dense_statistics(csv, schema, (0, 3))  # the last row is held out
    assert stats.mean == pytest.approx((2.0, 15.0)) and stats.std == pytest.approx((np.sqrt(2), np.sqrt(50)))
    assert stats.missing == pytest.approx((1 / 3, 1 / 3))
    scaled = stats.applied(schema)
    dense = np.concatenate([b.dense for b in tabular_reader(csv, scaled, 8)])
    np.testing.assert_allclose(dense[:3], [[-1 / np.sqrt(2), -5 / np.sqrt(50)], [0.0, 5 / np.sqrt(50)],
                                           [1 / np.sqrt(2), 0.0]], rtol=1e-6, atol=1e-7)
    raw = np.concatenate([b.dense for b in tabular_reader(csv, schema, 8)])
    assert raw[1, 0] == 0.0 and raw[3, 1] == 1000.0  # without statistics: as read, an empty cell 0


def test_eval_scores_other_data_and_refuses_only_what_changes_the_model_naming_the_key(trained, table, tmp_path,
                                                                                         capsys):
    run_tmp, config, result = trained
    rows = table.path.read_text().splitlines()
    new = tmp_path / "new.csv"
    new.write_text("\n".join([rows[0], *rows[-300:]]) + "\n")  # test rows of another file
    other = json.loads(json.dumps(config))
    other["data"].pop("test_fraction")
    other["data"]["test_path"] = str(new)
    path = tmp_path / "other.yaml"
    path.write_text(yaml.safe_dump(other))
    assert main(["eval", str(path), "--checkpoint", str(run_tmp / "run"), "--json"]) == 0
    scored = json.loads(capsys.readouterr().out)
    assert scored["count"] == 300 and scored["auc"] > 0.6
    other["data"]["schema"]["categorical"] = ["city", "device", "plan"]
    path.write_text(yaml.safe_dump(other))
    assert main(["eval", str(path), "--checkpoint", str(run_tmp / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert "data.schema.categorical: checkpoint" in err and len(err.splitlines()) == 1
    with pytest.raises(ConfigError, match=r"model.embedding_dim: checkpoint 16, the config 8"):
        evaluate_checkpoint(parse_config({**config, "model": {"name": "lr", "embedding_dim": 8}}), run_tmp / "run")


def test_set_model_name_drops_the_other_models_hparams_with_a_note(tmp_path, capsys):
    path = tmp_path / "deepfm.yaml"
    path.write_text(yaml.safe_dump({"model": {"name": "deepfm", "hparams": {"hidden": [8]}}}))
    cfg = load_config(path, ["model.name=lr"])
    assert cfg.model.name == "lr" and cfg.model.hparams == {}
    assert "--set model.name=lr: dropped model.hparams hidden" in capsys.readouterr().err
    assert load_config(path, ["model.name=dcn"]).model.hparams == {"hidden": [8]}  # dcn takes hidden
    with pytest.raises(ConfigError, match="'hidden' is not a hyper-parameter of model 'lr'"):
        load_config(path, ["model.name=lr", "model.hparams.hidden=[4]"])  # asked for on the command line
    path.write_text(yaml.safe_dump({"model": {"name": "lr", "hparams": {"hidden": [8]}}}))
    with pytest.raises(ConfigError, match="'hidden' is not a hyper-parameter"):
        load_config(path)  # the file's own mistake is still one
