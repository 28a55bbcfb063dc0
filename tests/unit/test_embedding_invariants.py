"""Capacity, eviction and admission invariants of EmbeddingStore under random operation
sequences (hypothesis), checked against a plain Python model where the policy is exact."""
import tempfile
from collections import OrderedDict

import numpy as np
from hypothesis import given, settings, strategies as st

from hybridrec.embedding import EmbeddingStore
from hybridrec.embedding import kernels as K
from hybridrec.embedding.hashing import index_hash
from hybridrec.embedding.store import S_EPOCH

KEYS = st.integers(min_value=0, max_value=40).map(lambda k: (k * 0x9E3779B97F4A7C15) % 2**64)
BATCHES = st.lists(st.lists(KEYS, min_size=1, max_size=6), min_size=1, max_size=40)


def _check_index(store):
    """Every live key is found at its own row; no key is stored twice."""
    keys = store.keys()
    assert len(keys) == len(store) <= store.config.capacity
    assert len(np.unique(keys)) == len(keys)
    if len(keys):
        found = store.lookup(keys, insert=False)
        assert (found.rows >= 0).all()
        assert len(np.unique(found.rows)) == len(keys)


def _use_in_lru_model(model: OrderedDict, batch: list, capacity: int) -> None:
    """A training lookup of `batch` in the Python model: first occurrences, in order, become the
    most recently used; a new key evicts the least recently used one when the model is full."""
    for k in dict.fromkeys(batch):
        if k in model:
            model.move_to_end(k)
        else:
            if len(model) == capacity:
                model.popitem(last=False)
            model[k] = True


@settings(max_examples=60, deadline=None)
@given(batches=BATCHES, capacity=st.integers(6, 12))
def test_lru_matches_a_python_lru_model(batches, capacity):
    store = EmbeddingStore(dim=2, capacity=capacity, eviction="lru")
    model = OrderedDict()
    rows_shape = store.rows.shape
    for batch in batches:
        keys = np.array(batch, dtype=np.uint64)
        store.lookup(keys)
        _use_in_lru_model(model, batch, capacity)
        assert set(store.keys().tolist()) == set(model)
        _check_index(store)
    assert store.rows.shape == rows_shape  # memory never grows


OPS = st.lists(st.tuples(st.sampled_from(["train", "train", "read", "reload"]),
                         st.lists(KEYS, min_size=1, max_size=6)), min_size=1, max_size=40)


@settings(max_examples=60, deadline=None)
@given(ops=OPS, capacity=st.integers(6, 12))
def test_lru_order_ignores_reads_and_survives_checkpoints(ops, capacity):
    """Read-only lookups do not refresh recency, and a checkpoint round trip keeps the order,
    both before a partition's first eviction (when the order lives in the rows' stamps) and after
    (when the LRU list is kept)."""
    store = EmbeddingStore(dim=2, capacity=capacity, eviction="lru")
    model = OrderedDict()
    for op, batch in ops:
        keys = np.array(batch, dtype=np.uint64)
        if op == "read":
            store.lookup(keys, insert=False)
        elif op == "reload":
            with tempfile.TemporaryDirectory() as directory:
                store.save(directory)
                store = EmbeddingStore.load(directory)
        else:
            store.lookup(keys)
            _use_in_lru_model(model, batch, capacity)
        assert set(store.keys().tolist()) == set(model)
    _check_index(store)


@settings(max_examples=40, deadline=None)
@given(batches=BATCHES, capacity=st.integers(6, 12), threads=st.sampled_from([1, 2]),
       policy=st.sampled_from(["lru", "lfu"]))
def test_capacity_bound_and_batch_keys_present(batches, capacity, threads, policy):
    store = EmbeddingStore(dim=2, capacity=capacity, eviction=policy, num_threads=threads)
    for batch in batches:
        keys = np.array(batch, dtype=np.uint64)
        if threads > 1:
            # a partition holds capacity/threads rows: keep each batch within what one can hold
            keys = keys[: max(1, capacity // threads // 2)]
        found = store.lookup(keys)
        assert (found.rows >= 0).all(), "every key of the batch is resident right after its lookup"
        assert (store.r64[found.rows, 0] == keys).all()
        _check_index(store)
    stats = store.stats()
    assert stats["inserted"] - stats["evicted"] == len(store)


@settings(max_examples=40, deadline=None)
@given(batches=BATCHES, min_freq=st.integers(2, 4))
def test_min_frequency_admits_every_key_seen_often_enough(batches, min_freq):
    store = EmbeddingStore(dim=2, capacity=1000, admit_min_frequency=min_freq)
    seen = {}
    for batch in batches:
        keys = np.array(batch, dtype=np.uint64)
        found = store.lookup(keys)
        for k, r in zip(batch, found.rows):
            seen[k] = seen.get(k, 0) + 1
            if seen[k] >= min_freq:
                assert r >= 0, f"key {k} seen {seen[k]} times (>= {min_freq}) must be admitted"
        _check_index(store)


def test_min_frequency_rejects_rare_keys_and_they_read_as_zero():
    store = EmbeddingStore(dim=3, capacity=100, admit_min_frequency=3)
    keys = np.arange(1, 21, dtype=np.uint64)
    assert (store.pull(keys) == 0).all() and len(store) == 0
    assert (store.pull(keys) == 0).all() and len(store) == 0
    assert (store.pull(keys) != 0).any(axis=1).all() and len(store) == 20
    assert store.stats()["rejected"] == 40


def test_admission_probability_admits_about_that_fraction():
    store = EmbeddingStore(dim=2, capacity=100_000, admit_probability=0.25)
    store.lookup(np.arange(20_000, dtype=np.uint64))
    assert 0.22 < len(store) / 20_000 < 0.28
    # a rejected key gets a new chance at a later lookup
    before = len(store)
    store.lookup(np.arange(20_000, dtype=np.uint64))
    assert len(store) > before


def test_lfu_evicts_rarely_used_keys_first():
    store = EmbeddingStore(dim=2, capacity=64, eviction="lfu")
    hot = np.arange(1, 17, dtype=np.uint64)
    for _ in range(20):
        store.lookup(hot)
    for start in range(1000, 3000, 16):  # a stream of one-off keys
        store.lookup(np.arange(start, start + 16, dtype=np.uint64))
        store.lookup(hot)
    assert set(hot.tolist()) <= set(store.keys().tolist())


def test_batch_with_more_distinct_keys_than_capacity_is_refused():
    store = EmbeddingStore(dim=2, capacity=8)
    try:
        store.lookup(np.arange(20, dtype=np.uint64))
    except ValueError as exc:
        assert "capacity 8" in str(exc)
    else:
        raise AssertionError("expected a ValueError")


def test_lru_order_survives_the_restart_of_the_epoch_count():
    """Stamps are int32, so the epoch count restarts near 2**31 and every stamp is zeroed; the
    recency they held must be carried into the LRU list first."""
    store = EmbeddingStore(dim=2, capacity=8, eviction="lru")
    for key in range(1, 9):  # rows 0..7 hold keys 1..8
        store.lookup(np.array([key], np.uint64))
    for key in range(8, 1, -1):  # least recent now: 1, then 8, 7, ..., 2
        store.lookup(np.array([key], np.uint64))
    store.scalars[S_EPOCH] = 2**31 - 2
    for key in (100, 101, 102):
        store.lookup(np.array([key], np.uint64))
    assert set(store.keys().tolist()) == {2, 3, 4, 5, 6, 100, 101, 102}


def test_index_keeps_every_key_when_many_share_a_home_slot():
    """An index entry records how far past its key's home slot it sits, up to a cap (then the
    deletion reads the key): keys sharing one home slot make a run longer than the cap, and
    evicting them in any order must leave every other key found at its row."""
    capacity = 64
    store = EmbeddingStore(dim=2, capacity=capacity, eviction="lru")
    model = OrderedDict()
    first = list(range(1, capacity + 1))
    store.lookup(np.array(first, np.uint64))  # full: the index has its final size
    _use_in_lru_model(model, first, capacity)
    ns = int(store.parts[0, K.PT_SLOT_COUNT])
    home = lambda key: ((int(index_hash(np.uint64(key))) & 0xFFFFFFFF) * ns) >> 32  # hashing.scale32
    sharing = [key for key in range(1000, 1000 + 40 * ns) if home(key) == 3][:2 * (1 << K.DISP_BITS)]
    assert len(sharing) == 2 * (1 << K.DISP_BITS)
    rng = np.random.default_rng(0)
    batches = [sharing[i:i + 8] for i in range(0, len(sharing), 8)]
    batches += [rng.permutation(sharing)[:8].tolist(), list(range(5000, 5040)), list(range(6000, 6040))]
    for batch in batches:
        store.lookup(np.array(batch, np.uint64))
        _use_in_lru_model(model, batch, capacity)
        assert set(store.keys().tolist()) == set(model)
        _check_index(store)
