"""The disk tier of an embedding store: rows evicted from memory, kept in files of our own layout.

A store with a tier (`TableConfig.tier`: {path, capacity_rows}) writes each row it evicts, with
its optimizer state, access count and clock, to the tier instead of dropping it, and takes it
back into memory at the key's next lookup; both happen inside the store's lookup kernel
(tier_kernels.py), one call per batch. The directory `path` holds:

* `records.bin`: the row records, a ring per memory partition written in order from its head
  (the layout is tier_kernels.py's), mapped with mmap and read and written by the kernels in place;
* `index.bin`: the hash index key -> record, mapped too;
* `regions.bin`: int64 [1 + nparts, TP_WIDTH], a header row (magic, dirty flag) and each region's
  bookkeeping (slots, rows, capacity, head, counters), mapped too, so it is current after a kill;
* `tier.json`: the layout (row width, partitions, capacity), checked when the tier is opened
  again: a restarted process (a PS server) finds its rows there;
* `saved/`: the chunk files of the last checkpoint (see `save_chunks`), which checkpoints link
  to, so a checkpoint copies only the chunks that changed since the one before;
* `lock`: held (flock, `file_lock.ExclusiveLock`) while a store has the tier open, so that two
  stores, of one process or of two, cannot write it at once.

Speed: a lookup call writes the rows it evicts one after another at its regions' heads, on
record pages `begin_write` mapped in writable ahead of the call (one madvise per region, no
fault per page), and reads a row taken back from disk through its index entry: a page fault
per row read and none per row written.

Memory: the records and the index are file pages. Those the kernels touch count in the process's
RSS until they are dropped from its mapping, which `end_write` does (madvise DONTNEED; the data
stays in the file and the page cache) after a lookup call whenever the pages mapped then, and as
many again for the next call, would exceed PAGE_BUDGET bytes: the records' pages (mostly written
once, or read once for a row taken back), and the index's too when they alone take three quarters
of the bound (16 bytes a slot: a tier of 1.2M rows' capacity). The process's memory
is thus the memory tier plus that fixed bound, whatever the size of the tier on disk.
"""
from __future__ import annotations

import json
import math
import mmap
import os
import shutil
import zlib
from pathlib import Path

import numpy as np
from numba import njit

from . import tier_kernels as T
from .file_lock import ExclusiveLock, LockHeld
from .hashing import index_hash, scale_hi32

FORMAT = "hybridrec-disk-tier"
VERSION = 2  # 2: a log of records and an index (1: a hash table of records)
_MAGIC = 0x48524454  # "HRDT"
_MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault a range in writable, in one call
H_MAGIC, H_DIRTY = 0, 1  # header row of regions.bin
PAGE_BUDGET = 32 << 20  # bytes of record pages a tier may keep mapped before it releases them
TIER_FACTS = ("rows_in_memory", "rows_on_disk", "disk_bytes", "hit_rate", "disk_dropped")  # a job's final facts


@njit(cache=True, nogil=True)
def partitions_of(keys, nparts, out):
    """The memory partition of every key (the top bits of its index hash, as the store's)."""
    for i in range(keys.shape[0]):
        out[i] = scale_hi32(index_hash(keys[i]), nparts) if nparts > 1 else 0


class FilePages:
    """The pages this process maps, read once per lookup call: statm's shared pages (RssFile +
    RssShmem) through a file kept open (about a microsecond), and RssFile alone from
    /proc/self/status (tens of microseconds), read only when the first says a release may be due."""

    def __init__(self):
        self._statm = os.open("/proc/self/statm", os.O_RDONLY | os.O_CLOEXEC)
        self._status = os.open("/proc/self/status", os.O_RDONLY | os.O_CLOEXEC)

    def shared(self) -> int:
        return int(os.pread(self._statm, 256, 0).split()[2]) * mmap.PAGESIZE

    def file(self) -> int:
        for line in os.pread(self._status, 8192, 0).splitlines():
            if line.startswith(b"RssFile:"):
                return int(line.split()[1]) * 1024
        return self.shared()

    def close(self) -> None:
        os.close(self._statm)
        os.close(self._status)


def table_tier_path(root, table: str) -> str:
    """The tier directory of table `table` under a job's tier root (':' of wide tables' names
    becomes '..', as in shared-memory names)."""
    return os.path.join(str(root), table.replace(":", ".."))


def _region_sizes(total: int, nparts: int) -> np.ndarray:
    sizes = np.full(nparts, total // nparts, np.int64)
    sizes[: total % nparts] += 1
    return sizes


def _crc(buf) -> int:
    return zlib.crc32(buf) & 0xFFFFFFFF


class DiskTier:
    """The rows of one store that are not in memory, in files under `path`.

    Open it with the store's row width and number of partitions: an existing tier of the same
    layout is opened again (its rows kept; repaired first if a process died while writing it), a
    missing one is made. `tier` is the tuple the lookup kernel takes.
    """

    def __init__(self, path, capacity_rows: int, row_width: int, nparts: int):
        self.path = Path(path)
        self.capacity_rows = int(capacity_rows)
        self.row_width = int(row_width)
        self.nparts = int(nparts)
        self.width = T.record_width(row_width)
        self._mapped = 0  # record and index pages mapped after the last lookup call
        self._populate = True  # whether madvise(MADV_POPULATE_WRITE) works here
        self._ready = [-1] * self.nparts  # each region's records mapped in writable up to here (-1: none known)
        caps = _region_sizes(self.capacity_rows, self.nparts)
        slots = np.array([math.ceil(c / T.LOAD_FACTOR) + 1 for c in caps], np.int64)
        self.slots = int(slots.sum())  # records, and index slots alike
        self.layout = {"format": FORMAT, "version": VERSION, "row_width": self.row_width, "nparts": self.nparts,
                       "capacity_rows": self.capacity_rows, "record_int32s": self.width}
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ValueError(f"tier.path: cannot make directory {str(self.path)!r} ({error.strerror})") from None
        try:
            self._lock = ExclusiveLock(self.path / "lock")
        except LockHeld as held:
            holder = ("another store of this process (close it first)" if held.by_this_process
                      else "another process's store")
            raise ValueError(f"tier.path: {str(self.path)!r} is in use by {holder}; "
                             f"give each table (and each PS server) a directory of its own") from None
        layout_file = self.path / "tier.json"
        existed = layout_file.is_file()
        if existed:
            found = json.loads(layout_file.read_text())
            if found != self.layout:
                self._unlock()
                raise ValueError(f"tier.path: {str(self.path)!r} holds a disk tier of another layout ({found}); "
                                 f"this table needs {self.layout}: use another directory or delete that one")
        self._records = self._map("records.bin", self.slots * self.width * 4)
        self._index = self._map("index.bin", self.slots * 16)
        self._regions = self._map("regions.bin", (1 + self.nparts) * T.TP_WIDTH * 8)
        self._records_fd = os.open(self.path / "records.bin", os.O_RDONLY | os.O_CLOEXEC)  # chunk reads
        self.rec32 = np.frombuffer(self._records, np.int32).reshape(self.slots, self.width)
        self.rec64 = self.rec32.view(np.uint64)
        self.recf = self.rec32.view(np.float32)
        self.index = np.frombuffer(self._index, np.uint64).reshape(self.slots, 2)
        regions = np.frombuffer(self._regions, np.int64).reshape(1 + self.nparts, T.TP_WIDTH)
        self.header, self.tparts = regions[0], regions[1:]
        self.tdirty = np.ones(-(-self.slots // T.CHUNK_SLOTS), np.uint8)
        self.seen = np.zeros(T.seen_words(self.capacity_rows, self.nparts), np.uint64)
        self.needs_repair = False
        if not existed or self.header[H_MAGIC] != _MAGIC:
            self._format(caps, slots)
            layout_file.write_text(json.dumps(self.layout))
        else:
            self.needs_repair = bool(self.header[H_DIRTY])
        self.tier = (self.rec32, self.rec64, self.recf, self.tparts, self.tdirty, self.seen, self.index)
        if existed and not self.needs_repair:  # (a repair re-indexes every row, noting it)
            T.fill_seen(self.tier)
            self.release_pages()
        self._pages = FilePages()  # the process's file pages before the tier's are mapped in:
        self._shared_base, self._file_base = self._pages.shared(), self._pages.file()
        self._saved: dict[int, tuple[str, int]] = {}  # chunk -> (file in saved/, crc32) of the last save
        self._saved_dir = self.path / "saved"
        if self._saved_dir.exists():  # left by an earlier process: what it links is unknown here
            for stale in self._saved_dir.iterdir():
                stale.unlink()
        self._saved_dir.mkdir(exist_ok=True)
        self._generation = 0

    def _map(self, name: str, size: int) -> mmap.mmap:
        fd = os.open(self.path / name, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            if os.fstat(fd).st_size != size:
                os.ftruncate(fd, size)  # sparse: unwritten records cost no disk
            mapped = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            mapped.madvise(mmap.MADV_RANDOM)  # no read-ahead around a page read
            return mapped
        finally:
            os.close(fd)

    def _truncate(self, name: str, size: int) -> None:
        # every record (entry) unused: the file cut to nothing and grown back (sparse zeros), rather
        # than a write to each, which would map the whole file and allocate all of it on disk
        fd = os.open(self.path / name, os.O_RDWR | os.O_CLOEXEC)
        try:
            os.ftruncate(fd, 0)
            os.ftruncate(fd, size)
        finally:
            os.close(fd)

    def _format(self, caps: np.ndarray, slots: np.ndarray) -> None:
        self._truncate("records.bin", self.slots * self.width * 4)
        self._truncate("index.bin", self.slots * 16)
        starts = np.concatenate([[0], np.cumsum(slots)[:-1]])
        self.tparts[:] = 0
        self.tparts[:, T.TP_SLOT_START] = self.tparts[:, T.TP_LOG_START] = starts
        self.tparts[:, T.TP_SLOT_COUNT] = self.tparts[:, T.TP_LOG_COUNT] = slots
        self.tparts[:, T.TP_CAPACITY] = caps
        self.header[:] = 0
        self.header[H_MAGIC] = _MAGIC
        self.tdirty[:] = 1
        self.seen[:] = 0
        self.release_pages()

    # ---------------------------------------------------------------- writing state
    def begin_write(self, appends: int = 0) -> None:
        """Mark the tier as being written (if the process dies before `end_write`, the next open
        repairs it: `repair`), and map in, writable, the records at each region's head that the
        next `appends` rows written there take (one madvise per region instead of a page fault
        per page in the kernel; none for records mapped in by an earlier call and still mapped)."""
        self.header[H_DIRTY] = 1
        if appends <= 0 or not self._populate:
            return
        record_bytes = self.width * 4
        for p in range(self.nparts):
            start, count, head = (int(self.tparts[p, c]) for c in (T.TP_LOG_START, T.TP_LOG_COUNT, T.TP_HEAD))
            end = head + min(appends, count)
            ready = self._ready[p]
            if end <= count:
                lo = ready if head <= ready < end else head
                if ready < end:
                    self._populate_records(start + lo, end - lo, record_bytes)
                    self._ready[p] = end
            else:  # the ring wraps
                self._populate_records(start + head, count - head, record_bytes)
                self._populate_records(start, end - count, record_bytes)
                self._ready[p] = -1

    def _populate_records(self, first: int, n: int, record_bytes: int) -> None:
        lo = first * record_bytes // mmap.PAGESIZE * mmap.PAGESIZE
        hi = min((first + n) * record_bytes, len(self._records))
        try:
            self._records.madvise(_MADV_POPULATE_WRITE, lo, hi - lo)
        except OSError:  # an older kernel: the kernels' writes fault the pages in instead
            self._populate = False

    def end_write(self) -> None:
        self.header[H_DIRTY] = 0
        # the next call is taken to map as many pages as this one did: the pages are released
        # now if together they would pass the bound, so that the mapping stays under it. The
        # shared pages grow at least as much as the file pages: while they say no release is
        # due, none is
        mapped = self._pages.shared() - self._shared_base
        if 2 * mapped - self._mapped > PAGE_BUDGET:
            mapped = self._pages.file() - self._file_base
            if 2 * mapped - self._mapped > PAGE_BUDGET:
                self._release_records()
                mapped = self._pages.file() - self._file_base  # the index's pages
                if mapped > PAGE_BUDGET * 3 // 4:  # they would leave the records a quarter of the bound or less
                    self._index.madvise(mmap.MADV_DONTNEED)
                    mapped = 0
        self._mapped = max(mapped, 0)

    def release_pages(self) -> None:
        """Drop the records' and the index's pages from this process's mapping (they stay in the
        files and the page cache), so that the tiers' share of the RSS stays under PAGE_BUDGET."""
        self._release_records()
        self._index.madvise(mmap.MADV_DONTNEED)
        self._mapped = 0

    def _release_records(self) -> None:
        self._records.madvise(mmap.MADV_DONTNEED)
        self._ready = [-1] * self.nparts

    def repair(self, memory_keys: np.ndarray) -> None:
        """Make the index valid again after a process died while writing the tier: put back every
        entry whose record holds its key (a key held twice, mid-shift, keeps one entry: both name
        the same record), and free the rows of keys the memory tier holds (the memory tier is
        newer: a row is written to disk before its memory row is reused, and taken into memory
        before its entry is freed)."""
        self.header[H_DIRTY] = 1
        copy = self.path / "index.repair"
        shutil.copyfile(self.path / "index.bin", copy)  # the old entries, read back a chunk at a time below
        self._truncate("index.bin", self.slots * 16)
        self.tparts[:, T.TP_SIZE] = 0
        self.tdirty[:] = 1
        old = np.memmap(copy, np.uint64, "r", shape=(self.slots, 2))
        for lo in range(0, self.slots, T.CHUNK_SLOTS):
            T.reindex(self.tier, np.asarray(old[lo:lo + T.CHUNK_SLOTS]), lo)
            self.release_pages()
        del old
        copy.unlink()
        self.remove(memory_keys)
        self.release_pages()
        self.header[H_DIRTY] = 0
        self.needs_repair = False

    # ---------------------------------------------------------------- bulk access
    def insert(self, keys: np.ndarray, rows: np.ndarray, counts: np.ndarray, clocks: np.ndarray) -> int:
        """Write rows for `keys` (replacing older copies); returns how many did not fit."""
        keys = np.ascontiguousarray(keys, np.uint64)
        rows = np.ascontiguousarray(rows, np.float32)
        counts = np.ascontiguousarray(counts, np.int32)
        clocks = np.ascontiguousarray(clocks, np.int32)
        dropped = 0
        for lo in range(0, keys.shape[0], T.CHUNK_SLOTS):  # a chunk's worth of head pages mapped at a time
            hi = lo + T.CHUNK_SLOTS
            parts = np.empty(keys[lo:hi].shape[0], np.int64)
            partitions_of(keys[lo:hi], self.nparts, parts)
            self.begin_write(parts.shape[0])
            dropped += T.insert_records(self.tier, parts, keys[lo:hi], rows[lo:hi], counts[lo:hi], clocks[lo:hi])
            self.end_write()
        return int(dropped)

    def remove(self, keys: np.ndarray) -> int:
        """Free the rows of those of `keys` on disk; returns how many."""
        keys = np.ascontiguousarray(keys, np.uint64)
        parts = np.empty(keys.shape[0], np.int64)
        partitions_of(keys, self.nparts, parts)
        self.begin_write()
        freed = T.remove_keys(self.tier, parts, keys)
        self.end_write()
        return int(freed)

    def clear(self) -> None:
        """Forget every row (a checkpoint is being loaded into the store)."""
        self._format(self.tparts[:, T.TP_CAPACITY].copy(), self.tparts[:, T.TP_SLOT_COUNT].copy())

    def _live_chunk(self, chunk: int) -> np.ndarray:
        """The records of one chunk, read through the file (the copy adds no pages to the RSS),
        with the written flag cleared on every record that is not its key's live copy."""
        lo = chunk * T.CHUNK_SLOTS
        hi = min(lo + T.CHUNK_SLOTS, self.slots)
        record_bytes = self.width * 4
        data = os.pread(self._records_fd, (hi - lo) * record_bytes, lo * record_bytes)
        records = np.frombuffer(bytearray(data), np.int32).reshape(hi - lo, self.width)
        T.live_in(self.tier, records, lo)
        return records

    def chunks(self):
        """(keys, rows, counts, clocks) of the rows on disk, a chunk of CHUNK_SLOTS records at a
        time (so reading the whole tier needs one chunk's memory)."""
        for chunk in range(self.tdirty.shape[0]):
            records = self._live_chunk(chunk)
            live = records[:, T.R_USED] != 0
            if live.any():
                yield records_fields(records[live], self.row_width)

    # ---------------------------------------------------------------- checkpoints
    def save_chunks(self) -> list[dict]:
        """Copy the chunks changed since the last call into `saved/` (new files: the older ones
        stay whole for the checkpoints that link them), each record written only if live, and
        return the file and CRC32 of every chunk that holds rows.
        Call it with the store's lock held: the copies are of one instant."""
        self._generation += 1
        for chunk in range(self.tdirty.shape[0]):
            if not (self.tdirty[chunk] or chunk not in self._saved):
                continue
            records = self._live_chunk(chunk)
            old = self._saved.get(chunk)
            if records[:, T.R_USED].any():
                data = records.tobytes()
                name = f"c{chunk:06d}-{self._generation}.bin"
                with open(self._saved_dir / name, "xb") as fh:
                    fh.write(data)
                self._saved[chunk] = (name, _crc(data))
            else:  # an empty chunk needs no file
                self._saved[chunk] = (None, 0)
            self.tdirty[chunk] = 0
            if old is not None and old[0] is not None:
                (self._saved_dir / old[0]).unlink(missing_ok=True)
        return [{"chunk": c, "file": str(self._saved_dir / name), "crc32": crc}
                for c, (name, crc) in sorted(self._saved.items()) if name is not None]

    # ---------------------------------------------------------------- introspection
    def __len__(self) -> int:
        return int(self.tparts[:, T.TP_SIZE].sum())

    def disk_bytes(self) -> int:
        """Bytes the records and the index take on disk (the files are sparse: what was never
        written takes none)."""
        return sum(int(os.stat(self.path / name).st_blocks * 512) for name in ("records.bin", "index.bin"))

    def stats(self) -> dict:
        t = self.tparts
        lookups, hits = int(t[:, T.TP_LOOKUPS].sum()), int(t[:, T.TP_HITS].sum())
        promoted = int(t[:, T.TP_PROMOTED].sum())
        return {
            "rows_on_disk": len(self),
            "disk_capacity_rows": self.capacity_rows,
            "disk_bytes": self.disk_bytes(),
            "spilled": int(t[:, T.TP_SPILLED].sum()),
            "promoted": promoted,
            "disk_dropped": int(t[:, T.TP_DROPPED].sum()),
            "memory_hits": hits,
            "lookups": lookups,
            "hit_rate": hits / (hits + promoted) if hits + promoted else 1.0,
        }

    def close(self) -> None:
        """Write the mapped pages back and release the tier for another process."""
        if not self._lock.held:
            return
        self._records.flush()
        self._index.flush()
        self._regions.flush()
        os.close(self._records_fd)
        self._pages.close()
        self.tier = self.rec32 = self.rec64 = self.recf = self.index = self.header = self.tparts = self.seen = None
        self._unlock()

    def _unlock(self) -> None:
        self._lock.release()


def records_fields(records: np.ndarray, row_width: int):
    """(keys uint64, rows float32 [n, row_width], counts int32, clocks int32) of raw records."""
    records = np.ascontiguousarray(records)
    keys = records[:, :2].copy().view(np.uint64)[:, 0]
    rows = records[:, T.R_ROW:T.R_ROW + row_width].copy().view(np.float32)
    return keys, rows, records[:, T.R_COUNT].copy(), records[:, T.R_CLOCK].copy()


def read_chunk_file(path, record_int32s: int, row_width: int, crc: int, where: str):
    """(keys, rows, counts, clocks) of the used records of one saved chunk, its CRC32 checked."""
    data = Path(path).read_bytes()
    if _crc(data) != crc:
        raise ValueError(f"checkpoint: {where} is corrupt: CRC32 {_crc(data):#010x}, the manifest says {crc:#010x}")
    if len(data) % (record_int32s * 4):
        raise ValueError(f"checkpoint: {where} has {len(data)} bytes, not whole records of {record_int32s * 4}")
    records = np.frombuffer(data, np.int32).reshape(-1, record_int32s)
    return records_fields(records[records[:, T.R_USED] != 0], row_width)
