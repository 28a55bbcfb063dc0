"""Reading a coming batch's cold rows ahead: the disk-tier records its lookup will read, faulted
into the process on a thread of their own while the training thread works on the batch before.

A tiered store's lookup writes the rows it evicts at its regions' heads, on pages mapped in
ahead of the call (disk_tier.begin_write), but reads each row it takes back from disk through a
page fault on the mapped records file (and, after a release of the mapping,
disk_tier.PAGE_BUDGET, on the index). Once a batch's lookup is done and its successor is known,
`prefault_cold_records` (`EmbeddingStore.read_ahead`) finds, in one kernel call over the
successor's distinct keys, those absent from memory and on disk, and writes the always-zero pad
column of each one's record: each page comes in writable, through a write fault on this thread,
before the lookup that reads it. Nothing a lookup reads changes, so results are the same with or
without it; a guess gone stale (a lookup ran meanwhile) costs only a fault. The kernel reads the
memory index and the tier's index without the store's lock (they may change under it: every row
number, slot and record number is bounds-checked and every walk bounded), and stops once the
lookup it prepares starts: the pages it mapped are then those that lookup's release accounts for
(disk_tier.end_write), so the RSS bound holds with it too.

`ReadAhead` is the thread: `submit(fn, *args)` hands it the newest job (a job not yet started
is replaced: only the next batch is worth reading), `close()` stops it.
"""
from __future__ import annotations

import threading

import numpy as np
from numba import njit

from .hashing import index_hash, scale32, scale_hi32
from .kernels import IC_META, IC_ROW_BITS, PT_SLOT_COUNT, PT_SLOT_START, SC_EPOCH, _row_mask, _tag, _tag_mask
from .tier_kernels import R_PAD, TP_SLOT_COUNT, TP_SLOT_START, X_KEY, X_RECORD, has_tier, maybe_on_disk

_CHECK_EVERY = 64  # keys between two looks at the store's lookup count


@njit(inline="always")
def _prefault(tier, p, key, h):
    """Write the pad column (always 0) of `key`'s record in region p, if the index has one (a
    bounded probe: the index may change meanwhile); returns whether it did."""
    index, tparts = tier[6], tier[3]
    s0 = tparts[p, TP_SLOT_START]
    ns = tparts[p, TP_SLOT_COUNT]
    s = scale32(h, ns)
    for _ in range(ns):
        record = np.int64(index[s0 + s, X_RECORD]) - 1
        if record < 0:
            return False
        if index[s0 + s, X_KEY] == key:
            if record < tier[0].shape[0]:
                tier[0][record, R_PAD] = 0
                return True
            return False
        s += 1
        if s == ns:
            s = 0
    return False


@njit(cache=True, nogil=True)
def _in_memory(index, r64, kcol, key, h, s0, ns, row_bits, nrows):
    """Whether `key` has an index entry (a bounded probe: the index may change meanwhile)."""
    tag = _tag(h, row_bits)
    tags = _tag_mask(row_bits)
    rows_part = _row_mask(row_bits)
    s = scale32(h, ns)
    for _ in range(ns):
        if s0 + s >= index.shape[0]:
            return False
        e = np.int64(index[s0 + s])
        if e < 0:
            return False
        r = e & rows_part
        if (e & tags) == tag and r < nrows and r64[r, kcol] == key:
            return True
        s += 1
        if s == ns:
            s = 0
    return False


@njit(cache=True, nogil=True)
def prefault_cold_records(keys, r64, index, parts, icfg, scalars, tier):
    """Fault in, writable, the disk-tier records a lookup of `keys` will read: those of keys
    absent from memory and on disk, in the order it reads them. Returns the records touched.
    Stops once the store's next lookup starts."""
    if not has_tier(tier):
        return 0
    stale = scalars[SC_EPOCH] + 1
    kcol = icfg[IC_META] // 2
    row_bits = icfg[IC_ROW_BITS]
    nparts = parts.shape[0]
    nrows = r64.shape[0]
    touched = 0
    for i in range(keys.shape[0]):
        if i % _CHECK_EVERY == 0 and scalars[SC_EPOCH] >= stale:
            return touched
        key = keys[i]
        h = index_hash(key)
        p = scale_hi32(h, nparts) if nparts > 1 else 0
        if _in_memory(index, r64, kcol, key, h, parts[p, PT_SLOT_START], parts[p, PT_SLOT_COUNT], row_bits, nrows):
            continue
        if maybe_on_disk(tier, p, key) and _prefault(tier, p, key, h):
            touched += 1
    return touched


class ReadAhead:
    """A daemon thread that runs the newest job it was given (a read-ahead of the next batch).
    An exception in a job is raised by the next `submit` or by `close` (it is a bug of ours: a
    read-ahead only reads and writes pad bytes)."""

    def __init__(self, name: str = "hybridrec-read-ahead", join_timeout_seconds: float = 10.0):
        self._name = name
        self._join_timeout = join_timeout_seconds
        self._cond = threading.Condition()
        self._job = None
        self._busy = False
        self._closed = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def submit(self, fn, *args) -> None:
        """Run fn(*args) on the thread; replaces a job that has not started yet."""
        with self._cond:
            self._raise_error()
            if self._closed:
                raise RuntimeError("read-ahead: submit after close")
            self._job = (fn, args)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify()

    def wait(self, timeout: float = 10.0) -> bool:
        """Wait until no job is pending or running; False if `timeout` seconds passed first."""
        with self._cond:
            done = self._cond.wait_for(lambda: self._job is None and not self._busy, timeout)
            self._raise_error()
            return done

    def _raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"read-ahead failed: {error!r}") from error

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._job is None and not self._closed:
                    self._cond.wait(0.5)
                if self._closed:
                    return
                (fn, args), self._job = self._job, None
                self._busy = True
            try:
                fn(*args)
            except BaseException as error:  # handed to the submitting thread
                with self._cond:
                    self._error = error
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def close(self) -> None:
        """Stop the thread (a running job is finished first); raises a job's error."""
        with self._cond:
            self._closed = True
            self._job = None
            self._cond.notify_all()
            thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(self._join_timeout)
            if thread.is_alive():
                raise RuntimeError(f"read-ahead: the thread did not stop within {self._join_timeout} s")
        with self._cond:
            self._raise_error()
