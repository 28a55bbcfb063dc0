"""Tests of what a run does with its inputs (issue 16, items 11-17): no training rows is an error
that says what was read and rejected; metrics files are strict JSON; each bad line is reported
once, by the split it belongs to; user mistakes are one-line errors with exit code 2 (tracebacks
are for bugs); the shuffle buffer and the validation split with its best checkpoint; every
model's hyper-parameters are printed with their defaults."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from hybridrec.cli import main
from hybridrec.config import ConfigError, load_config, parse_config
from hybridrec.data import Batch, SyntheticReader, criteo_like
from hybridrec.data.shuffle import ShuffleBuffer
from hybridrec.data.tabular import DelimitedTextReader, TabularSchema
from hybridrec.errors import UserError
from hybridrec.models import HPARAM_HELP, MODELS, model_hparams
from hybridrec.train.evaluation import evaluate_checkpoint
from hybridrec.train.trainer import train

torch.set_num_threads(1)
README = Path(__file__).resolve().parents[2] / "README.md"
SCHEMA = {"labels": ["y"], "dense": ["x"], "categorical": ["k"]}


def strict_json(text: str):
    """json.loads that refuses NaN and Infinity, which are not JSON."""
    def refuse(name):
        raise ValueError(f"{name} is not JSON")
    return json.loads(text, parse_constant=refuse)


def job(tmp_path, csv_lines, **data) -> dict:
    csv = tmp_path / "d.csv"
    csv.write_text("".join(csv_lines))
    return {"data": {"format": "tabular", "path": str(csv), "schema": dict(SCHEMA), "batch_size": 64,
                     "prefetch": 1, **({"train_rows": 200} if "test_path" not in data else {}), **data},
            "model": {"name": "fm", "embedding_dim": 4},
            "embedding": {"default": {"capacity": 5_000}},
            "train": {"output_dir": str(tmp_path / "run"), "progress": False}}


def good_lines(n, seed=0):
    rng = np.random.default_rng(seed)
    return [f"{int(rng.random() < 0.3 + 0.04 * (r % 10))},{rng.random():.3f},k{r % 10}\n" for r in range(n)]


def run_cli(tmp_path, data: dict, capsys, *extra) -> tuple[int, str]:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    code = main(["train", str(path), *extra])
    return code, capsys.readouterr().err


# --- item 11: no training rows; strict JSON ---------------------------------------------------

@pytest.mark.parametrize("lines, shows", [
    ([], ["expected a header line", "the file is empty"]),
    (["y,x,k\n"], ["gave 0 rows, 0 of them rejected", "only a header"]),
    (["y,x,k\n", "yes,1.0,a\n", "no,2.0,b\n", "1,cheap,c\n"],
     ["gave 3 rows, 3 of them rejected", "d.csv:2: column 1 (y): label is not a number", "(value 'yes')",
      "d.csv:4: column 2 (x): not a number (value 'cheap')"]),
])
def test_no_training_rows_is_an_error_saying_what_was_read_and_rejected(tmp_path, capsys, lines, shows):
    code, err = run_cli(tmp_path, job(tmp_path, lines), capsys)
    assert code == 2 and "Traceback" not in err
    assert err.startswith("hybridrec train: error: ") and err.count("\n") == 1, err
    for text in shows:
        assert text in err
    assert not (tmp_path / "run" / "final_metrics.json").exists()


def test_metrics_files_are_strict_json_with_null_for_a_metric_that_is_not_a_number(tmp_path):
    # every test row has label 0: AUC is undefined
    lines = ["y,x,k\n"] + good_lines(200) + ["0,0.5,k1\n"] * 50
    result = train(parse_config(job(tmp_path, lines, **{"train_rows": 200})))
    assert np.isnan(result["auc"])
    final = strict_json((tmp_path / "run" / "final_metrics.json").read_text())
    assert final["auc"] is None and final["count"] == 50
    for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines():
        strict_json(line)


# --- item 12: each bad line once ---------------------------------------------------------------

def test_a_row_range_reads_and_reports_only_its_own_lines(tmp_path, caplog):
    lines = ["y,x,k\n"] + good_lines(10)
    lines[3] = "1,bad,k\n"  # data row 2
    lines[8] = "2,0.1,k\n"  # data row 7
    path = tmp_path / "r.csv"
    path.write_text("".join(lines))
    schema = TabularSchema(**{k: tuple(v) for k, v in SCHEMA.items()})
    first = DelimitedTextReader(path, schema, 4, row_range=(0, 5))
    rest = DelimitedTextReader(path, schema, 4, row_range=(5, None))
    assert np.concatenate([b.sample_ids for b in first]).tolist() == [0, 1, 3, 4]
    assert np.concatenate([b.sample_ids for b in rest]).tolist() == [5, 6, 8, 9]
    assert (first.bad_rows.count, rest.bad_rows.count) == (1, 1)
    assert [b.line for b in first.bad_rows.examples] == [4] and [b.line for b in rest.bad_rows.examples] == [9]
    list(first)  # a second pass counts again but does not warn again
    assert first.bad_rows.count == 1
    assert len([r for r in caplog.records if "skipping bad row" in r.getMessage()]) == 2


# --- item 13 and 14: the config refuses what it would ignore; the schema is validated ----------

def test_a_test_file_with_a_row_split_is_refused_naming_both(tmp_path):
    data = job(tmp_path, good_lines(5), test_path=str(tmp_path / "d.csv"))
    for split, value in (("train_rows", 100), ("test_fraction", 0.2)):
        with pytest.raises(ConfigError, match=rf"data.test_path and data.{split} exclude each other"):
            parse_config({**data, "data": {**data["data"], split: value}})


@pytest.mark.parametrize("schema_text, line, message", [
    ("    multi_seperator: ';'\n", 8, "data.schema.multi_seperator: unknown key 'multi_seperator' "
                                    "(did you mean 'multi_separator'?)"),
    ("    multi_separator: null\n", 8, "data.schema.multi_separator: Input should be a valid string"),
    ("    header: false\n", 8, "data.schema.header: is false, so column_names must name"),
    ("    dense_transform: log\n", 8, "data.schema.dense_transform: must be one of ('none', 'log1p'), "
                                     "got 'log'"),
])
def test_schema_keys_are_validated_with_file_line_and_closest_name(tmp_path, schema_text, line, message):
    path = tmp_path / "job.yaml"
    path.write_text("data:\n  format: tabular\n  path: d.csv\n  train_rows: 10\n  schema:\n    labels: [y]\n"
                    "    dense: [x]\n" + schema_text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert f"{path}:{line}: {message}" in str(info.value)


def test_the_readme_documents_every_schema_key():
    import dataclasses

    readme = README.read_text()
    for field in dataclasses.fields(TabularSchema):
        assert f"`{field.name}`" in readme, field.name


# --- item 15: user mistakes are one line with exit code 2 ---------------------------------------

def _parquet(tmp_path) -> str:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"y": [0, 1], "x": [0.5, 1.5], "k": ["a", "b"]}), path)
    return str(path)


@pytest.mark.parametrize("mistake, says", [
    ({"data.schema": {"labels": ["y"], "dense": ["price"], "categorical": ["k"]}},
     "columns ['price'] named by the schema are not among"),
    ({"data.schema": {"labels": ["y"], "dense": ["x"]}}, "data.schema: name at least one sparse column"),
    ({"data.strict": True, "lines": ["y,x,k\n", "1,0.5,a\n", "1,oops,b\n"]}, "d.csv:3: column 2 (x): not a number"),
    ({"data.format": "criteo", "data.schema": None, "data.path": "PARQUET"}, "this is a Parquet file"),
    ({"data.path": "FAKE.parquet"}, "not a Parquet file"),
    ({"model.name": "dcn", "model.hparams": {"hidden": [0]}}, "model.hparams.hidden must be a list of positive ints"),
    ({"model.name": "dlrm", "model.hparams": {"bottom_mlp": [8, 3]}}, "model.hparams.bottom_mlp must end with"),
    ({"embedding.default": {"capacity": 1}}, "embedding.per_feature.k.capacity"),
    ({"embedding.default": {"capacity": 1}, "train.pipeline": True, "train.threads": 2},
     "embedding.per_feature.k.capacity"),  # raised in the pipelined step's thread, reported the same
])
def test_user_mistakes_are_one_line_errors_with_exit_code_2(tmp_path, capsys, mistake, says):
    mistake = dict(mistake)
    data = job(tmp_path, mistake.pop("lines", ["y,x,k\n"] + good_lines(300)))
    for key, value in mistake.items():
        section, name = key.split(".")
        if value == "PARQUET":
            value = _parquet(tmp_path)
        elif value == "FAKE.parquet":
            (tmp_path / value).write_text("y,x,k\n1,2,3\n")
            value = str(tmp_path / value)
        if value is None:
            data[section].pop(name)
        else:
            data[section][name] = value
    code, err = run_cli(tmp_path, data, capsys)
    assert code == 2 and "Traceback" not in err and err.count("\n") == 1, err
    assert says in err


# --- item 16: shuffle buffer; validation split and the best checkpoint --------------------------

def rows_of(source) -> Batch:
    return Batch.concat(list(source))


def test_take_rows_gathers_jagged_rows_in_any_order():
    batch = rows_of(SyntheticReader(criteo_like(vocab_size=50, n_multi_hot=2), 300, 300, seed=1))
    order = np.random.default_rng(0).permutation(300)[:120]
    taken = batch.take_rows(order).validate()
    assert taken.sample_ids.tolist() == batch.sample_ids[order].tolist()
    for name in batch.sparse.names:
        values, offsets = batch.feature(name)
        got, got_offsets = taken.feature(name)
        for i, row in enumerate(order):
            assert got[got_offsets[i]:got_offsets[i + 1]].tolist() == values[offsets[row]:offsets[row + 1]].tolist()
    np.testing.assert_array_equal(taken.dense, batch.dense[order])


def test_the_shuffle_buffer_mixes_every_row_once_deterministically_by_seed():
    source = SyntheticReader(criteo_like(vocab_size=50), 5_000, 256, seed=3)
    first = list(ShuffleBuffer(source, 1_000, 256, seed=7))
    ids = np.concatenate([b.sample_ids for b in first]).astype(np.int64)
    assert sorted(ids.tolist()) == list(range(5_000))  # every row exactly once
    assert [len(b) for b in first[:-1]] == [256] * (len(first) - 1)
    assert np.mean(ids != np.arange(5_000)) > 0.9  # not the file order
    assert np.median(np.abs(ids - np.arange(5_000))) < 2 * 1_000  # rows move by about a buffer length
    again = np.concatenate([b.sample_ids for b in ShuffleBuffer(source, 1_000, 256, seed=7)])
    other = np.concatenate([b.sample_ids for b in ShuffleBuffer(source, 1_000, 256, seed=8)])
    assert again.tolist() == ids.tolist() and other.tolist() != ids.tolist()
    whole = rows_of(first)
    order = np.argsort(ids)
    np.testing.assert_array_equal(whole.labels[order], rows_of(source).labels)


def test_a_validation_split_is_evaluated_during_training_and_its_best_checkpoint_kept(tmp_path):
    data = job(tmp_path, ["y,x,k\n"] + good_lines(1_000), train_rows=800, valid_fraction=0.25,
               shuffle_buffer=128)
    data["train"].update(eval_every=2, epochs=2)
    cfg = parse_config(data)
    result = train(cfg)
    out = tmp_path / "run"
    records = [strict_json(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    valid = [r for r in records if r["split"] == "valid"]
    assert [r["step"] for r in valid] == list(range(2, 22, 2)) and all(r["count"] == 200 for r in valid)
    assert not [r for r in records if r["split"] == "test"]  # the test rows wait for the end
    best = max(valid, key=lambda r: r["auc"])
    recorded = strict_json((out / "best" / "best.json").read_text())
    assert recorded["step"] == best["step"] == result["best_valid"]["step"]
    assert recorded["valid_auc"] == best["auc"]
    assert [p.name for p in (out / "best" / "checkpoints").glob("step-*")] == [f"step-{best['step']:09d}"]
    assert evaluate_checkpoint(cfg, out / "best")["step"] == best["step"]
    assert result["samples"] == 2 * 600 and result["count"] == 200  # train 600 rows, valid 200, test 200


def test_valid_path_and_valid_fraction_exclude_each_other(tmp_path):
    data = job(tmp_path, good_lines(5), valid_fraction=0.1, valid_path="v.csv")
    with pytest.raises(ConfigError, match="data.valid_path and data.valid_fraction exclude each other"):
        parse_config(data)


# --- item 17: every model's hyper-parameters with defaults ------------------------------------

def test_hybridrec_models_prints_every_models_hyper_parameters_with_defaults(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    # the last line says how to name a model of one's own instead
    assert lines[-1].startswith("A model of your own: model.name 'package.module:Factory'")
    blocks = {}
    for line in lines[1:-1]:
        if not line.startswith(" "):
            current = line.split(":")[0]
            blocks[current] = []
        else:
            blocks[current].append(line.strip())
    assert set(blocks) == set(MODELS)
    for name in MODELS:
        for key, default in model_hparams(name).items():
            shown = list(default) if isinstance(default, tuple) else default
            assert f"{key} = {shown!r}: {HPARAM_HELP[key]}" in blocks[name], (name, key)
