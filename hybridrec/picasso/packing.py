"""Kernels of the model-parallel (sharded) lookup: PICASSO's packed operations on the CPU.

A *pack* is a set of tables of one dim whose features are looked up together (D-packing). Its
features are described by *segments*, ordered table-major: segment s is feature position
`seg_pos[s]` of the batch (whose keys are one contiguous range of the batch's values), pooled
into output column `seg_col[s]`, of pack table `seg_table[s]`; table t owns the segments
`tab_seg[t]:tab_seg[t+1]` (several when features share the table).

One lookup round of a pack, on every rank (W ranks, each the owner of the keys that the global
route hash `hashing.route_one` sends to it):

1. `unique_partition` (PICASSO's fused Unique&Partition): each table's keys deduplicated in
   first-seen order, each unique key routed to its owner (or found in the hot storage of the
   HybridHash cache), the keys laid out for the AllToAll in (owner, table, first-seen) order,
   and each key occurrence given its *slot*: its unique key's place in that send buffer (>= 0),
   or -(hot row + 1) for a key held in hot storage. One call per pack.
2. AllToAll of the counts and of the keys (hybridrec.strategy.placement.sharded).
3. `owner_probe`: the owner probes each pack table's store once with every key the ranks sent
   for it (insertion, admission, eviction as everywhere: `kernels._lookup_partition`) and
   gathers the rows to send back, in the order the keys came. One call per pack.
4. AllToAll of the rows back.
5. `stitch` (Shuffle&Stitch): every bag pooled from the received rows (and hot rows) straight
   into its column of the side's [B, F, D] output, so no per-feature output is made and
   stacked. One call per pack.

Backward: `unstitch` turns the output gradient into one gradient per sent key (and per hot
row), the gradients travel back to the owners with one AllToAll, and `owner_apply` sums them
per row and applies every table's fused optimizer, once per training step even when the step
was looked up in several micro-batches (D-interleaving). `hot_apply` applies the AllReduced
gradients of the hot rows to every rank's copy.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from hybridrec.embedding import kernels as K
from hybridrec.embedding.hashing import mix64, route_one
from hybridrec.embedding.group_kernels import probe_segment, segments_need_service
from hybridrec.embedding.table_arrays import meta64_of, meta_of, rows_of, scalars_of

NEEDS_SERVICE = -1  # owner_probe: a store must grow its index or restart its epoch count first
_HOT_SALT = np.uint64(0x9E3779B97F4A7C15)


# ---------------------------------------------------------------- hot set (HybridHash's index)

@njit(inline="always")
def _hot_hash(key, table):
    return mix64(key ^ (np.uint64(table + 1) * _HOT_SALT))


@njit(cache=True, nogil=True)
def build_hot_index(keys, tables, rows, index_keys, index_tables, index_rows):
    """Open-addressing index (size a power of two, -1 empty) of hot (table, key) -> hot row."""
    mask = np.uint64(index_rows.shape[0] - 1)
    index_rows[:] = -1
    for i in range(keys.shape[0]):
        s = _hot_hash(keys[i], tables[i]) & mask
        while index_rows[s] >= 0:
            s = (s + np.uint64(1)) & mask
        index_keys[s] = keys[i]
        index_tables[s] = tables[i]
        index_rows[s] = rows[i]


@njit(inline="always")
def _hot_row(key, table, index_keys, index_tables, index_rows):
    """The hot row of (table, key), or -1."""
    n = index_rows.shape[0]
    if n == 0:
        return -1
    mask = np.uint64(n - 1)
    s = _hot_hash(key, table) & mask
    while True:
        r = index_rows[s]
        if r < 0:
            return -1
        if index_keys[s] == key and index_tables[s] == table:
            return r
        s = (s + np.uint64(1)) & mask


# ---------------------------------------------------------------- requester side

@njit(cache=True, nogil=True, parallel=True)
def unique_partition(values, offsets, batch_size, seg_pos, tab_seg, pack_tables, salts, world, hot_keys,
                     hot_tables, hot_rows, slots, send_keys, counts, nuniq, hot_hits):
    """Fused Unique&Partition of one pack. Fills `counts` [world, T] (keys for each owner and
    table), `send_keys` (the unique cold keys in (owner, table, first-seen) order; sized for
    every key, the first counts.sum() are used), `slots` at every key position of the pack's
    segments (>= 0: place in send_keys; < 0: -(hot row + 1)), `nuniq[t]` (unique keys of table t)
    and `hot_hits[t]` (those of them found in hot storage, via the index of (pack_tables[t],
    key) -> hot row; an empty index: no hot storage). Returns the number of keys to send."""
    ntab = tab_seg.shape[0] - 1
    sizes = np.zeros(ntab + 1, np.int64)
    for t in range(ntab):
        n = 0
        for s in range(tab_seg[t], tab_seg[t + 1]):
            p = seg_pos[s]
            n += offsets[(p + 1) * batch_size] - offsets[p * batch_size]
        sizes[t + 1] = sizes[t] + n
    total = sizes[ntab]
    ukeys = np.empty(total, np.uint64)
    uslot = np.empty(total, np.int64)  # owner (>= 0) or hot code (< 0) of each unique key, then its slot
    counts[:, :] = 0
    for tp in prange(ntab):
        t = np.int64(tp)
        base = sizes[t]
        n = sizes[t + 1] - base
        size = 16
        while size < 2 * n:
            size *= 2
        mask = np.uint64(size - 1)
        table = np.full(size, -1, np.int64)
        nu = 0
        hits = 0
        salt = salts[t]
        for s in range(tab_seg[t], tab_seg[t + 1]):
            p = seg_pos[s]
            for i in range(offsets[p * batch_size], offsets[(p + 1) * batch_size]):
                key = values[i]
                h = mix64(key) & mask
                while True:
                    u = table[h]
                    if u < 0:
                        u = nu
                        table[h] = u
                        ukeys[base + u] = key
                        hot = _hot_row(key, pack_tables[t], hot_keys, hot_tables, hot_rows)
                        if hot >= 0:
                            uslot[base + u] = -(hot + 1)
                            hits += 1
                        else:
                            owner = route_one(key, salt, world)
                            uslot[base + u] = owner
                            counts[owner, t] += 1  # one thread per table: its column is its own
                        nu += 1
                        break
                    if ukeys[base + u] == key:
                        break
                    h = (h + np.uint64(1)) & mask
                slots[i] = u  # the local unique index until the slots are known
        nuniq[t] = nu
        hot_hits[t] = hits
    start = np.empty((world, ntab), np.int64)
    acc = 0
    for w in range(world):
        for t in range(ntab):
            start[w, t] = acc
            acc += counts[w, t]
    for tp in prange(ntab):
        t = np.int64(tp)
        base = sizes[t]
        cursor = start[:, t].copy()
        for u in range(nuniq[t]):
            code = uslot[base + u]
            if code >= 0:
                slot = cursor[code]
                cursor[code] += 1
                send_keys[slot] = ukeys[base + u]
                uslot[base + u] = slot
        for s in range(tab_seg[t], tab_seg[t + 1]):
            p = seg_pos[s]
            for i in range(offsets[p * batch_size], offsets[(p + 1) * batch_size]):
                slots[i] = uslot[base + slots[i]]
    return acc


@njit(cache=True, nogil=True, parallel=True)
def stitch(values_offsets, batch_size, seg_pos, seg_col, seg_table, slots, recv_rows, hot, pool_modes, out):
    """Shuffle&Stitch: out[b, seg_col[s]] = the pooled rows of bag (seg_pos[s], b), read from the
    received rows (slot >= 0) or from pack table t's hot rows (`hot`, an address table). `out` is
    the side's [B, F, D] output; only this pack's columns are written."""
    dim = out.shape[2]
    for sp in prange(seg_pos.shape[0]):
        s = np.int64(sp)
        p = seg_pos[s]
        c = seg_col[s]
        t = seg_table[s]
        hot_rows = rows_of(hot, t)
        for b in range(batch_size):
            start = values_offsets[p * batch_size + b]
            end = values_offsets[p * batch_size + b + 1]
            for d in range(dim):
                out[b, c, d] = 0.0
            for i in range(start, end):
                slot = slots[i]
                if slot >= 0:
                    for d in range(dim):
                        out[b, c, d] += recv_rows[slot, d]
                else:
                    r = -slot - 1
                    for d in range(dim):
                        out[b, c, d] += hot_rows[r, d]
            scale = K._pool_scale(end - start, pool_modes[t])
            if scale != 1.0:
                for d in range(dim):
                    out[b, c, d] *= scale


@njit(cache=True, nogil=True, parallel=True)
def unstitch(grad, values_offsets, batch_size, seg_pos, seg_col, tab_seg, slots, pool_modes, factor, send_grad,
             hot_grad, hot_base):
    """Backward of `stitch`: each bag's gradient (times its pooling scale and `factor`) added to
    the gradient of every key of the bag: send_grad[slot] for sent keys (zeroed by the caller),
    hot_grad[hot_base[t] + hot row, :dim] for hot ones, whose last column is set to 1 (this rank
    used the row). One thread per table, so keys of a shared table are summed by one thread."""
    dim = grad.shape[2]
    ntab = tab_seg.shape[0] - 1
    for tp in prange(ntab):
        t = np.int64(tp)
        mode = pool_modes[t]
        for s in range(tab_seg[t], tab_seg[t + 1]):
            p = seg_pos[s]
            c = seg_col[s]
            for b in range(batch_size):
                start = values_offsets[p * batch_size + b]
                end = values_offsets[p * batch_size + b + 1]
                scale = K._pool_scale(end - start, mode) * factor
                for i in range(start, end):
                    slot = slots[i]
                    if slot >= 0:
                        for d in range(dim):
                            send_grad[slot, d] += scale * grad[b, c, d]
                    else:
                        h = hot_base[t] - slot - 1
                        for d in range(dim):
                            hot_grad[h, d] += scale * grad[b, c, d]
                        hot_grad[h, dim] = 1.0


# ---------------------------------------------------------------- owner side

@njit(cache=True, nogil=True)
def group_by_table(counts, perm, tspan):
    """The received keys, laid out (source rank, table, ...), grouped by table: perm[tspan[t]:
    tspan[t+1]] are the positions of table t's keys, source after source."""
    world, ntab = counts.shape
    start = np.empty((world, ntab), np.int64)
    acc = 0
    for w in range(world):
        for t in range(ntab):
            start[w, t] = acc
            acc += counts[w, t]
    j = 0
    for t in range(ntab):
        tspan[t] = j
        for w in range(world):
            for k in range(counts[w, t]):
                perm[j] = start[w, t] + k
                j += 1
    tspan[ntab] = j


@njit(cache=True, nogil=True, parallel=True)
def owner_probe(keys, perm, tspan, tables, icfg, fcfg, seeds, mode, rooms, out_rows, inverse, uniq_rows, uniq_keys,
                nuniq, send_rows):
    """Probe each pack table's store once with every key the ranks sent for it (perm/tspan from
    `group_by_table`) and gather the rows to send back (send_rows[i]: the row of keys[i], zeros
    when absent or not admitted). Table t's unique rows land at uniq_rows[tspan[t]:tspan[t] +
    nuniq[t]]; inverse[i] is keys[i]'s index among all unique rows (-1: no row). Returns 0, t + 1
    when table t ran out of evictable rows, or NEEDS_SERVICE (nothing changed) when a store must
    grow its index (rooms[t]) or restart its epoch count first."""
    ntab = tspan.shape[0] - 1
    if segments_need_service(tables, mode, rooms, tspan[:-1], tspan[1:]):
        return NEEDS_SERVICE
    failed = np.zeros(ntab, np.int64)
    unhashed = np.empty(0, np.uint64)
    dim = send_rows.shape[1]
    for tp in prange(ntab):
        t = np.int64(tp)
        lo = tspan[t]
        hi = tspan[t + 1]
        failed[t] = probe_segment(tables, t, keys, unhashed, perm, lo, hi, icfg, fcfg, seeds, mode, out_rows, inverse,
                                  uniq_rows, uniq_keys, nuniq)
        if failed[t] != 0:
            continue
        rows = rows_of(tables, t)
        for j in range(lo, hi):
            i = perm[j]
            r = out_rows[i]
            if r >= 0:
                for d in range(dim):
                    send_rows[i, d] = rows[r, d]
            else:
                for d in range(dim):
                    send_rows[i, d] = 0.0
    for t in range(ntab):
        if failed[t]:
            return t + 1
    return 0


@njit(cache=True, nogil=True, parallel=True)
def owner_apply(tables, icfg, fcfg, opt_codes, opt_params, grads, round_base, perm, tspan, inverse, uniq_rows,
                uniq_keys, nuniq, dropped):
    """One optimizer step per pack table with the gradients the ranks sent for a training step
    looked up in R rounds (micro-batches): round r's received gradients are grads[round_base[r]:
    round_base[r+1]], and its perm/inverse/uniq arrays (from `owner_probe`, concatenated) start
    at round_base[r] too; tspan and nuniq are [R, T+1] and [R, T]. A row looked up in several
    rounds gets one update with the sum. Every table takes a step (its step count advances) even
    without keys this step, as each store of the local placement does per batch. Refuses the
    whole step (returns False, no row changed) if a summed gradient is NaN or inf."""
    nround = tspan.shape[0]
    ntab = tspan.shape[1] - 1
    dim = grads.shape[1]
    width = np.zeros(ntab + 1, np.int64)  # unique rows of table t over all rounds (before merging)
    for t in range(ntab):
        m = 0
        for r in range(nround):
            m += nuniq[r, t]
        width[t + 1] = width[t] + m
    rows_all = np.empty(width[ntab], np.int32)
    keys_all = np.empty(width[ntab], np.uint64)
    grad_all = np.zeros((width[ntab], dim), np.float32)
    merged = np.zeros(ntab, np.int64)
    finite = np.ones(ntab, np.bool_)
    for tp in prange(ntab):
        t = np.int64(tp)
        c = width[t]
        for r in range(nround):
            rb = round_base[r]
            lo = tspan[r, t]
            n = nuniq[r, t]
            for k in range(n):
                rows_all[c + k] = uniq_rows[rb + lo + k]
                keys_all[c + k] = uniq_keys[rb + lo + k]
            for j in range(lo, tspan[r, t + 1]):
                i = rb + perm[rb + j]
                u = inverse[i]
                if u >= 0:
                    g = c + u - lo
                    for d in range(dim):
                        grad_all[g, d] += grads[i, d]
            c += n
        m = c - width[t]
        if nround > 1 and m > 0:  # the same row looked up in several rounds: one sum, one update
            size = 16
            while size < 2 * m:
                size *= 2
            mask = np.uint64(size - 1)
            index = np.full(size, -1, np.int64)
            kept = 0
            for k in range(m):
                row = rows_all[width[t] + k]
                h = mix64(np.uint64(row)) & mask
                while True:
                    e = index[h]
                    if e < 0:
                        index[h] = kept
                        dst = width[t] + kept
                        if dst != width[t] + k:
                            rows_all[dst] = row
                            keys_all[dst] = keys_all[width[t] + k]
                            for d in range(dim):
                                grad_all[dst, d] = grad_all[width[t] + k, d]
                        kept += 1
                        break
                    if rows_all[width[t] + e] == row:
                        for d in range(dim):
                            grad_all[width[t] + e, d] += grad_all[width[t] + k, d]
                        break
                    h = (h + np.uint64(1)) & mask
            m = kept
        merged[t] = m
        finite[t] = K.all_finite(grad_all[width[t]:width[t] + m])
    if not finite.all():
        return False
    for tp in prange(ntab):
        t = np.int64(tp)
        lo = width[t]
        hi = lo + merged[t]
        scalars = scalars_of(tables, t)
        scalars[K.SC_STEP] += 1
        scalars[K.SC_DIRTY] = 1
        dropped[t] = K.apply_updates(rows_of(tables, t), meta_of(tables, t), meta64_of(tables, t), rows_all[lo:hi],
                                     keys_all[lo:hi], grad_all[lo:hi], icfg[t], fcfg[t], opt_codes[t],
                                     opt_params[t], scalars[K.SC_STEP])
        scalars[K.SC_DROPPED] += dropped[t]
        scalars[K.SC_DIRTY] = 0
    return True


@njit(cache=True, nogil=True, parallel=True)
def hot_apply(hot, hot_counts, hot_base, grads, icfg, fcfg, opt_codes, opt_params, steps):
    """One optimizer step on every rank's copy of the hot rows a rank used this step, with their
    AllReduced gradients (grads[hot_base[t] + row, :dim]; the last column counts the ranks that
    used the row, and is added to the row's access count, HybridHash's frequency counter).
    steps[t] is the step number the table's stores took this step, so the copy is updated as
    the owner's store would have updated it. Rows no rank used are left alone, as an owner
    leaves rows of no key in the batch."""
    ntab = hot_counts.shape[0]
    dim = grads.shape[1] - 1
    for tp in prange(ntab):
        t = np.int64(tp)
        n = hot_counts[t]
        used = 0
        for h in range(n):
            if grads[hot_base[t] + h, dim] > 0.0:
                used += 1
        if used == 0:
            continue
        rows_idx = np.empty(used, np.int32)
        keys = np.empty(used, np.uint64)
        g = np.empty((used, dim), np.float32)
        meta = meta_of(hot, t)
        meta64 = meta64_of(hot, t)
        k = 0
        for h in range(n):
            src = hot_base[t] + h
            if grads[src, dim] > 0.0:
                rows_idx[k] = h
                keys[k] = meta64[h, 0]
                for d in range(dim):
                    g[k, d] = grads[src, d]
                meta[h, K.M_COUNT] += np.int32(grads[src, dim])
                k += 1
        K.apply_updates(rows_of(hot, t), meta, meta64, rows_idx, keys, g, icfg[t], fcfg[t], opt_codes[t],
                        opt_params[t], steps[t])
