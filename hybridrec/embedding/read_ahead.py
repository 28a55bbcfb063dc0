"""Reading a coming batch's cold rows ahead: the disk-tier records its lookup will touch, faulted
into the process on a thread of their own while the training thread works on the batch before.

A tiered store's lookup spends its time in page faults on the mapped records file (the records
of keys it takes back from disk, and the home records of the rows it evicts; after each release of
the mapping, disk_tier.PAGE_BUDGET, nearly each of them faults). Once a batch's lookup is done
and its successor is known, `prefault_cold_records` (`EmbeddingStore.read_ahead`) finds, in one
kernel call over the successor's distinct keys, those absent from memory and perhaps on disk, and
the rows that will be evicted for the absent ones (the front of each partition's LRU ring, which
a lookup's update leaves where it is), and writes the always-zero pad column of each of their home
records: each page comes in writable, through a write fault on this thread, before the lookup
that reads and writes it. Nothing a lookup reads changes, so results are the same with or without
it; a guess gone stale (a lookup ran meanwhile) costs only a fault. The kernel reads the index
and the LRU ring without the store's lock (they may change under it: every row number and slot is
bounds-checked and every walk bounded), and stops once the lookup it prepares starts: the pages
it mapped are then those that lookup's release accounts for (disk_tier.end_write), so the RSS
bound holds with it too.

`ReadAhead` is the thread: `submit(fn, *args)` hands it the newest job (a job not yet started
is replaced: only the next batch is worth reading), `close()` stops it.
"""
from __future__ import annotations

import threading

import numpy as np
from numba import njit

from .hashing import index_hash, scale32, scale_hi32
from .kernels import (IC_META, IC_POLICY, IC_ROW_BITS, M_LOG_AT, POLICY_LRU, PT_LOG_END, PT_LOG_START, PT_LRU_KEPT,
                      PT_ROW_COUNT, PT_SIZE, PT_SLOT_COUNT, PT_SLOT_START, SC_EPOCH, _row_mask, _tag, _tag_mask,
                      log_span)
from .tier_kernels import R_PAD, TP_SLOT_COUNT, TP_SLOT_START, has_tier, maybe_on_disk

_CHECK_EVERY = 64  # keys between two looks at the store's lookup count


@njit(inline="always")
def _prefault(tier, p, h):
    """Write the pad column (always 0) of the home record, in region p, of a key of hash h."""
    tparts = tier[3]
    ns = tparts[p, TP_SLOT_COUNT]
    if ns > 0:
        tier[0][tparts[p, TP_SLOT_START] + scale32(h, ns), R_PAD] = 0


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
def prefault_cold_records(keys, r32, r64, index, parts, icfg, scalars, tier, lru_log):
    """Fault in, writable, the home records a lookup of `keys` will touch on the disk tier, in
    the order it touches them: those of keys absent from memory that may be on disk, then, in
    each full LRU partition, those of the rows its absent keys will evict (a key given twice is
    counted twice: a few victims more). Returns the records touched. Stops once the store's
    next lookup starts."""
    if not has_tier(tier):
        return 0
    stale = scalars[SC_EPOCH] + 1
    meta = icfg[IC_META]
    kcol = meta // 2
    row_bits = icfg[IC_ROW_BITS]
    nparts = parts.shape[0]
    nrows = r64.shape[0]
    absent = np.zeros(nparts, np.int64)
    touched = 0
    for i in range(keys.shape[0]):
        if i % _CHECK_EVERY == 0 and scalars[SC_EPOCH] >= stale:
            return touched
        key = keys[i]
        h = index_hash(key)
        p = scale_hi32(h, nparts) if nparts > 1 else 0
        if _in_memory(index, r64, kcol, key, h, parts[p, PT_SLOT_START], parts[p, PT_SLOT_COUNT], row_bits, nrows):
            continue
        absent[p] += 1
        if maybe_on_disk(tier, p, key):
            _prefault(tier, p, h)
            touched += 1
    if icfg[IC_POLICY] != POLICY_LRU:  # an LFU victim is a sampled row: nothing to foresee
        return touched
    for p in range(nparts):
        if parts[p, PT_LRU_KEPT] == 0:  # not full yet: absent keys take unused rows
            continue
        victims = parts[p, PT_SIZE] + absent[p] - parts[p, PT_ROW_COUNT]
        base, ring = log_span(parts, p)
        i = parts[p, PT_LOG_START]
        end = parts[p, PT_LOG_END]
        k = 0
        for step in range(ring):  # the ring's live entries from its front, as the lookup walks it
            if k >= victims or i == end or not 0 <= i < ring or (
                    step % _CHECK_EVERY == 0 and scalars[SC_EPOCH] >= stale):
                break
            r = lru_log[base + i]
            if 0 <= r < nrows and r32[r, meta + M_LOG_AT] == i:
                _prefault(tier, p, index_hash(r64[r, kcol]))
                touched += 1
                k += 1
            i = i + 1 if i + 1 < ring else 0
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
