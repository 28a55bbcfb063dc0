"""Which rows of a store changed since a mark, and which keys left it: what a delta version of
a published model holds (hybridrec.train.publisher).

Nothing on the training path records changes. A row's metadata already says enough: its key, its
clock (every optimizer update of the row adds one, `kernels.apply_updates`) and its stamp (the
lookup call that last used it for training). `ChangeTracker` keeps, per row position, the key and
clock it saw at the last mark (12 bytes per row of capacity, outside the store). At the next mark
one kernel pass over the metadata, under the store's lock, finds the rows whose key or clock
differ or whose stamp is newer than the mark (a key evicted and admitted again gets a new stamp),
and the positions whose key left (evicted, expired, or moved by expiry's compaction: a moved key
shows up again among the changed rows and is not a deletion). The rows are copied out in the same
pass under the lock, so a mark is one consistent instant of the table.
"""
from __future__ import annotations

import dataclasses
import weakref

import numpy as np
from numba import njit

from . import kernels as K
from .store import EmbeddingStore


@dataclasses.dataclass
class Changes:
    """Rows of one store at a mark: all of them (`full`) or those changed since the mark before."""

    keys: np.ndarray  # uint64 [n]
    weights: np.ndarray  # float32 [n, dim]
    deleted: np.ndarray  # uint64 keys that left the store since the mark before (empty when full)
    full: bool


@njit(cache=True, nogil=True)
def _scan(r32, r64, live, prev_key, prev_clock, prev_live, stamp_after, changed, vacated):
    """Positions of rows changed since the mark, and the keys that left their position; records
    the current key and clock of every row as the new mark. Returns (n changed, n vacated)."""
    n_changed = 0
    n_vacated = 0
    for p in range(live.shape[0]):
        if live[p]:
            key = r64[p, 0]
            clock = r32[p, K.M_CLOCK]
            if (not prev_live[p]) or prev_key[p] != key or prev_clock[p] != clock or r32[p, K.M_STAMP] > stamp_after:
                changed[n_changed] = p
                n_changed += 1
            if prev_live[p] and prev_key[p] != key:
                vacated[n_vacated] = prev_key[p]
                n_vacated += 1
            prev_key[p] = key
            prev_clock[p] = clock
        elif prev_live[p]:
            vacated[n_vacated] = prev_key[p]
            n_vacated += 1
        prev_live[p] = live[p]
    return n_changed, n_vacated


class ChangeTracker:
    """The marks of one store (see the module docstring)."""

    def __init__(self, store: EmbeddingStore):
        self.store = weakref.ref(store)  # the store marked; another (a checkpoint loaded) starts over
        capacity = store.config.capacity
        self.prev_key = np.zeros(capacity, np.uint64)
        self.prev_clock = np.zeros(capacity, np.int32)
        self.prev_live = np.zeros(capacity, np.bool_)
        self.epoch = -1  # the store's lookup count at the last mark; -1: no mark yet

    def must_start_over(self, store: EmbeddingStore) -> bool:
        """Whether the next mark must hold every row: there was none, or the store restarted its
        count of lookups (the stamps before and after cannot be compared)."""
        return self.epoch < 0 or self.store() is not store or int(store.scalars[K.SC_EPOCH]) < self.epoch

    def take(self, store: EmbeddingStore, full: bool = False) -> Changes:
        """Mark the store now: its rows changed since the last mark (every row when `full`, at the
        first mark, or after the store restarted its count of lookups), with the keys removed."""
        dim = store.config.dim
        with store.lock:
            live = np.zeros(store.config.capacity, np.bool_)
            parts = store.parts
            for p in range(store.nparts):
                start = parts[p, K.PT_ROW_START]
                live[start:start + parts[p, K.PT_SIZE]] = True
            epoch = int(store.scalars[K.SC_EPOCH])
            full = full or self.must_start_over(store)
            if self.store() is not store:
                self.store = weakref.ref(store)
                self.prev_key, self.prev_clock, self.prev_live = (np.zeros(store.config.capacity, a.dtype) for a in
                                                                  (self.prev_key, self.prev_clock, self.prev_live))
            changed = np.empty(len(live), np.int64)
            vacated = np.empty(len(live), np.uint64)
            n_changed, n_vacated = _scan(store.meta, store.meta.view(np.uint64), live, self.prev_key,
                                         self.prev_clock, self.prev_live, self.epoch, changed, vacated)
            rows = np.flatnonzero(live) if full else changed[:n_changed]
            keys = store.meta.view(np.uint64)[rows, 0].copy()
            weights = store.rows[rows, :dim].copy()
            self.epoch = epoch
        if full:
            return Changes(keys, weights, np.empty(0, np.uint64), True)
        deleted = np.setdiff1d(vacated[:n_vacated], keys)
        return Changes(keys, weights, deleted, False)
