"""HET jobs on loopback with real roles (2 PS servers, 2 trainers under torchrun, no embedding
workers), started by `hybridrec launch`: the `het` preset converges with its cache doing the
reads, and a trainer killed mid-training costs only its unflushed cache: the group restarts from
the last checkpoint (written after a flush) and finishes the epoch."""
import json
import re
import subprocess
from pathlib import Path

import yaml
from helpers import LEARNT_GAP, kill_a_trainer_after_a_checkpoint, no_role_left, start_launch, steps_of_one_epoch, finish as finish_launch


# bound on one job: every role compiles its kernels first when the numba cache is cold (any source
# change), which on a small, shared machine takes minutes
JOB_SECONDS = 900


def write_config(tmp_path: Path, het: dict, **train) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    config = {
        "seed": 3,
        "data": {"format": "synthetic", "batch_size": 256,
                 "synthetic": {"vocab_size": 300, "zipf_exponent": 1.05, "train_rows": 40_000,
                               "test_rows": 4_000, "n_dense": 4, "n_categorical": 8, "id_weight_std": 0.6}},
        "model": {"name": "deepfm", "embedding_dim": 4, "hparams": {"hidden": [16]}},
        "embedding": {"default": {"capacity": 2_000, "optimizer": {"name": "adagrad", "lr": 0.1}},
                      "wide": {"optimizer": {"lr": 0.3}}},
        "train": {"epochs": 1, "dense_optimizer": {"name": "adam", "lr": 0.02}, "log_every": 5,
                  "output_dir": str(tmp_path / "run"), **train},
        "strategy": {"preset": "het", "request_timeout": 120, "retries": 3, "het": het},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def start(config: Path, log: Path, *extra: str) -> subprocess.Popen:
    """The HET job on 2 PS and 2 trainers, with no embedding worker (its trainers reach the PS directly)."""
    return start_launch(config, log, *extra, embedding_workers=0, seconds=JOB_SECONDS)


def finish(process: subprocess.Popen, log: Path) -> int:
    return finish_launch(process, log, JOB_SECONDS)


def test_two_trainers_two_ps_converge_with_the_het_preset(tmp_path):
    config, log = write_config(tmp_path, {"staleness": 10, "cache_fraction": 0.1, "policy": "lfu"}), tmp_path / "log"
    code = finish(start(config, log), log)
    text = log.read_text()
    assert code == 0, text[-3000:]
    assert "[ew" not in text  # HET's trainers talk to the PS servers directly
    result = json.loads((tmp_path / "run" / "final_metrics.json").read_text())
    assert result["trainers"] == 2 and result["route"] == "direct"
    assert result["strategy"]["consistency"] == "het" and result["strategy"]["het"]["staleness"] == 10
    assert result["step"] == steps_of_one_epoch(config)
    assert result["best_auc"] - LEARNT_GAP < result["auc"] <= result["best_auc"] + 0.01, result
    assert result["cache_hit_rate"] > 0.5 and result["cache_evictions"] > 0 and result["cache_invalidations"] > 0
    assert 0 < result["max_staleness"] <= 2 * 10 + 1  # the clock gaps, by the one name
    assert 0 < result["mean_staleness"] <= result["max_staleness"]
    assert result["dropped_updates"] == 0 and result["cache_flushed"] > 0
    assert result["embedding_vector_bytes"] > 0 and result["embedding_clock_bytes"] > 0
    assert no_role_left(config)


def test_a_trainer_killed_mid_training_loses_only_its_cache_and_the_job_finishes(tmp_path):
    config = write_config(tmp_path, {"staleness": 100, "cache_fraction": 0.1}, checkpoint_every=10)
    log = tmp_path / "log"
    process = start(config, log, "--max-restarts", "3")
    kill_a_trainer_after_a_checkpoint(config, tmp_path / "run", log, seconds=JOB_SECONDS)
    code = finish(process, log)
    assert code == 0, log.read_text()[-3000:]
    result = json.loads((tmp_path / "run" / "final_metrics.json").read_text())
    assert result["step"] == steps_of_one_epoch(config), result
    resumed = [int(step) for step in re.findall(r"resumed from checkpoint \S+ at step (\d+)", log.read_text())]
    assert resumed and all(step >= 10 and step % 10 == 0 for step in resumed), log.read_text()[-3000:]
    assert result["auc"] > result["best_auc"] - LEARNT_GAP, result
    assert no_role_left(config)
