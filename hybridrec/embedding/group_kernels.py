"""Kernels that serve many tables in one call: probe + pool for a whole batch, and gradient
scatter + fused update for a whole batch.

The collection's fast path. With one store per feature, calling the per-table kernels costs
four Python round trips per table per step; here a batch costs two calls whatever the number
of tables, and with more than one numba thread the tables are served in parallel (Persia's
per-thread subsets, here one table per task). Each table's arrays arrive as one row of an address
table (table_arrays.py); table t serves the feature at positions[t] of the batch, whose keys
(feature-major, so contiguous) are the segment [spans[SPAN_LO, t], spans[SPAN_HI, t]) and whose
samples' offsets start at spans[SPAN_BASE, t]; its unique rows occupy
uniq_rows[spans[SPAN_LO, t] : spans[SPAN_LO, t] + nuniq[t]]. The forward kernel works the spans out
from the offsets, so no numpy index operations run in Python per step, and the backward kernel
reads them back. The probe, the pooling and the update are the per-table kernels of kernels.py,
so both paths compute the same values.
"""
import numpy as np
from numba import njit, prange

from . import kernels as K
from .tier_kernels import no_tier
from .cache_hints import prefetch_cell
from .table_arrays import index_of, lru_log_of, meta64_of, meta_of, parts_of, rows_of, scalars_of, sketch_of

# samples ahead whose gradient line the backward scatter prefetches: far enough ahead that the
# strided lines arrive in time
GRAD_AHEAD = 32
NEEDS_SERVICE = -1  # lookup_pool_tables: a table's index must grow or its epoch restart first
SPAN_LO, SPAN_HI, SPAN_BASE = 0, 1, 2  # rows of `spans`: first key, end of keys, first sample offset


@njit(cache=True, nogil=True)
def segments_need_service(tables, mode, rooms, seg_lo, seg_hi):
    """Whether some table must be serviced before its segment keys[seg_lo[t]:seg_hi[t]] is probed:
    its epoch count is at its limit, or (in a mode that inserts) the segment could take its index
    past rooms[t] keys."""
    for tp in range(seg_lo.shape[0]):
        t = np.int64(tp)
        if scalars_of(tables, t)[K.SC_EPOCH] >= K.EPOCH_LIMIT:
            return True
        if mode != K.MODE_FIND and parts_of(tables, t)[0, K.PT_SIZE] + (seg_hi[t] - seg_lo[t]) > rooms[t]:
            return True
    return False


@njit(cache=True, nogil=True)
def probe_segment(tables, t, keys, unhashed, order, lo, hi, icfg, fcfg, seeds, mode, out_rows, inverse, uniq_rows,
                  uniq_keys, nuniq):
    """Probe table t's store with its segment of keys (positions lo..hi, through `order` when it is
    not empty) under a new epoch: out_rows, inverse and the segment's unique rows and keys (at
    uniq_rows[lo:lo + nuniq[t]]) are filled. Returns 0, or the store's error (no evictable row)."""
    meta64 = meta64_of(tables, t)
    scalars = scalars_of(tables, t)
    scalars[K.SC_EPOCH] += 1
    scalars[K.SC_DIRTY] = 1
    n, err = K._lookup_partition(0, keys, unhashed, order, lo, hi, rows_of(tables, t), meta_of(tables, t), meta64,
                                 index_of(tables, t), parts_of(tables, t), sketch_of(tables, t), icfg[t], fcfg[t],
                                 seeds[t], scalars[K.SC_EPOCH], mode, out_rows, inverse, uniq_rows, lo, no_tier(),
                                 lru_log_of(tables, t))
    scalars[K.SC_DIRTY] = 0
    if err != 0:
        return err
    nuniq[t] = n
    for u in range(lo, lo + n):
        uniq_keys[u] = meta64[uniq_rows[u], 0]
    return 0


@njit(cache=True, nogil=True, parallel=True)
def lookup_pool_tables(keys, sample_offsets, positions, batch_size, tables, icfg, fcfg, seeds, pool_modes, mode,
                       rooms, out_rows, inverse, uniq_rows, uniq_keys, spans, nuniq, out, pool):
    """Fill `spans` [3, tables] from the offsets, probe every table's segment, then, with `pool`,
    pool it into out[:, t, :] (without, `pool_tables` does that later). Returns 0, or t + 1 for the first table t that ran out of evictable rows,
    or NEEDS_SERVICE, having changed nothing, when a table's epoch count is at its limit or (in
    a mode that inserts) its segment could take its index past rooms[t] keys: the caller grows
    the index or restarts the epoch count (store.make_index_room,
    store.restart_epoch_count_if_due) and calls again. Checked here, these conditions cost no
    Python per table and step."""
    ntab = positions.shape[0]
    for t in range(ntab):
        base = positions[t] * batch_size
        spans[SPAN_BASE, t] = base
        spans[SPAN_LO, t] = sample_offsets[base]
        spans[SPAN_HI, t] = sample_offsets[base + batch_size]
    seg_lo = spans[SPAN_LO]
    seg_hi = spans[SPAN_HI]
    if segments_need_service(tables, mode, rooms, seg_lo, seg_hi):
        return NEEDS_SERVICE
    empty = np.empty(0, np.int64)
    failed = np.zeros(ntab, np.int64)
    unhashed = np.empty(0, np.uint64)  # dedupe hashes each key as it reads it
    for tp in prange(ntab):
        t = np.int64(tp)
        failed[t] = probe_segment(tables, t, keys, unhashed, empty, seg_lo[t], seg_hi[t], icfg, fcfg, seeds, mode,
                                  out_rows, inverse, uniq_rows, uniq_keys, nuniq)
        if failed[t] == 0 and pool:
            base = spans[SPAN_BASE, t]
            K.gather_pool(rows_of(tables, t), out_rows, sample_offsets[base:base + batch_size + 1], pool_modes[t],
                          out, t)
    for t in range(ntab):
        if failed[t]:
            return t + 1
    return 0


@njit(cache=True, nogil=True, parallel=True)
def backward_tables(grad, inverse, spans, sample_offsets, batch_size, tables, uniq_rows, uniq_keys, nuniq, ugrad,
                    icfg, fcfg, opt_codes, opt_params, pool_modes, dropped):
    """Sum every table's pooled gradient onto its unique rows, then apply each table's optimizer.
    Refuses the whole batch (returns False, no row changed) if a gradient is NaN or inf."""
    ntab = spans.shape[1]
    seg_lo = spans[SPAN_LO]
    # table-major, so each table's unique rows (tens of KB) stay in L1/L2 while its gradient is
    # summed; the [B, T, dim] gradient is then read with a stride of T*dim floats, which hardware
    # prefetch does not follow, so its lines are prefetched GRAD_AHEAD samples ahead. Sample-major
    # streamed the gradient but scattered over every table's unique rows at once (megabytes).
    # No zeroing pass: a table's unique rows are numbered in the order their keys first appear
    # (lookup_pool_tables), which is the order this loop meets them, so the first sighting of
    # each writes its row and later ones add, which saves clearing them first (a memset).
    covered = np.empty(ntab, np.int64)
    for tp in prange(ntab):
        t = np.int64(tp)
        base = spans[SPAN_BASE, t]
        scale_mode = pool_modes[t]
        first_unseen = seg_lo[t]
        for b in range(batch_size):
            if b + GRAD_AHEAD < batch_size:
                prefetch_cell(grad, b + GRAD_AHEAD, t)
            start = sample_offsets[base + b]
            end = sample_offsets[base + b + 1]
            scale = K._pool_scale(end - start, scale_mode)
            for i in range(start, end):
                u = inverse[i]
                if u == first_unseen:
                    for d in range(ugrad.shape[1]):
                        ugrad[u, d] = scale * grad[b, t, d]
                    first_unseen += 1
                elif u >= 0:
                    for d in range(ugrad.shape[1]):
                        ugrad[u, d] += scale * grad[b, t, d]
        covered[t] = first_unseen - seg_lo[t]
    for t in range(ntab):
        if covered[t] != nuniq[t]:
            raise AssertionError("backward_tables: unique rows not numbered in first-seen order")
    finite = np.ones(ntab, np.bool_)
    for t in prange(ntab):  # a NaN/inf gradient reaches the sum of its row
        finite[t] = K.all_finite(ugrad[seg_lo[t]:seg_lo[t] + nuniq[t]])
    if not finite.all():
        return False
    for tp in prange(ntab):
        t = np.int64(tp)
        lo = seg_lo[t]
        n = nuniq[t]
        scalars = scalars_of(tables, t)
        scalars[K.SC_STEP] += 1
        scalars[K.SC_DIRTY] = 1
        dropped[t] = K.apply_updates(rows_of(tables, t), meta_of(tables, t), meta64_of(tables, t),
                                     uniq_rows[lo:lo + n], uniq_keys[lo:lo + n],
                                     ugrad[lo:lo + n], icfg[t], fcfg[t], opt_codes[t], opt_params[t],
                                     scalars[K.SC_STEP])
        scalars[K.SC_DROPPED] += dropped[t]
        scalars[K.SC_DIRTY] = 0
    return True


@njit(cache=True, nogil=True, parallel=True)
def pool_tables(inverse, uniq_rows, spans, sample_offsets, batch_size, tables, pool_modes, row_ids, out):
    """Pool into out[:, t, :] every table's samples of a batch `lookup_pool_tables` probed
    without pooling, from the rows as they are now. `row_ids` (one per key) is scratch."""
    for tp in prange(spans.shape[1]):
        t = np.int64(tp)
        for i in range(spans[SPAN_LO, t], spans[SPAN_HI, t]):  # each key's row
            u = inverse[i]
            row_ids[i] = uniq_rows[u] if u >= 0 else -1
        base = spans[SPAN_BASE, t]
        K.gather_pool(rows_of(tables, t), row_ids, sample_offsets[base:base + batch_size + 1], pool_modes[t], out, t)


@njit(cache=True, nogil=True)
def count_shared_rows(prev_uniq_rows, prev_spans, prev_nuniq, uniq_rows, spans, nuniq, tables, icfg):
    """Rows of the previous batch that this batch also reads, over the tables. A row is this
    batch's when its metadata slot (this batch's lookup wrote it) names a unique position of this
    batch holding that very row."""
    shared = 0
    for t in range(spans.shape[1]):
        lo = spans[SPAN_LO, t]
        n = nuniq[t]
        slot_col = icfg[t, K.IC_META] + K.M_SLOT
        r32 = meta_of(tables, t)
        plo = prev_spans[SPAN_LO, t]
        for u in range(plo, plo + prev_nuniq[t]):
            r = prev_uniq_rows[u]
            if r >= 0:
                s = r32[r, slot_col]
                if lo <= s < lo + n and uniq_rows[s] == r:
                    shared += 1
    return shared
