"""Numba kernels of the embedding store: probe/insert, eviction, pooling, gradient scatter and
fused optimizer updates. No Python runs per ID; `store.py` only validates and calls these.

Memory layout (Persia §4.2.2): `rows` is one contiguous float32 array [capacity, width], each row
[embedding (dim) | optimizer state]; `meta` is an int32 array [capacity, 8] beside it, one 32-byte
record per row: key (uint64, 2 slots) | LRU ring place | spare | access count | clock | stamp | slot.
`r32` is that int32 array and `r64` its uint64 view (the key is column meta//2 of r64). `stamp`
and `slot` say when a row was last used for training: the lookup call (epoch) and its place among
that call's unique rows. `index` is an int32 open-addressing (linear probing) table, -1 = empty,
with backward-shift deletion (no tombstones). An entry is a row number in its low `row_bits` bits
(enough for the capacity) and, above them, a tag: 31 - row_bits further bits of the key hash. A
probe reads a row's key only when the tag matches, so passing over another key's entry costs no
random metadata read, and the row prefetches aim at the entry whose tag matches, not just the home
slot. The store is split into partitions (one per thread, Persia's per-thread subsets): partition
p owns a range of rows, a range of index slots, and its own LRU order; its bookkeeping is the int64
row parts[p].

The LRU order is a ring of row numbers in order of use (`lru_log`, log-structured): a use appends
the row's number at the end and records the place in the row's metadata (M_LOG_AT), which makes
any older entry of that row stale; the victims are the live entries at the front, taken in one
sequential walk that passes over stale entries (their row records another place) and rows the
call itself uses. A hit thus writes one entry at the ring's end and its own metadata, where a
linked list would read and write the metadata of its two neighbours (two random accesses). A
partition's ring has one and a half entries per row and one more; when a call's appends would
fill it, the live entries are packed to its front first (`_log_room`, about once every half
row-count uses).

The order is kept only once a partition has been full. Until then nothing is evicted, so nobody
reads it. When the partition first needs a victim, `link_lru_from_stamps` builds the ring from
the rows' (stamp, slot), which is exactly the order a kept one would have, and from then on every
use appends.
"""
import numpy as np
from numba import njit, prange

from .dedupe import dedupe
from .hashing import (INIT_SALT, ADMIT_SALT, SKETCH_SALT, U64_GOLDEN, index_hash, mix64, scale32, scale_hi32,
                      stays_in_run, uniform01)
from .cache_hints import (CACHE_LINE, LINE_FLOATS, prefetch_cell, prefetch_cell_for_write, prefetch_row, store_fence,
                          stream_line)
from .optim import OPT_SGD, OPT_ADAGRAD, OPT_ADAM, P_LR, P_A, P_B, P_C
from .tier_kernels import TP_HITS, TP_LOOKUPS, has_tier, maybe_on_disk, tier_find, tier_put, tier_take


def _called_and_inlined(py_func):
    """A helper of the per-key paths compiled twice from one body: as a function of its own that
    counts no references (for callers that do count them: inlined there, numba would take an
    atomic increment and decrement per array argument and call) and inlined (for `_evict_for`,
    which counts none: no call passing every field of every array argument per eviction)."""
    return njit(cache=True, nogil=True, _nrt=False)(py_func), njit(inline="always")(py_func)


# metadata columns, relative to the meta offset (int32 view)
M_LOG_AT, M_SPARE, M_COUNT, M_CLOCK, M_STAMP, M_SLOT = 2, 3, 4, 5, 6, 7  # M_LOG_AT: place in the LRU ring
META_WIDTH = 8

# parts[p, *]
PT_ROW_START, PT_ROW_COUNT, PT_SLOT_START, PT_SLOT_COUNT, PT_SIZE, PT_LOG_END, PT_LOG_START = 0, 1, 2, 3, 4, 5, 6
PT_EVICTED, PT_REJECTED, PT_RNG, PT_INSERTED = 7, 8, 9, 10
PT_LRU_KEPT = 11  # 1 once partition p's LRU ring is kept up to date (it has been full), else 0
PARTS_WIDTH = 12

# icfg[*]: integer configuration read by kernels
IC_DIM, IC_STATE, IC_META, IC_POLICY, IC_MIN_FREQ, IC_INIT_KIND, IC_NPARTS, IC_ROW_BITS = 0, 1, 2, 3, 4, 5, 6, 7
ICFG_WIDTH = 8
# fcfg[*]: float configuration
FC_ADMIT_PROB, FC_INIT_A, FC_INIT_B, FC_INIT_BOUND, FC_STATE_INIT, FC_WEIGHT_DECAY, FC_WEIGHT_BOUND = 0, 1, 2, 3, 4, 5, 6
FCFG_WIDTH = 8

# scalars[*]: per-store counters
SC_MAGIC, SC_EPOCH, SC_STEP, SC_DIRTY, SC_DROPPED, SC_INDEX_GEN = 0, 1, 2, 3, 4, 5
SC_EXPIRED = 6  # rows dropped by expiry (`expire_rows`)
SCALARS_WIDTH = 16

POLICY_LRU, POLICY_LFU = 0, 1
INIT_UNIFORM, INIT_NORMAL, INIT_ZEROS = 0, 1, 2
MODE_TRAIN, MODE_FIND, MODE_FORCE = 0, 1, 2  # insert with admission | never insert | insert always

ERR_FULL = 1  # every row of a partition is used by the current batch: nothing can be evicted
EPOCH_LIMIT = 2**31 - 2  # stamps are int32: at this many lookup calls the epoch count restarts
_COUNT_CEILING = 1 << 30
_LFU_SAMPLES = 8
PREFETCH_SLOT = 16  # keys ahead whose index slot is prefetched
PREFETCH_ROW = 8  # keys ahead whose row (metadata and values) is prefetched
FRONTIER_AHEAD = 4  # rows past the growth frontier whose lines an insert prefetches for writing
EVICT_AHEAD = 8  # victims ahead whose row lines, metadata and index slot an eviction requests
WALK_AHEAD = 32  # ring entries ahead whose row metadata the walk for victims requests
DISP_BITS = 4  # bits of an index entry holding its distance from its home slot (see _entry)


@njit(cache=True, nogil=True)
def compute_partitions(keys, nparts, hashes, part_of):
    """Hash every key once; record its partition when nparts > 1 (part_of may be empty otherwise)."""
    for i in range(keys.shape[0]):
        h = index_hash(keys[i])
        hashes[i] = h
        if nparts > 1:
            part_of[i] = scale_hi32(h, nparts)


@njit(cache=True, nogil=True)
def order_by_partition(part_of, nparts, order, starts):
    """Counting sort of key positions by partition: order[starts[p]:starts[p+1]] are partition p's."""
    counts = np.zeros(nparts + 1, dtype=np.int64)
    for i in range(part_of.shape[0]):
        counts[part_of[i] + 1] += 1
    for p in range(nparts):
        counts[p + 1] += counts[p]
    for p in range(nparts + 1):
        starts[p] = counts[p]
    for i in range(part_of.shape[0]):
        p = part_of[i]
        order[counts[p]] = i
        counts[p] += 1


OFFSETS_ENDS_WRONG = -2  # offsets_problem: offsets[0] != 0 or offsets[-1] != the number of values


@njit(cache=True, nogil=True)
def offsets_problem(offsets, n_values):
    """What is wrong with a batch's jagged offsets, in one call: -1 when they start at 0, end at
    n_values and never decrease; OFFSETS_ENDS_WRONG when an end is off; else the index i of the
    first offsets[i+1] < offsets[i]. A branch-free pass decides whether there is a decrease (LLVM
    vectorises it; a loop that stops at the first decrease stays scalar), and only then a second
    pass finds it. `offsets` must not be empty."""
    n = offsets.shape[0] - 1
    if offsets[0] != 0 or offsets[n] != n_values:
        return OFFSETS_ENDS_WRONG
    decreases = False
    for i in range(n):
        decreases |= offsets[i + 1] < offsets[i]
    if decreases:
        for i in range(n):
            if offsets[i + 1] < offsets[i]:
                return i
    return -1


# ---------------------------------------------------------------- LRU ring (log-structured)
# Helpers that take arrays and branch or loop are ordinary calls, not `inline="always"`: numba
# inlines by binding each array argument to a new variable, and the reference counts it takes for
# them (atomic increments and decrements) survive its pruning once the body has control flow.
# Inlined, each of the LRU relink, the admission roll and the row initialisation would take 2-4
# atomic increments and as many decrements per key; a call costs less. The helpers called per key
# are compiled `_nrt=False` (they allocate nothing): compiled with reference counting, such a
# function counts its own array arguments too (the row fill took 11 atomic increments and 11
# decrements per call, each a full memory fence on x86). `_evict_for` counts none either, so it
# inlines them (`_called_and_inlined`).

@njit(cache=True)
def ring_slots(rows):
    """Entries of the LRU ring of a partition of `rows` rows: one and a half per row, and one
    more (the live entries and a call's appends then always leave one free: a full ring would
    look empty)."""
    return rows + rows // 2 + 1


def log_slots(row_counts) -> int:
    """Entries of a store's `lru_log`: the rings of partitions of `row_counts` rows, in order."""
    return int(sum(ring_slots(int(n)) for n in row_counts))


@njit(cache=True, nogil=True)
def log_span(parts, p):
    """(first entry, entries) of partition p's ring in `lru_log`."""
    base = 0
    for q in range(p):
        base += ring_slots(parts[q, PT_ROW_COUNT])
    return base, ring_slots(parts[p, PT_ROW_COUNT])


@njit(cache=True, nogil=True)
def _log_append(lru_log, base, ring, r32, meta, parts, p, r):
    """Row r is used now: its number goes at the end of partition p's ring (entries
    lru_log[base:base + ring]), and its metadata records where: an older entry of r is stale
    from now on."""
    end = parts[p, PT_LOG_END]
    lru_log[base + end] = r
    r32[r, meta + M_LOG_AT] = end
    end += 1
    parts[p, PT_LOG_END] = 0 if end == ring else end


@njit(cache=True, nogil=True)
def _log_room(lru_log, base, ring, r32, meta, parts, p, m, epoch):
    """Make room in partition p's ring for the m rows of lookup call `epoch` about to be
    appended: when they would fill it, the live entries are packed to its front first, leaving
    out those of the call's rows (each is appended again right after). At most a partition's
    rows are live, so that leaves at least ring - rows entries for the next calls."""
    used = parts[p, PT_LOG_END] - parts[p, PT_LOG_START]
    if used < 0:
        used += ring
    if used + m < ring:
        return
    i = parts[p, PT_LOG_START]
    end = parts[p, PT_LOG_END]
    keep = np.empty(parts[p, PT_ROW_COUNT], np.int32)
    n = 0
    while i != end:
        r = lru_log[base + i]
        if r32[r, meta + M_LOG_AT] == i and r32[r, meta + M_STAMP] != epoch:
            keep[n] = r
            n += 1
        i = i + 1 if i + 1 < ring else 0
    for j in range(n):
        lru_log[base + j] = keep[j]
        r32[keep[j], meta + M_LOG_AT] = j
    parts[p, PT_LOG_START] = 0
    parts[p, PT_LOG_END] = n


@njit(cache=True, nogil=True)
def link_lru_from_stamps(lru_log, r32, meta, parts, p, leave_out=-1):
    """(Re)build partition p's LRU ring from its live rows' last training use, least recent at
    the front: by stamp (lookup call), then by slot (first-seen order within that call), the
    order in which a kept ring would have had them appended. Rows stamped `leave_out` (the lookup
    call building it, which appends its own rows afterwards) stay out. Marks the ring as kept."""
    start = parts[p, PT_ROW_START]
    size = parts[p, PT_SIZE]
    last_use = np.empty(size, np.int64)
    n = 0
    for i in range(size):
        r = start + i
        if r32[r, meta + M_STAMP] != leave_out:
            last_use[n] = (np.int64(r32[r, meta + M_STAMP]) << 32) | (np.int64(r32[r, meta + M_SLOT]) & 0xFFFFFFFF)
            n += 1
    rows_of = np.empty(n, np.int64)
    n = 0
    for i in range(size):
        if r32[start + i, meta + M_STAMP] != leave_out:
            rows_of[n] = start + i
            n += 1
    order = np.argsort(last_use[:n], kind="mergesort")
    for i in range(start, start + size):
        r32[i, meta + M_LOG_AT] = -1
    parts[p, PT_LOG_END] = 0
    parts[p, PT_LOG_START] = 0
    base, ring = log_span(parts, p)
    for i in range(n):
        _log_append(lru_log, base, ring, r32, meta, parts, p, rows_of[order[i]])
    parts[p, PT_LRU_KEPT] = 1


# ---------------------------------------------------------------- hash index

@njit(inline="always")
def _disp_bits(row_bits):
    """Bits of an index entry, just above its row number, that hold how far past its home slot
    the entry sits (DISP_BITS, fewer when row numbers leave fewer free)."""
    return min(DISP_BITS, 31 - row_bits)


@njit(inline="always")
def _tag(h, row_bits):
    """The part of an index entry above its row number and displacement: the remaining bits of
    31 (none when row numbers and displacement need them all) from the key hash, taken from just
    above bit 32. The slot comes from the low 32 bits and the partition from the top ones, so the
    tag is independent of both."""
    low = row_bits + _disp_bits(row_bits)
    if low >= 31:
        return np.int64(0)
    return np.int64((h >> np.uint64(32)) & np.uint64((1 << (31 - low)) - 1)) << low


@njit(inline="always")
def _tag_mask(row_bits):
    """The bits of an index entry that hold its tag."""
    return np.int64(0x7FFFFFFF) & ~((np.int64(1) << (row_bits + _disp_bits(row_bits))) - 1)


@njit(inline="always")
def _row_mask(row_bits):
    """The bits of an index entry that hold its row number."""
    return (np.int64(1) << row_bits) - 1


@njit(inline="always")
def _entry(r, h, row_bits, at, ns):
    """The index entry of row r holding a key of hash h, stored at slot `at` of its ns slots:
    tag | displacement (slots past the key's home, capped at the field's largest value, which
    then means "at least that far") | row."""
    cap = (np.int64(1) << _disp_bits(row_bits)) - 1
    disp = at - scale32(h, ns)
    if disp < 0:
        disp += ns
    return np.int32(_tag(h, row_bits) | (min(disp, cap) << row_bits) | r)


@njit(inline="always")
def _entry_row(e, row_bits):
    """The row number in index entry e (-1 for an empty slot)."""
    if e < 0:
        return np.int64(-1)
    return np.int64(e) & _row_mask(row_bits)


@njit(inline="always")
def _probe(index, r64, kcol, key, s0, ns, h, row_bits):
    """Slot holding `key`, or the first empty slot of its probe sequence (index[slot] == -1).
    An entry whose tag differs from the key's is passed over without reading its row's key."""
    s = scale32(h, ns)
    tag = _tag(h, row_bits)
    tags = _tag_mask(row_bits)
    rows_part = _row_mask(row_bits)
    while True:
        e = np.int64(index[s0 + s])
        if e < 0 or ((e & tags) == tag and r64[e & rows_part, kcol] == key):
            return s0 + s
        s += 1
        if s == ns:
            s = 0


@njit(inline="always")
def _slot_of_row(index, r, s0, ns, h, row_bits):
    """Slot of row r's index entry, r holding a key of hash h: its probe sequence matched by row
    number, so no key is read (the entry must be there: no empty slot comes before it)."""
    s = scale32(h, ns)
    rows_part = _row_mask(row_bits)
    while (np.int64(index[s0 + s]) & rows_part) != r:
        s = s + 1 if s + 1 < ns else 0
    return s0 + s


@njit(inline="always")
def _free_slot(index, s0, ns, h):
    """The first empty slot of the probe sequence of a key of hash h known to be absent: where
    it is inserted (no entry's tag or key needs comparing)."""
    s = scale32(h, ns)
    while index[s0 + s] >= 0:
        s = s + 1 if s + 1 < ns else 0
    return s0 + s


def _index_delete_body(index, r64, kcol, slot, s0, ns, row_bits):
    """Remove the entry at `slot` by shifting later entries of the run back (no tombstones). An
    entry's home slot is its slot minus its displacement, so the shift reads no key, unless a
    displacement is capped (then the key is read and hashed); a moved entry's displacement
    shrinks by the distance it moves."""
    cap = (np.int64(1) << _disp_bits(row_bits)) - 1
    rows_part = _row_mask(row_bits)
    hole = slot - s0
    j = hole
    while True:
        j += 1
        if j == ns:
            j = 0
        e = np.int64(index[s0 + j])
        if e < 0:
            break
        disp = (e >> row_bits) & cap
        if disp < cap:
            home = j - disp
            if home < 0:
                home += ns
        else:
            home = scale32(index_hash(r64[e & rows_part, kcol]), ns)
        if stays_in_run(home, hole, j, ns):
            continue
        moved = hole - home
        if moved < 0:
            moved += ns
        index[s0 + hole] = np.int32((e & ~(cap << row_bits)) | (min(moved, cap) << row_bits))
        hole = j
    index[s0 + hole] = -1


_index_delete, _index_delete_inlined = _called_and_inlined(_index_delete_body)


# ---------------------------------------------------------------- row initialisation

@njit(cache=True, nogil=True, _nrt=False)
def _init_row(rows, r, key, seed, icfg, fcfg):
    dim = icfg[IC_DIM]
    kind = icfg[IC_INIT_KIND]
    base = mix64(key ^ mix64(seed ^ INIT_SALT))
    if kind == INIT_ZEROS:
        for j in range(dim):
            rows[r, j] = 0.0
    elif kind == INIT_UNIFORM:
        lo = fcfg[FC_INIT_A]
        width = fcfg[FC_INIT_B] - lo
        for j in range(dim):
            rows[r, j] = lo + width * uniform01(mix64(base + np.uint64(j) * U64_GOLDEN))
    else:  # truncated normal: resample outside mean +- bound, counter-based so it is deterministic
        mean = fcfg[FC_INIT_A]
        std = fcfg[FC_INIT_B]
        bound = fcfg[FC_INIT_BOUND]
        c = np.uint64(0)
        for j in range(dim):
            v = mean
            for _ in range(32):
                u1 = uniform01(mix64(base + c * U64_GOLDEN))
                u2 = uniform01(mix64(base + (c + np.uint64(1)) * U64_GOLDEN))
                c += np.uint64(2)
                z = np.sqrt(-2.0 * np.log(1.0 - u1)) * np.cos(2.0 * np.pi * u2)
                v = mean + std * z
                if abs(v - mean) <= bound:
                    break
            rows[r, j] = min(max(v, mean - bound), mean + bound)
    init = fcfg[FC_STATE_INIT]
    # unsigned bounds: with a signed column numba wraps negative indices, and LLVM stored the
    # state with scatter instructions instead of contiguous vector stores (see dedupe)
    for j in range(np.uint64(dim), np.uint64(dim + icfg[IC_STATE])):
        rows[r, j] = init


# ---------------------------------------------------------------- admission and eviction

@njit(cache=True, nogil=True)
def _admit(key, seed, draw, icfg, fcfg, sketch):
    """Whether a key not in the store gets a row now. The probability roll is keyed by (seed,
    key, draw), where draw counts this partition's admission decisions: training lookups alone
    advance it, so evaluating or pulling read-only never changes what training admits."""
    min_freq = icfg[IC_MIN_FREQ]
    if min_freq > 1:
        width = sketch.shape[1]
        h1 = mix64(key ^ SKETCH_SALT)
        h2 = mix64(h1 ^ SKETCH_SALT)
        a = scale32(h1, width)
        b = scale32(h2, width)
        est = min(sketch[0, a], sketch[1, b])
        if est < 65535:  # conservative update: raise only the counters at the minimum
            if sketch[0, a] == est:
                sketch[0, a] = est + 1
            if sketch[1, b] == est:
                sketch[1, b] = est + 1
        if np.int64(est) + 1 < min_freq:
            return False
    prob = fcfg[FC_ADMIT_PROB]
    if prob < 1.0:
        u = uniform01(mix64(key ^ mix64(seed ^ ADMIT_SALT ^ np.uint64(draw))))
        if u >= prob:
            return False
    return True


@njit(cache=True, nogil=True)
def _lru_victims(lru_log, r32, r64, index, parts, p, meta, s0, ns, m, victims, vhash, epoch):
    """The m least recently used rows of partition p, oldest first, into victims[:m] with their
    keys' hashes in vhash, taken off the front of its ring (stale entries and rows this call
    uses are passed over); False when it holds fewer."""
    kcol = meta // 2
    base, ring = log_span(parts, p)
    i = parts[p, PT_LOG_START]
    end = parts[p, PT_LOG_END]
    ahead = i
    for _ in range(WALK_AHEAD):
        if ahead == end:
            break
        prefetch_row(r32, lru_log[base + ahead])
        ahead = ahead + 1 if ahead + 1 < ring else 0
    k = 0
    while k < m:
        if i == end:
            return False
        if ahead != end:
            prefetch_row(r32, lru_log[base + ahead])
            ahead = ahead + 1 if ahead + 1 < ring else 0
        r = lru_log[base + i]
        live = r32[r, meta + M_LOG_AT] == i
        i = i + 1 if i + 1 < ring else 0
        if not live or r32[r, meta + M_STAMP] == epoch:  # (a row of this call is appended again at its end)
            continue
        h = index_hash(r64[r, kcol])
        prefetch_row(index, s0 + scale32(h, ns))
        victims[k] = r
        vhash[k] = h
        k += 1
    parts[p, PT_LOG_START] = i
    return True


@njit(cache=True, nogil=True)
def _lfu_victim(r32, meta, parts, p, epoch):
    start = parts[p, PT_ROW_START]
    count = parts[p, PT_ROW_COUNT]
    best = -1
    best_count = np.int64(1) << 40
    for _ in range(4):
        for _k in range(_LFU_SAMPLES):
            parts[p, PT_RNG] += 1
            r = start + scale32(mix64(np.uint64(parts[p, PT_RNG]) ^ SKETCH_SALT), count)
            if r32[r, meta + M_STAMP] != epoch and r32[r, meta + M_COUNT] < best_count:
                best = r
                best_count = r32[r, meta + M_COUNT]
        if best >= 0:
            return best
    for r in range(start, start + count):  # every sample was in use by this batch
        if r32[r, meta + M_STAMP] != epoch:
            return r
    return -1


@njit(inline="always")
def _age_counts(r32, meta, parts, p):
    start = parts[p, PT_ROW_START]
    for r in range(start, start + parts[p, PT_SIZE]):
        r32[r, meta + M_COUNT] >>= 1


# ---------------------------------------------------------------- lookup

@njit(cache=True, nogil=True)
def _admit_any(key, seed, times, parts, p, icfg, fcfg, sketch):
    """Admission of a key seen `times` times in this batch: one decision per sighting, as if
    the sightings came one by one, stopping at the first that admits it."""
    for _ in range(times):
        if _admit(key, seed, parts[p, PT_INSERTED] + parts[p, PT_REJECTED], icfg, fcfg, sketch):
            return True
        parts[p, PT_REJECTED] += 1
    return False


@njit(inline="always")
def _own_row(p, r, key, h, slot, r64, index, parts, icfg):
    """Row r holds `key` from now on: its index entry goes at `slot` (where a probe for the key
    stopped) and its key into its metadata."""
    index[slot] = _entry(r, h, icfg[IC_ROW_BITS], slot - parts[p, PT_SLOT_START], parts[p, PT_SLOT_COUNT])
    r64[r, icfg[IC_META] // 2] = key


def _new_row_body(p, r, key, h, slot, rows, r32, r64, index, parts, icfg, fcfg, seed):
    """Row r becomes new `key`'s (`_own_row`): initial values, access count and clock 0. No
    disk tier among its arguments: a call passes each array's fields, and a tier's are many."""
    meta = icfg[IC_META]
    _own_row(p, r, key, h, slot, r64, index, parts, icfg)
    _init_row(rows, r, key, seed, icfg, fcfg)
    r32[r, meta + M_COUNT] = 0
    r32[r, meta + M_CLOCK] = 0
    parts[p, PT_INSERTED] += 1


_new_row, _new_row_inlined = _called_and_inlined(_new_row_body)


@njit(cache=True, nogil=True, _nrt=False)
def _row_from_disk(p, r, key, h, slot, on_disk, rows, r32, r64, index, parts, icfg, tier):
    """Row r becomes `key`'s (`_own_row`), with its values, access count and clock from disk
    tier record `on_disk`."""
    _own_row(p, r, key, h, slot, r64, index, parts, icfg)
    tier_take(tier, p, on_disk, rows, r, r32, icfg[IC_META], M_COUNT, M_CLOCK)


def _mark_use_body(r32, meta, parts, p, r, mode, tiered, times, epoch, slot):
    """Row r is used by lookup call `epoch` as its unique row number `slot`: a training use counts
    `times` and stamps it (not evictable until the next call); a read-only lookup of a tiered
    store stamps it too (it may take rows from disk and evict: the rows it returns stay), but
    leaves counts alone, and other read-only lookups leave the row as it is."""
    if mode != MODE_FIND:
        c = r32[r, meta + M_COUNT] + times
        r32[r, meta + M_COUNT] = c
        if c >= _COUNT_CEILING:
            _age_counts(r32, meta, parts, p)
    if mode != MODE_FIND or tiered:
        r32[r, meta + M_STAMP] = epoch
        r32[r, meta + M_SLOT] = slot


_mark_use, _mark_use_inlined = _called_and_inlined(_mark_use_body)


@njit(cache=True, nogil=True, _nrt=False)
def _evict_for(p, pend, npend, ukeys, uhash, mult, slot_of, row_of, rows, r32, r64, index, parts, icfg, fcfg,
               seed, epoch, mode, uniq_rows, tier, lru_log, victims, vhash):
    """Give the distinct keys pend[:npend] of a full partition the rows of as many evicted ones,
    after every key of the call was probed (the rows the call uses carry its stamp by then, and
    are passed over); returns an error code. Under LRU the victims are taken off the ring's front
    at once (the walk requests their index slots), then evicted in order, each requesting what the eviction
    EVICT_AHEAD further touches: the victim's row lines (for writing), metadata and index slot,
    and the index slot of the key taking its row. `victims` and `vhash` hold npend entries (the
    caller allocates them, and builds the ring first when the partition has none: this kernel
    counts no references, so that the helpers it inlines take none per eviction)."""
    meta = icfg[IC_META]
    kcol = meta // 2
    row_bits = icfg[IC_ROW_BITS]
    width = rows.shape[1]
    lfu = icfg[IC_POLICY] == POLICY_LFU
    tiered = has_tier(tier)
    s0 = parts[p, PT_SLOT_START]
    ns = parts[p, PT_SLOT_COUNT]
    if not lfu:
        if not _lru_victims(lru_log, r32, r64, index, parts, p, meta, s0, ns, npend, victims, vhash, epoch):
            return ERR_FULL
    for i in range(npend):
        if lfu:
            r = _lfu_victim(r32, meta, parts, p, epoch)
            if r < 0:
                return ERR_FULL
            hv = index_hash(r64[r, kcol])
        else:
            ahead = i + EVICT_AHEAD
            if ahead < npend:  # (the walk requested the index slots too, but long before)
                v = victims[ahead]
                prefetch_cell_for_write(rows, v, 0)
                if width > LINE_FLOATS:
                    prefetch_cell_for_write(rows, v, width - 1)
                prefetch_row(r32, v)
                prefetch_row(index, s0 + scale32(vhash[ahead], ns))
                prefetch_row(index, s0 + scale32(uhash[pend[ahead]], ns))
            r = victims[i]
            hv = vhash[i]
        if tiered:
            tier_put(tier, p, r64[r, kcol], rows, r, r32, meta, M_COUNT, M_CLOCK)
        _index_delete_inlined(index, r64, kcol, _slot_of_row(index, r, s0, ns, hv, row_bits), s0, ns, row_bits)
        parts[p, PT_EVICTED] += 1
        u = pend[i]
        key = ukeys[u]
        h = uhash[u]
        on_disk = tier_find(tier, p, key, h) if tiered and maybe_on_disk(tier, p, key) else np.int64(-1)
        slot = _free_slot(index, s0, ns, h)
        if on_disk >= 0:
            _row_from_disk(p, r, key, h, slot, on_disk, rows, r32, r64, index, parts, icfg, tier)
        else:
            _new_row_inlined(p, r, key, h, slot, rows, r32, r64, index, parts, icfg, fcfg, seed)
        _mark_use_inlined(r32, meta, parts, p, r, mode, tiered, mult[u], epoch, slot_of[u])
        uniq_rows[slot_of[u]] = r
        row_of[u] = r
    return 0


@njit(cache=True, nogil=True)
def _lookup_partition(p, keys, hashes, order, lo, hi, rows, r32, r64, index, parts, sketch,
                      icfg, fcfg, seed, epoch, mode, out_rows, inverse, uniq_rows, ubase, tier, lru_log):
    """Probe (and insert) the keys of partition p; returns (number of unique rows, error code).

    Passes: dedupe the batch's keys locally (`dedupe`); probe each distinct key once in a
    software pipeline (the index slot of the key PREFETCH_SLOT ahead, the row and metadata of the
    key PREFETCH_ROW ahead are requested from memory early, so their misses
    overlap instead of following one another), a new key taking the next unused row while there
    is one; then the new keys of a full partition get rows by eviction, all at once (`_evict_for`);
    then the call's rows go to the end of the LRU ring in first-seen order; then every position
    is mapped to its unique row. A key absent or refused admission reads as row -1 at every one of
    its positions. Evicting after the probes means a key the call uses is never evicted by it.

    With a disk tier (`tier`, tier_kernels.py) an evicted row is written there with its optimizer
    state, count and clock, and a key absent from memory but on disk comes back into a row, in
    every mode. A read-only lookup of such a store may thus evict, so it marks every row it
    returns as used by this call (stamp, LRU position), as a training lookup does, so that the
    call cannot evict a row it has already returned; it still leaves access counts alone."""
    meta = icfg[IC_META]
    kcol = meta // 2
    width = rows.shape[1]
    lfu = icfg[IC_POLICY] == POLICY_LFU
    row_bits = icfg[IC_ROW_BITS]
    tags = _tag_mask(row_bits)
    admit_all = icfg[IC_MIN_FREQ] <= 1 and fcfg[FC_ADMIT_PROB] >= 1.0  # no admission roll to make
    tiered = has_tier(tier)
    relinks = not lfu and (mode != MODE_FIND or tiered)  # the call's uses move rows in the LRU order
    s0 = parts[p, PT_SLOT_START]
    ns = parts[p, PT_SLOT_COUNT]
    n = hi - lo
    ukeys = np.empty(n, np.uint64)
    uhash = np.empty(n, np.uint64)
    mult = np.empty(n, np.int64)
    local_inverse = np.empty(n, np.int32)
    nd = dedupe(keys, hashes, order, lo, hi, ukeys, uhash, mult, local_inverse)
    row_of = np.empty(nd, np.int32)  # distinct key -> row (-1: absent / not admitted)
    slot_of = np.empty(nd, np.int32)  # distinct key -> unique index (-1 likewise)
    guess_of = np.empty(nd, np.int32)  # the row each key's tag points at, read once for the prefetches
    pend = np.empty(nd, np.int32)  # distinct keys waiting for the row of an eviction
    npend = 0
    nuniq = 0
    for u in range(nd):
        ahead = u + PREFETCH_SLOT
        if ahead < nd:
            prefetch_row(index, s0 + scale32(uhash[ahead], ns))
        ahead = u + PREFETCH_ROW
        if ahead < nd:  # the row of the first entry whose tag matches: the key's own, but for a tag clash
            h = uhash[ahead]
            tag = _tag(h, row_bits)
            s = scale32(h, ns)
            e = np.int64(index[s0 + s])
            while e >= 0 and (e & tags) != tag:  # written out: an inlined _probe would take reference counts here
                s = s + 1 if s + 1 < ns else 0
                e = np.int64(index[s0 + s])
            guess = _entry_row(e, row_bits)
            guess_of[ahead] = guess
            if guess >= 0:
                prefetch_row(r32, guess)
                prefetch_row(rows, guess)
                if width > LINE_FLOATS:  # the optimizer state's line too, for the update
                    prefetch_cell(rows, guess, width - 1)
        key = ukeys[u]
        h = uhash[u]
        slot = _probe(index, r64, kcol, key, s0, ns, h, row_bits)
        r = _entry_row(index[slot], row_bits)
        if r < 0:
            on_disk = tier_find(tier, p, key, h) if tiered and maybe_on_disk(tier, p, key) else np.int64(-1)
            if on_disk < 0 and (mode == MODE_FIND or (mode == MODE_TRAIN and not admit_all and not _admit_any(
                    key, seed, mult[u], parts, p, icfg, fcfg, sketch))):
                row_of[u] = -1
                slot_of[u] = -1
                continue
            size = parts[p, PT_SIZE]
            if size < parts[p, PT_ROW_COUNT]:
                r = parts[p, PT_ROW_START] + size
                parts[p, PT_SIZE] = size + 1
                if size + FRONTIER_AHEAD < parts[p, PT_ROW_COUNT]:  # rows are taken in order: own the next
                    ahead = r + FRONTIER_AHEAD
                    prefetch_cell_for_write(rows, ahead, 0)
                    if width > LINE_FLOATS:
                        prefetch_cell_for_write(rows, ahead, width - 1)
                    prefetch_cell_for_write(r32, ahead, 0)
                if on_disk >= 0:
                    _row_from_disk(p, r, key, h, slot, on_disk, rows, r32, r64, index, parts, icfg, tier)
                else:
                    _new_row(p, r, key, h, slot, rows, r32, r64, index, parts, icfg, fcfg, seed)
            else:  # full: the row comes from an eviction once every key is probed
                pend[npend] = u
                npend += 1
        else:
            if tiered:
                tier[3][p, TP_HITS] += 1
        if r >= 0:
            _mark_use(r32, meta, parts, p, r, mode, tiered, mult[u], epoch, ubase + nuniq)
        uniq_rows[ubase + nuniq] = r
        row_of[u] = r
        slot_of[u] = ubase + nuniq
        nuniq += 1
    err = 0
    if npend > 0:
        if not lfu and parts[p, PT_LRU_KEPT] == 0:  # the first eviction of this partition
            link_lru_from_stamps(lru_log, r32, meta, parts, p, epoch)
        victims = np.empty(0 if lfu else npend, np.int64)
        vhash = np.empty(0 if lfu else npend, np.uint64)
        err = _evict_for(p, pend, npend, ukeys, uhash, mult, slot_of, row_of, rows, r32, r64, index, parts, icfg,
                         fcfg, seed, epoch, mode, uniq_rows, tier, lru_log, victims, vhash)
    if relinks and parts[p, PT_LRU_KEPT] == 1:  # the call's rows, most recent at the end of the ring
        base, ring = log_span(parts, p)
        _log_room(lru_log, base, ring, r32, meta, parts, p, nuniq, epoch)
        for i in range(nuniq):
            r = uniq_rows[ubase + i]
            if r >= 0:
                _log_append(lru_log, base, ring, r32, meta, parts, p, r)
    if tiered:
        tier[3][p, TP_LOOKUPS] += nd
    if err != 0:
        return nuniq, err
    use_order = order.shape[0] > 0
    base = np.uint64(lo)
    for jj in range(n):  # unsigned indices: no negative-index wrap per access (see dedupe)
        j = np.uint64(jj)
        i = np.uint64(order[base + j]) if use_order else base + j
        u = np.uint64(local_inverse[j])
        out_rows[i] = row_of[u]
        inverse[i] = slot_of[u]
    return nuniq, 0


@njit(cache=True, nogil=True, parallel=True)
def lookup_parallel(keys, hashes, order, starts, rows, r32, r64, index, parts, sketch, icfg, fcfg,
                    seed, epoch, mode, out_rows, inverse, uniq_rows, nuniq, errors, tier, lru_log):
    """All partitions at once, one per thread; unique rows of p land at uniq_rows[starts[p]:]."""
    for p in prange(parts.shape[0]):
        n, err = _lookup_partition(p, keys, hashes, order, starts[p], starts[p + 1], rows, r32, r64,
                                   index, parts, sketch, icfg, fcfg, seed, epoch, mode, out_rows,
                                   inverse, uniq_rows, starts[p], tier, lru_log)
        nuniq[p] = n
        errors[p] = err


@njit(cache=True, nogil=True)
def lookup_serial(keys, rows, r32, r64, index, parts, sketch, icfg, fcfg, seed, epoch,
                  mode, out_rows, inverse, uniq_rows, tier, lru_log):
    """One partition: the common single-thread path, no reordering (dedupe hashes the keys)."""
    return _lookup_partition(0, keys, np.empty(0, np.uint64), np.empty(0, np.int64), 0, keys.shape[0], rows, r32,
                             r64, index, parts, sketch, icfg, fcfg, seed, epoch, mode, out_rows,
                             inverse, uniq_rows, 0, tier, lru_log)


@njit(cache=True, nogil=True)
def compact_unique(starts, nuniq, part_of, uniq_rows, inverse):
    """Close the gaps between partitions' unique ranges; returns the total number of unique rows."""
    nparts = nuniq.shape[0]
    shift = np.zeros(nparts, dtype=np.int64)
    total = 0
    for p in range(nparts):
        shift[p] = starts[p] - total
        for u in range(nuniq[p]):
            uniq_rows[total + u] = uniq_rows[starts[p] + u]
        total += nuniq[p]
    for i in range(inverse.shape[0]):
        if inverse[i] >= 0:
            inverse[i] -= shift[part_of[i]]
    return total


# ---------------------------------------------------------------- forward / backward

@njit(inline="always")
def _pool_scale(n, mode):
    if n > 1 and mode != 0:
        return np.float32(1.0 / n) if mode == 1 else np.float32(1.0 / np.sqrt(n))
    return np.float32(1.0)


@njit(inline="always")
def _can_stream(rows, out):
    """Whether gather_pool may write out[b, col] rows with `stream_line`: whole 64-byte lines
    (dim a multiple of 16), every row starting on a line boundary, both last dimensions contiguous."""
    return (out.shape[2] % LINE_FLOATS == 0 and out.strides[2] == 4 and rows.strides[1] == 4
            and out.ctypes.data % CACHE_LINE == 0 and out.strides[0] % CACHE_LINE == 0
            and out.strides[1] % CACHE_LINE == 0)


@njit(cache=True, nogil=True)
def pool_bag(rows, row_ids, start, end, mode, out, b, col):
    """out[b, col] = pool(rows[row_ids[start:end]]) with plain stores; mode 0 sum, 1 mean, 2
    sqrt-n. Missing rows (-1: absent or not admitted) read as zeros."""
    dim = out.shape[2]
    if end - start == 1:  # one-hot: a copy
        r = row_ids[start]
        if r >= 0:
            for d in range(dim):
                out[b, col, d] = rows[r, d]
        else:
            for d in range(dim):
                out[b, col, d] = 0.0
        return
    for d in range(dim):
        out[b, col, d] = 0.0
    for i in range(start, end):
        r = row_ids[i]
        if r >= 0:
            for d in range(dim):
                out[b, col, d] += rows[r, d]
    scale = _pool_scale(end - start, mode)
    if scale != 1.0:
        for d in range(dim):
            out[b, col, d] *= scale


@njit(cache=True, nogil=True)
def gather_pool(rows, row_ids, offsets, mode, out, col):
    """out[b, col] = pool(rows[row_ids[offsets[b]:offsets[b+1]]]) for every bag b (`pool_bag`).
    `out` is [B, C, dim] (C-contiguous, so the inner copy vectorises). One-hot bags of a table
    whose dim is a multiple of 16 are copied with non-temporal stores when the layout allows
    (cache_hints.py)."""
    dim = out.shape[2]
    nb = out.shape[0]
    stream = _can_stream(rows, out)
    for b in range(nb):
        ahead = offsets[min(b + PREFETCH_ROW, nb)]
        if ahead < row_ids.shape[0] and row_ids[ahead] >= 0:
            prefetch_row(rows, row_ids[ahead])
        start = offsets[b]
        end = offsets[b + 1]
        if stream and end - start == 1 and row_ids[start] >= 0:
            for line in range(dim // LINE_FLOATS):
                stream_line(out, b, col, rows, row_ids[start], line)
        else:
            pool_bag(rows, row_ids, start, end, mode, out, b, col)
    if stream:
        store_fence()


@njit(cache=True, nogil=True)
def gather_rows(rows, row_ids, out):
    """out[i] = rows[row_ids[i], :dim] (zeros for -1): the unpooled form."""
    dim = out.shape[1]
    for i in range(row_ids.shape[0]):
        r = row_ids[i]
        if r >= 0:
            for d in range(dim):
                out[i, d] = rows[r, d]
        else:
            for d in range(dim):
                out[i, d] = 0.0


@njit(cache=True, nogil=True)
def scatter_pooled_grad(grad, col, inverse, offsets, mode, ugrad):
    """Accumulate the gradient of pooled outputs grad[:, col] ([B, C, dim]) onto unique rows:
    the transpose of gather_pool. NaN/inf propagate into ugrad, where callers check for them."""
    dim = grad.shape[2]
    for b in range(grad.shape[0]):
        start = offsets[b]
        end = offsets[b + 1]
        scale = _pool_scale(end - start, mode)
        for i in range(start, end):
            u = inverse[i]
            if u >= 0:
                for d in range(dim):
                    ugrad[u, d] += scale * grad[b, col, d]


@njit(cache=True, nogil=True)
def scatter_rows_grad(grad, inverse, ugrad):
    """Accumulate per-ID gradients onto unique rows (equal keys sum)."""
    dim = grad.shape[1]
    for i in range(grad.shape[0]):
        u = inverse[i]
        if u >= 0:
            for d in range(dim):
                ugrad[u, d] += grad[i, d]


_F32_EXPONENT = np.uint32(0x7F800000)  # all ones in a float32's exponent: inf or NaN


@njit(cache=True, nogil=True)
def all_finite(x):
    """Whether a C-contiguous float32 array holds no NaN or inf. A branch-free maximum of the
    exponent bits, which LLVM vectorises (a loop that stops at the first bad value stays scalar)."""
    bits = x.reshape(-1).view(np.uint32)
    worst = np.uint32(0)
    for i in range(bits.shape[0]):
        worst = max(worst, bits[i] & _F32_EXPONENT)
    return worst < _F32_EXPONENT


# ---------------------------------------------------------------- fused optimizer updates

@njit(inline="always")
def _f32(x):
    return np.float64(np.float32(x))


@njit(cache=True, nogil=True, error_model="numpy")
def apply_updates(rows, r32, r64, uniq_rows, uniq_keys, ugrad, icfg, fcfg, opt, params, step):
    """Apply one optimizer step to each unique row whose key is still the one looked up.

    Rows evicted (and reused by another key) since the lookup are skipped and counted: their
    gradient belongs to a key that is no longer in memory. Returns the number skipped.
    """
    dim = icfg[IC_DIM]
    meta = icfg[IC_META]
    kcol = meta // 2
    width = rows.shape[1]
    wd = fcfg[FC_WEIGHT_DECAY]
    bound = fcfg[FC_WEIGHT_BOUND]
    lr = params[P_LR]
    a = params[P_A]
    b = params[P_B]
    c = params[P_C]
    adam_step = 0.0
    if opt == OPT_ADAGRAD:
        lr = lr / (1.0 + (step - 1) * b)
    elif opt == OPT_ADAM:  # torch.optim.SparseAdam: lr * sqrt(1 - b2^t) / (1 - b1^t)
        adam_step = lr * np.sqrt(1.0 - b ** step) / (1.0 - a ** step)
    lr32 = np.float32(lr)
    eps32 = np.float32(a)
    wd32 = np.float32(wd)
    bound32 = np.float32(bound)
    skipped = 0
    nu = uniq_rows.shape[0]
    for u in range(nu):
        if u + PREFETCH_ROW < nu:  # the row's weight and state lines, and its metadata
            ahead = uniq_rows[u + PREFETCH_ROW]
            if ahead >= 0:
                prefetch_row(rows, ahead)
                if width > LINE_FLOATS:
                    prefetch_cell(rows, ahead, width - 1)
                prefetch_row(r32, ahead)
        r = uniq_rows[u]
        if r < 0 or r64[r, kcol] != uniq_keys[u]:
            skipped += 1
            continue
        # one branch-free loop per optimizer so that LLVM vectorises across the row; float32
        # rounding at the points where torch materialises a float32 tensor. error_model="numpy":
        # with numba's default ("python") every float division checks for zero and may raise,
        # a branch that would keep these loops scalar. A zero denominator (eps = 0 and a zero accumulator) gives NaN, as torch does.
        if opt == OPT_ADAGRAD:  # float32 throughout, in torch's order: w + (-lr * g) / (sqrt(acc) + eps)
            for d in range(dim):
                w32 = rows[r, d]
                g32 = ugrad[u, d] + wd32 * w32
                acc32 = rows[r, dim + d] + g32 * g32
                rows[r, dim + d] = acc32
                rows[r, d] = min(max(w32 - (lr32 * g32) / (np.sqrt(acc32) + eps32), -bound32), bound32)
        elif opt == OPT_SGD:
            for d in range(dim):
                w = np.float64(rows[r, d])
                g = _f32(np.float64(ugrad[u, d]) + wd * w)
                if a > 0.0:
                    buf = _f32(a * rows[r, dim + d] + g)
                    rows[r, dim + d] = buf
                    g = _f32(g + a * buf) if b > 0.0 else buf
                rows[r, d] = min(max(w - lr * g, -bound), bound)
        elif opt == OPT_ADAM:
            for d in range(dim):
                w = np.float64(rows[r, d])
                g = _f32(np.float64(ugrad[u, d]) + wd * w)
                m = _f32(a * rows[r, dim + d] + (1.0 - a) * g)
                v = _f32(b * rows[r, dim + dim + d] + (1.0 - b) * g * g)
                rows[r, dim + d] = m
                rows[r, dim + dim + d] = v
                rows[r, d] = min(max(w - adam_step * m / _f32(np.sqrt(v) + c), -bound), bound)
        else:  # FTRL-Proximal: state z at dim+d, n at 2*dim+d; a=l1, b=l2, c=beta
            for d in range(dim):
                w = np.float64(rows[r, d])
                g = _f32(np.float64(ugrad[u, d]) + wd * w)
                n_old = np.float64(rows[r, dim + dim + d])
                n_new = _f32(n_old + g * g)
                sigma = (np.sqrt(n_new) - np.sqrt(n_old)) / lr
                z = _f32(rows[r, dim + d] + g - sigma * w)
                rows[r, dim + d] = z
                rows[r, dim + dim + d] = n_new
                if abs(z) <= a:
                    w = 0.0
                else:
                    sign = 1.0 if z > 0 else -1.0
                    w = -(z - sign * a) / ((c + np.sqrt(n_new)) / lr + b)
                rows[r, d] = min(max(w, -bound), bound)
        r32[r, meta + M_CLOCK] += 1
    return skipped


# ---------------------------------------------------------------- expiry

@njit(cache=True, nogil=True)
def expire_rows(rows, r32, r64, index, parts, icfg, last_stamp, lru_log):
    """Drop every live row whose last training use (stamp) is at or before lookup call
    `last_stamp`; returns how many. A partition's rows stay contiguous: the hole a dropped row
    leaves takes the partition's last row (its data, metadata, index entry and LRU links move
    with it), so row numbers change, and no lookup may be in flight across a call."""
    meta = icfg[IC_META]
    kcol = meta // 2
    row_bits = icfg[IC_ROW_BITS]
    lfu = icfg[IC_POLICY] == POLICY_LFU
    width = rows.shape[1]
    dropped = 0
    for p in range(parts.shape[0]):
        start = parts[p, PT_ROW_START]
        s0 = parts[p, PT_SLOT_START]
        ns = parts[p, PT_SLOT_COUNT]
        linked = not lfu and parts[p, PT_LRU_KEPT] == 1
        i = 0
        while i < parts[p, PT_SIZE]:
            r = start + i
            if r32[r, meta + M_STAMP] > last_stamp:
                i += 1
                continue
            key = r64[r, kcol]
            _index_delete(index, r64, kcol, _probe(index, r64, kcol, key, s0, ns, index_hash(key), row_bits),
                          s0, ns, row_bits)
            r32[r, meta + M_LOG_AT] = -1  # its ring entry, if any, is stale from now on
            last = start + parts[p, PT_SIZE] - 1
            parts[p, PT_SIZE] -= 1
            dropped += 1
            if last == r:
                continue
            moved = r64[last, kcol]
            h = index_hash(moved)
            slot = _probe(index, r64, kcol, moved, s0, ns, h, row_bits)
            for j in range(width):
                rows[r, j] = rows[last, j]
            for j in range(META_WIDTH):
                r32[r, meta + j] = r32[last, meta + j]
            index[slot] = _entry(r, h, row_bits, slot - s0, ns)
            at = r32[r, meta + M_LOG_AT]
            base = log_span(parts, p)[0]
            if linked and at >= 0 and lru_log[base + at] == last:  # the moved row's ring entry names its new row
                lru_log[base + at] = r
            # row r now holds the moved row: look at it again
    return dropped


# ---------------------------------------------------------------- repair and rebuild

@njit(cache=True, nogil=True)
def rebuild_index(r64, index, parts, meta, row_bits):
    """Re-insert every live row's key into the slots the partitions use (after the index grew,
    rows were loaded, or an interrupted update is repaired). Slots past them are not touched."""
    kcol = meta // 2
    for p in range(parts.shape[0]):
        s0 = parts[p, PT_SLOT_START]
        ns = parts[p, PT_SLOT_COUNT]
        index[s0:s0 + ns] = -1
        start = parts[p, PT_ROW_START]
        for r in range(start, start + parts[p, PT_SIZE]):
            key = r64[r, kcol]
            h = index_hash(key)
            slot = _probe(index, r64, kcol, key, s0, ns, h, row_bits)
            if index[slot] >= 0:
                return r  # a duplicate key: the rows are not a valid store
            index[slot] = _entry(r, h, row_bits, slot - s0, ns)
    return -1

