"""Numba kernels of the disk tier: a log of row records in a file and a hash index over it.

The tier has two mapped files, each split in regions, one per partition of the memory tier, so
that the partitions' threads never write the same region (`disk_tier.py` owns the files and the
mappings; these kernels read and write them):

* the records (`rec32` and its uint64 / float32 views), fixed-size, int32 columns: key (uint64,
  columns 0-1) | written flag | access count | clock | pad | the row's float32 values (embedding
  and optimizer state, as in the memory tier). A region's records are a ring written in order:
  each row written goes to the next free record at or after the region's head, and the head
  moves past it. So the rows a lookup call evicts land next to one another, on pages the
  call has mapped in ahead (`disk_tier.begin_write`), instead of one record page per row at
  random places in the file;
* the index (uint64 [slots, 2]: key | record number + 1, 0 for an empty entry), an
  open-addressing hash table per region (linear probing from `scale32(index_hash(key), slots)`,
  backward-shift deletion, no tombstones), 16 bytes per slot where a record is a row wide.

A record is live while the index entry of its key points at it; every other record is free
(never written, taken back into memory, or an older copy of its key) and the head writes over
it when it passes. A region's ring has more records than the region's capacity, so the head
finds a free one within a few steps even with the tier full.

Writes keep the tier readable at every instant, so a process killed in the middle of one (kill -9:
the writes already made are in the page cache) leaves at worst a key whose index entry is held
twice (with the same record) or an entry off its probe run; a record is whole before an entry
points at it, an entry is whole before its record number makes it used, a moved entry is whole
at its new place before its old place is cleared. `disk_tier.DiskTier.repair` (run when the
tier's dirty flag is found set) puts every entry whose record holds its key back in place.

`tier` below is the tuple (rec32, rec64, recf, tparts, tdirty, seen, index): the records, the
regions' bookkeeping (int64 [nparts, TP_WIDTH]), one byte per chunk of CHUNK_SLOTS records that is
set when a record of the chunk is written or stops being live (incremental checkpoints copy only
those chunks), `seen`, a bitmap in memory with one bit set for the hash of every key ever written
to the tier (a key whose bit is clear was never on disk, so the lookup of a new key reads no
index entry), and the index. A store without a tier passes `no_tier()`, whose arrays are empty.
"""
import numpy as np
from numba import njit

from .hashing import index_hash, scale32, stays_in_run

R_KEY, R_USED, R_COUNT, R_CLOCK = 0, 2, 3, 4  # int32 columns of a record (the key spans 0-1)
R_PAD = 5  # always 0 (a read-ahead writes it to fault the record's page in writable: read_ahead.py)
R_ROW = 6  # first float32 column of the row
X_KEY, X_RECORD = 0, 1  # uint64 columns of an index entry (X_RECORD: record number + 1; 0: empty)
# tparts[p, *]
TP_SLOT_START, TP_SLOT_COUNT, TP_SIZE, TP_CAPACITY = 0, 1, 2, 3  # index slots of the region, live rows, most rows
TP_SPILLED, TP_PROMOTED, TP_DROPPED, TP_LOOKUPS, TP_HITS = 4, 5, 6, 7, 8
TP_LOG_START, TP_LOG_COUNT, TP_HEAD = 9, 10, 11  # the region's records, and where the next write looks first
TP_WIDTH = 16
LOAD_FACTOR = 0.75  # at most this many rows per index slot, and per record, of a region
CHUNK_SLOTS = 1 << 12  # records per chunk of the dirty map (and per file of a checkpoint's tier)


def record_width(row_width: int) -> int:
    """int32 columns of a record holding a row of `row_width` floats (even, for the uint64 view)."""
    width = R_ROW + row_width
    return width + (width & 1)


@njit(cache=True)
def no_tier():
    """The `tier` argument of a store without a disk tier (callable from kernels too)."""
    return (np.empty((0, 2), np.int32), np.empty((0, 1), np.uint64), np.empty((0, 2), np.float32),
            np.empty((0, TP_WIDTH), np.int64), np.empty(0, np.uint8), np.empty(0, np.uint64),
            np.empty((0, 2), np.uint64))


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
    index, tparts = tier[6], tier[3]
    for p in range(tparts.shape[0]):
        for s in range(tparts[p, TP_SLOT_START], tparts[p, TP_SLOT_START] + tparts[p, TP_SLOT_COUNT]):
            if index[s, X_RECORD] != 0:
                _note_seen(tier, p, index[s, X_KEY])


@njit(inline="always")
def has_tier(tier):
    return tier[3].shape[0] > 0


@njit(inline="always")
def _mark(tier, slot):
    tier[4][slot // CHUNK_SLOTS] = 1


@njit(inline="always")
def _first_touch(rec32, record):
    """Write the pad column (always 0) of a record before reading it: if its page is not mapped,
    the write fault maps that page alone, writable, where a read fault would map up to 16 cached
    pages around it (the kernel's fault-around) and the write that follows would fault again."""
    rec32[record, R_PAD] = 0


@njit(cache=True, nogil=True)
def tier_find(tier, p, key, h):
    """Index slot of `key`'s entry in region p (its record: `index[slot, X_RECORD] - 1`), or -1."""
    index = tier[6]
    s0 = tier[3][p, TP_SLOT_START]
    ns = tier[3][p, TP_SLOT_COUNT]
    s = scale32(h, ns)
    while True:
        if index[s0 + s, X_RECORD] == 0:
            return np.int64(-1)
        if index[s0 + s, X_KEY] == key:
            return s0 + s
        s += 1
        if s == ns:
            s = 0


@njit(cache=True, nogil=True)
def _index_insert(tier, p, key, h, record):
    """An entry for `key` (not in the index) pointing at `record`: its key first, then the record
    number that makes it used."""
    index = tier[6]
    s0 = tier[3][p, TP_SLOT_START]
    ns = tier[3][p, TP_SLOT_COUNT]
    s = scale32(h, ns)
    while index[s0 + s, X_RECORD] != 0:
        s += 1
        if s == ns:
            s = 0
    index[s0 + s, X_KEY] = key
    index[s0 + s, X_RECORD] = np.uint64(record + 1)


@njit(cache=True, nogil=True)
def _index_delete(tier, p, slot):
    """Free index `slot` of region p, shifting later entries of its run back (no tombstones). A
    moved entry is whole at its new place before its old place is freed."""
    index = tier[6]
    s0 = tier[3][p, TP_SLOT_START]
    ns = tier[3][p, TP_SLOT_COUNT]
    index[slot, X_RECORD] = 0
    hole = slot - s0
    j = hole
    while True:
        j += 1
        if j == ns:
            j = 0
        if index[s0 + j, X_RECORD] == 0:
            break
        if stays_in_run(scale32(index_hash(index[s0 + j, X_KEY]), ns), hole, j, ns):
            continue
        index[s0 + hole, X_KEY] = index[s0 + j, X_KEY]
        index[s0 + hole, X_RECORD] = index[s0 + j, X_RECORD]
        index[s0 + j, X_RECORD] = 0
        hole = j


@njit(cache=True, nogil=True)
def _region_of(tparts, n, start):
    """The region whose records (start = TP_LOG_START) or index slots (TP_SLOT_START) hold
    number n, or -1."""
    for p in range(tparts.shape[0]):
        if tparts[p, start] <= n < tparts[p, start] + tparts[p, start + 1]:
            return p
    return -1


@njit(inline="always")
def _live(tier, p, record, key, written):
    """Whether `record` of region p, holding `key` (if `written`), is the live copy of its key."""
    if written == 0:
        return False
    at = tier_find(tier, p, key, index_hash(key))
    return at >= 0 and tier[6][at, X_RECORD] == np.uint64(record + 1)


@njit(cache=True, nogil=True)
def _next_free(tier, p):
    """The first free record of region p at or after its head; the head moves past it. There is
    one: a region holds more records than rows (TP_CAPACITY)."""
    rec32, rec64, tparts = tier[0], tier[1], tier[3]
    start = tparts[p, TP_LOG_START]
    count = tparts[p, TP_LOG_COUNT]
    head = tparts[p, TP_HEAD]
    for _ in range(count):
        record = start + head
        head = head + 1 if head + 1 < count else 0
        _first_touch(rec32, record)  # the record is read, then (mostly) written
        if not _live(tier, p, record, rec64[record, 0], rec32[record, R_USED]):
            tparts[p, TP_HEAD] = head
            return record
    return np.int64(-1)


@njit(cache=True, nogil=True)
def tier_take(tier, p, slot, rows, r, r32, meta, m_count, m_clock):
    """Move the row of index `slot` (tier_find) of region p into memory row r (its values, access
    count and clock) and free its record: the row's next pull found it on disk."""
    rec32, recf = tier[0], tier[2]
    record = np.int64(tier[6][slot, X_RECORD]) - 1
    _first_touch(rec32, record)  # one page mapped, not the 16 around it that a read fault maps
    for j in range(rows.shape[1]):
        rows[r, j] = recf[record, R_ROW + j]
    r32[r, meta + m_count] = rec32[record, R_COUNT]
    r32[r, meta + m_clock] = rec32[record, R_CLOCK]
    _index_delete(tier, p, slot)
    _mark(tier, record)
    tier[3][p, TP_SIZE] -= 1
    tier[3][p, TP_PROMOTED] += 1


@njit(cache=True, nogil=True)
def _write(tier, p, key, rows, i, count, clock):
    """Write rows[i] with its count and clock as `key`'s record in region p, replacing an older
    copy of the key; False (nothing written) when it would be a new row of a full region."""
    rec32, rec64, recf, tparts = tier[0], tier[1], tier[2], tier[3]
    h = index_hash(key)
    at = tier_find(tier, p, key, h) if maybe_on_disk(tier, p, key) else np.int64(-1)
    if at < 0 and tparts[p, TP_SIZE] >= tparts[p, TP_CAPACITY]:
        return False
    record = _next_free(tier, p)
    rec32[record, R_USED] = 0  # a free record: no entry points at it while it is rewritten
    rec64[record, 0] = key
    rec32[record, R_COUNT] = count
    rec32[record, R_CLOCK] = clock
    for j in range(rows.shape[1]):
        recf[record, R_ROW + j] = rows[i, j]
    rec32[record, R_USED] = 1
    _mark(tier, record)
    if at >= 0:  # the entry moves to the new copy in one store; the old record is free from then on
        _mark(tier, np.int64(tier[6][at, X_RECORD]) - 1)
        tier[6][at, X_RECORD] = np.uint64(record + 1)
    else:
        _index_insert(tier, p, key, h, record)
        tparts[p, TP_SIZE] += 1
    _note_seen(tier, p, key)
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
def live_in(tier, records, first):
    """Clear the written flag of every record of `records` (a copy of the file's records from
    record number `first` on) that is not the live copy of its key; returns how many stay."""
    n = 0
    for i in range(records.shape[0]):
        record = first + i
        p = _region_of(tier[3], record, TP_LOG_START)
        key = (np.uint64(np.uint32(records[i, R_KEY + 1])) << np.uint64(32)) | np.uint64(np.uint32(records[i, R_KEY]))
        if p >= 0 and _live(tier, p, record, key, records[i, R_USED]):
            n += 1
        else:
            records[i, R_USED] = 0
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
    """Free the rows of `keys` (those present); returns how many were freed."""
    freed = 0
    for i in range(keys.shape[0]):
        p = parts_of_keys[i]
        slot = tier_find(tier, p, keys[i], index_hash(keys[i]))
        if slot >= 0:
            _mark(tier, np.int64(tier[6][slot, X_RECORD]) - 1)
            _index_delete(tier, p, slot)
            tier[3][p, TP_SIZE] -= 1
            freed += 1
    return freed


@njit(cache=True, nogil=True)
def reindex(tier, old_index, first):
    """Put back the entries of `old_index` (index slots from `first` on, of a tier whose writer
    died mid-write) whose record holds their key, once per key, into the cleared index; returns
    the entries kept."""
    rec32, rec64, tparts = tier[0], tier[1], tier[3]
    kept = 0
    for i in range(old_index.shape[0]):
        if old_index[i, X_RECORD] == 0:
            continue
        p = _region_of(tparts, first + i, TP_SLOT_START)
        key = old_index[i, X_KEY]
        record = np.int64(old_index[i, X_RECORD]) - 1
        if p < 0 or _region_of(tparts, record, TP_LOG_START) != p:
            continue
        if rec32[record, R_USED] == 0 or rec64[record, 0] != key:
            continue
        h = index_hash(key)
        if tier_find(tier, p, key, h) >= 0:  # held twice mid-shift: both entries name the same record
            continue
        _index_insert(tier, p, key, h, record)
        _mark(tier, record)
        tparts[p, TP_SIZE] += 1
        kept += 1
    return kept
