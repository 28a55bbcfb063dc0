"""Numba kernels of the disk tier: an open-addressing hash table of rows in a file.

The tier's file is one array of fixed-size records, mapped with numpy.memmap; `disk_tier.py` owns
the file and the mapping, these kernels read and write the records. A record is int32 columns:
key (uint64, columns 0-1) | used flag | access count | clock | pad | the row's float32 values
(embedding and optimizer state, as in the memory tier). The records are split in regions, one per
partition of the memory tier, so that the partitions' threads never write the same region; in a
region a key's home record is `scale32(index_hash(key), slots)` and collisions probe forward
(linear probing), with backward-shift deletion and no tombstones.

Writes keep every record readable at every instant, so a process killed in the middle of one
(kill -9: the writes already made are in the page cache) leaves at worst a key held twice with
the same row, or a record off its probe run; `rebuild_regions` (run when the tier's dirty flag
is found set) repairs both. A record's data is written before its used flag is set, and a moved
record is complete at its new place before its old place is cleared.

`tier` below is the tuple (rec32, rec64, recf, tparts, tdirty, seen): the same records as int32,
uint64 and float32 views, the regions' bookkeeping (int64 [nparts, TP_WIDTH]), one byte per
chunk of CHUNK_SLOTS records that is set when the chunk changes (incremental checkpoints copy
only those), and `seen`, a bitmap in memory with one bit set for the hash of every key ever
written to the tier: a key whose bit is clear was never on disk, so the lookup of a new key
reads no record (a record read is a page of the file). A store without a tier passes
`no_tier()`, whose arrays are empty.
"""
import numpy as np
from numba import njit

from .hashing import index_hash, scale32, stays_in_run

R_KEY, R_USED, R_COUNT, R_CLOCK = 0, 2, 3, 4  # int32 columns of a record (the key spans 0-1)
R_PAD = 5  # always 0 (a read-ahead writes it to fault the record's page in writable: read_ahead.py)
R_ROW = 6  # first float32 column of the row
# tparts[p, *]
TP_SLOT_START, TP_SLOT_COUNT, TP_SIZE, TP_CAPACITY = 0, 1, 2, 3
TP_SPILLED, TP_PROMOTED, TP_DROPPED, TP_LOOKUPS, TP_HITS = 4, 5, 6, 7, 8
TP_WIDTH = 12
LOAD_FACTOR = 0.75  # at most this many rows per record slot of a region
CHUNK_SLOTS = 1 << 12  # records per chunk of the dirty map (and per file of a checkpoint's tier)


def record_width(row_width: int) -> int:
    """int32 columns of a record holding a row of `row_width` floats (even, for the uint64 view)."""
    width = R_ROW + row_width
    return width + (width & 1)


@njit(cache=True)
def no_tier():
    """The `tier` argument of a store without a disk tier (callable from kernels too)."""
    return (np.empty((0, 2), np.int32), np.empty((0, 1), np.uint64), np.empty((0, 2), np.float32),
            np.empty((0, TP_WIDTH), np.int64), np.empty(0, np.uint8), np.empty(0, np.uint64))


def seen_words(capacity_rows: int, nparts: int) -> int:
    """uint64 words of the `seen` bitmap: a section per partition (its lookup thread sets bits
    only there: a bit set by one thread cannot undo another's), each 16 bits per row of the
    partition's share of the tier (a key never on disk then passes for one in 1 - e^(-1/16),
    about 6%, with the tier full), a power of two, at most 8 MiB in all."""
    share = -(-capacity_rows // nparts)
    bits = 1 << max(6, min(26 - (nparts - 1).bit_length(), (share * 16 - 1).bit_length()))
    return bits // 64 * nparts


@njit(inline="always")
def _seen_bit(seen, p, nparts, key):
    """(word, mask) of `key`'s bit, in partition p's section of the bitmap."""
    words = seen.shape[0] // nparts
    h = index_hash(key)
    bit = (h ^ (h >> np.uint64(29))) & np.uint64(words * 64 - 1)
    return p * words + np.int64(bit >> np.uint64(6)), np.uint64(1) << (bit & np.uint64(63))


@njit(inline="always")
def maybe_on_disk(tier, p, key):
    """False when `key`, of partition p, was never written to the tier (its `seen` bit is clear)."""
    word, mask = _seen_bit(tier[5], p, tier[3].shape[0], key)
    return (tier[5][word] & mask) != 0


@njit(inline="always")
def _note_seen(tier, p, key):
    word, mask = _seen_bit(tier[5], p, tier[3].shape[0], key)
    tier[5][word] |= mask


@njit(cache=True, nogil=True)
def fill_seen(tier):
    """Set the `seen` bit of every key on the tier (when it is opened again)."""
    rec32, rec64, tparts = tier[0], tier[1], tier[3]
    for p in range(tparts.shape[0]):
        for s in range(tparts[p, TP_SLOT_START], tparts[p, TP_SLOT_START] + tparts[p, TP_SLOT_COUNT]):
            if rec32[s, R_USED] != 0:
                _note_seen(tier, p, rec64[s, 0])


@njit(inline="always")
def has_tier(tier):
    return tier[3].shape[0] > 0


@njit(inline="always")
def _first_touch(rec32, slot):
    """Write the pad column (always 0) of a record before reading it: if its page is not mapped,
    the write fault maps that page alone, writable, where a read fault would map up to 16
    cached pages around it (the kernel's fault-around), each counting in the RSS, and the write
    that follows would fault again."""
    rec32[slot, R_PAD] = 0


@njit(cache=True, nogil=True)
def tier_find(tier, p, key, h):
    """Record slot of `key` in region p, or -1."""
    rec32, rec64 = tier[0], tier[1]
    s0 = tier[3][p, TP_SLOT_START]
    ns = tier[3][p, TP_SLOT_COUNT]
    s = scale32(h, ns)
    _first_touch(rec32, s0 + s)
    while True:
        if rec32[s0 + s, R_USED] == 0:
            return np.int64(-1)
        if rec64[s0 + s, 0] == key:
            return s0 + s
        s += 1
        if s == ns:
            s = 0


@njit(inline="always")
def _mark(tier, slot):
    tier[4][slot // CHUNK_SLOTS] = 1


@njit(cache=True, nogil=True)
def _copy_record(rec32, src, dst):
    """Record src into slot dst, its used flag last."""
    for j in range(rec32.shape[1]):
        if j != R_USED:
            rec32[dst, j] = rec32[src, j]
    rec32[dst, R_USED] = 1


@njit(cache=True, nogil=True)
def _delete(tier, p, slot):
    """Free `slot` of region p, shifting later records of its run back (no tombstones). A moved
    record is whole at its new place before its old place is freed."""
    rec32, rec64 = tier[0], tier[1]
    s0 = tier[3][p, TP_SLOT_START]
    ns = tier[3][p, TP_SLOT_COUNT]
    rec32[slot, R_USED] = 0
    _mark(tier, slot)
    hole = slot - s0
    j = hole
    while True:
        j += 1
        if j == ns:
            j = 0
        if rec32[s0 + j, R_USED] == 0:
            break
        if stays_in_run(scale32(index_hash(rec64[s0 + j, 0]), ns), hole, j, ns):
            continue
        _copy_record(rec32, s0 + j, s0 + hole)
        rec32[s0 + j, R_USED] = 0
        _mark(tier, s0 + hole)
        _mark(tier, s0 + j)
        hole = j


@njit(cache=True, nogil=True)
def tier_take(tier, p, slot, rows, r, r32, meta, m_count, m_clock):
    """Move the record at `slot` of region p into memory row r (its values, access count and
    clock) and free the record: the row's next pull found it on disk."""
    rec32, recf = tier[0], tier[2]
    for j in range(rows.shape[1]):
        rows[r, j] = recf[slot, R_ROW + j]
    r32[r, meta + m_count] = rec32[slot, R_COUNT]
    r32[r, meta + m_clock] = rec32[slot, R_CLOCK]
    _delete(tier, p, slot)
    tier[3][p, TP_SIZE] -= 1
    tier[3][p, TP_PROMOTED] += 1


@njit(cache=True, nogil=True)
def _write(tier, p, key, rows, i, count, clock):
    """Write rows[i] with its count and clock as `key`'s record in region p, replacing an older
    copy of the key; False (nothing written) when it would be a new record of a full region."""
    rec32, rec64, recf, tparts = tier[0], tier[1], tier[2], tier[3]
    s0 = tparts[p, TP_SLOT_START]
    ns = tparts[p, TP_SLOT_COUNT]
    s = scale32(index_hash(key), ns)
    _first_touch(rec32, s0 + s)
    while rec32[s0 + s, R_USED] != 0 and rec64[s0 + s, 0] != key:
        s += 1
        if s == ns:
            s = 0
    slot = s0 + s
    fresh = rec32[slot, R_USED] == 0
    if fresh and tparts[p, TP_SIZE] >= tparts[p, TP_CAPACITY]:
        return False
    rec32[slot, R_USED] = 0  # an older copy is unused while rewritten: no half-row is ever read
    rec64[slot, 0] = key
    rec32[slot, R_COUNT] = count
    rec32[slot, R_CLOCK] = clock
    for j in range(rows.shape[1]):
        recf[slot, R_ROW + j] = rows[i, j]
    rec32[slot, R_USED] = 1
    _mark(tier, slot)
    _note_seen(tier, p, key)
    if fresh:
        tparts[p, TP_SIZE] += 1
    return True


@njit(cache=True, nogil=True)
def tier_put(tier, p, key, rows, r, r32, meta, m_count, m_clock):
    """Write memory row r, holding `key`, to region p (the row is being evicted). When the region
    is full the row is dropped and counted (TP_DROPPED), as a store without a tier drops it."""
    if _write(tier, p, key, rows, r, r32[r, meta + m_count], r32[r, meta + m_clock]):
        tier[3][p, TP_SPILLED] += 1
    else:
        tier[3][p, TP_DROPPED] += 1


@njit(cache=True, nogil=True)
def gather_used(rec32, lo, hi, out_slots):
    """Slots in [lo, hi) whose record is used, into out_slots; returns how many."""
    n = 0
    for s in range(lo, hi):
        if rec32[s, R_USED] != 0:
            out_slots[n] = s
            n += 1
    return n


@njit(cache=True, nogil=True)
def insert_records(tier, parts_of_keys, keys, rows, counts, clocks):
    """Put saved rows (keys, float32 rows, counts, clocks) into their regions, replacing a copy
    of the same key; returns how many were dropped for want of room."""
    dropped = 0
    for i in range(keys.shape[0]):
        if not _write(tier, parts_of_keys[i], keys[i], rows, i, counts[i], clocks[i]):
            dropped += 1
    return dropped


@njit(cache=True, nogil=True)
def remove_keys(tier, parts_of_keys, keys):
    """Free the records of `keys` (those present); returns how many were freed."""
    freed = 0
    for i in range(keys.shape[0]):
        p = parts_of_keys[i]
        slot = tier_find(tier, p, keys[i], index_hash(keys[i]))
        if slot >= 0:
            _delete(tier, p, slot)
            tier[3][p, TP_SIZE] -= 1
            freed += 1
    return freed
