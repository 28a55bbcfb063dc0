"""EmbeddingStore behaviour a user relies on: deterministic initialisation, pull/push, input
checks that leave the store untouched, memory per row, and multi-threaded partitions."""
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import pytest

from hybridrec.embedding import EmbeddingStore, TableConfig, route

KEYS = np.array([0, 1, 2**32, 2**63, 2**64 - 1, 987654321987654321], dtype=np.uint64)


def test_initial_row_depends_only_on_seed_and_key():
    a = EmbeddingStore(dim=8, capacity=100, seed=7, num_threads=1)
    b = EmbeddingStore(dim=8, capacity=50, seed=7, num_threads=2)
    a.pull(np.arange(100, 140, dtype=np.uint64))  # a different history first
    np.testing.assert_array_equal(a.pull(KEYS), b.pull(KEYS[::-1])[::-1])
    c = EmbeddingStore(dim=8, capacity=100, seed=8)
    assert not np.allclose(a.pull(KEYS), c.pull(KEYS))


def test_uniform_and_normal_initialisers_respect_their_bounds():
    u = EmbeddingStore(dim=16, capacity=5000, init={"kind": "uniform", "low": -0.1, "high": 0.3})
    w = u.pull(np.arange(4000, dtype=np.uint64))
    assert w.min() >= -0.1 and w.max() < 0.3 and abs(w.mean() - 0.1) < 0.01
    n = EmbeddingStore(dim=16, capacity=5000, init={"kind": "normal", "mean": 0.0, "std": 0.1, "bound": 0.15})
    w = n.pull(np.arange(4000, dtype=np.uint64))
    assert np.abs(w).max() <= 0.15 and 0.07 < w.std() < 0.1  # truncation narrows the spread
    z = EmbeddingStore(dim=4, capacity=10, init="zeros")
    assert (z.pull(KEYS) == 0).all()


def test_pull_without_insert_reads_zeros_and_leaves_store_empty():
    store = EmbeddingStore(dim=4, capacity=10)
    assert (store.pull(KEYS, insert=False) == 0).all()
    assert len(store) == 0


def test_push_sums_gradients_of_equal_keys():
    store = EmbeddingStore(dim=2, capacity=10, optimizer={"name": "sgd", "lr": 1.0}, init="zeros")
    keys = np.array([5, 5, 6], dtype=np.uint64)
    store.pull(keys)
    store.push(keys, np.array([[1, 2], [3, 4], [1, 1]], np.float32))
    np.testing.assert_array_equal(store.pull(keys, insert=False), [[-4, -6], [-4, -6], [-1, -1]])
    assert store.export()["clocks"].tolist() == [1, 1]


def test_push_of_absent_keys_is_dropped_and_counted():
    store = EmbeddingStore(dim=2, capacity=10)
    assert store.push(np.array([1, 2], np.uint64), np.ones((2, 2), np.float32)) == 2
    assert len(store) == 0


@pytest.mark.parametrize("keys, message", [
    (np.array([1, 2], dtype=np.int64), "keys: dtype must be uint64"),
    ([1, 2], "keys: expected a numpy uint64 array"),
    (np.ones((2, 2), dtype=np.uint64), "keys: must be 1-D"),
])
def test_bad_keys_are_refused_with_the_argument_named(keys, message):
    store = EmbeddingStore(dim=2, capacity=10)
    with pytest.raises((TypeError, ValueError), match=message):
        store.pull(keys)


@pytest.mark.parametrize("grads, message", [
    (np.array([[np.nan, 0], [0, 0]], np.float32), "NaN or inf"),
    (np.array([[np.inf, 0], [0, 0]], np.float32), "NaN or inf"),
    (np.array([[0, 0], [0, -np.inf]], np.float32), "NaN or inf"),
    (np.array([[0, 0], [0, np.nan]], np.float32), "NaN or inf"),
    (np.zeros((2, 3), np.float32), r"shape must be \(2, 2\)"),
    (np.zeros((1, 2), np.float32), r"shape must be \(2, 2\)"),
])
def test_bad_gradients_change_no_row(grads, message):
    store = EmbeddingStore(dim=2, capacity=10, optimizer="adam")
    keys = np.array([1, 2], np.uint64)
    store.pull(keys)
    before = store.export()
    with pytest.raises(ValueError, match=message):
        store.push(keys, grads)
    after = store.export()
    for name in before:
        np.testing.assert_array_equal(before[name], after[name])
    assert store.step == 0


def test_extreme_but_finite_gradients_are_applied():
    """The finiteness check looks at exponent bits: the largest float32, the smallest subnormal
    and a negative zero are numbers, and the update goes through."""
    store = EmbeddingStore(dim=4, capacity=10, optimizer={"name": "sgd", "lr": 1e-30})
    keys = np.array([1, 2], np.uint64)
    store.pull(keys)
    tiny = np.finfo(np.float32).smallest_subnormal
    store.push(keys, np.array([[np.finfo(np.float32).max, tiny, -0.0, 1.0],
                               [-np.finfo(np.float32).max, -tiny, 0.0, -1.0]], np.float32))
    assert store.step == 1


@pytest.mark.parametrize("field, value, message", [
    ("dim", 0, "dim: must be an integer"),
    ("capacity", -5, "capacity: must be an integer"),
    ("eviction", "lrv", "did you mean 'lru'"),
    ("optimizer", "adagrd", "did you mean 'adagrad'"),
    ("optimizer", {"name": "adam", "betta1": 0.9}, "did you mean 'beta1'"),
    ("optimizer", {"name": "sgd", "lr": -1}, "lr must be a finite number > 0"),
    ("admit_probability", 0.0, "admit_probability: must be >"),
    ("pooling", "max", "choose one of"),
    ("init", {"kind": "uniform", "low": 1, "high": 0}, "low must be < high"),
    ("prefault", "yes", "prefault: must be true or false, got 'yes'"),
])
def test_bad_table_config_names_the_parameter(field, value, message):
    with pytest.raises(ValueError, match=message):
        TableConfig(**{"dim": 4, "capacity": 10, field: value})


def test_a_key_reads_one_row_at_all_its_positions_within_a_call():
    """Admission is decided sighting by sighting, but a batch sees one consistent view: a key
    admitted at its second sighting reads its row at the first position too."""
    store = EmbeddingStore(dim=3, capacity=100, admit_min_frequency=2)
    keys = np.array([7, 9, 7, 11], dtype=np.uint64)
    rows = store.pull(keys)
    assert store.stats()["size"] == 1  # 7 was seen twice; 9 and 11 once
    np.testing.assert_array_equal(rows[0], rows[2])
    assert rows[0].any() and not rows[1].any() and not rows[3].any()
    found = store.lookup(keys, insert=False)
    assert found.inverse[0] == found.inverse[2] >= 0 and found.inverse[1] == found.inverse[3] == -1


def test_unknown_table_key_is_refused_with_the_closest_name():
    with pytest.raises(ValueError, match="did you mean 'capacity'"):
        TableConfig.from_dict({"dim": 4, "capacty": 10})


def test_memory_per_row_stays_within_budget_at_full_capacity():
    dim = 16
    store = EmbeddingStore(dim=dim, capacity=100_000, optimizer="adagrad")
    store.pull(np.arange(200_000, dtype=np.uint64)[:100_000])
    stats = store.stats()
    assert stats["size"] == 100_000
    assert stats["bytes_per_row"] <= (dim + dim) * 4 + 48


def _resident_bytes_of(array: np.ndarray) -> int:
    """Bytes of `array`'s pages that are backed by RAM, from /proc/self/pagemap (bit 63 of a
    page's entry: present). Only the array's own pages count, whatever mapping holds them: the
    kernel may merge an allocation's mapping with its neighbours."""
    page = os.sysconf("SC_PAGE_SIZE")
    first, last = array.ctypes.data // page, (array.ctypes.data + array.nbytes - 1) // page
    with open("/proc/self/pagemap", "rb") as pagemap:
        pagemap.seek(first * 8)
        entries = np.frombuffer(pagemap.read((last - first + 1) * 8), dtype=np.uint64)
    return int(((entries >> np.uint64(63)) & np.uint64(1)).sum()) * page


def _prefault_and_lazy(shm: bool) -> dict:
    """In a fresh process: the resident shares of a prefaulted store's rows and metadata and of a
    default store's rows, and whether the two stores give the same values."""
    capacity = 400_000  # 51 MB of rows: above malloc's largest mmap threshold, so a mapping of its own
    name = f"prefault-test-{os.getpid()}" if shm else None
    store = EmbeddingStore(dim=16, capacity=capacity, optimizer="adagrad", prefault=True, shm_name=name)
    try:
        lazy = EmbeddingStore(dim=16, capacity=capacity, optimizer="adagrad")
        shares = {"rows": _resident_bytes_of(store.rows) / store.rows.nbytes,
                  "meta": _resident_bytes_of(store.meta) / store.meta.nbytes,
                  "lazy_rows": _resident_bytes_of(lazy.rows) / lazy.rows.nbytes}
        keys = np.arange(1_000, dtype=np.uint64) * np.uint64(2**40 + 7)
        shares["same_values"] = bool(np.array_equal(store.pull(keys), lazy.pull(keys)))
        shares["size"] = store.stats()["size"]
        return shares
    finally:
        if shm:
            EmbeddingStore.unlink_shared(name)


@pytest.mark.parametrize("shm", [False, True])
def test_prefault_commits_the_rows_at_creation_and_changes_no_value(shm):
    # a fresh process: what earlier tests left in this one's allocator (a raised mmap threshold
    # hands out memory already touched) is not what a store's creation does
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        shares = pool.submit(_prefault_and_lazy, shm).result(timeout=120)
    assert shares["rows"] >= 0.99 and shares["meta"] >= 0.99
    assert shares["lazy_rows"] < 0.1  # the default: committed on use
    assert shares["same_values"] and shares["size"] == 1_000


def test_two_threads_give_the_same_values_as_one():
    rng = np.random.default_rng(1)
    one = EmbeddingStore(dim=4, capacity=10_000, optimizer="adagrad")
    two = EmbeddingStore(dim=4, capacity=10_000, optimizer="adagrad", num_threads=2)
    for _ in range(20):
        keys = (rng.zipf(1.3, size=500).astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15))
        grads = rng.normal(size=(500, 4)).astype(np.float32)
        np.testing.assert_array_equal(one.pull(keys), two.pull(keys))
        one.push(keys, grads)
        two.push(keys, grads)
    probe = np.unique(keys)
    np.testing.assert_array_equal(one.pull(probe, insert=False), two.pull(probe, insert=False))


@pytest.mark.parametrize("table_id", [0, 3, 2375276105, 2**40 + 1])
def test_route_is_uniform_for_any_table_id(table_id):
    keys = np.arange(100_000, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    counts = np.bincount(route(keys, table_id, 4), minlength=4)
    assert counts.min() > 0.95 * 25_000, counts


def test_route_is_uniform_and_stable():
    keys = np.arange(100_000, dtype=np.uint64)
    shards = route(keys, table_id=3, num_shards=4)
    counts = np.bincount(shards, minlength=4)
    assert counts.min() > 0.95 * 25_000
    np.testing.assert_array_equal(shards, route(keys.copy(), 3, 4))
    assert not np.array_equal(shards, route(keys, 4, 4)), "tables are shuffled independently"
    with pytest.raises(TypeError, match="uint64"):
        route(keys.astype(np.int64), 0, 4)


def test_read_only_lookups_do_not_change_what_training_admits():
    rng = np.random.default_rng(5)
    plain = EmbeddingStore(dim=2, capacity=10_000, admit_probability=0.5)
    probed = EmbeddingStore(dim=2, capacity=10_000, admit_probability=0.5)
    for _ in range(10):
        keys = rng.integers(0, 3000, size=200).astype(np.uint64)
        plain.pull(keys)
        probed.pull(keys)
        probed.pull(rng.integers(0, 3000, size=50).astype(np.uint64), insert=False)  # an evaluation
    np.testing.assert_array_equal(np.sort(plain.keys()), np.sort(probed.keys()))


@pytest.mark.parametrize("row_bits", [30, 31])
def test_index_tags_never_stand_in_for_the_key(row_bits):
    """Index entries keep a hash tag above the row number so that probes pass over other keys
    without reading their rows; a matching tag must still be checked against the key. With 30
    row bits a tag is one bit, so half of all keys share each tag; with 31 there is no tag. Either
    way every key finds its own row, and a key never inserted finds none."""
    from hybridrec.embedding import kernels as K

    reference = EmbeddingStore(dim=2, capacity=600)
    store = EmbeddingStore(dim=2, capacity=600)
    store.icfg[K.IC_ROW_BITS] = row_bits  # row numbers below 600 fit in any width
    keys = np.random.default_rng(9).integers(0, 2**63, size=2000, dtype=np.uint64)
    for batch in np.array_split(keys[:1500], 10):  # 1500 keys into 600 rows: evictions shift entries
        assert np.array_equal(store.lookup(batch).rows, reference.lookup(batch).rows)
    found = store.lookup(keys, insert=False)
    assert np.array_equal(found.rows, reference.lookup(keys, insert=False).rows)
    live = found.rows >= 0
    assert live.sum() == 600
    assert np.array_equal(store.r64[found.rows[live], 0], keys[live])
    assert not live[1500:].any()
