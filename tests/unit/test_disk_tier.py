"""The disk tier under the embedding store: evicted rows go to disk with their optimizer state and
come back at their next pull; checkpoints carry the tier (only its changed chunks written again)
and re-shard; a process killed while writing the tier leaves the last checkpoint whole and the
tier repairable."""
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from hybridrec.embedding import EmbeddingStore
from hybridrec.embedding.checkpoint import load_resharded
from hybridrec.embedding.tier_kernels import TP_SPILLED, TP_WIDTH
from hybridrec.errors import UserError

DIM = 4


def _stream(steps, seed=0, universe=3000, batch=128):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        keys = rng.integers(0, universe, batch).astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        yield keys, rng.normal(size=(batch, DIM)).astype(np.float32)


def _train(store, steps, seed=0, batch=128, universe=3000):
    for keys, grads in _stream(steps, seed, universe, batch):
        store.pull(keys)
        assert store.push(keys, grads) == 0


def _by_key(export):
    order = np.argsort(export["keys"])
    return {name: column[order] for name, column in export.items()}


def _assert_same_rows(a, b):
    a, b = _by_key(a), _by_key(b)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def _tiered(tmp_path, capacity=256, threads=1, name="tier", optimizer="adam", tier_rows=4000):
    return EmbeddingStore(dim=DIM, capacity=capacity, optimizer=optimizer, num_threads=threads,
                          tier={"path": str(tmp_path / name), "capacity_rows": tier_rows})


@pytest.mark.parametrize("threads, steps, tier_rows", [(1, 40, 4000), (2, 40, 4000), (1, 80, 3000)])
def test_every_row_survives_eviction_to_disk_bit_for_bit(tmp_path, threads, steps, tier_rows):
    """The third case writes the tier's records over twice: each region's head passes the rows
    still live on disk and writes over the free records between them."""
    tiered = _tiered(tmp_path, threads=threads, tier_rows=tier_rows)
    in_memory = EmbeddingStore(dim=DIM, capacity=4000, optimizer="adam", num_threads=threads)
    _train(tiered, steps)
    _train(in_memory, steps)
    stats = tiered.stats()
    assert stats["evicted"] > 1000 and stats["rows_on_disk"] > 1000 and stats["disk_dropped"] == 0
    assert stats["spilled"] > (2 * tiered.disk_tier.slots if steps > 40 else 0)
    assert stats["rows_in_memory"] + stats["rows_on_disk"] == len(in_memory)
    _assert_same_rows(tiered.export(), in_memory.export())  # weights, optimizer state, counts, clocks
    keys = in_memory.keys()
    for part in np.array_split(keys, len(keys) // 100):  # every key pulled once more, read-only: each returns its last row
        np.testing.assert_array_equal(tiered.pull(part, insert=False), in_memory.pull(part, insert=False))
    tiered.close()


def test_checkpoint_carries_the_tier_incrementally_and_reshards(tmp_path):
    store = _tiered(tmp_path, optimizer="adagrad", tier_rows=40_000)
    _train(store, 100, universe=20_000)  # about 12,500 rows written to the tier: 4 chunks of its records
    first = store.save(tmp_path / "ck1")
    _train(store, 1, seed=1, batch=4, universe=20_000)  # a few rows: most chunks of the tier unchanged
    second = store.save(tmp_path / "ck2")
    chunks = sorted((second / "tier").iterdir())
    linked = [c for c in chunks if os.stat(c).st_ino == os.stat(first / "tier" / c.name).st_ino]
    assert 0 < len(linked) < len(chunks)  # unchanged chunks are links to the last checkpoint's files
    want = store.export()

    loaded = EmbeddingStore.load(second, tier={"path": str(tmp_path / "other"), "capacity_rows": 12_000}, capacity=300)
    _assert_same_rows(loaded.export(), want)
    in_memory = EmbeddingStore.load(second, capacity=12_000)  # no tier: every row in memory
    _assert_same_rows(in_memory.export(), want)
    shards = [load_resharded([second], s, 2, capacity=12_000) for s in range(2)]
    merged = {k: np.concatenate([s.export()[k] for s in shards]) for k in want}
    _assert_same_rows(merged, want)
    store.close()
    loaded.close()


def test_a_second_store_on_the_same_tier_and_bad_tier_settings_are_refused(tmp_path):
    store = _tiered(tmp_path)
    with pytest.raises(ValueError, match="in use by another store of this process"):
        _tiered(tmp_path)
    store.close()
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import fcntl, os, sys
        fd = os.open({str(tmp_path / "tier" / "lock")!r}, os.O_RDWR)
        fcntl.flock(fd, fcntl.LOCK_EX)
        print("held", flush=True)
        sys.stdin.read()""")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(ValueError, match="in use by another process's store"):
            _tiered(tmp_path)
    finally:
        holder.stdin.close()
        holder.wait(10)
    _tiered(tmp_path).close()  # free again once each holder let go
    with pytest.raises(ValueError, match="another layout"):
        _tiered(tmp_path, optimizer="sgd")
    with pytest.raises(ValueError, match="tier.capacity_rows"):
        EmbeddingStore(dim=DIM, capacity=10, tier={"path": str(tmp_path / "x"), "capacity_rows": 0})
    with pytest.raises(ValueError, match=r"tier: must be \{path"):
        EmbeddingStore(dim=DIM, capacity=10, tier={"path": str(tmp_path / "x")})


def test_tier_settings_in_the_job_config_are_checked_with_their_names(tmp_path):
    from hybridrec.config import parse_config

    with pytest.raises(UserError, match="embedding.default.tier.path"):
        parse_config({"embedding": {"default": {"tier": {"path": "", "capacity_rows": 10}}}})
    with pytest.raises(UserError, match="embedding.per_feature.C1.tier.capacity_rows"):
        parse_config({"embedding": {"per_feature": {"C1": {"tier": {"path": "t", "capacity_rows": 0}}}}})
    cfg = parse_config({"embedding": {"default": {"tier": {"path": str(tmp_path), "capacity_rows": 10}}}})
    assert cfg.embedding.default.table_config(4, name="C1:wide").tier["path"] == str(tmp_path / "C1..wide")


CHILD = textwrap.dedent("""
    import sys
    import numpy as np
    from hybridrec.embedding import EmbeddingStore
    root = sys.argv[1]
    store = EmbeddingStore(dim=4, capacity=256, optimizer="adagrad", tier={"path": root + "/tier", "capacity_rows": 4000})
    rng = np.random.default_rng(0)
    def step():
        keys = rng.integers(0, 3000, 128).astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        store.pull(keys)
        store.push(keys, rng.normal(size=(128, 4)).astype(np.float32))
    for _ in range(30):
        step()
    store.save(root + "/ck")
    np.savez(root + "/want.npz", **store.export())
    print("saved", flush=True)
    while True:  # keep evicting to the tier and taking rows back until killed
        step()
""")


def test_kill_during_a_tier_write_then_load_the_last_checkpoint(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "saved"
        spilled = lambda: np.frombuffer((tmp_path / "tier" / "regions.bin").read_bytes(), np.int64)[TP_WIDTH + TP_SPILLED]
        before = spilled()
        while spilled() < before + 2000 and child.poll() is None:  # the child is writing the tier
            pass
        assert child.poll() is None
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    want = dict(np.load(tmp_path / "want.npz"))
    loaded = EmbeddingStore.load(tmp_path / "ck", tier={"path": str(tmp_path / "fresh"), "capacity_rows": 4000})
    _assert_same_rows(loaded.export(), want)
    loaded.close()
    # the live tier, killed mid-write, opens again: repaired, every key once, every row readable
    reopened = EmbeddingStore(dim=4, capacity=256, optimizer="adagrad",
                              tier={"path": str(tmp_path / "tier"), "capacity_rows": 4000})
    keys = reopened.export()["keys"]
    assert len(keys) == len(np.unique(keys)) > 1000
    assert np.isfinite(reopened.pull(keys[:200], insert=False)).all()
    reopened.close()


def test_a_tier_left_mid_write_is_reindexed_with_every_row_once(tmp_path):
    store = _tiered(tmp_path, optimizer="adagrad")
    _train(store, 40)
    on_disk = [np.concatenate(column) for column in zip(*store.disk_tier.chunks())]
    want = dict(zip(("keys", "rows", "counts", "clocks"), on_disk))
    store.close()
    regions = np.memmap(tmp_path / "tier" / "regions.bin", np.int64, "r+")
    regions[1] = 1  # the dirty flag: as if the process had died inside a write
    index = np.memmap(tmp_path / "tier" / "index.bin", np.uint64, "r+").reshape(-1, 2)
    used, free = np.flatnonzero(index[:, 1]), np.flatnonzero(index[:, 1] == 0)
    index[free[-1]] = index[used[0]]  # an entry moved off its probe run, past empty slots
    index[used[0]] = 0
    index[free[-2]] = index[used[1]]  # an entry held twice (a shift cut short)
    regions.flush(), index.flush()
    del regions, index
    reopened = _tiered(tmp_path, optimizer="adagrad")
    got = reopened.export()  # the memory tier is new and empty: every row comes from the disk tier
    _assert_same_rows({"keys": got["keys"], "rows": np.hstack([got["weights"], got["state"]]),
                       "counts": got["counts"], "clocks": got["clocks"]}, want)
    reopened.close()
