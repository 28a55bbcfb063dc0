"""HET's client (HET §3.2, Algorithms 1-3): one trainer's cache embedding tables and the protocol
that keeps them within the per-embedding clock bound of the PS servers' global tables.

`read(keys)` (Het.Read, Algorithm 2) for the distinct keys of every table of a batch:
  1. each cache probes its keys in one kernel call (`CacheTable.begin_read`): a hit that fails
     CheckValid's first bound (c_c > c_s + s) must synchronise; a miss takes a row, evicting a
     victim by the cache policy (a victim holding updates is written back);
  2. one exchange with the servers (one request per shard, every table in it): the write-backs
     (synchronising entries and dirty victims: accumulated gradient and c_c; the server applies
     the gradient with its optimizer and sets c_g = max(c_g, c_c)), the fetches (misses and the
     synchronising entries, refetched after their write-back: c_s = c_c = c_g) and, for the other
     hits, clock-only checks of the second bound, c_g <= c_c + s (no vectors travel);
  3. the hits whose check failed synchronise in a second exchange (only when some did);
  4. the rows are gathered from the caches.
`begin` runs steps 1-3 and `gather` step 4, so that a stream can run the next batch's steps 1-3
in a thread of its own while the current batch trains (HET's prefetch): the caches' arrays are
under one lock, the next read keeps the training batch's rows cached (`keep`), and a row written
while its write-back and refetch are in flight keeps that write (`CacheTable.refill`); step 4 runs
after the training batch's write, so a batch reads its trainer's own updates as before; the first
bound counts the training batch's coming update, so both bounds hold as for reads one after
another. With s = 0 (BSP) no read begins before the write.
`write(read, grads)` (Het.Write, Algorithm 3): each row's gradient is accumulated and the cached
copy takes a plain SGD step at the table's learning rate (read-my-updates: the server's optimizer
sees the accumulated gradient later, so with sgd both agree exactly); c_c advances by one.
Nothing goes to the servers until the entry is evicted or fails a bound (stale writes).
`flush()` writes every entry holding updates back and empties the caches (a checkpoint or an
evaluation follows: the servers then hold every update).

With s = 0 every read sees every update the servers know of, and every write reaches the server
before the key is read again: BSP's semantics for one trainer. With s = None (infinity) nothing
is ever checked: entries synchronise only when evicted.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from hybridrec.het.cache import HIT, MISS, SYNC, CacheTable
from hybridrec.errors import UserError
from hybridrec.het.clocks import HetBackend, TableSync


@dataclass(frozen=True)
class TableSpec:
    capacity: int  # cache rows
    dim: int
    lr: float  # the cached copy's local SGD step


@dataclass
class HetRead:
    """The rows one read gave, per table, and where they sit in the caches (for the write)."""

    rows_of: dict[str, np.ndarray]
    values: dict[str, np.ndarray]  # empty until `gather`
    generation: int = 0  # the caches' generation it was read in: a flush empties them and starts the next


COUNTERS = ("reads", "hits", "misses", "invalidations", "evictions", "dirty_evictions", "write_backs",
            "fetches", "checks", "flushed")


class HetWorker:
    def __init__(self, specs: Mapping[str, TableSpec], backend: HetBackend, staleness: int | None,
                 policy: str = "lfu", light_threshold: int = 10):
        if staleness is not None and (not isinstance(staleness, int) or staleness < 0):
            raise ValueError(f"staleness must be an int >= 0 or None (infinite), got {staleness!r}")
        self.specs = dict(specs)
        self.backend = backend
        self.staleness = staleness
        self.policy = policy
        self.caches = {t: CacheTable(spec.capacity, spec.dim, policy, light_threshold=light_threshold)
                       for t, spec in self.specs.items()}
        self.counts = dict.fromkeys(COUNTERS, 0)
        self.generation = 0
        self._lock = threading.Lock()  # the caches' arrays: a read in flight beside the training thread

    # ------------------------------------------------------------------ Het.Read
    def read(self, keys_by_table: Mapping[str, np.ndarray]) -> HetRead:
        """The rows of each table's distinct keys (Algorithm 2); they satisfy both CheckValid
        bounds as of the servers' answers."""
        return self.gather(self.begin(keys_by_table))

    def begin(self, keys_by_table: Mapping[str, np.ndarray], keep: int = 0) -> HetRead:
        """Steps 1-3 of a read: the rows are in the caches, not gathered yet. Thread-safe beside
        `write` and `gather` of an earlier read: with `keep` = 1 the rows of the read before this
        one stay cached (its batch may be training) and updates written into a row while its
        write-back and refetch are in flight are kept (`CacheTable.refill`)."""
        s = self.staleness
        requests, plans = {}, {}
        with self._lock:
            generation = self.generation
            for table, keys in keys_by_table.items():
                cache = self.caches[table]
                if len(keys) > cache.capacity:
                    raise UserError(f"table {table!r}: a batch has {len(keys)} distinct keys, more than the "
                                    f"{cache.capacity} rows of its HET cache; raise strategy.het.cache_rows or "
                                    f"cache_fraction, or use smaller batches (data.batch_size)")
                rows_of, status, ev_keys, ev_clocks, ev_grads = cache.begin_read(keys, s, keep)
                synced = np.flatnonzero(status == SYNC)
                missed = np.flatnonzero(status == MISS)
                hit = np.flatnonzero(status == HIT)
                s_keys, s_clocks, s_grads = cache.take(rows_of[synced])
                fetched = np.concatenate([synced, missed])
                checked = hit if s is not None else hit[:0]
                requests[table] = TableSync(
                    np.concatenate([s_keys, ev_keys]), np.concatenate([s_clocks, ev_clocks]),
                    np.concatenate([s_grads, ev_grads]), keys[fetched], keys[checked],
                    cache.cc[rows_of[checked]])
                taken = (np.concatenate([s_clocks, np.zeros(len(missed), np.int64)]),
                         np.concatenate([s_grads, np.zeros((len(missed), cache.dim), np.float32)]))
                plans[table] = (rows_of, fetched, checked, taken)
                self.counts["reads"] += len(keys)
                self.counts["misses"] += len(missed)
                self.counts["invalidations"] += len(synced)
                self.counts["hits"] += len(hit)
        replies = self._exchange(requests)
        second = {}
        with self._lock:
            for table, (rows_of, fetched, checked, taken) in plans.items():
                cache, reply = self.caches[table], replies[table]
                cache.refill(rows_of[fetched], reply.values, reply.clocks, *taken, self.specs[table].lr)
                stale = checked[reply.stale]
                if len(stale):  # the second bound failed: synchronise before reading
                    rows = rows_of[stale]
                    dirty = np.flatnonzero(cache.cc[rows] > cache.cs[rows])
                    w_keys, w_clocks, w_grads = cache.take(rows[dirty])
                    taken_clocks = np.zeros(len(rows), np.int64)
                    taken_grads = np.zeros((len(rows), cache.dim), np.float32)
                    taken_clocks[dirty], taken_grads[dirty] = w_clocks, w_grads
                    empty = np.empty(0, np.uint64)
                    second[table] = (TableSync(w_keys, w_clocks, w_grads, keys_by_table[table][stale], empty,
                                               np.empty(0, np.int64)), rows, (taken_clocks, taken_grads))
                    self.counts["invalidations"] += len(stale)
                    self.counts["hits"] -= len(stale)
        if second:
            replies = self._exchange({t: sync for t, (sync, _, _) in second.items()})
            with self._lock:
                for table, (_, rows, taken) in second.items():
                    self.caches[table].refill(rows, replies[table].values, replies[table].clocks, *taken,
                                              self.specs[table].lr)
        return HetRead({t: plan[0] for t, plan in plans.items()}, {}, generation)

    def gather(self, read: HetRead) -> HetRead:
        """Step 4: the rows' vectors as the caches hold them now (with every write before this)."""
        with self._lock:
            if read.generation != self.generation:
                raise RuntimeError("a HET read gathered after a flush emptied the caches it was read into")
            read.values = {t: self.caches[t].gather(rows_of) for t, rows_of in read.rows_of.items()}
        return read

    def can_read_ahead(self, keys_by_table: Mapping[str, np.ndarray], training: HetRead) -> bool:
        """Whether a read of these keys can begin (keep = 1) while `training`'s batch still trains:
        s > 0 (with s = 0, BSP, every write reaches the servers before the next read) and the keys
        fit every cache beside that batch's rows."""
        return self.staleness != 0 and all(len(keys) + len(training.rows_of.get(t, ())) <= self.caches[t].capacity
                                           for t, keys in keys_by_table.items())

    def _exchange(self, requests: Mapping[str, TableSync]):
        for sync in requests.values():
            self.counts["write_backs"] += len(sync.w_keys)
            self.counts["fetches"] += len(sync.f_keys)
            self.counts["checks"] += len(sync.c_keys)
        return self.backend.sync(requests, self.staleness, insert=True)

    # ------------------------------------------------------------------ Het.Write
    def write(self, read: HetRead, grads: Mapping[str, np.ndarray]) -> None:
        """Accumulate each row's gradient in its cache entry (Algorithm 3; nothing is sent)."""
        with self._lock:
            if read.generation != self.generation:
                raise RuntimeError("a HET write after a flush emptied the caches its read used")
            for table, rows_of in read.rows_of.items():
                self.caches[table].accumulate(rows_of, grads[table], self.specs[table].lr)

    # ------------------------------------------------------------------ flush
    def flush(self) -> int:
        """Write every entry holding updates back, then empty the caches; the entries written.
        Call it with no read in flight."""
        with self._lock:
            self.generation += 1
        requests = {}
        for table, cache in self.caches.items():
            dirty = cache.dirty_rows()
            if len(dirty):
                keys, clocks, grads = cache.take(dirty)
                empty = np.empty(0, np.uint64)
                requests[table] = TableSync(keys, clocks, grads, empty, empty, np.empty(0, np.int64))
        if requests:
            self._exchange(requests)
        for cache in self.caches.values():
            cache.clear()
        written = sum(len(sync.w_keys) for sync in requests.values())
        self.counts["flushed"] += written
        return written

    # ------------------------------------------------------------------ counters
    def stats(self) -> dict:
        """Counts so far: reads (distinct keys read), hits (read from the cache without a
        fetch), misses, invalidations (entries that failed a bound and synchronised), evictions
        (and those that held updates), write-backs, fetches, checks, entries flushed; the wire
        bytes of vectors and of clocks; the largest clock gap the servers saw, and the histogram
        of every gap they saw (`clock_gaps`)."""
        caches = [cache.stats() for cache in self.caches.values()]
        wire = self.backend.counts
        return {**self.counts, "evictions": sum(c["evictions"] for c in caches),
                "dirty_evictions": sum(c["dirty_evictions"] for c in caches),
                "pins": sum(c["pins"] for c in caches),
                "vector_bytes": wire.vector_bytes_sent + wire.vector_bytes_received,
                "clock_bytes": wire.clock_bytes_sent + wire.clock_bytes_received,
                "bytes_sent": wire.vector_bytes_sent + wire.clock_bytes_sent,
                "bytes_received": wire.vector_bytes_received + wire.clock_bytes_received,
                "dropped_updates": wire.dropped, "max_clock_gap": wire.max_gap, "requests": wire.requests,
                "clock_gaps": wire.gaps.as_dict()}
