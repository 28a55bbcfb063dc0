"""Tests of the strategy axes: every preset expands to the axes the docs name; unknown values and
impossible combinations are refused at load time with the reason; every run records its axes;
the same job trained with the local placement and with ps + sync + allreduce on one trainer
(both routes to the PS) ends with the same metrics; `hybridrec train` on a distributed config
starts the job's roles and never trains locally."""
import io
import json
import re
from pathlib import Path

import pytest
import torch

from hybridrec.axes import AXES, PRESETS
from hybridrec.cli import main
from hybridrec.config import ConfigError, parse_config
from hybridrec.parallel.launch import launch
from hybridrec.train.summary import SUMMARY_KEYS
from helpers import summary_of
from hybridrec.train.trainer import train

torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[2]

JOB = {
    "seed": 3,
    "data": {"format": "synthetic", "batch_size": 256,
             "synthetic": {"n_categorical": 6, "n_dense": 2, "vocab_size": 300, "train_rows": 4096,
                           "test_rows": 1024}},
    "model": {"name": "deepfm", "embedding_dim": 4, "hparams": {"hidden": [8]}},
    "embedding": {"default": {"capacity": 5000, "optimizer": {"name": "adagrad", "lr": 0.1}}},
    "train": {"progress": False, "dense_optimizer": {"name": "adam", "lr": 0.01}},
}


def job_file(tmp_path: Path, name: str, strategy: dict) -> Path:
    path = tmp_path / f"{name}.json"  # JSON is YAML
    path.write_text(json.dumps({**JOB, "strategy": strategy,
                                "train": {**JOB["train"], "output_dir": str(tmp_path / name)}}))
    return path


def test_every_preset_expands_to_the_axes_the_architecture_doc_names():
    table = (REPO / "docs" / "architecture.md").read_text()
    for preset, axes in PRESETS.items():
        row = next((line for line in table.splitlines() if line.startswith(f"| `{preset}`")), None)
        assert row is not None, f"docs/architecture.md has no row for preset {preset!r}"
        if axes is None:
            assert "issue #" in row, row  # an unbuilt paper names the issue that builds it
            continue
        assert parse_config({"strategy": {"preset": preset}}).strategy.resolved == axes
        for axis in ("placement", "consistency", "dense"):
            assert f"{axis}.{axes[axis]}" in row or f"`{axes[axis]}`" in row, (preset, axis, row)


def test_a_preset_is_a_default_that_each_axis_may_override():
    cfg = parse_config({"strategy": {"preset": "persia", "consistency": "sync", "value_codec": "fp16"}})
    assert cfg.strategy.resolved == {**PRESETS["persia"], "consistency": "sync", "value_codec": "fp16"}
    assert cfg.strategy.effective_tau == 0
    assert parse_config({}).strategy.resolved == PRESETS["local"]


@pytest.mark.parametrize("strategy, message", [
    ({"preset": "persai"}, "strategy.preset: unknown preset 'persai' (did you mean 'persia'?)"),
    ({"consistency": "bounde"}, "strategy.consistency: unknown value 'bounde' (did you mean 'bounded'?)"),
    ({"dense": "all_reduce"}, "strategy.dense: unknown value 'all_reduce' (did you mean 'allreduce'?)"),
    ({"consistency": "het"}, "het reads and writes its cached rows on the PS servers directly, with the servers' "
                             "per-embedding clocks; it needs the PS servers' addresses and clients (ps_endpoints), "
                             "which placement local does not offer; allowed with placement ps"),
    ({"placement": "sharded", "consistency": "bounded"}, "the sharded placement's AllToAll is synchronous"),
    ({"consistency": "hot_cold"}, "hot_cold keeps a copy of the hottest rows on every trainer"),
    ({"dense": "ps_async"}, "ps_async keeps the dense parameters on the PS servers"),
    ({"consistency": "bounded"}, "needs a remote placement"),
    ({"id_codec": "unique"}, "wire codecs need a remote placement"),
    ({"name": "persia"}, "strategy.name: ('persia') is now strategy.preset"),
])
def test_unknown_values_and_impossible_combinations_are_refused_at_load_time(tmp_path, strategy, message):
    path = tmp_path / "job.yaml"
    path.write_text("model:\n  name: fm\nstrategy:\n" + "".join(f"  {k}: {v}\n" for k, v in strategy.items()))
    with pytest.raises(ConfigError) as info:
        from hybridrec.config import load_config
        load_config(path)
    assert message in str(info.value)
    assert re.search(rf"{re.escape(str(path))}:[34]: strategy", str(info.value)), str(info.value)


def test_every_axis_value_is_built_or_names_its_issue():
    for axis, values in AXES.items():
        for name, value in values.items():
            assert value.module is not None or value.issue is not None, (axis, name)


def ps_job(config: Path, embedding_workers: int) -> dict:
    out = io.StringIO()
    code = launch(str(config), ps=1, embedding_workers=embedding_workers, trainers=1, overwrite=True,
                  timeout=300, out=out)
    assert code == 0, out.getvalue()[-3000:]
    return json.loads((Path(json.loads(config.read_text())["train"]["output_dir"]) / "final_metrics.json").read_text())


def test_local_and_ps_sync_on_one_trainer_train_the_same_model(tmp_path):
    local = train(parse_config({**JOB, "train": {**JOB["train"], "output_dir": str(tmp_path / "local")}}))
    assert local["strategy"]["placement"] == "local"
    remote = {"preset": "persia", "consistency": "sync", "id_codec": "unique"}
    for route, workers in (("embedding_workers", 1), ("direct", 0)):
        result = ps_job(job_file(tmp_path, route, remote), workers)
        assert result["strategy"] == {"preset": "persia", "placement": "ps", "consistency": "sync",
                                      "dense": "allreduce", "id_codec": "unique", "value_codec": "none", "tau": 0}
        assert result["route"] == route and result["step"] == local["step"] == 16
        assert result["bytes_per_sample"] > 0  # both routes count what crossed the wire
        assert result["auc"] == pytest.approx(local["auc"], abs=2e-4), (route, result["auc"], local["auc"])
        assert result["logloss"] == pytest.approx(local["logloss"], abs=2e-4), route


def test_hybridrec_train_on_a_distributed_config_starts_its_roles_instead_of_training_locally(tmp_path, capsys):
    config = job_file(tmp_path, "persia", {"preset": "persia", "roles": {"ps_servers": 1, "embedding_workers": 1,
                                                                          "trainers": 1}})
    assert main(["train", str(config), "--set", "train.max_steps=3", "--set", "train.progress=true",
                 "--set", "train.progress_every_s=0.001"]) == 0
    out = capsys.readouterr().out
    assert "hybridrec launch" in out and "--ps 1 --embedding-workers 1 --trainers 1" in out
    # the strategy first, the leader's progress through the launcher (lines: not a terminal), the summary last
    assert out.startswith("hybridrec train: strategy persia (placement ps, consistency bounded tau=")
    assert re.search(r"^\[nn\] progress: step 1/3 \(33%\), 256 samples", out, re.M), out
    assert re.search(r"^\[nn\] progress: step 3/3 \(100%\), 768 samples, [\d,]+ samples/s", out, re.M), out
    said = summary_of(out, "hybridrec train: finished")
    assert set(SUMMARY_KEYS) <= set(said) and said["steps"] == "3" and said["samples"] == "768"
    assert said["strategy"].startswith("persia (placement ps") and said["staleness"].startswith("max ")
    result = json.loads((tmp_path / "persia" / "final_metrics.json").read_text())
    assert result["strategy"]["placement"] == "ps" and result["route"] == "embedding_workers"
    assert result["step"] == 3 and result["bytes_per_sample"] > 0  # its rows came over the wire
