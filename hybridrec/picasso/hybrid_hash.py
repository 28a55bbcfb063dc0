"""PICASSO's HybridHash (§III-D, Algorithm 1): the hottest rows of the sharded tables copied to
every trainer.

During `warmup_iters` training steps only frequencies are counted: each owner's stores count
every training use of a row (the rows' access counts, which also drive LFU eviction: one per
trainer that looked the key up in a step). Then every `flush_iters` steps (Algorithm 1, L23-26)
the top-k rows of all tables by that count become the hot storage (hybridrec.picasso.hot_rows):

- on the CPU, hot storage is a copy of those rows (weights and optimizer state) on every
  trainer. A hot key skips the AllToAll: it is read from the local copy inside the packed
  lookup kernel, and its gradient, summed over every trainer with one AllReduce per step, is
  applied by every trainer to its copy with the table's fused optimizer at the step number the
  owner's store is at, so every copy stays identical to the others and to what the owner would
  hold without the cache. The AllReduce also counts the trainers that used each hot row, which
  is added to the row's access count (the frequency counter keeps counting, Algorithm 1 L20).
  (With the dense part on CUDA, PICASSO's hot storage is device memory; here the dense part's
  device does not change where the copy lives.)
- at each flush, and before a checkpoint, every owner writes the current copy of its hot rows
  back into its store, then the new top-k are chosen from the owners' counts: each trainer
  offers its best k (count, table, key), all trainers pick the same global k (ties broken by
  table and key), and the owners fill the new copies (one AllReduce of rows, one of metadata).

`hot_hit_rate` (facts) is the share of a step's unique (table, key) lookups of a trainer that
hot storage served, over the steps with a hot set.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from hybridrec.embedding import kernels as K
from hybridrec.embedding.hashing import route, table_route_id
from hybridrec.picasso.hot_rows import HotSet


class HybridHash:
    """The hot-row policy of a trainer's `ShardedTables` (their `hot_sets` are the hot storage),
    attached to them with `attach_hot_rows`."""

    def __init__(self, shards, hot_rows: int, warmup_iters: int, flush_iters: int):
        self.shards = shards
        self.k, self.warmup, self.flush_every = hot_rows, warmup_iters, flush_iters
        self.reset()

    def reset(self) -> None:
        """Start counting steps again (a loaded checkpoint holds no hot set: it was written back)."""
        self.itr = 0
        self.hits = self.lookups = 0
        self.flushes = 0

    # ------------------------------------------------------------ per step
    def record_hits(self, hits: int, uniques: int) -> None:
        if any(h.total for h in self.shards.hot_sets):
            self.hits += hits
            self.lookups += uniques

    def after_step(self, ops) -> None:
        """Algorithm 1: after the warm-up, every flush_iters steps the hot set is chosen anew."""
        self.itr += 1
        if self.k > 0 and self.itr >= self.warmup and self.itr % self.flush_every == 0:
            self.flush(ops)

    # ------------------------------------------------------------ flush
    def write_back(self) -> None:
        """Every owner's store takes the current copy of its hot rows (weights, optimizer state,
        access count and clock), re-inserting a row the store evicted meanwhile."""
        pl = self.shards
        W, rank = pl.world.size, pl.world.rank
        for pack, hot in zip(pl.packs, pl.hot_sets):
            for t, (table, store) in enumerate(zip(pack.tables, pack.stores)):
                if hot.counts[t] == 0:
                    continue
                meta = hot.table_meta(t)
                keys = np.ascontiguousarray(meta.view(np.uint64)[:, 0])
                mine = route(keys, table_route_id(table), W) == rank
                if mine.any():
                    store.insert_rows(np.ascontiguousarray(hot.table_rows(t)[mine]),
                                      np.ascontiguousarray(meta[mine]))

    def flush(self, ops) -> None:
        pl = self.shards
        self.write_back()
        chosen = self._choose(ops)
        tables = [(pi, t) for pi, pack in enumerate(pl.packs) for t in range(len(pack.tables))]
        picked = {key: chosen[chosen[:, 1] == i] for i, key in enumerate(tables)}
        # the owners fill the chosen rows, every other trainer zeros: summed, every trainer has them
        widths = [pl.packs[pi].stores[t].config.row_width for pi, t in tables]
        sizes = [len(picked[key]) for key in tables]
        rows = np.zeros(sum(n * w for n, w in zip(sizes, widths)), np.float32)
        meta = np.zeros((sum(sizes), K.META_WIDTH), np.int32)
        start, mstart = 0, 0
        for (pi, t), n, width in zip(tables, sizes, widths):
            pack = pl.packs[pi]
            if n:
                keys = np.ascontiguousarray(picked[(pi, t)][:, 2].astype(np.uint64))
                mine = route(keys, table_route_id(pack.tables[t]), pl.world.size) == pl.world.rank
                store = pack.stores[t]
                if mine.any():
                    found = store.lookup(keys[mine], insert=False)
                    where = found.rows
                    block = rows[start:start + n * width].reshape(n, width)
                    block[np.flatnonzero(mine)] = store.rows[where]
                    meta[mstart + np.flatnonzero(mine)] = store.meta[where]
            start += n * width
            mstart += n
        pl.comm.allreduce(rows, ops, "train")
        pl.comm.allreduce(meta, ops, "train")
        new_sets, start, mstart = [], 0, 0
        cursor = 0
        for pi, pack in enumerate(pl.packs):
            per_rows, per_meta = [], []
            for t in range(len(pack.tables)):
                n, width = sizes[cursor], widths[cursor]
                per_rows.append(rows[start:start + n * width].reshape(n, width).copy())
                per_meta.append(meta[mstart:mstart + n].copy())
                start += n * width
                mstart += n
                cursor += 1
            new_sets.append(HotSet(pack, per_rows, per_meta))
        pl.hot_sets = new_sets
        self.flushes += 1

    def _choose(self, ops) -> np.ndarray:
        """The global top-k as int64 [k, 3] rows (count, table number, key bits), the same on
        every trainer."""
        pl = self.shards
        offers = []
        number = 0
        for pack in pl.packs:
            for store in pack.stores:
                live = store.live_rows()
                counts = store.meta[live, K.M_COUNT].astype(np.int64)
                if len(live) > self.k:
                    best = np.argpartition(-counts, self.k - 1)[:self.k]
                    live, counts = live[best], counts[best]
                keys = store.r64[live, 0].view(np.int64)
                offers.append(np.stack([counts, np.full(len(live), number, np.int64), keys], axis=1))
                number += 1
        mine = np.concatenate(offers) if offers else np.empty((0, 3), np.int64)
        mine = _top(mine, self.k)
        padded = np.full((self.k, 3), -1, np.int64)
        padded[:len(mine)] = mine
        if pl.world.size > 1:
            gathered = [torch.empty((self.k, 3), dtype=torch.int64) for _ in range(pl.world.size)]
            dist.all_gather(gathered, torch.from_numpy(padded), group=pl.comm.group)
            ops.collectives += 1
            padded = np.concatenate([g.numpy() for g in gathered])
        every = padded[padded[:, 0] >= 0]
        return _top(every, self.k)

    def facts(self) -> dict:
        return {"hot_hit_rate": self.hits / self.lookups if self.lookups else None,
                "hot_rows": int(sum(h.total for h in self.shards.hot_sets)), "hot_flushes": self.flushes}


def _top(rows: np.ndarray, k: int) -> np.ndarray:
    """The k rows with the highest count, ties by table then key: one order on every trainer."""
    order = np.lexsort((rows[:, 2].view(np.uint64), rows[:, 1], -rows[:, 0]))
    return rows[order[:k]]
