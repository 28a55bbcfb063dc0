"""The files of one bundle version, written so that a version is visible only when complete.

A version is a directory:

    manifest.json        format, version, kind (full | delta), base, step, stream position,
                         precision, model, features, tables, and every file's bytes and CRC32
    dense.pt             the dense model's state dict (torch.save; loaded with weights_only)
    tables/tNNN/         one directory per table (the manifest maps names to them):
        keys.bin         uint64 keys of the rows this version holds (a delta: the rows changed)
        weights.bin      fp32 rows, or fp16 bits; int8: codes.bin, scale.bin, bias.bin
        deleted.bin      uint64 keys removed since the base version (deltas only)

It is written under a temporary name (`.NAME.tmp-<pid>`), every file and the directory synced,
and renamed into place: a reader (or a trainer killed at any moment) sees the whole version or
none of it. A directory of versions (`v-000000001`, `v-000000002`, ...) is what training
publishes and the server watches; an exported bundle is one version directory.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import zlib
from pathlib import Path

import numpy as np
import torch

from hybridrec.errors import UserError

FORMAT = "hybridrec-bundle"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
DENSE = "dense.pt"
VERSION_NAME = re.compile(r"v-(?P<n>[0-9]{9})")
TEMPORARY_NAME = re.compile(r"\.(?P<name>.+)\.tmp-(?P<pid>[0-9]+)")


class BundleError(UserError):
    """A bundle that cannot be read: the message names the file and what is wrong with it."""


@dataclasses.dataclass
class TablePart:
    """What one version holds of a table: rows (all of them, or those changed since the base
    version) as `arrays` in the table's stored precision, and the keys deleted since the base."""

    name: str
    dim: int
    side: str  # "deep" or "wide"
    pooling: str
    precision: str
    keys: np.ndarray
    arrays: dict[str, np.ndarray]
    deleted: np.ndarray = dataclasses.field(default_factory=lambda: np.empty(0, np.uint64))

    def describe(self) -> dict:
        return {"dim": self.dim, "side": self.side, "pooling": self.pooling, "precision": self.precision,
                "rows": int(len(self.keys)), "deleted": int(len(self.deleted))}


def version_path(root, version: int) -> Path:
    return Path(root) / f"v-{version:09d}"


def is_version(path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def complete_versions(root) -> dict[int, Path]:
    """The complete versions in a directory of versions, by number (oldest first)."""
    root = Path(root)
    found = {}
    for entry in sorted(root.iterdir()) if root.is_dir() else []:
        match = VERSION_NAME.fullmatch(entry.name)
        if match and is_version(entry):
            found[int(match["n"])] = entry
    return found


def remove_interrupted(root) -> list[Path]:
    """Delete the half-written versions (`.NAME.tmp-<pid>`) of writers that are gone."""
    removed = []
    for entry in sorted(Path(root).iterdir()) if Path(root).is_dir() else []:
        match = TEMPORARY_NAME.fullmatch(entry.name)
        if match and not Path(f"/proc/{match['pid']}").exists():
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def _crc(data) -> int:
    return zlib.crc32(data) & 0xFFFFFFFF


def _write_file(path: Path, data: bytes | memoryview, files: dict, root: Path) -> None:
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    files[str(path.relative_to(root))] = {"bytes": len(data), "crc32": _crc(data)}


def _sync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_version(path, manifest: dict, dense_state: dict, tables: list[TablePart]) -> Path:
    """Write a version to `path` (which must not exist) atomically; `manifest` holds the fields
    of the version (version, kind, base, step, ...): the format, the tables and the files'
    checksums are added here. Returns the path."""
    import io

    path = Path(path)
    if path.exists():
        raise BundleError(f"bundle: {path} exists already; a version is never overwritten")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "tables").mkdir(parents=True)
    files, described = {}, {}
    buffer = io.BytesIO()
    torch.save({k: v.detach().cpu().contiguous() for k, v in dense_state.items()}, buffer)
    _write_file(tmp / DENSE, buffer.getbuffer(), files, tmp)
    for number, part in enumerate(tables):
        directory = tmp / "tables" / f"t{number:03d}"
        directory.mkdir()
        arrays = {"keys": part.keys, **part.arrays, **({"deleted": part.deleted} if len(part.deleted) else {})}
        layout = {}
        for name, array in arrays.items():
            array = np.ascontiguousarray(array)
            _write_file(directory / f"{name}.bin", memoryview(array).cast("B"), files, tmp)
            layout[name] = {"dtype": array.dtype.str, "shape": list(array.shape)}
        described[part.name] = {**part.describe(), "directory": str(directory.relative_to(tmp)), "arrays": layout}
        _sync_directory(directory)
    record = {"format": FORMAT, "format_version": FORMAT_VERSION, **manifest, "tables": described, "files": files}
    with open(tmp / MANIFEST, "w") as handle:
        json.dump(record, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    _sync_directory(tmp / "tables")
    _sync_directory(tmp)
    os.rename(tmp, path)  # atomic: the version appears whole
    _sync_directory(path.parent)
    return path


def read_manifest(path) -> dict:
    """The manifest of the version in `path`, its format checked."""
    file = Path(path) / MANIFEST
    if not file.is_file():
        raise BundleError(f"bundle: {path} is not a bundle version (no {MANIFEST}); give the directory `hybridrec "
                          f"export` wrote or one of train.publish_dir's versions (v-NNNNNNNNN)")
    try:
        manifest = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise BundleError(f"bundle: {file} is not readable JSON ({exc})") from None
    if manifest.get("format") != FORMAT:
        raise BundleError(f"bundle: {file} has format {manifest.get('format')!r}, not {FORMAT!r}")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise BundleError(f"bundle: {file} has format_version {manifest.get('format_version')!r}; this hybridrec "
                          f"reads {FORMAT_VERSION}")
    return manifest


def _read_bytes(path: Path, manifest: dict, relative: str) -> bytes:
    file = path / relative
    try:
        described = manifest["files"][relative]
        data = file.read_bytes()
    except KeyError:
        raise BundleError(f"bundle: {path / MANIFEST} does not describe {relative}") from None
    except OSError as exc:
        raise BundleError(f"bundle: {file} cannot be read ({exc.strerror})") from None
    if len(data) != described["bytes"]:
        raise BundleError(f"bundle: {file} has {len(data)} bytes, the manifest says {described['bytes']} (truncated?)")
    if _crc(data) != described["crc32"]:
        raise BundleError(f"bundle: {file} is corrupt (CRC32 {_crc(data):#010x}, the manifest says "
                          f"{described['crc32']:#010x})")
    return data


def read_dense(path, manifest: dict) -> dict:
    """The dense state dict of a version, its checksum verified."""
    import io

    data = _read_bytes(Path(path), manifest, DENSE)
    try:
        return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception as exc:  # torch raises many types for a damaged file
        raise BundleError(f"bundle: {Path(path) / DENSE} is not a state dict ({type(exc).__name__})") from None


def read_table(path, manifest: dict, name: str) -> TablePart:
    """One table of a version, every array's checksum verified."""
    path = Path(path)
    described = manifest["tables"][name]
    arrays = {}
    for array, layout in described["arrays"].items():
        data = _read_bytes(path, manifest, f"{described['directory']}/{array}.bin")
        arrays[array] = np.frombuffer(data, dtype=np.dtype(layout["dtype"])).reshape(layout["shape"])
    keys = arrays.pop("keys")
    deleted = arrays.pop("deleted", np.empty(0, np.uint64))
    return TablePart(name, int(described["dim"]), described["side"], described["pooling"], described["precision"],
                     keys, arrays, deleted)
