"""Reading a coming batch's cold rows ahead (hybridrec/embedding/read_ahead.py): a tiered store
read ahead on another thread, while it looks batches up and updates them, ends with exactly the
rows, optimizer state, counts, clocks and disk records of one never read ahead; and a local job
whose loader prefetches reads each next batch ahead and trains the same model as without it."""
import numpy as np
import pytest
import torch

from hybridrec.embedding import EmbeddingStore
from hybridrec.embedding.read_ahead import ReadAhead
from hybridrec.train.trainer import train
from helpers import small_config, trained_state

DIM = 4


def _batches(steps, universe=3000, batch=128):
    rng = np.random.default_rng(0)
    keys = [rng.integers(0, universe, batch).astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15) for _ in range(steps)]
    return keys, [rng.normal(size=(batch, DIM)).astype(np.float32) for _ in range(steps)]


@pytest.mark.parametrize("threads", [1, 2])
def test_reading_ahead_leaves_every_row_optimizer_state_and_record_as_without_it(tmp_path, threads):
    stores = [EmbeddingStore(dim=DIM, capacity=256, optimizer="adam", num_threads=threads,
                             tier={"path": str(tmp_path / name), "capacity_rows": 4000}) for name in ("plain", "ahead")]
    plain, ahead = stores
    keys, grads = _batches(40)
    thread = ReadAhead()
    touched = 0
    for step in range(len(keys)):
        plain.pull(keys[step])
        assert plain.push(keys[step], grads[step]) == 0
        ahead.pull(keys[step])
        if step + 1 < len(keys):
            if step % 4 == 0:  # here in this thread, counted; else beside the push and the next pull
                touched += ahead.read_ahead(keys[step + 1])
            else:
                thread.submit(ahead.read_ahead, keys[step + 1])
        assert ahead.push(keys[step], grads[step]) == 0
    thread.close()
    assert touched > 100  # cold keys and the victims' records were faulted in
    assert ahead.stats()["evicted"] == plain.stats()["evicted"] > 1000
    want, got = plain.export(), ahead.export()
    order_w, order_g = np.argsort(want["keys"]), np.argsort(got["keys"])
    for name in want:  # keys, weights, optimizer state, counts, clocks
        np.testing.assert_array_equal(got[name][order_g], want[name][order_w], err_msg=name)
    np.testing.assert_array_equal(ahead.disk_tier.rec32, plain.disk_tier.rec32)  # the records, pad included
    for store in stores:
        store.close()


def test_a_local_job_with_disk_tiers_reads_each_next_batch_ahead_and_trains_the_same_model(tmp_path, monkeypatch):
    calls = []
    original = EmbeddingStore.read_ahead

    def counted(store, keys):
        calls.append(len(keys))
        return original(store, keys)

    monkeypatch.setattr(EmbeddingStore, "read_ahead", counted)
    changes = {"data.synthetic.vocab_size": 3000, "data.synthetic.zipf_exponent": 1.2,
               "data.synthetic.train_rows": 8_000, "data.synthetic.test_rows": 1_000, "data.batch_size": 256,
               "embedding.default.capacity": 300}
    configs = {}
    for name, prefetch in (("plain", 0), ("ahead", 2)):
        tier = {"path": str(tmp_path / f"tiers-{name}"), "capacity_rows": 10_000}
        configs[name] = small_config(tmp_path, name, **changes, **{"data.prefetch": prefetch,
                                                                   "embedding.default.tier": tier})
        calls.clear()
        train(configs[name])
        assert (len(calls) > 0) == (prefetch > 0)
    # loaded into stores with tiers of their own (the job's stay open in this process)
    states = [trained_state(small_config(tmp_path, name, **changes, **{
        "embedding.default.tier": {"path": str(tmp_path / f"load-{name}"), "capacity_rows": 10_000}}))
        for name in configs]
    (dense_a, rows_a), (dense_b, rows_b) = states
    for name in dense_a:
        assert torch.equal(dense_a[name], dense_b[name]), name
    assert rows_a.keys() == rows_b.keys()
    for table in rows_a:
        order_a, order_b = np.argsort(rows_a[table]["keys"]), np.argsort(rows_b[table]["keys"])
        for field in rows_a[table]:
            np.testing.assert_array_equal(rows_a[table][field][order_a], rows_b[table][field][order_b],
                                          err_msg=f"{table} {field}")


def test_a_local_job_leaves_its_disk_tier_free_for_the_next_store_of_its_process(tmp_path):
    """fit, then score its checkpoint (or train again) in one Python process: the job's stores let
    go of their tier directories when it ends, so the loaded stores can open the same ones."""
    tier = {"path": str(tmp_path / "tiers"), "capacity_rows": 10_000}
    config = small_config(tmp_path, "job", **{"data.synthetic.vocab_size": 3000, "data.synthetic.train_rows": 2_000,
                                               "data.synthetic.test_rows": 500, "embedding.default.capacity": 300,
                                               "embedding.default.tier": tier})
    train(config)
    _, rows = trained_state(config)  # the same tier directories as the job's
    assert rows and all(len(table["keys"]) > 0 for table in rows.values())

