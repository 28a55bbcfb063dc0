"""HET's cache embedding table (hybridrec.het.cache): each policy against a plain
Python model of it, under random reads; the clocks and accumulated gradients it keeps."""
from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridrec.het.cache import HIT, MISS, SYNC, CacheTable


class ModelCache:
    """The policies as the module doc states them, one key at a time."""

    def __init__(self, capacity, policy, threshold=10):
        self.capacity, self.policy, self.threshold = capacity, policy, threshold
        self.max_pinned = capacity // 2
        self.row = {}  # key -> row
        self.freq, self.tick, self.clock = {}, {}, 0
        self.order = OrderedDict()  # lru: least recent first
        self.buckets = [OrderedDict() for _ in range(threshold)]  # light_lfu: least recent first
        self.pinned = set()

    def _use(self, key, new):
        self.clock += 1
        self.tick[key] = self.clock
        if self.policy == "lru":
            self.order.pop(key, None)
            self.order[key] = True
        elif self.policy == "lfu":
            self.freq[key] = 1 if new else self.freq[key] + 1
        elif new:
            self.freq[key] = 1
            self.buckets[0][key] = True
        elif key not in self.pinned:
            f = self.freq[key]
            del self.buckets[f - 1][key]
            if f >= self.threshold and len(self.pinned) < self.max_pinned:
                self.pinned.add(key)
            else:
                self.freq[key] = min(f + 1, self.threshold)
                self.buckets[self.freq[key] - 1][key] = True

    def _victim(self, current):
        if self.policy == "lru":
            return next((k for k in self.order if k not in current), None)
        if self.policy == "lfu":
            free = [k for k in self.row if k not in current]
            return min(free, key=lambda k: (self.freq[k], self.tick[k]), default=None)
        for bucket in self.buckets:
            found = next((k for k in bucket if k not in current), None)
            if found is not None:
                return found
        pinned = [k for k in self.pinned if k not in current]
        return min(pinned, key=lambda k: self.row[k], default=None)

    def _forget(self, key):
        self.order.pop(key, None)
        if key in self.pinned:
            self.pinned.discard(key)
        elif self.policy == "light_lfu":
            del self.buckets[self.freq[key] - 1][key]
        del self.row[key]

    def read(self, keys):
        current = set(keys)
        evicted, pending = [], []
        for k in keys:
            if k in self.row:
                self._use(k, new=False)
        for k in keys:
            if k in self.row:
                continue
            if len(self.row) < self.capacity:
                r = len(self.row)
            else:
                victim = self._victim(current)
                r = self.row[victim]
                self._forget(victim)
                evicted.append(victim)
            self.row[k] = r
            pending.append(k)
        for k in pending:
            self._use(k, new=True)
        return evicted


reads = st.lists(st.lists(st.integers(0, 40), min_size=1, max_size=12, unique=True), min_size=1, max_size=60)


@pytest.mark.parametrize("policy", ["lru", "lfu", "light_lfu"])
@settings(max_examples=25, deadline=None)
@given(sequence=reads, capacity=st.integers(12, 30), threshold=st.integers(1, 4))
def test_each_policy_keeps_and_evicts_what_its_model_does(policy, sequence, capacity, threshold):
    cache = CacheTable(capacity, 2, policy, light_threshold=threshold)
    model = ModelCache(capacity, policy, threshold)
    for keys in sequence:
        array = np.array(keys, dtype=np.uint64)
        rows_of, status, ev_keys, _, _ = cache.begin_read(array, 5)
        expected = model.read(keys)
        assert sorted(cache.cached_keys().tolist()) == sorted(model.row)
        assert rows_of.tolist() == [model.row[k] for k in keys]
        evictions = cache.stats()["evictions"]
        assert set(ev_keys.tolist()) <= set(expected)  # only victims holding updates are written back
        cache.fill(rows_of[status == MISS], np.zeros((int((status == MISS).sum()), 2), np.float32),
                   np.zeros(int((status == MISS).sum()), np.int64))
        cache.accumulate(rows_of, np.ones((len(keys), 2), np.float32), 0.0)
        model_evictions = getattr(model, "evictions", 0) + len(expected)
        model.evictions = model_evictions
        assert evictions == model_evictions
        assert len(cache) == len(model.row) <= capacity


def test_clocks_accumulation_and_the_first_bound():
    cache = CacheTable(4, 3, "lru")
    keys = np.array([7, 9], np.uint64)
    rows_of, status, *_ = cache.begin_read(keys, 1)
    assert status.tolist() == [MISS, MISS]
    cache.fill(rows_of, np.array([[1, 1, 1], [2, 2, 2]], np.float32), np.array([10, 20]))
    assert cache.entry(7) == (10, 10) and cache.entry(9) == (20, 20)
    grads = np.array([[1, 0, 0], [0, 2, 0]], np.float32)
    cache.accumulate(rows_of, grads, 0.5)  # c_c + 1, local SGD step, gradient kept
    np.testing.assert_allclose(cache.gather(rows_of), [[0.5, 1, 1], [2, 1, 2]])
    assert cache.entry(7) == (10, 11)
    rows_of, status, *_ = cache.begin_read(keys, 1)
    assert status.tolist() == [HIT, HIT]  # c_c = c_s + 1 <= c_s + s
    cache.accumulate(rows_of, grads, 0.5)
    rows_of, status, *_ = cache.begin_read(keys, 1)
    assert status.tolist() == [SYNC, SYNC]  # c_c = c_s + 2 > c_s + 1
    k, clocks, acc = cache.take(rows_of)
    assert k.tolist() == [7, 9] and clocks.tolist() == [12, 22]
    np.testing.assert_allclose(acc, 2 * grads)
    assert sorted(cache.dirty_rows().tolist()) == sorted(rows_of.tolist())
    cache.clear()
    assert len(cache) == 0 and cache.entry(7) is None


def test_a_dirty_victim_is_handed_back_with_its_clock_and_gradient():
    cache = CacheTable(2, 1, "lru")
    rows_of, *_ = cache.begin_read(np.array([1, 2], np.uint64), None)
    cache.fill(rows_of, np.zeros((2, 1), np.float32), np.array([5, 5]))
    cache.accumulate(rows_of[:1], np.array([[3.0]], np.float32), 0.1)  # key 1 holds an update, key 2 none
    rows_of, status, ev_keys, ev_clocks, ev_grads = cache.begin_read(np.array([3, 4], np.uint64), None)
    assert status.tolist() == [MISS, MISS]
    assert ev_keys.tolist() == [1] and ev_clocks.tolist() == [6] and ev_grads.tolist() == [[3.0]]
    assert cache.stats()["evictions"] == 2 and cache.stats()["dirty_evictions"] == 1


def test_a_read_larger_than_the_cache_is_refused_before_it_changes_anything():
    cache = CacheTable(3, 1, "lfu")
    with pytest.raises(ValueError, match="does not fit"):
        cache.begin_read(np.arange(4, dtype=np.uint64), 0)


def test_light_lfu_pins_frequent_entries_and_stops_counting_them():
    cache = CacheTable(4, 1, "light_lfu", light_threshold=3)
    hot = np.array([1], np.uint64)
    for _ in range(4):  # inserted, then used 3 times: the 3rd use at the threshold pins it
        cache.begin_read(hot, None)
    assert cache.stats()["pinned"] == 1 and cache.freq[0] == -1
    for step in range(20):  # a stream of cold keys does not push the pinned entry out
        cache.begin_read(np.array([100 + 3 * step, 101 + 3 * step, 102 + 3 * step], np.uint64), None)
    assert 1 in cache.cached_keys().tolist()
