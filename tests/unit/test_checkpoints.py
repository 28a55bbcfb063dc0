"""Checkpoints that fail clearly (issue 16, items 7-10): a damaged checkpoint is refused in one
line naming the file (exit 2, no traceback, no advice to unpickle anyway); a damaged newest
checkpoint gives way to an older one that reads whole; half-written checkpoints of a killed run
are removed by the next run; `hybridrec eval` uses the config saved with the checkpoint and
refuses a config that changes the model."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from hybridrec.cli import main

torch.set_num_threads(1)


def job(tmp_path: Path, **train) -> str:
    config = {
        "data": {"format": "synthetic", "batch_size": 512,
                 "synthetic": {"n_categorical": 4, "n_dense": 2, "vocab_size": 100, "train_rows": 4_096,
                               "test_rows": 1_024}},
        "model": {"name": "fm", "embedding_dim": 4},
        "embedding": {"default": {"capacity": 10_000}},
        "train": {"output_dir": str(tmp_path / "run"), "progress": False, "checkpoint_every": 2,
                  "keep_checkpoints": 3, **train},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def checkpoints(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "run" / "checkpoints").glob("step-*"))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run of 6 steps with checkpoints at steps 2, 4 and 6, copied afresh for each test."""
    base = tmp_path_factory.mktemp("trained")
    assert main(["train", job(base, max_steps=6)]) == 0
    return base


@pytest.fixture
def run_dir(trained, tmp_path):
    shutil.copytree(trained / "run", tmp_path / "run")
    job(tmp_path, max_steps=8)
    return tmp_path


def damage_manifest(checkpoint: Path) -> Path:
    manifest = next(checkpoint.glob("embeddings/deep/*/manifest.json"))
    data = json.loads(manifest.read_text())
    data["files"]["rows"]["shape"] = [data["files"]["rows"]["shape"][0] // 2, 999]
    manifest.write_text(json.dumps(data))
    return manifest


@pytest.mark.parametrize("damage, named", [
    (lambda c: (c / "dense.pt").write_bytes(b"not a torch file"), "dense.pt"),
    (lambda c: (c / "progress.json").write_text("{not json"), "progress.json"),
    (damage_manifest, "manifest.json"),
])
def test_every_damaged_checkpoint_is_refused_in_one_line_naming_the_file(run_dir, damage, named, capsys):
    for checkpoint in checkpoints(run_dir):
        damage(checkpoint)
    assert main(["train", str(run_dir / "job.yaml"), "--resume"]) == 2  # a traceback would raise here
    err = capsys.readouterr().err
    error = [line for line in err.splitlines() if line.startswith("hybridrec train: error:")]
    assert len(error) == 1 and named in error[0] and "--overwrite" in error[0], err
    assert "weights_only" not in err


def test_a_damaged_newest_checkpoint_gives_way_to_an_older_one(run_dir, capsys):
    newest = checkpoints(run_dir)[-1]
    manifest = damage_manifest(newest)
    assert main(["train", str(run_dir / "job.yaml"), "--resume"]) == 0
    out = capsys.readouterr().out
    assert str(manifest) in out and "resumed from checkpoint" in out and "step-000000004" in out
    assert json.loads((run_dir / "run" / "final_metrics.json").read_text())["step"] == 8


def test_half_written_checkpoints_of_a_killed_run_are_removed_by_the_next(run_dir, capsys):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    leftover = run_dir / "run" / "checkpoints" / f".step-000000007.tmp-{dead.stdout.strip()}"
    (leftover / "embeddings").mkdir(parents=True)
    assert main(["train", str(run_dir / "job.yaml"), "--resume"]) == 0
    assert not leftover.exists() and f"removed {leftover}" in capsys.readouterr().out


def test_eval_uses_the_saved_config_and_refuses_one_that_builds_another_model(run_dir, capsys):
    final = json.loads((run_dir / "run" / "final_metrics.json").read_text())
    assert main(["eval", "--checkpoint", str(run_dir / "run"), "--json"]) == 0  # no config: the saved one
    assert json.loads(capsys.readouterr().out)["auc"] == final["auc"]
    other = Path(job(run_dir)).read_text().replace("embedding_dim: 4", "embedding_dim: 8")
    (run_dir / "other.yaml").write_text(other)
    assert main(["eval", str(run_dir / "other.yaml"), "--checkpoint", str(run_dir / "run")]) == 2
    err = capsys.readouterr().err
    assert "changes the model" in err and "model.embedding_dim: checkpoint 4, " in err and " 8" in err
