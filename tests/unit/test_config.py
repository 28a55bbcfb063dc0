"""Tests of the job config: unknown keys and bad values are refused at load time with the file
and line (or the --set item), the closest valid name and what is allowed; overrides apply;
every example config in configs/ loads."""
from pathlib import Path

import pytest

from hybridrec.config import ConfigError, JobConfig, load_config, parse_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def write(tmp_path, text: str) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return path


def error_of(path, overrides=None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return str(info.value)


@pytest.mark.parametrize("text, line, where, suggestion", [
    ("seed: 1\nsead: 2\n", 2, "sead", "seed"),
    ("data:\n  format: synthetic\n  batchsize: 12\n", 3, "data.batchsize", "batch_size"),
    ("data:\n  synthetic:\n    vocab_size: 10\n    zipf_exponnt: 1.1\n", 4, "data.synthetic.zipf_exponnt",
     "zipf_exponent"),
    ("embedding:\n  per_feature:\n    C1:\n      capacty: 5\n", 4, "embedding.per_feature.C1.capacty", "capacity"),
    ("embedding:\n  default:\n    optimizer: {name: adagrad, lr: 0.1, lrr: 3}\n", 3, "embedding.default.optimizer",
     "lr"),
    ("model:\n  name: dcn\n  hparams:\n    crosslayers: 2\n", 3, "model.hparams", "cross_layers"),
])
def test_unknown_keys_at_any_depth_name_the_line_and_the_closest_valid_key(tmp_path, text, line, where, suggestion):
    path = write(tmp_path, text)
    message = error_of(path)
    assert f"{path}:{line}: {where}" in message
    assert f"did you mean {suggestion!r}" in message


@pytest.mark.parametrize("text, line, where, allowed", [
    ("model:\n  name: deepfn\n", 2, "model.name", "'dcn'"),
    ("train:\n  dense_optimizer: {name: adamw}\n", 2, "train.dense_optimizer.name", "'adagrad'"),
    ("train:\n  epochs: 0\n", 2, "train.epochs", "greater than or equal to 1"),
    ("data:\n  batch_size: many\n", 2, "data.batch_size", "valid integer"),
    ("embedding:\n  default:\n    eviction: fifo\n", 3, "embedding.default.eviction", "'lfu'"),
])
def test_bad_values_name_the_line_the_value_and_what_is_allowed(tmp_path, text, line, where, allowed):
    path = write(tmp_path, text)
    message = error_of(path)
    assert f"{path}:{line}: {where}" in message
    assert allowed in message


def test_every_problem_is_reported_at_once(tmp_path):
    path = write(tmp_path, "seed: 0\ndata:\n  batchsize: 1\nmodel:\n  name: deepfn\ntrain:\n  epochs: -1\n")
    message = error_of(path)
    assert f"{path}:3: data.batchsize" in message
    assert f"{path}:5: model.name" in message
    assert f"{path}:7: train.epochs" in message


def test_file_formats_need_a_path_and_a_test_split(tmp_path):
    assert "data.path is required" in error_of(write(tmp_path, "data:\n  format: criteo\n"))
    message = error_of(write(tmp_path, "data:\n  format: criteo\n  path: x.tsv\n"))
    assert "data.test_path, data.train_rows or data.test_fraction" in message


def test_set_overrides_values_and_creates_sections(tmp_path):
    path = write(tmp_path, "model:\n  name: deepfm\ntrain:\n  epochs: 3\n")
    cfg = load_config(path, ["train.epochs=5", "model.hparams.hidden=[8, 4]", "data.synthetic.vocab_size=77"])
    assert cfg.train.epochs == 5
    assert tuple(cfg.model.hparams["hidden"]) == (8, 4)
    assert cfg.data.synthetic.vocab_size == 77
    assert cfg.model.name == "deepfm"


def test_set_works_on_an_empty_file(tmp_path):
    cfg = load_config(write(tmp_path, ""), ["train.epochs=2", "data.batch_size=64"])
    assert (cfg.train.epochs, cfg.data.batch_size) == (2, 64)


def test_a_bad_override_is_blamed_on_the_set_item_not_the_file(tmp_path):
    path = write(tmp_path, "train:\n  epochs: 3\n")
    message = error_of(path, ["train.epochs=zero"])
    assert "--set train.epochs=zero: train.epochs" in message
    message = error_of(path, ["train.epoch=2"])
    assert "--set train.epoch=2" in message and "did you mean 'epochs'" in message


@pytest.mark.parametrize("item", ["train.epochs", "=3", "train..epochs=2"])
def test_malformed_set_items_are_refused(tmp_path, item):
    assert "--set" in error_of(write(tmp_path, "seed: 0\n"), [item])


def test_set_into_a_value_is_refused(tmp_path):
    message = error_of(write(tmp_path, "seed: 0\n"), ["seed.x=1"])
    assert "seed" in message


def test_missing_file_and_invalid_yaml_are_config_errors(tmp_path):
    assert "does not exist" in error_of(tmp_path / "nope.yaml")
    assert "not valid YAML" in error_of(write(tmp_path, "data: [unclosed\n"))
    assert "must be a mapping" in error_of(write(tmp_path, "- 1\n- 2\n"))


def test_parse_config_of_plain_data():
    cfg = parse_config({"model": {"name": "dlrm", "hparams": {"top_mlp": [8]}}, "train": {"max_steps": 3}})
    assert isinstance(cfg, JobConfig)
    assert cfg.model.name == "dlrm" and cfg.train.max_steps == 3


EXAMPLES = sorted(CONFIGS.glob("*.yaml"))


def test_the_examples_cover_every_model_and_dataset():
    names = {p.stem for p in EXAMPLES}
    expected = {f"{m}_synthetic" for m in ("lr", "fm", "wide_deep", "deepfm", "dcn", "dlrm")}
    expected |= {"deepfm_criteo_sample", "dcn_criteo_sample", "criteo_kaggle", "avazu", "tabular_example",
                 "quickstart"}
    assert expected <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_every_example_config_loads(path):
    cfg = load_config(path)
    assert cfg.train.output_dir.startswith("runs/")
    if cfg.data.format != "synthetic":
        assert cfg.data.path is not None or cfg.data.stream is not None


def test_a_stream_is_the_training_data_and_its_keys_are_checked_by_name():
    stream = {"backend": "files", "path": "incoming"}
    cfg = parse_config({"data": {"format": "criteo", "stream": stream}})
    assert cfg.data.stream == stream and cfg.data.path is None
    with pytest.raises(ConfigError, match=r"data.stream.complete: .*'marker'.*'rename'"):
        parse_config({"data": {"format": "criteo", "stream": {**stream, "complete": "maybe"}}})
    with pytest.raises(ConfigError, match="data.path does not go with data.stream"):
        parse_config({"data": {"format": "criteo", "path": "x.tsv", "stream": stream}})
    with pytest.raises(ConfigError, match="not synthetic"):
        parse_config({"data": {"stream": stream}})
    with pytest.raises(ConfigError, match=r"expire_after: must be \{steps: N\} or \{seconds: S\}"):
        parse_config({"embedding": {"default": {"expire_after": {"hours": 3}}}})


def test_an_empty_config_is_refused_naming_what_to_give(tmp_path):
    for text in ("", "# only a comment\n"):
        message = error_of(write(tmp_path, text), [])
        assert "the config is empty" in message and "--set KEY=VALUE" in message
