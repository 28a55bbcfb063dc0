"""Checkpoints of embedding stores: raw array copies plus a manifest with checksums.

A checkpoint is a directory: `manifest.json` (format, table config, layout, step, and for each
array file its dtype, shape, byte size and CRC32) and one raw `.bin` file per array. The rows
array holds embedding, optimizer state and metadata side by side, so copying it under the store's
lock yields weights and optimizer slots from one consistent instant. A checkpoint is written to a
temporary directory and renamed into place, so an interrupted save never damages the previous one.

Loading verifies every checksum and refuses a corrupt, truncated or mismatched checkpoint with an
error naming the file. `load_resharded` reads checkpoints taken with N shards into shard s of M:
it keeps the keys that the global route sends to s.
"""
from __future__ import annotations

import json
import os
import shutil
import zlib
from pathlib import Path

import numpy as np

from . import kernels as K
from .hashing import route
from .store import EmbeddingStore, S_EPOCH, S_STEP, S_DROPPED
from .table import TableConfig

FORMAT = "hybridrec-embedding-store"
VERSION = 2  # 2: metadata saved apart from rows
MANIFEST = "manifest.json"


def _crc(arr: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(arr).reshape(-1).view(np.uint8)) & 0xFFFFFFFF


def save(store: EmbeddingStore, directory, extra: dict | None = None) -> Path:
    """Write a consistent snapshot of `store` to `directory` (replaced atomically)."""
    directory = Path(directory)
    with store._lock:
        live = store.live_rows()
        arrays = {
            "rows": store.rows[live],
            "meta": store.meta[live],
            "parts": np.array(store.parts),
            "sketch": np.array(store.sketch),
        }
        step, epoch, dropped = (int(store.scalars[i]) for i in (S_STEP, S_EPOCH, S_DROPPED))
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "table": store.config.to_dict(),
        "layout": {"capacity": store.config.capacity, "nparts": store.nparts, "row_width": store.config.row_width},
        "step": step,
        "epoch": epoch,
        "dropped_updates": dropped,
        "size": int(len(live)),
        "extra": extra or {},
        "files": {},
    }
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.with_name(f".{directory.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for name, arr in arrays.items():
        arr = np.ascontiguousarray(arr)
        arr.tofile(tmp / f"{name}.bin")
        manifest["files"][name] = {"dtype": arr.dtype.str, "shape": list(arr.shape), "bytes": int(arr.nbytes),
                                   "crc32": _crc(arr)}
    with open(tmp / MANIFEST, "w") as fh:
        json.dump(manifest, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    old = directory.with_name(f".{directory.name}.old-{os.getpid()}")
    if directory.exists():
        os.replace(directory, old)
    os.replace(tmp, directory)
    shutil.rmtree(old, ignore_errors=True)
    return directory


def read_manifest(directory) -> dict:
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint: {path} does not exist (not a hybridrec store checkpoint)")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"checkpoint: {path} is not valid JSON ({exc})") from None
    if manifest.get("format") != FORMAT:
        raise ValueError(f"checkpoint: {path} has format {manifest.get('format')!r}, expected {FORMAT!r}")
    if manifest.get("version") != VERSION:
        raise ValueError(f"checkpoint: {path} has version {manifest.get('version')!r}; this hybridrec reads {VERSION}")
    return manifest


def _read_array(directory: Path, manifest: dict, name: str) -> np.ndarray:
    desc = manifest["files"][name]
    path = directory / f"{name}.bin"
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint: {path} is missing")
    size = path.stat().st_size
    if size != desc["bytes"]:
        raise ValueError(f"checkpoint: {path} has {size} bytes, the manifest says {desc['bytes']} (truncated?)")
    arr = np.fromfile(path, dtype=np.dtype(desc["dtype"])).reshape(desc["shape"])
    crc = _crc(arr)
    if crc != desc["crc32"]:
        raise ValueError(f"checkpoint: {path} is corrupt: CRC32 {crc:#010x}, the manifest says {desc['crc32']:#010x}")
    return arr


def _check_compatible(manifest: dict, config: TableConfig, path) -> None:
    saved = TableConfig.from_dict(manifest["table"])
    for field in ("dim", "optimizer"):
        if getattr(saved, field) != getattr(config, field):
            raise ValueError(f"checkpoint: {path} has {field}={getattr(saved, field)!r} but the store expects "
                             f"{getattr(config, field)!r}")


def load(directory, shm_name: str | None = None, **overrides) -> EmbeddingStore:
    """A new store holding a checkpoint. `overrides` may change table fields (e.g. capacity,
    num_threads, lr-free settings); dim and optimizer must match the checkpoint."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    config = TableConfig.from_dict({**manifest["table"], **overrides})
    _check_compatible(manifest, config, directory)
    rows = _read_array(directory, manifest, "rows")
    meta = _read_array(directory, manifest, "meta")
    parts = _read_array(directory, manifest, "parts")
    sketch = _read_array(directory, manifest, "sketch")
    store = EmbeddingStore(config, shm_name=shm_name)
    same_layout = (parts.shape == store.parts.shape and np.array_equal(parts[:, :2], store.parts[:, :2])
                   and sketch.shape == store.sketch.shape)
    if same_layout:
        slots = store.parts[:, K.PT_SLOT_START:K.PT_SLOT_COUNT + 1].copy()
        store.parts[:] = parts
        store.parts[:, K.PT_SLOT_START:K.PT_SLOT_COUNT + 1] = slots  # the index is rebuilt to fit below
        live = store.live_rows()
        store.rows[live] = rows
        store.meta[live] = meta
        store.sketch[:] = sketch
        store._reserve(0, rebuild=True)
        if len(np.unique(store.keys())) != len(store):
            raise ValueError(f"checkpoint: {directory} is corrupt (a key appears in two rows)")
    else:
        insert_rows(store, rows, meta)
    store.scalars[S_STEP] = manifest["step"]
    store.scalars[S_EPOCH] = max(int(store.scalars[S_EPOCH]), manifest["epoch"])
    store.scalars[S_DROPPED] = manifest.get("dropped_updates", 0)
    return store


def insert_rows(store: EmbeddingStore, rows: np.ndarray, meta: np.ndarray) -> None:
    """Insert saved rows (embedding + state, and their metadata) into `store`, least recently
    used first, so that if they do not all fit, the most recently used ones are kept."""
    if len(rows) == 0:
        return
    order = np.lexsort((meta[:, K.M_SLOT], meta[:, K.M_STAMP]))  # last training use, oldest first
    rows, meta = rows[order], meta[order]
    keys = np.ascontiguousarray(meta.view(np.uint64)[:, 0])
    chunk = max(1, store.config.capacity // max(store.nparts, 1) // 2)
    with store._lock:
        for start in range(0, len(keys), chunk):
            part = slice(start, start + chunk)
            found = store._probe(keys[part], K.MODE_FORCE)
            store.rows[found.rows] = rows[part]
            store.meta[found.rows, K.M_COUNT] = meta[part, K.M_COUNT]
            store.meta[found.rows, K.M_CLOCK] = meta[part, K.M_CLOCK]


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
    base = TableConfig.from_dict(manifests[0]["table"])
    total_capacity = sum(m["layout"]["capacity"] for m in manifests)
    overrides.setdefault("capacity", max(1, -(-total_capacity // num_shards)))
    config = TableConfig.from_dict({**base.to_dict(), **overrides})
    for d, m in zip(directories, manifests):
        _check_compatible(m, config, d)
    store = EmbeddingStore(config, shm_name=shm_name)
    for d, m in zip(directories, manifests):
        rows = _read_array(d, m, "rows")
        meta = _read_array(d, m, "meta")
        mine = route(np.ascontiguousarray(meta.view(np.uint64)[:, 0]), table_id, num_shards) == shard
        insert_rows(store, rows[mine], meta[mine])
    store.scalars[S_STEP] = max(m["step"] for m in manifests)
    return store
