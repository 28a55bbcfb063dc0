"""Checkpoints: round trip of weights and optimizer state, N -> M re-sharding, refusal of
corrupt, truncated and mismatched files, and atomic replacement."""
import json

import numpy as np
import pytest

from hybridrec.embedding import EmbeddingStore, route
from hybridrec.embedding.checkpoint import load_resharded

DIM = 4


def _train(store, steps=30, seed=0, universe=300):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        keys = rng.integers(0, universe, size=64).astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        store.pull(keys)
        store.push(keys, rng.normal(size=(64, DIM)).astype(np.float32))


def _by_key(store):
    e = store.export()
    order = np.argsort(e["keys"])
    return {name: arr[order] for name, arr in e.items()}


def _assert_same_content(a, b):
    ea, eb = _by_key(a), _by_key(b)
    for name in ("keys", "weights", "state", "clocks"):
        np.testing.assert_array_equal(ea[name], eb[name], err_msg=name)


@pytest.mark.parametrize("optimizer", ["adagrad", "adam", "ftrl"])
def test_round_trip_keeps_weights_and_optimizer_state(tmp_path, optimizer):
    store = EmbeddingStore(dim=DIM, capacity=1000, optimizer=optimizer, num_threads=2)
    _train(store)
    store.save(tmp_path / "ckpt")
    loaded = EmbeddingStore.load(tmp_path / "ckpt")
    _assert_same_content(store, loaded)
    assert loaded.step == store.step
    # training on continues identically
    _train(store, steps=5, seed=1)
    _train(loaded, steps=5, seed=1)
    _assert_same_content(store, loaded)


def test_loading_into_a_smaller_store_keeps_the_most_recent_keys(tmp_path):
    store = EmbeddingStore(dim=DIM, capacity=100)
    store.pull(np.arange(1, 101, dtype=np.uint64))
    store.pull(np.arange(1, 11, dtype=np.uint64))  # 1..10 are now the most recent
    store.save(tmp_path / "c")
    small = EmbeddingStore.load(tmp_path / "c", capacity=20)
    assert len(small) == 20
    assert set(range(1, 11)) <= set(small.keys().tolist())


@pytest.mark.parametrize("n_from, n_to", [(3, 2), (2, 5), (1, 3)])
def test_checkpoint_of_n_shards_loads_into_m_shards(tmp_path, n_from, n_to):
    rng = np.random.default_rng(0)
    single = EmbeddingStore(dim=DIM, capacity=5000, optimizer="adagrad")
    shards = [EmbeddingStore(dim=DIM, capacity=5000, optimizer="adagrad") for _ in range(n_from)]
    for _ in range(20):
        keys = np.unique(rng.integers(0, 2**63, size=200).astype(np.uint64) | np.uint64(1))
        grads = rng.normal(size=(len(keys), DIM)).astype(np.float32)
        single.pull(keys)
        single.push(keys, grads)
        owner = route(keys, 0, n_from)
        for s, shard in enumerate(shards):
            mine = owner == s
            shard.pull(keys[mine])
            shard.push(keys[mine], grads[mine])
    dirs = [shard.save(tmp_path / f"from{s}") for s, shard in enumerate(shards)]
    targets = [load_resharded(dirs, s, n_to) for s in range(n_to)]
    assert sum(len(t) for t in targets) == len(single)
    for s, t in enumerate(targets):
        assert (route(t.keys(), 0, n_to) == s).all()
        ref = single.export()
        keys = t.keys()
        found = t.lookup(keys, insert=False)
        ref_rows = {k: i for i, k in enumerate(ref["keys"].tolist())}
        idx = np.array([ref_rows[k] for k in keys.tolist()])
        np.testing.assert_array_equal(t.rows[found.rows, :DIM], ref["weights"][idx])
        np.testing.assert_array_equal(t.rows[found.rows, DIM:2 * DIM], ref["state"][idx])


def test_corrupt_checkpoint_is_refused(tmp_path):
    store = EmbeddingStore(dim=DIM, capacity=100)
    _train(store, steps=3, universe=50)
    path = store.save(tmp_path / "c")
    raw = bytearray((path / "rows.bin").read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    (path / "rows.bin").write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"rows.bin is corrupt: CRC32"):
        EmbeddingStore.load(path)


def test_truncated_checkpoint_is_refused(tmp_path):
    store = EmbeddingStore(dim=DIM, capacity=100)
    _train(store, steps=3, universe=50)
    path = store.save(tmp_path / "c")
    raw = (path / "rows.bin").read_bytes()
    (path / "rows.bin").write_bytes(raw[:-8])
    with pytest.raises(ValueError, match="truncated"):
        EmbeddingStore.load(path)


def test_mismatched_checkpoint_is_refused(tmp_path):
    store = EmbeddingStore(dim=DIM, capacity=100, optimizer="adagrad")
    path = store.save(tmp_path / "c")
    with pytest.raises(ValueError, match="dim=4 but the store expects 8"):
        EmbeddingStore.load(path, dim=8)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["format"] = "something-else"
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="format 'something-else'"):
        EmbeddingStore.load(path)
    with pytest.raises(FileNotFoundError, match="manifest.json does not exist"):
        EmbeddingStore.load(tmp_path / "nothing-here")


def test_saving_over_a_checkpoint_replaces_it_whole(tmp_path):
    store = EmbeddingStore(dim=DIM, capacity=100)
    store.pull(np.arange(10, dtype=np.uint64))
    store.save(tmp_path / "c")
    store.pull(np.arange(10, 30, dtype=np.uint64))
    store.save(tmp_path / "c")
    assert len(EmbeddingStore.load(tmp_path / "c")) == 30
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


def test_snapshot_restores_without_files_and_only_into_an_empty_store():
    store = EmbeddingStore(dim=DIM, capacity=300, optimizer="adam", num_threads=2)
    _train(store, steps=10)
    copy = EmbeddingStore(store.config)
    copy.restore(store.snapshot())
    _assert_same_content(store, copy)
    assert copy.step == store.step
    with pytest.raises(ValueError, match="already holds"):
        copy.restore(store.snapshot())
    with pytest.raises(ValueError, match=r"insert_rows: need rows \[n, 12\]"):
        EmbeddingStore(store.config).insert_rows(np.zeros((3, DIM), np.float32), np.zeros((3, 8), np.int32))
