"""Tests of the pipelined local step (hybridrec/train/local_pipeline.py): it trains exactly the
plain step's model on Zipf keys with eviction, multi-hot bags, first-order tables, tables off the
one-call path, evaluations and checkpoints mid-run; a failure in its thread ends training with an
error and stops the thread; and the thread split of train.threads / train.pipeline."""
import threading
import time

import numpy as np
import pytest
import torch

from hybridrec.config import ConfigError
from hybridrec.strategy.placement.local import LocalPlacement
from hybridrec.train.trainer import train
from hybridrec.train.threads import thread_split
from helpers import small_config, trained_state


ZIPF_WITH_EVICTION = {"data.synthetic.zipf_exponent": 1.2, "data.synthetic.vocab_size": 3000,
                      "data.synthetic.n_categorical": 6, "data.synthetic.n_multi_hot": 2,
                      "data.synthetic.train_rows": 12_000, "data.synthetic.test_rows": 2_000,
                      "data.batch_size": 256, "embedding.default.capacity": 400,
                      "train.eval_every": 13, "train.checkpoint_every": 17, "train.threads": 2}


def run(tmp_path, name, pipeline, **changes):
    cfg = small_config(tmp_path, name, **{**ZIPF_WITH_EVICTION, **changes, "train.pipeline": pipeline})
    return cfg, train(cfg)


@pytest.mark.parametrize("model, changes", [
    ("deepfm", {}),  # deep and first-order (wide) tables, one-call path, multi-hot bags
    ("dlrm", {"model.hparams": {"top_mlp": [16]},  # two features share a table: the per-table path
              "embedding.shared": {"both": {"features": ["C1", "C2"]}}}),
])
def test_the_pipelined_step_trains_exactly_the_plain_steps_model(tmp_path, model, changes):
    plain_cfg, plain = run(tmp_path, "plain", False, **{"model.name": model, **changes})
    piped_cfg, piped = run(tmp_path, "piped", True, **{"model.name": model, **changes})
    assert piped["threads"] == {"dense": 2, "embedding": 1} and plain["threads"]["embedding"] == 0
    figures = piped["pipeline"]
    assert figures["batches"] == plain["step"] == piped["step"] == 47
    assert 0 < figures["shared_rows"] <= figures["unique_rows"]  # Zipf: batches share rows, re-pooled
    assert piped["auc"] == plain["auc"] and piped["logloss"] == plain["logloss"]
    dense_a, rows_a = trained_state(plain_cfg)
    dense_b, rows_b = trained_state(piped_cfg)
    for name in dense_a:
        assert torch.equal(dense_a[name], dense_b[name]), name
    assert rows_a.keys() == rows_b.keys()
    for table in rows_a:
        for field in rows_a[table]:
            np.testing.assert_array_equal(rows_a[table][field], rows_b[table][field], err_msg=f"{table} {field}")
    placement = LocalPlacement(piped_cfg, *_tables(piped_cfg))
    placement.load(sorted((tmp_path / "piped" / "checkpoints").glob("step-*"))[-1] / "embeddings")
    assert sum(store.stats()["evicted"] for c in placement.collections.values()
               for store in c.stores.values()) > 0  # eviction happened


def _tables(cfg):
    from hybridrec.job.tables import job_tables
    from hybridrec.strategy.world import World

    return job_tables(cfg), World()


@pytest.mark.parametrize("where", ["look_ahead", "apply_ahead"])
def test_a_failure_in_the_pipeline_thread_ends_training_with_an_error_and_stops_the_thread(tmp_path, monkeypatch,
                                                                                           where):
    original = getattr(LocalPlacement, where)
    calls = []

    def failing(self, *args):
        calls.append(1)
        if len(calls) == 5:
            raise OSError("disk on fire")
        return original(self, *args)

    monkeypatch.setattr(LocalPlacement, where, failing)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="embedding pipeline failed: disk on fire"):
        run(tmp_path, "failing", True)
    assert time.monotonic() - start < 120
    assert not [t for t in threading.enumerate() if t.name == "emb-ahead"]


def test_threads_split_and_pipeline_choice(tmp_path):
    local = small_config(tmp_path, "t", **{"train.threads": 3}).train
    split = thread_split(local, "local")
    assert (split.total, split.dense, split.pipelined) == (3, 3, False)  # the plain step unless asked
    piped = thread_split(small_config(tmp_path, "t", **{"train.threads": 3, "train.pipeline": True}).train, "local")
    assert (piped.total, piped.dense, piped.embedding) == (3, 3, 1)
    assert thread_split(small_config(tmp_path, "t").train, "ps").total == 1  # auto: one per trainer process
    assert not thread_split(small_config(tmp_path, "t", **{"train.threads": 4}).train, "ps").pipelined
    with pytest.raises(ConfigError, match="train.pipeline is true, but strategy.placement is 'ps'"):
        thread_split(small_config(tmp_path, "t", **{"train.pipeline": True}).train, "ps")
    with pytest.raises(ConfigError, match="train.threads"):
        small_config(tmp_path, "t", **{"train.threads": 0})
