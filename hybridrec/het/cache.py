"""HET's cache embedding table (HET §3.1, §4.3): a small, capacity-bounded table of embedding rows
a trainer keeps of one PS table, with per-row clocks and accumulated gradients.

Each cached row holds its vector, the *start clock* c_s (the server's clock c_g when it was
fetched), the *current clock* c_c (c_s plus this trainer's updates since) and the gradient
accumulated since it was fetched (the stale writes the server has not seen yet). The protocol
around it (what to fetch, check and write back) is `hybridrec.het.worker`; this module
only keeps the table, with every per-key step in numba kernels over numpy arrays:

* `begin_read(keys, s)`: probe a batch's distinct keys in one call; a hit is stamped (it cannot
  be evicted during this read), its policy bookkeeping updated and checked against the first
  CheckValid bound (c_c <= c_s + s); each miss gets a row, taking a victim by the policy when the
  table is full. A victim that holds updates is copied out (key, c_c, accumulated gradient) for
  the write-back. Returns each key's row and status (HIT, SYNC: fails the first bound, MISS).
  With `keep` = 1 the rows of the read before are kept too (its batch is still training) and the
  first bound counts that batch's coming update of them.
* `fill(rows_of, values, clocks)`: the fetched rows (c_s = c_c = c_g, no accumulated gradient);
  `refill` the same for rows whose write-back was taken before the fetch, keeping the updates
  accumulated since the take.
* `gather(rows_of, out)`: the vectors the dense step trains on.
* `accumulate(rows_of, grads, lr)`: Het.Write: the gradient is added to the accumulated one, the
  cached vector takes a plain SGD step at `lr` (read-my-updates), and c_c advances by one.
* `take_dirty()` / `clear()`: every row that holds updates, for a flush, then an empty table.

Policies (HET §4.3), chosen per table:
* `lru`: one doubly linked list, most recent at the head; the victim is the tail.
* `lfu`: exact in-cache LFU, a binary min-heap on (uses, last use), so ties go to the least
  recently used; every use pays O(log n) to restore the heap.
* `light_lfu`: HET's light-weight LFU (as in Hetu's LFUOpt cache): uses are counted in
  `light_threshold` buckets, each a list in recency order (O(1) per use); an entry used that many
  times is *pinned*: it leaves the lists and gets no frequency upkeep at all from then on (HET's
  direct-access index) and is not evicted while unpinned rows remain. At most `max_pinned` rows
  are pinned (half the table by default), so the lists always have room for a batch's misses.
  The victim is the least recent row of the lowest non-empty bucket.

The hash index is the store's (kernels.py): open addressing with tags and backward-shift
deletion, keyed by `index_hash`; keys sit in a [capacity, 1] uint64 array, the store's `r64`
with one column.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from hybridrec.embedding.hashing import index_hash
from hybridrec.embedding.kernels import _entry, _entry_row, _index_delete, _probe

LRU, LFU, LIGHT_LFU = 0, 1, 2
POLICIES = {"lru": LRU, "lfu": LFU, "light_lfu": LIGHT_LFU}
LIGHT_THRESHOLD = 10  # uses after which light LFU pins an entry (Hetu's kUseCntMax)
HIT, SYNC, MISS = 0, 1, 2  # status of a key after begin_read
INFINITE = np.int64(1) << 62  # the staleness bound that never fails

# state[*]
ST_SIZE, ST_READ, ST_HEAP, ST_PINNED, ST_TICK, ST_MAX_PINNED, ST_ROW_BITS, ST_POLICY = range(8)
ST_BUCKETS = 8
STATE_WIDTH = 9
# counters[*]
CT_HITS, CT_MISSES, CT_SYNCS, CT_EVICTIONS, CT_DIRTY_EVICTIONS, CT_PINS = range(6)
COUNTERS_WIDTH = 6

ERR_FULL = 1  # a read has more distinct keys than the table has rows


# ---------------------------------------------------------------- policy bookkeeping

@njit(cache=True, nogil=True)
def _unlink(prev, nxt, heads, tails, b, r):
    p = prev[r]
    n = nxt[r]
    if p >= 0:
        nxt[p] = n
    else:
        heads[b] = n
    if n >= 0:
        prev[n] = p
    else:
        tails[b] = p
    prev[r] = -1
    nxt[r] = -1


@njit(cache=True, nogil=True)
def _push_head(prev, nxt, heads, tails, b, r):
    h = heads[b]
    prev[r] = -1
    nxt[r] = h
    if h >= 0:
        prev[h] = r
    else:
        tails[b] = r
    heads[b] = r


@njit(inline="always")
def _before(freq, tick, a, b):
    """Whether entry a comes before entry b in the LFU heap (fewer uses, then older use)."""
    return freq[a] < freq[b] or (freq[a] == freq[b] and tick[a] < tick[b])


@njit(cache=True, nogil=True)
def _sift_up(heap, hpos, freq, tick, i):
    r = heap[i]
    while i > 0:
        parent = (i - 1) >> 1
        q = heap[parent]
        if not _before(freq, tick, r, q):
            break
        heap[i] = q
        hpos[q] = i
        i = parent
    heap[i] = r
    hpos[r] = i


@njit(cache=True, nogil=True)
def _sift_down(heap, hpos, freq, tick, size, i):
    r = heap[i]
    while True:
        child = 2 * i + 1
        if child >= size:
            break
        if child + 1 < size and _before(freq, tick, heap[child + 1], heap[child]):
            child += 1
        q = heap[child]
        if not _before(freq, tick, q, r):
            break
        heap[i] = q
        hpos[q] = i
        i = child
    heap[i] = r
    hpos[r] = i


@njit(cache=True, nogil=True)
def _heap_push(heap, hpos, freq, tick, state, r):
    i = state[ST_HEAP]
    state[ST_HEAP] = i + 1
    heap[i] = r
    hpos[r] = i
    _sift_up(heap, hpos, freq, tick, i)


@njit(cache=True, nogil=True)
def _heap_remove(heap, hpos, freq, tick, state, r):
    i = hpos[r]
    if i < 0:
        return
    last = state[ST_HEAP] - 1
    state[ST_HEAP] = last
    hpos[r] = -1
    if i == last:
        return
    q = heap[last]
    heap[i] = q
    hpos[q] = i
    if i > 0 and _before(freq, tick, q, heap[(i - 1) >> 1]):
        _sift_up(heap, hpos, freq, tick, i)
    else:
        _sift_down(heap, hpos, freq, tick, last, i)


@njit(cache=True, nogil=True)
def _on_insert(r, freq, tick, prev, nxt, heads, tails, heap, hpos, state):
    """A new entry's policy bookkeeping: one use."""
    policy = state[ST_POLICY]
    freq[r] = 1
    state[ST_TICK] += 1
    tick[r] = state[ST_TICK]
    if policy == LFU:
        _heap_push(heap, hpos, freq, tick, state, r)
    else:
        _push_head(prev, nxt, heads, tails, 0, r)


@njit(cache=True, nogil=True)
def _on_use(r, freq, tick, prev, nxt, heads, tails, heap, hpos, state, counters):
    """The policy bookkeeping of a hit."""
    policy = state[ST_POLICY]
    state[ST_TICK] += 1
    tick[r] = state[ST_TICK]
    if policy == LRU:
        if heads[0] != r:
            _unlink(prev, nxt, heads, tails, 0, r)
            _push_head(prev, nxt, heads, tails, 0, r)
    elif policy == LFU:
        freq[r] += 1
        _sift_down(heap, hpos, freq, tick, state[ST_HEAP], hpos[r])
    else:
        f = freq[r]
        if f < 0:  # pinned: the direct-access index, no upkeep
            return
        buckets = state[ST_BUCKETS]
        if f >= buckets and state[ST_PINNED] < state[ST_MAX_PINNED]:
            _unlink(prev, nxt, heads, tails, buckets - 1, r)
            freq[r] = -1
            state[ST_PINNED] += 1
            counters[CT_PINS] += 1
            return
        new = min(f + 1, buckets)
        _unlink(prev, nxt, heads, tails, f - 1, r)
        _push_head(prev, nxt, heads, tails, new - 1, r)
        freq[r] = new


@njit(cache=True, nogil=True)
def _forget(r, freq, tick, prev, nxt, heads, tails, heap, hpos, state):
    """Remove an entry from the policy's structures (it is being evicted)."""
    policy = state[ST_POLICY]
    if policy == LFU:
        _heap_remove(heap, hpos, freq, tick, state, r)
    elif policy == LRU:
        _unlink(prev, nxt, heads, tails, 0, r)
    elif freq[r] < 0:
        state[ST_PINNED] -= 1
    else:
        _unlink(prev, nxt, heads, tails, freq[r] - 1, r)


@njit(cache=True, nogil=True)
def _victim(stamp, oldest, freq, tick, prev, tails, cursor, heap, hpos, state, aside, n_aside):
    """The entry the policy evicts next among those no read since read `oldest` uses (this read,
    and the one before it while that read's batch trains), or -1; also the new count of `aside`. LFU: roots this read uses are popped into `aside` (pushed back when
    the read ends). Lists: `cursor[b]` is where the walk from bucket b's tail stopped, so the
    entries this read uses are passed over once per read, not once per miss."""
    policy = state[ST_POLICY]
    if policy == LFU:
        while state[ST_HEAP] > 0:
            r = heap[0]
            if stamp[r] < oldest:
                return r, n_aside
            _heap_remove(heap, hpos, freq, tick, state, r)
            aside[n_aside] = r
            n_aside += 1
        return -1, n_aside
    buckets = state[ST_BUCKETS] if policy == LIGHT_LFU else 1
    for b in range(buckets):
        r = cursor[b]
        while r >= 0 and stamp[r] >= oldest:
            r = prev[r]
        if r >= 0:
            cursor[b] = prev[r]  # r leaves the list: the walk goes on before it
            return r, n_aside
        cursor[b] = -1
    if policy == LIGHT_LFU:  # only pinned entries are left to give
        for r in range(state[ST_SIZE]):
            if freq[r] < 0 and stamp[r] < oldest:
                return r, n_aside
    return -1, n_aside


# ---------------------------------------------------------------- the read and write kernels

@njit(cache=True, nogil=True)
def begin_read(keys, staleness, keep, kcache, index, cs, cc, acc, stamp, freq, tick, prev, nxt, heads, tails,
               heap, hpos, state, counters, rows_of, status, ev_keys, ev_clocks, ev_grads):
    """Probe the distinct `keys` of one read (see the module doc). Fills rows_of and status per
    key, and the evicted rows that held updates into ev_*; returns (evicted with updates, error).
    No row the last `keep` reads used is evicted (1: the previous read's batch is still training)."""
    state[ST_READ] += 1
    now = state[ST_READ]
    oldest = now - keep
    capacity = kcache.shape[0]
    ns = index.shape[0]
    row_bits = state[ST_ROW_BITS]
    n = keys.shape[0]
    misses = 0
    for u in range(n):  # hits first, so that no key of this read is chosen as a victim below
        key = keys[u]
        h = index_hash(key)
        slot = _probe(index, kcache, 0, key, 0, ns, h, row_bits)
        r = _entry_row(index[slot], row_bits)
        if r < 0:
            rows_of[u] = -1
            status[u] = MISS
            misses += 1
            continue
        rows_of[u] = r
        prior = stamp[r]
        if prior != now:
            stamp[r] = now
            _on_use(r, freq, tick, prev, nxt, heads, tails, heap, hpos, state, counters)
        # the training batch's write is still to come on the rows it read: count it in
        coming = 1 if keep > 0 and prior == now - 1 else 0
        if cc[r] + coming > cs[r] + staleness:  # CheckValid, first bound
            status[u] = SYNC
            counters[CT_SYNCS] += 1
        else:
            status[u] = HIT
            counters[CT_HITS] += 1
    counters[CT_MISSES] += misses
    n_ev = 0
    if misses == 0:
        return n_ev, 0
    dim = acc.shape[1]
    cursor = tails.copy()
    aside = np.empty(n, np.int32)  # LFU roots this read uses, out of the heap until it ends
    n_aside = 0
    pending = np.empty(n, np.int32)  # rows inserted by this read: they join the policy at its end
    n_pending = 0
    err = 0
    for u in range(n):
        if status[u] != MISS:
            continue
        key = keys[u]
        h = index_hash(key)
        slot = _probe(index, kcache, 0, key, 0, ns, h, row_bits)
        r = _entry_row(index[slot], row_bits)
        if r >= 0:  # the same key twice in this read: one row
            rows_of[u] = r
            continue
        size = state[ST_SIZE]
        if size < capacity:
            r = size
            state[ST_SIZE] = size + 1
        else:
            r, n_aside = _victim(stamp, oldest, freq, tick, prev, tails, cursor, heap, hpos, state, aside, n_aside)
            if r < 0:
                err = ERR_FULL
                break
            _forget(r, freq, tick, prev, nxt, heads, tails, heap, hpos, state)
            counters[CT_EVICTIONS] += 1
            if cc[r] > cs[r]:  # it holds updates the server has not seen: write them back
                ev_keys[n_ev] = kcache[r, 0]
                ev_clocks[n_ev] = cc[r]
                for d in range(dim):
                    ev_grads[n_ev, d] = acc[r, d]
                n_ev += 1
                counters[CT_DIRTY_EVICTIONS] += 1
            old = kcache[r, 0]
            _index_delete(index, kcache, 0, _probe(index, kcache, 0, old, 0, ns, index_hash(old), row_bits), 0, ns,
                          row_bits)
            slot = _probe(index, kcache, 0, key, 0, ns, h, row_bits)
        index[slot] = _entry(r, h, row_bits, slot, ns)
        kcache[r, 0] = key
        stamp[r] = now
        cs[r] = 0
        cc[r] = 0
        for d in range(dim):
            acc[r, d] = 0.0
        pending[n_pending] = r
        n_pending += 1
        rows_of[u] = r
    for i in range(n_aside):
        _heap_push(heap, hpos, freq, tick, state, aside[i])
    for i in range(n_pending):
        _on_insert(pending[i], freq, tick, prev, nxt, heads, tails, heap, hpos, state)
    return n_ev, err


@njit(cache=True, nogil=True)
def fill(vec, cs, cc, acc, rows_of, values, clocks):
    """Fetched rows: vec = the server's row, c_s = c_c = c_g, nothing accumulated."""
    dim = vec.shape[1]
    for i in range(rows_of.shape[0]):
        r = rows_of[i]
        for d in range(dim):
            vec[r, d] = values[i, d]
            acc[r, d] = 0.0
        cs[r] = clocks[i]
        cc[r] = clocks[i]


@njit(cache=True, nogil=True)
def refill(vec, cs, cc, acc, rows_of, values, clocks, taken_clocks, taken_grads, lr):
    """Fetched rows whose write-back (c_c and gradient in taken_*, zero for a miss) was taken
    before the fetch: what accumulated since the take stays (a batch training while the next
    one's read is in flight writes into its rows): acc -= taken, c_c = c_g + the updates since,
    and the server's row takes the local SGD step of those updates (read-my-updates)."""
    dim = vec.shape[1]
    lr32 = np.float32(lr)
    for i in range(rows_of.shape[0]):
        r = rows_of[i]
        for d in range(dim):
            rest = acc[r, d] - taken_grads[i, d]
            acc[r, d] = rest
            vec[r, d] = values[i, d] - lr32 * rest
        cc[r] = clocks[i] + (cc[r] - taken_clocks[i])
        cs[r] = clocks[i]


@njit(cache=True, nogil=True)
def gather(vec, rows_of, out):
    dim = vec.shape[1]
    for i in range(rows_of.shape[0]):
        r = rows_of[i]
        for d in range(dim):
            out[i, d] = vec[r, d]


@njit(cache=True, nogil=True)
def take(kcache, cc, acc, rows_of, keys_out, clocks_out, grads_out):
    """Key, c_c and accumulated gradient of each row in rows_of (a write-back's payload)."""
    dim = acc.shape[1]
    for i in range(rows_of.shape[0]):
        r = rows_of[i]
        keys_out[i] = kcache[r, 0]
        clocks_out[i] = cc[r]
        for d in range(dim):
            grads_out[i, d] = acc[r, d]


@njit(cache=True, nogil=True)
def accumulate(vec, acc, cc, rows_of, grads, lr):
    """Het.Write for one read's rows: accumulate, a local SGD step, c_c + 1."""
    dim = vec.shape[1]
    lr32 = np.float32(lr)
    for i in range(rows_of.shape[0]):
        r = rows_of[i]
        for d in range(dim):
            g = grads[i, d]
            acc[r, d] += g
            vec[r, d] -= lr32 * g
        cc[r] += 1


def _row_bits(capacity: int) -> int:
    return max(1, int(capacity - 1).bit_length())


class CacheTable:
    """One trainer's cache of one embedding table: `capacity` rows of width `dim`."""

    def __init__(self, capacity: int, dim: int, policy: str = "lfu", *, light_threshold: int = LIGHT_THRESHOLD,
                 max_pinned: int | None = None):
        if not isinstance(capacity, int) or not 1 <= capacity < 2**30:
            raise ValueError(f"capacity must be an int in [1, 2**30), got {capacity!r}")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {policy!r}")
        if not isinstance(light_threshold, int) or light_threshold < 1:
            raise ValueError(f"light_threshold must be an int >= 1, got {light_threshold!r}")
        self.capacity, self.dim, self.policy = capacity, dim, policy
        slots = 8
        while slots < 2 * capacity:
            slots *= 2
        self.keys = np.zeros((capacity, 1), np.uint64)
        self.index = np.full(slots, -1, np.int32)
        self.vec = np.zeros((capacity, dim), np.float32)
        self.acc = np.zeros((capacity, dim), np.float32)
        self.cs = np.zeros(capacity, np.int64)
        self.cc = np.zeros(capacity, np.int64)
        self.stamp = np.zeros(capacity, np.int64)
        self.freq = np.zeros(capacity, np.int64)
        self.tick = np.zeros(capacity, np.int64)
        self.prev = np.full(capacity, -1, np.int32)
        self.next = np.full(capacity, -1, np.int32)
        buckets = light_threshold if policy == "light_lfu" else 1
        self.heads = np.full(buckets, -1, np.int32)
        self.tails = np.full(buckets, -1, np.int32)
        self.heap = np.zeros(capacity, np.int32)
        self.hpos = np.full(capacity, -1, np.int32)
        self.state = np.zeros(STATE_WIDTH, np.int64)
        self.state[ST_ROW_BITS] = _row_bits(capacity)
        self.state[ST_POLICY] = POLICIES[policy]
        self.state[ST_BUCKETS] = buckets
        self.state[ST_MAX_PINNED] = capacity // 2 if max_pinned is None else max_pinned
        self.counters = np.zeros(COUNTERS_WIDTH, np.int64)

    def __len__(self) -> int:
        return int(self.state[ST_SIZE])

    def begin_read(self, keys: np.ndarray, staleness: int | None, keep: int = 0):
        """(rows_of int32[n], status uint8[n], evicted keys, their c_c, their gradients) for the
        distinct `keys` of a read; `staleness` None is s = infinity; no row of the last `keep`
        reads is evicted. ValueError when the read's keys do not fit beside those rows."""
        n = keys.shape[0]
        rows_of = np.empty(n, np.int32)
        status = np.empty(n, np.uint8)
        ev_keys = np.empty(n, np.uint64)
        ev_clocks = np.empty(n, np.int64)
        ev_grads = np.empty((n, self.dim), np.float32)
        s = INFINITE if staleness is None else np.int64(staleness)
        n_ev, err = begin_read(keys, s, np.int64(keep), self.keys, self.index, self.cs, self.cc, self.acc, self.stamp, self.freq,
                               self.tick, self.prev, self.next, self.heads, self.tails, self.heap, self.hpos,
                               self.state, self.counters, rows_of, status, ev_keys, ev_clocks, ev_grads)
        if err == ERR_FULL:
            raise ValueError(f"a read of {n} distinct keys does not fit a cache of {self.capacity} rows")
        return rows_of, status, ev_keys[:n_ev], ev_clocks[:n_ev], ev_grads[:n_ev]

    def fill(self, rows_of: np.ndarray, values: np.ndarray, clocks: np.ndarray) -> None:
        fill(self.vec, self.cs, self.cc, self.acc, rows_of, values, clocks.astype(np.int64, copy=False))

    def refill(self, rows_of: np.ndarray, values: np.ndarray, clocks: np.ndarray, taken_clocks: np.ndarray,
               taken_grads: np.ndarray, lr: float) -> None:
        """`fill` for rows whose write-back (`take`) went out before the fetch, keeping what was
        accumulated since (see the kernel)."""
        refill(self.vec, self.cs, self.cc, self.acc, rows_of, values, clocks.astype(np.int64, copy=False),
               taken_clocks, taken_grads, float(lr))

    def gather(self, rows_of: np.ndarray) -> np.ndarray:
        out = np.empty((rows_of.shape[0], self.dim), np.float32)
        gather(self.vec, rows_of, out)
        return out

    def take(self, rows_of: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(keys, c_c, accumulated gradients) of `rows_of`."""
        n = rows_of.shape[0]
        keys, clocks, grads = np.empty(n, np.uint64), np.empty(n, np.int64), np.empty((n, self.dim), np.float32)
        take(self.keys, self.cc, self.acc, rows_of, keys, clocks, grads)
        return keys, clocks, grads

    def accumulate(self, rows_of: np.ndarray, grads: np.ndarray, lr: float) -> None:
        accumulate(self.vec, self.acc, self.cc, rows_of, np.ascontiguousarray(grads, dtype=np.float32), float(lr))

    def dirty_rows(self) -> np.ndarray:
        """Rows holding updates the server has not seen (c_c > c_s)."""
        size = len(self)
        return np.flatnonzero(self.cc[:size] > self.cs[:size]).astype(np.int32)

    def clear(self) -> None:
        """Drop every entry (after a flush wrote their updates back)."""
        size = len(self)
        self.index[:] = -1
        self.keys[:size] = 0
        self.cs[:size] = 0
        self.cc[:size] = 0
        self.acc[:size] = 0.0
        self.stamp[:size] = 0
        self.freq[:size] = 0
        self.prev[:] = -1
        self.next[:] = -1
        self.heads[:] = -1
        self.tails[:] = -1
        self.hpos[:] = -1
        for field in (ST_SIZE, ST_HEAP, ST_PINNED):
            self.state[field] = 0

    def entry(self, key: int) -> tuple[int, int] | None:
        """(c_s, c_c) of a cached key, or None (for tests and inspection; not a hot path)."""
        keys = self.keys[: len(self), 0]
        where = np.flatnonzero(keys == np.uint64(key))
        if where.size == 0:
            return None
        r = int(where[0])
        return int(self.cs[r]), int(self.cc[r])

    def cached_keys(self) -> np.ndarray:
        return self.keys[: len(self), 0].copy()

    def stats(self) -> dict:
        c = self.counters
        return {"hits": int(c[CT_HITS]), "misses": int(c[CT_MISSES]), "syncs": int(c[CT_SYNCS]),
                "evictions": int(c[CT_EVICTIONS]), "dirty_evictions": int(c[CT_DIRTY_EVICTIONS]),
                "pins": int(c[CT_PINS]), "size": len(self), "pinned": int(self.state[ST_PINNED])}
