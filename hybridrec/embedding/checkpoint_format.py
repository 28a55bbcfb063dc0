"""The on-disk format of an embedding store checkpoint, apart from the store that fills it.

A checkpoint is a directory: `manifest.json` (format, table config, layout, counters, and for
each array file its dtype, shape, byte size and CRC32) and one raw `.bin` file per array of a
`Snapshot`: `rows` (each live row's embedding and optimizer state), `meta` (their metadata
records: key, LRU links, count, clock, last use), `parts` (the partitions' bookkeeping) and
`sketch` (the admission counters), and, for a store with a disk tier, `tier/`: the tier's records
in chunk files (disk_tier.py's layout). Those are hard links to the tier's own copies of its
last saved chunks, so a checkpoint writes only the chunks that changed since the one before
(and copies them only when the links cannot be made, across file systems). It is written to a temporary directory and renamed into
place, so an interrupted save never damages the previous checkpoint. Reading verifies every
checksum and refuses a corrupt, truncated or mismatched checkpoint with an error naming the file.
Every file is written and read through directory handles (`dir_handle`): given an `Entry` of an
open directory, nothing is reached through a symlink or a renamed path.

This module knows files and arrays only: `EmbeddingStore.snapshot()` makes what `write` writes,
and `EmbeddingStore.restore()` takes what `read` returns.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import zlib
from pathlib import Path

import numpy as np

from .dir_handle import DirHandle, Entry, open_directory, parent_and_name
from .disk_tier import read_chunk_file
from .table import TableConfig

FORMAT = "hybridrec-embedding-store"
VERSION = 2  # 2: metadata saved apart from rows
MANIFEST = "manifest.json"
ARRAYS = ("rows", "meta", "parts", "sketch")
TIER_DIRECTORY = "tier"


@dataclasses.dataclass
class Snapshot:
    """A store's content at one instant: its live rows and what is needed to serve them again."""

    config: TableConfig
    nparts: int
    rows: np.ndarray  # float32 [size, row_width]: embedding | optimizer state of each live row
    meta: np.ndarray  # int32 [size, META_WIDTH]: the metadata record of each of those rows
    parts: np.ndarray  # int64 [nparts, PARTS_WIDTH]: partition bookkeeping (row ranges, sizes, counters)
    sketch: np.ndarray  # uint16 [2, width]: the admission frequency sketch
    step: int  # optimizer steps taken
    epoch: int  # lookup calls counted (the stamps in `meta` are these)
    dropped_updates: int
    extra: dict = dataclasses.field(default_factory=dict)
    expired: int = 0  # rows dropped by expiry
    expiry_marks: list = dataclasses.field(default_factory=list)  # [[lookup call, step, time]] (store.expire)
    # the disk tier's rows: {"layout": DiskTier.layout, "rows": n, "chunks": [{"file", "crc32", "records"}]}
    tier: dict | None = None

    def arrays(self) -> dict[str, np.ndarray]:
        return {name: getattr(self, name) for name in ARRAYS}


def _crc(arr: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(arr).reshape(-1).view(np.uint8)) & 0xFFFFFFFF


def write(directory, snapshot: Snapshot):
    """Write `snapshot` to `directory` (a path, or an `Entry` of an open directory), replacing
    what was there atomically; returns `directory` (a path as a Path)."""
    config = snapshot.config
    table = config.to_dict()
    table.pop("tier", None)  # where the tier lives is the loading job's choice, not the checkpoint's
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "table": table,
        "layout": {"capacity": config.capacity, "nparts": snapshot.nparts, "row_width": config.row_width},
        "step": int(snapshot.step),
        "epoch": int(snapshot.epoch),
        "dropped_updates": int(snapshot.dropped_updates),
        "expired": int(snapshot.expired),
        "expiry_marks": [[int(e), int(s), float(t)] for e, s, t in snapshot.expiry_marks],
        "size": int(len(snapshot.rows)),
        "extra": snapshot.extra or {},
        "files": {},
    }
    parent, name = parent_and_name(directory)
    with parent:
        tmp, old = f".{name}.tmp-{os.getpid()}", f".{name}.old-{os.getpid()}"
        parent.remove(tmp)
        with parent.sub(tmp, create=True) as out:
            for array_name, arr in snapshot.arrays().items():
                arr = np.ascontiguousarray(arr)
                with out.open_file(f"{array_name}.bin", "xb") as fh:
                    arr.tofile(fh)
                manifest["files"][array_name] = {"dtype": arr.dtype.str, "shape": list(arr.shape),
                                                 "bytes": int(arr.nbytes), "crc32": _crc(arr)}
            if snapshot.tier is not None:
                manifest["tier"] = _write_tier(out, snapshot.tier)
            with out.open_file(MANIFEST, "xb") as fh:
                fh.write(json.dumps(manifest, indent=1).encode())
                fh.flush()
                os.fsync(fh.fileno())
        if parent.exists(name):
            parent.rename(name, old)
        parent.rename(tmp, name)
        parent.remove(old)
    return directory if isinstance(directory, Entry) else Path(directory)


def _write_tier(out: DirHandle, tier: dict) -> dict:
    """Link (or, across file systems, copy) the tier's chunk files into `tier/` of the checkpoint
    being written; returns the manifest's description of them."""
    chunks = []
    with out.sub(TIER_DIRECTORY, create=True) as sub:
        for chunk in tier["chunks"]:
            name = f"c{int(chunk['chunk']):06d}.bin"
            try:
                os.link(chunk["file"], name, dst_dir_fd=sub.fd)
            except OSError:  # another file system: a copy
                with open(chunk["file"], "rb") as src, sub.open_file(name, "xb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
            chunks.append({"chunk": int(chunk["chunk"]), "file": name, "crc32": int(chunk["crc32"])})
    return {"layout": tier["layout"], "rows": int(tier["rows"]), "chunks": chunks}


def tier_rows(tier: dict | None, source: str):
    """(keys, rows, counts, clocks) of a snapshot's disk tier, one chunk at a time, each chunk's
    CRC32 checked as it is read."""
    if not tier:
        return
    layout = tier["layout"]
    for chunk in tier["chunks"]:
        where = f"{source}: {chunk['file']}"
        yield read_chunk_file(chunk["file"], int(layout["record_int32s"]), int(layout["row_width"]),
                              int(chunk["crc32"]), where)


def read_manifest(directory) -> dict:
    """The manifest of the checkpoint in `directory` (a path, an `Entry` or a `DirHandle`), its
    format and version checked."""
    with _opened(directory) as handle:
        return _manifest(handle)


def _opened(directory) -> DirHandle:
    try:
        return open_directory(directory)
    except FileNotFoundError:
        raise FileNotFoundError(f"checkpoint: {os.path.join(str(directory), MANIFEST)} does not exist (there is no "
                                f"directory {str(directory)!r})") from None
    except NotADirectoryError as error:
        raise ValueError(f"checkpoint: {directory} is not a directory ({error})") from None


def _manifest(handle: DirHandle) -> dict:
    where = handle.where(MANIFEST)
    if not handle.is_file(MANIFEST):
        raise FileNotFoundError(f"checkpoint: {where} does not exist (not a hybridrec store checkpoint)")
    try:
        manifest = json.loads(handle.read_bytes(MANIFEST))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"checkpoint: {where} is not valid JSON ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else manifest
        raise ValueError(f"checkpoint: {where} has format {found!r:.80}, expected {FORMAT!r}")
    if manifest.get("version") != VERSION:
        raise ValueError(f"checkpoint: {where} has version {manifest.get('version')!r}; this hybridrec reads {VERSION}")
    return manifest


def saved_config(manifest: dict) -> TableConfig:
    """The table config a checkpoint was written with."""
    return TableConfig.from_dict(manifest["table"])


def check_compatible(manifest: dict, config: TableConfig, directory) -> None:
    """Refuse to load a checkpoint into a table of another dim or optimizer."""
    saved = saved_config(manifest)
    for field in ("dim", "optimizer"):
        if getattr(saved, field) != getattr(config, field):
            raise ValueError(f"checkpoint: {directory} has {field}={getattr(saved, field)!r} but the store expects "
                             f"{getattr(config, field)!r}")


def _described(where: str, manifest: dict, name: str) -> tuple[np.dtype, tuple, int]:
    """(dtype, shape, bytes) of array `name` as the manifest describes it, checked to agree."""
    try:
        desc = manifest["files"][name]
        dtype, shape, size = np.dtype(desc["dtype"]), tuple(int(n) for n in desc["shape"]), int(desc["bytes"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"checkpoint: {where} does not describe array {name!r} properly ({exc!r})") from None
    if any(n < 0 for n in shape) or int(np.prod(shape)) * dtype.itemsize != size:
        raise ValueError(f"checkpoint: {where} says {name} is {dtype.str} of shape {list(shape)}, which is not "
                         f"its {size} bytes: the manifest was changed")
    return dtype, shape, size


def _read_array(handle: DirHandle, manifest: dict, name: str) -> np.ndarray:
    dtype, shape, expected = _described(handle.where(MANIFEST), manifest, name)
    desc = manifest["files"][name]
    file_name = f"{name}.bin"
    where = handle.where(file_name)
    if not handle.is_file(file_name):
        raise FileNotFoundError(f"checkpoint: {where} is missing")
    with handle.open_file(file_name) as fh:
        size = os.fstat(fh.fileno()).st_size
        if size != expected:
            raise ValueError(f"checkpoint: {where} has {size} bytes, the manifest says {expected} (truncated?)")
        arr = np.fromfile(fh, dtype=dtype).reshape(shape)
    crc = _crc(arr)
    if crc != desc["crc32"]:
        raise ValueError(f"checkpoint: {where} is corrupt: CRC32 {crc:#010x}, the manifest says {desc['crc32']:#010x}")
    return arr


def read(directory, manifest: dict | None = None) -> Snapshot:
    """The snapshot saved in `directory` (a path, an `Entry` or a `DirHandle`), every array's
    size and checksum verified (`manifest`: the one `read_manifest` returned already, to read
    it only once)."""
    with _opened(directory) as handle:
        if manifest is None:
            manifest = _manifest(handle)
        arrays = {name: _read_array(handle, manifest, name) for name in ARRAYS}
        where = handle.where(MANIFEST)
        rows_where = handle.where("rows.bin")
        tier = manifest.get("tier")
        if tier is not None:  # read chunk by chunk when restored (tier_rows): here only named
            tier = {**tier, "chunks": [{**c, "file": os.path.join(handle.where(TIER_DIRECTORY), c["file"])}
                                       for c in tier["chunks"]]}
    try:
        config, nparts = saved_config(manifest), int(manifest["layout"]["nparts"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"checkpoint: {where} lacks or garbles the table or layout ({exc!r})") from None
    if arrays["rows"].ndim != 2 or arrays["rows"].shape[1] != config.row_width:
        raise ValueError(f"checkpoint: {rows_where} holds rows of shape {list(arrays['rows'].shape)}, "
                         f"not [n, {config.row_width}] as its table config needs: the manifest was changed")
    return Snapshot(config=config, nparts=nparts,
                    step=int(manifest["step"]), epoch=int(manifest["epoch"]),
                    dropped_updates=int(manifest.get("dropped_updates", 0)), extra=manifest.get("extra", {}),
                    expired=int(manifest.get("expired", 0)),
                    expiry_marks=[tuple(m) for m in manifest.get("expiry_marks", [])], tier=tier, **arrays)


def verify(directory) -> None:
    """Read the checkpoint in `directory` whole, its arrays and its tier's chunks, checking every
    size and checksum (ValueError naming the bad file), without keeping more than one chunk."""
    snapshot = read(directory)
    for _ in tier_rows(snapshot.tier, str(directory)):
        pass
