"""Store checkpoints as functions: save and load one store, and load one shard of a re-sharded set.

`save` and `load` are `EmbeddingStore.save` / `EmbeddingStore.load` for callers that hold a
function rather than the class; the file format is checkpoint_format.py's. `load_resharded`
reads checkpoints taken with N shards into shard s of M: it keeps the keys that the global route
(`hashing.route`) sends to s, from the memory tiers and the disk tiers of the checkpoints.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from . import kernels as K
from .checkpoint_format import Snapshot, check_compatible, read, read_manifest, saved_config, tier_rows
from .hashing import route
from .store import EmbeddingStore
from .table import TableConfig

__all__ = ["load", "load_resharded", "read_manifest", "save"]


def save(store: EmbeddingStore, directory, extra: dict | None = None) -> Path:
    """Write a consistent checkpoint of `store` to `directory` (replaced atomically)."""
    return store.save(directory, extra)


def load(directory, shm_name: str | None = None, **overrides) -> EmbeddingStore:
    """A new store holding a checkpoint. `overrides` may change table fields (e.g. capacity,
    num_threads); dim and optimizer must match the checkpoint."""
    return EmbeddingStore.load(directory, shm_name=shm_name, **overrides)


def load_resharded(directories, shard: int, num_shards: int, table_id: int = 0, shm_name: str | None = None,
                   **overrides) -> EmbeddingStore:
    """Shard `shard` of `num_shards` built from checkpoints of any number of shards.

    Keeps the keys that `route(key, table_id, num_shards)` sends to `shard`. The default capacity
    is the source checkpoints' total divided by num_shards (rounded up).
    """
    directories = [Path(d) for d in directories]
    if not directories:
        raise ValueError("directories: at least one checkpoint directory is needed")
    if not (isinstance(num_shards, int) and num_shards >= 1 and isinstance(shard, int) and 0 <= shard < num_shards):
        raise ValueError(f"shard/num_shards: need 0 <= shard < num_shards, got shard={shard!r}, num_shards={num_shards!r}")
    manifests = [read_manifest(d) for d in directories]
    total_capacity = sum(m["layout"]["capacity"] for m in manifests)
    overrides.setdefault("capacity", max(1, -(-total_capacity // num_shards)))
    config = TableConfig.from_dict({**saved_config(manifests[0]).to_dict(), **overrides})
    for d, m in zip(directories, manifests):
        check_compatible(m, config, d)
    rows, meta, tiers = [], [], []
    for d, m in zip(directories, manifests):
        saved = read(d, m)
        mine = route(np.ascontiguousarray(saved.meta.view(np.uint64)[:, 0]), table_id, num_shards) == shard
        rows.append(saved.rows[mine])
        meta.append(saved.meta[mine])
        tiers.append((saved.tier, f"checkpoint: {d}"))
    # no partition layout: the rows are re-inserted, least recently used first
    gathered = Snapshot(config=config, nparts=0, rows=np.concatenate(rows), meta=np.concatenate(meta),
                        parts=np.empty((0, K.PARTS_WIDTH), np.int64), sketch=np.empty((2, 0), np.uint16),
                        step=max(m["step"] for m in manifests), epoch=0, dropped_updates=0)
    store = EmbeddingStore(config, shm_name=shm_name)
    store.restore(gathered, source=f"checkpoints {[str(d) for d in directories]}")
    for tier, source in tiers:  # the disk tiers' rows, a chunk at a time
        for keys, cold_rows, counts, clocks in tier_rows(tier, source):
            mine = route(keys, table_id, num_shards) == shard
            store.add_cold_rows(keys[mine], cold_rows[mine], counts[mine], clocks[mine])
    return store
