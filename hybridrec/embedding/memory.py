"""Where a store's arrays live: process heap, or named shared memory that outlives the process.

A named store keeps each array as a file in a directory under /dev/shm (tmpfs: RAM, not disk),
mapped with numpy.memmap. Writes land in those pages directly, so after `kill -9` of the owning
process a new process that maps the same name sees every update that completed. We do not use
multiprocessing.shared_memory: before Python 3.13 its resource tracker unlinks segments when the
creating process dies, which is exactly the case this must survive.
"""
from __future__ import annotations

import json
import math
import mmap
import os
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,120}$")
CONFIG_FILE = "store.json"


def shm_root() -> Path:
    """The directory holding named stores: HYBRIDREC_SHM_DIR, else /dev/shm, else the temp dir."""
    env = os.environ.get("HYBRIDREC_SHM_DIR")
    if env:
        return Path(env)
    dev = Path("/dev/shm")
    return dev if dev.is_dir() and os.access(dev, os.W_OK) else Path(tempfile.gettempdir())


def shm_path(name: str) -> Path:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(
            f"shm_name: {name!r} is not allowed; use 1-121 characters of letters, digits, '_', '.', '-' "
            "starting with a letter or digit"
        )
    return shm_root() / f"hybridrec-{name}"


def shared_exists(name: str) -> bool:
    return (shm_path(name) / CONFIG_FILE).is_file()


def unlink_shared(name: str) -> bool:
    """Delete a named store's memory; True when something was there."""
    path = shm_path(name)
    if path.exists():
        shutil.rmtree(path, ignore_errors=True)
        return True
    return False


def aligned_empty(shape, dtype, alignment: int = mmap.PAGESIZE) -> np.ndarray:
    """An uninitialised C-contiguous array whose first byte sits on an `alignment` boundary.
    numpy's own large arrays start 16 bytes past a page (the allocator's header), so a 64-byte
    row there straddles two cache lines and a 128-byte row three: every random row access pays
    an extra line. Aligned, a row of whole lines costs exactly its lines."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + alignment, np.uint8)
    start = (-raw.ctypes.data) % alignment
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def heap_array(shape, dtype) -> np.ndarray:
    """An uninitialised page-aligned array. Pages are only backed by memory once touched, so
    untouched capacity costs address space, not RAM, unless the table asks for `prefault`. numpy
    advises transparent huge pages for large arrays: touched lazily inside training steps, a
    huge page's first touch can stall in direct compaction (`defrag=madvise`); prefaulted at
    creation, they save TLB misses over 4 KB pages (docs/benchmarks.md has the figures)."""
    return aligned_empty(shape, dtype)


def _touch_pages(arr: np.ndarray) -> None:
    """Write a zero byte into every page of a new array whose contents are not defined yet (fresh
    heap memory, or a new zero-filled file), so that the kernel backs it now rather than at each
    page's first use inside a training step, where each fault stalls the step."""
    raw = arr.reshape(-1).view(np.uint8)
    raw[:: mmap.PAGESIZE] = 0


class Arena:
    """Allocates a store's arrays either on the heap (name None) or as named shared memory."""

    def __init__(self, name: str | None, create: bool):
        self.name = name
        self.path = shm_path(name) if name is not None else None
        if self.path is not None:
            if create:
                if shared_exists(name):
                    raise FileExistsError(
                        f"shm_name: a store named {name!r} already exists at {self.path}; attach to it with "
                        "EmbeddingStore.attach(name) or delete it with hybridrec.embedding.unlink_shared(name)"
                    )
                shutil.rmtree(self.path, ignore_errors=True)  # a creation that never finished
                self.path.mkdir(parents=True)
            elif not shared_exists(name):
                raise FileNotFoundError(f"shm_name: no store named {name!r} at {self.path}")

    def array(self, label: str, shape, dtype, fill=None, create=True, prefault=False) -> np.ndarray:
        """A new (create) or existing named array; `prefault` backs a new one's pages right away."""
        if self.path is None:
            arr = heap_array(shape, dtype)
            if fill is not None:
                arr.fill(fill)
            elif prefault:
                _touch_pages(arr)
            return arr
        file = self.path / f"{label}.bin"
        if create:
            arr = np.memmap(file, dtype=dtype, mode="w+", shape=tuple(shape))
            if fill is not None and fill != 0:  # new tmpfs pages are already zero
                arr.fill(fill)
            elif prefault:
                _touch_pages(arr)
            return arr
        return np.memmap(file, dtype=dtype, mode="r+", shape=tuple(shape))

    def size_of(self, label: str, dtype, missing: int | None = None) -> int:
        """Number of elements of `dtype` in a named array's file (`missing` if there is none,
        when given)."""
        file = self.path / f"{label}.bin"
        if missing is not None and not file.exists():
            return missing
        return file.stat().st_size // np.dtype(dtype).itemsize

    def replace_array(self, label: str, shape, dtype) -> np.ndarray:
        """A new zero-filled array under `label`; for named memory the new file replaces the old
        one atomically."""
        if self.path is None:
            return self.array(label, shape, dtype, fill=0)
        tmp = self.path / f"{label}.bin.new"
        arr = np.memmap(tmp, dtype=dtype, mode="w+", shape=tuple(shape))  # new tmpfs pages are zero
        os.replace(tmp, self.path / f"{label}.bin")
        return arr

    def write_config(self, config: dict) -> None:
        """Written last: a named store without it is an unfinished creation."""
        if self.path is not None:
            tmp = self.path / (CONFIG_FILE + ".tmp")
            tmp.write_text(json.dumps(config))
            os.replace(tmp, self.path / CONFIG_FILE)

    def read_config(self) -> dict:
        return json.loads((self.path / CONFIG_FILE).read_text())
