"""Named shared-memory stores survive `kill -9` of their owning process: a new process reattaches
and has every update that completed before the kill."""
import os
import signal
import subprocess
import sys
import textwrap
import uuid

import numpy as np
import pytest

from hybridrec.embedding import EmbeddingStore, unlink_shared
from hybridrec.embedding.memory import shm_path
from hybridrec.embedding.kernels import PT_SLOT_COUNT, PT_SLOT_START
from hybridrec.embedding.store import S_DIRTY, S_INDEX_GEN, S_MAGIC

BATCHES = textwrap.dedent("""
    import numpy as np
    def batch(step):
        rng = np.random.default_rng(step)
        keys = rng.integers(0, 500, size=128).astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        return keys, rng.normal(size=(128, 4)).astype(np.float32)
    CONFIG = dict(dim=4, capacity=1000, optimizer="adagrad", num_threads=2)
""")

CHILD = BATCHES + textwrap.dedent("""
    import sys, time
    from hybridrec.embedding import EmbeddingStore
    name, steps = sys.argv[1], int(sys.argv[2])
    store = EmbeddingStore.open_shared(name, **CONFIG)
    step = store.step
    while steps < 0 or step < steps:
        keys, grads = batch(step)
        store.pull(keys)
        store.push(keys, grads)
        step += 1
        print(step, flush=True)
    time.sleep(120)
""")

helpers = {}
exec(BATCHES, helpers)


@pytest.fixture
def shm_name():
    name = f"test-{uuid.uuid4().hex[:12]}"
    yield name
    unlink_shared(name)


def _start(name, steps):
    return subprocess.Popen([sys.executable, "-c", CHILD, name, str(steps)], stdout=subprocess.PIPE, text=True)


def _wait_acks(proc, count):
    acked = 0
    while acked < count:
        line = proc.stdout.readline()
        assert line, f"child exited early with code {proc.wait(timeout=10)}"
        acked = int(line)
    return acked


def _replica(steps):
    store = EmbeddingStore(**helpers["CONFIG"])
    for step in range(steps):
        keys, grads = helpers["batch"](step)
        store.pull(keys)
        store.push(keys, grads)
    return store


def _content(store):
    e = store.export()
    order = np.argsort(e["keys"])
    return e["keys"][order], e["weights"][order], e["state"][order], e["clocks"][order]


def _kill(proc):
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    proc.stdout.close()


def test_reattach_after_kill_has_every_completed_update(shm_name):
    proc = _start(shm_name, steps=25)
    try:
        _wait_acks(proc, 25)
    finally:
        _kill(proc)
    attached = EmbeddingStore.attach(shm_name)
    assert attached.step == 25
    for got, want in zip(_content(attached), _content(_replica(25))):
        np.testing.assert_array_equal(got, want)


def test_kill_during_updates_loses_no_acknowledged_update(shm_name):
    proc = _start(shm_name, steps=-1)
    try:
        acked = _wait_acks(proc, 40)
    finally:
        _kill(proc)
    attached = EmbeddingStore.attach(shm_name)
    assert attached.step >= acked
    keys = attached.keys()
    assert len(np.unique(keys)) == len(keys) == len(attached)
    assert (attached.lookup(keys, insert=False).rows >= 0).all(), "index rebuilt for every live key"
    ref_keys, _, _, ref_clocks = _content(_replica(acked))
    got = dict(zip(*_content(attached)[::3]))
    # capacity exceeds the 500 keys: nothing is evicted, so every acknowledged update must be there
    for k, c in zip(ref_keys.tolist(), ref_clocks.tolist()):
        assert got[k] >= c, f"key {k}: {got[k]} updates survived, {c} were acknowledged"
    # and the reattached store trains on
    keys, grads = helpers["batch"](1000)
    attached.pull(keys)
    attached.push(keys, grads)


def test_open_shared_refuses_a_different_config(shm_name):
    EmbeddingStore.open_shared(shm_name, dim=4, capacity=10).close()
    with pytest.raises(ValueError, match="different table config"):
        EmbeddingStore.open_shared(shm_name, dim=8, capacity=10)
    with pytest.raises(FileExistsError, match="already exists"):
        EmbeddingStore(dim=4, capacity=10, shm_name=shm_name)
    with pytest.raises(ValueError, match="shm_name: 'bad/name' is not allowed"):
        EmbeddingStore(dim=4, capacity=10, shm_name="bad/name")


def test_a_store_of_the_untagged_index_layout_is_refused_by_name(shm_name):
    """Index entries now carry a hash tag above the row number; a store written by the earlier
    layout would read its bare row numbers as wrong tags and lose keys, so attaching refuses it."""
    store = EmbeddingStore.open_shared(shm_name, dim=4, capacity=10)
    store.pull(np.arange(5, dtype=np.uint64))
    store.scalars[S_MAGIC] = 0x48524543  # the magic the untagged layout wrote ("HREC")
    store.close()
    with pytest.raises(ValueError, match=f"shm_name: '{shm_name}' holds a store of an earlier hybridrec layout"):
        EmbeddingStore.attach(shm_name)


def test_a_store_whose_index_entries_carry_no_displacement_is_reindexed_on_attach(shm_name):
    """The layout before this one ("HRE2") put hash-tag bits where entries now hold their
    displacement; its rows and LRU lists are the same, so attaching it rebuilds the index."""
    store = EmbeddingStore.open_shared(shm_name, dim=4, capacity=50)
    keys = np.arange(1, 81, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    store.pull(keys[:40])
    rows = _trained(store, keys[-40:])  # 80 keys in 50 rows: evicting
    live = set(store.keys().tolist())
    store.scalars[S_MAGIC] = 0x48524532
    store.index[:] = 0  # entries the new layout cannot read
    store.close()
    again = EmbeddingStore.attach(shm_name)
    np.testing.assert_array_equal(again.pull(keys[-40:], insert=False), rows)
    assert set(again.keys().tolist()) == live
    assert again.scalars[S_MAGIC] == 0x48524534


def test_a_store_with_linked_lru_lists_gets_its_lru_ring_on_attach_and_evicts_as_before(shm_name):
    """The layout before this one ("HRE3") kept the LRU order in linked lists and had no ring
    file; attaching it builds the ring from the rows' stamps, so later evictions pick the
    victims a store that never left memory picks."""
    keys = np.arange(1, 121, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    stores = [EmbeddingStore.open_shared(shm_name, dim=4, capacity=50), EmbeddingStore(dim=4, capacity=50)]
    for store in stores:
        store.pull(keys[:40])
        _trained(store, keys[30:80])  # evicting: the ring is kept
    old, same = stores
    old.scalars[S_MAGIC] = 0x48524533
    ring_file = old._arena.path / "lru_log.bin"
    old.close()
    ring_file.unlink()
    again = EmbeddingStore.attach(shm_name)
    assert again.scalars[S_MAGIC] == 0x48524534
    for store in (again, same):
        _trained(store, keys[70:120])
    assert set(again.keys().tolist()) == set(same.keys().tolist())
    again.close()


def _slots_in_use(store):
    """The end of the last partition's index slots."""
    return int((store.parts[:, PT_SLOT_START] + store.parts[:, PT_SLOT_COUNT]).max())


def _trained(store, keys):
    """Rows of `keys` after one update, so that they differ from any key's first value."""
    store.pull(keys)
    store.push(keys, np.ones((len(keys), store.dim), np.float32))
    return store.pull(keys, insert=False)


def test_index_growth_writes_only_the_slots_in_use(shm_name):
    """The index file is made at its full-capacity size, but a store holding few keys writes only
    the first slots: the rest stay unwritten file pages, which cost no memory."""
    store = EmbeddingStore.open_shared(shm_name, dim=4, capacity=100_000)
    index_before = store.index
    keys = np.arange(1, 3001, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    rows = _trained(store, keys)  # several doublings of the index
    assert store.index is index_before  # grown in place: readers holding the array still see it
    used = _slots_in_use(store)
    assert 2 * len(keys) <= used < len(store.index) // 4
    assert (store.index[used:] == 0).all()
    store.close()
    again = EmbeddingStore.attach(shm_name)
    np.testing.assert_array_equal(again.pull(keys, insert=False), rows)


def test_a_store_whose_index_file_grew_with_its_keys_is_attached_and_repaired(shm_name):
    """Stores written by hybridrec before the full-size index kept a file only as large as the
    current generation's slots; attaching one gives it the full-size index and re-inserts every key."""
    store = EmbeddingStore.open_shared(shm_name, dim=4, capacity=5000, num_threads=2)
    keys = np.arange(1, 1001, dtype=np.uint64) * np.uint64(0xD1B54A32D192ED03)
    rows = _trained(store, keys)
    used = _slots_in_use(store)
    store.close()
    # the earlier layout's file size, its entries lost, so only a re-insertion finds the keys
    (shm_path(shm_name) / "index.bin").write_bytes(np.full(used, -1, np.int32).tobytes())
    again = EmbeddingStore.attach(shm_name)
    assert len(again.index) == len(store.index)
    np.testing.assert_array_equal(again.pull(keys, insert=False), rows)
    assert len(again) == len(keys)


def test_a_growth_interrupted_before_its_keys_were_reinserted_is_repaired_on_attach(shm_name):
    store = EmbeddingStore.open_shared(shm_name, dim=4, capacity=5000)
    keys = np.arange(1, 201, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    rows = _trained(store, keys)
    # what a kill inside _reserve leaves: the dirty mark, the next generation, slots not re-filled
    store.scalars[S_DIRTY] = 1
    store.scalars[S_INDEX_GEN] += 1
    store.index[:] = 0
    store.close()
    again = EmbeddingStore.attach(shm_name)
    np.testing.assert_array_equal(again.pull(keys, insert=False), rows)
    assert again.scalars[S_DIRTY] == 0 and again.scalars[S_INDEX_GEN] >= 1
