"""Feature expiry (`expire_after`): a store drops exactly the rows training has not used for longer
than the bound, keeps its LRU order and index whole while rows move, remembers its marks across a
checkpoint, and counts what it dropped."""
from collections import OrderedDict

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from hybridrec.embedding import EmbeddingCollection, EmbeddingStore, TableConfig
from hybridrec.data.batch import JaggedFeatures

KEYS = st.integers(min_value=0, max_value=30).map(lambda k: (k * 0x9E3779B97F4A7C15 + 1) % 2**64)
STEPS = st.lists(st.tuples(st.lists(KEYS, min_size=0, max_size=6), st.booleans()), min_size=1, max_size=40)


def _check_index(store):
    keys = store.keys()
    assert len(np.unique(keys)) == len(keys) == len(store)
    if len(keys):
        found = store.lookup(keys, insert=False)
        assert (found.rows >= 0).all() and len(np.unique(found.rows)) == len(keys)


@settings(max_examples=80, deadline=None)
@given(steps=STEPS, bound=st.integers(1, 6), capacity=st.integers(6, 40), threads=st.sampled_from([1, 2]))
def test_expiry_drops_exactly_the_rows_unseen_longer_than_the_bound(steps, bound, capacity, threads):
    """Against a Python model of LRU plus expiry: after the sweep of step s, the store holds exactly
    the keys trained in one of the last `bound` steps (and, once full, LRU decides as before)."""
    # each partition holds a whole batch (6 keys at most), or a batch could find no evictable row
    store = EmbeddingStore(dim=2, capacity=capacity * threads + 6 * (threads - 1), num_threads=threads,
                           expire_after={"steps": bound})
    model: OrderedDict = OrderedDict()  # key -> last step it was trained in, least recently used first
    for step, (batch, read_too) in enumerate(steps, start=1):
        if batch:
            store.lookup(np.array(batch, dtype=np.uint64))  # a training use stamps the rows
        if read_too:  # a read-only lookup (evaluation) is no use
            store.lookup(np.array([12345], dtype=np.uint64), insert=False)
        if threads == 1:  # one partition: the exact LRU model applies
            for k in dict.fromkeys(batch):
                if k in model:
                    model.move_to_end(k)
                elif len(model) == store.config.capacity:
                    model.popitem(last=False)
                model[k] = step
        dropped = store.expire(step)
        expected_drop = [k for k, last in model.items() if last <= step - bound]
        for k in expected_drop:
            del model[k]
        if threads == 1:
            assert set(store.keys().tolist()) == set(model)
            assert dropped == len(expected_drop)
        else:  # partitions evict on their own; still nothing older than the bound survives
            recent = {k for s, (b, _) in enumerate(steps[:step], start=1) if s > step - bound for k in b}
            assert set(store.keys().tolist()) <= recent
        _check_index(store)
    assert store.stats()["expired"] >= 0


def test_expiry_by_seconds_uses_the_times_given():
    store = EmbeddingStore(dim=4, capacity=100, expire_after={"seconds": 10})
    store.lookup(np.array([1, 2, 3], dtype=np.uint64))
    assert store.expire(1, now=1000.0) == 0
    store.lookup(np.array([3, 4], dtype=np.uint64))
    assert store.expire(2, now=1005.0) == 0
    assert store.expire(3, now=1010.0) == 2  # 1 and 2 were last trained before the mark at 1000
    assert sorted(store.keys().tolist()) == [3, 4]
    assert store.expire(4, now=1016.0) == 2 and len(store) == 0
    assert store.stats()["expired"] == 4


def test_expired_rows_keep_their_neighbours_values_and_the_marks_survive_a_checkpoint(tmp_path):
    store = EmbeddingStore(dim=3, capacity=50, expire_after={"steps": 2}, optimizer={"name": "sgd", "lr": 0.5})
    keys = np.arange(1, 21, dtype=np.uint64)
    store.push(keys, np.ones((20, 3), np.float32))  # push probes read-only: nothing is stamped yet
    store.lookup(keys)
    store.expire(1)
    before = dict(zip(store.keys().tolist(), store.pull(store.keys(), insert=False)))
    store.lookup(keys[::2])
    store.expire(2)
    store.save(tmp_path / "t")
    loaded = EmbeddingStore.load(tmp_path / "t")
    assert loaded.expire(3) == 10 and store.expire(3) == 10  # the odd keys, last trained at step 1
    for s in (store, loaded):
        kept = s.keys().tolist()
        assert sorted(kept) == keys[::2].tolist()
        assert np.array_equal(s.pull(s.keys(), insert=False), np.stack([before[k] for k in kept]))
        assert s.stats()["expired"] == 10


def test_collection_stores_expire_between_steps():
    tables = {"t": TableConfig(dim=4, capacity=100, expire_after={"steps": 1})}
    collection = EmbeddingCollection(tables, {"f": "t"})
    for step, ids in enumerate(([1, 2, 3], [3, 4]), start=1):
        features = JaggedFeatures(["f"], np.array(ids, np.uint64), np.arange(len(ids) + 1, dtype=np.int64))
        out = collection(features)["f"]
        out.sum().backward()
        collection.stores["t"].expire(step)
    assert sorted(collection.stores["t"].keys().tolist()) == [3, 4]


def test_expire_after_is_checked():
    with pytest.raises(ValueError, match=r"expire_after: must be \{steps: N\} or \{seconds: S\}"):
        TableConfig(dim=2, capacity=10, expire_after={"days": 3})
    with pytest.raises(ValueError, match="expire_after.steps"):
        TableConfig(dim=2, capacity=10, expire_after={"steps": 0})
