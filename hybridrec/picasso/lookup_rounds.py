"""A lookup round of PICASSO's sharded tables (§III-A): every trainer sends each of its batch's
unique keys to the key's owner (the global route hash) with AllToAll, the owners probe their
stores and send the rows back, and the rows are pooled into the dense model's inputs.

A round is a collective: first a header (per rank: closing?, training?, key counts per table),
then the keys, then the rows back. With packing (§III-B) one round serves every table of a pack
with the fused kernels (`unique_partition`, `owner_probe`, `stitch`; hot keys are read from the
hot storage instead of being sent), and with K-interleaving the packs' exchanges are started
asynchronously and pipelined with the owners' probes. Without packing every table runs its own
unique, route, partition, three AllToAlls, the store's lookup and gather, and torch pooling,
the way a per-feature model-parallel lookup is written. Both give bit-identical inputs.

`shards` is the trainer's `ShardedTables` (hybridrec.picasso.sharded_tables), whose stores,
packs, hot sets and collectives a round uses.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from hybridrec.embedding import kernels as K
from hybridrec.embedding.dedupe import first_seen_unique
from hybridrec.embedding.hashing import route, table_route_id
from hybridrec.picasso import packing as P
from hybridrec.picasso.collectives import OpCounts
from hybridrec.picasso.packs import Pack, store_locks


@dataclasses.dataclass


class PackRound:
    """One pack's share of a lookup round: what this trainer sent and what it received as owner."""

    slots: np.ndarray | None  # requester: per position of the batch's values (this pack's segments)
    positions: np.ndarray | None
    counts: np.ndarray  # [W, T] keys sent to each owner
    recv_counts: np.ndarray | None = None  # [W, T] keys received from each rank
    perm: np.ndarray | None = None  # owner: received keys grouped by table (partition.group_by_table)
    tspan: np.ndarray | None = None
    inverse: np.ndarray | None = None
    uniq_rows: np.ndarray | None = None
    uniq_keys: np.ndarray | None = None
    nuniq: np.ndarray | None = None
    send_grad: np.ndarray | None = None  # backward: one gradient per sent key


@dataclasses.dataclass


class TableRound:
    """One table's share of an unpacked lookup round."""

    order: np.ndarray | None  # requester: unique keys in send order
    counts: np.ndarray  # [W]
    recv_counts: np.ndarray
    recv_keys: np.ndarray  # owner: the keys the ranks sent
    leaf: torch.Tensor | None = None  # requester: the unique keys' rows (autograd leaf)


@dataclasses.dataclass


class Round:
    batch: object
    train: bool
    all_closing: bool
    packs: list = dataclasses.field(default_factory=list)
    outputs: dict = dataclasses.field(default_factory=dict)  # side -> numpy (packed) or tensor (unpacked)
    ops: OpCounts = dataclasses.field(default_factory=OpCounts)


class Step:
    """A batch as the loop's stream hands it on: looked up only in `inputs` (a collective, run
    once every trainer knows it trains this step). Holds the step's rounds (one per micro-batch),
    with D-interleaving its parts and their lookups in flight, and the gradient buffer of its hot
    rows until `update`."""

    def __init__(self, batch, train: bool):
        self.batch, self.train = batch, train
        self.rounds: list[Round] = []
        self.parts: list | None = None
        self.futures: list | None = None
        self.hot_grad: dict[int, np.ndarray] = {}


@dataclasses.dataclass(frozen=True)


class Part:
    step: Step
    index: int


def lookup_round(shards, batch, train: bool, closing: bool) -> Round:
    rnd = Round(batch, train, False)
    with torch.no_grad():
        if shards.packing:
            _packed_round(shards, rnd, closing)
        else:
            _unpacked_round(shards, rnd, closing)
    if not train:
        shards.eval_ops.add(rnd.ops)
    return rnd


def _header(shards, rnd: Round, closing: bool, counts: list[np.ndarray]) -> np.ndarray:
    """The round's header, exchanged first: per rank (closing, train) and the key counts."""
    W = shards.world.size
    header = np.zeros((W, 2 + sum(c.shape[1] for c in counts)), np.int64)
    header[:, 0], header[:, 1] = int(closing), int(rnd.train)
    col = 2
    for c in counts:
        header[:, col:col + c.shape[1]] = c
        col += c.shape[1]
    received, _ = shards.comm.alltoall(header, [1] * W, [1] * W, rnd.ops, _purpose(rnd))
    rnd.all_closing = bool(received[:, 0].all())
    return received


def _purpose(rnd: Round) -> str:
    return "train" if rnd.train else "eval"


def _mode(header: np.ndarray) -> int:
    return K.MODE_TRAIN if header[:, 1].any() else K.MODE_FIND


def _packed_round(shards, rnd: Round, closing: bool) -> None:
    W, batch, ops, purpose = shards.world.size, rnd.batch, rnd.ops, _purpose(rnd)
    sends = []
    for pi, pack in enumerate(shards.packs):
        T = len(pack.tables)
        if batch is None:
            rnd.packs.append(PackRound(None, None, np.zeros((W, T), np.int64)))
            sends.append(np.empty(0, np.uint64))
            continue
        sp = batch.sparse
        hot = shards.hot_sets[pi]
        positions = pack.positions(sp.names)
        slots = np.empty(len(sp.values), np.int64)
        send_keys = np.empty(len(sp.values), np.uint64)
        counts = np.empty((W, T), np.int64)
        nuniq, hits = np.empty(T, np.int64), np.empty(T, np.int64)
        with shards.kernel_lock:
            sent = P.unique_partition(sp.values, sp.offsets, sp.batch_size, positions, pack.tab_seg,
                                      pack.table_index, pack.salts, W, hot.index_keys, hot.index_tables,
                                      hot.index_rows, slots, send_keys, counts, nuniq, hits)
        ops.native += 1
        if shards.hot_policy is not None and rnd.train:
            shards.hot_policy.record_hits(int(hits.sum()), int(nuniq.sum()))
        rnd.packs.append(PackRound(slots, positions, counts))
        sends.append(send_keys[:sent])
    header = _header(shards, rnd, closing, [pr.counts for pr in rnd.packs])
    mode = _mode(header)
    col = 2
    for pr in rnd.packs:
        T = pr.counts.shape[1]
        pr.recv_counts = np.ascontiguousarray(header[:, col:col + T])
        col += T
    # keys to their owners: every pack's exchange is started before any is probed when the
    # packs are pipelined (K-interleaving), else one pack after the other
    keys = [None] * len(shards.packs)
    for pi, pr in enumerate(rnd.packs):
        keys[pi] = shards.comm.alltoall(sends[pi], pr.counts.sum(1), pr.recv_counts.sum(1), ops, purpose,
                                      async_op=shards.pipelined)
    rows_back = [None] * len(shards.packs)
    for pi, (pack, pr) in enumerate(zip(shards.packs, rnd.packs)):
        recv_keys, work = keys[pi]
        if work is not None:
            work.wait()
        send_rows = _owner_probe(shards, pack, pr, recv_keys, mode, ops)
        rows_back[pi] = shards.comm.alltoall(send_rows, pr.recv_counts.sum(1), pr.counts.sum(1), ops, purpose,
                                           async_op=shards.pipelined)
    if batch is None:
        for _, work in rows_back:
            if work is not None:
                work.wait()
        return
    sp = batch.sparse
    for side in shards.sides:
        dim = next(p.dim for p in shards.packs if p.side == side)
        rnd.outputs[side] = np.empty((sp.batch_size, len(shards.names), dim), np.float32)
        ops.native += 1
    for pi, (pack, pr) in enumerate(zip(shards.packs, rnd.packs)):
        recv_rows, work = rows_back[pi]
        if work is not None:
            work.wait()
        with shards.kernel_lock:
            P.stitch(sp.offsets, sp.batch_size, pr.positions, pack.seg_col, pack.seg_table, pr.slots,
                     recv_rows, shards.hot_sets[pi].arrays.table, pack.pool_modes, rnd.outputs[pack.side])
        ops.native += 1


def _owner_probe(shards, pack: Pack, pr: PackRound, recv_keys: np.ndarray, mode: int, ops: OpCounts) -> np.ndarray:
    """Probe the owner's stores with the keys the ranks sent; the rows to send back."""
    n = len(recv_keys)
    T = len(pack.tables)
    pr.perm, pr.tspan = np.empty(n, np.int64), np.empty(T + 1, np.int64)
    out_rows = np.empty(n, np.int32)
    pr.inverse, pr.uniq_rows = np.empty(n, np.int32), np.empty(n, np.int32)
    pr.uniq_keys, pr.nuniq = np.empty(n, np.uint64), np.zeros(T, np.int64)
    send_rows = np.empty((n, pack.dim), np.float32)
    with shards.kernel_lock:
        P.group_by_table(pr.recv_counts, pr.perm, pr.tspan)
        ops.native += 1
        if n == 0:
            return send_rows
        with store_locks(pack.stores):
            pack.rooms[:] = [s.index_room for s in pack.stores]
            for _ in range(2):
                status = P.owner_probe(recv_keys, pr.perm, pr.tspan, pack.arrays.table, pack.icfg, pack.fcfg,
                                       pack.seeds, mode, pack.rooms, out_rows, pr.inverse, pr.uniq_rows,
                                       pr.uniq_keys, pr.nuniq, send_rows)
                ops.native += 1
                if status != P.NEEDS_SERVICE:
                    break
                spans = np.diff(pr.tspan)
                for store, count in zip(pack.stores, spans.tolist()):
                    if mode != K.MODE_FIND:
                        store.make_index_room(count)
                    store.restart_epoch_count_if_due()
                pack.rooms[:] = [s.index_room for s in pack.stores]
            else:
                raise RuntimeError("sharded: a store still asks for index room after being given it; "
                                   "this is a bug in hybridrec")
    if status > 0:
        raise pack.stores[status - 1].batch_too_large_error(pack.tables[status - 1])
    return send_rows


def _unpacked_round(shards, rnd: Round, closing: bool) -> None:
    """The plain model-parallel lookup: each table on its own, with separate operations for
    unique, route, partition, AllToAll of counts, keys and rows, gather and pooling."""
    W, batch, ops, purpose = shards.world.size, rnd.batch, rnd.ops, _purpose(rnd)
    header = _header(shards, rnd, closing, [])
    mode = _mode(header)
    outputs: dict[str, list] = {side: [None] * len(shards.names) for side in shards.sides}
    sp = None if batch is None else batch.sparse
    for side, table, columns in shards.unpacked:
        store = shards.stores[table]
        order, inverse, keys_u = None, None, np.empty(0, np.uint64)
        counts = np.zeros(W, np.int64)
        if sp is not None:
            keys = np.concatenate([sp.feature(name)[0] for name, _ in columns]) if len(columns) > 1 else \
                sp.feature(columns[0][0])[0]
            uniq, inverse = first_seen_unique(np.ascontiguousarray(keys))
            owner = route(uniq, table_route_id(table), W)
            order = np.argsort(owner, kind="stable")
            keys_u = uniq[order]
            counts = np.bincount(owner, minlength=W).astype(np.int64)
            ops.native += 6
        recv_counts, _ = shards.comm.alltoall(counts.reshape(W, 1), [1] * W, [1] * W, ops, purpose)
        recv_counts = recv_counts.reshape(W)
        recv_keys, _ = shards.comm.alltoall(keys_u, counts, recv_counts, ops, purpose)
        rows = np.empty((len(recv_keys), store.dim), np.float32)
        if len(recv_keys):
            found = store.lookup(np.ascontiguousarray(recv_keys), insert=mode != K.MODE_FIND)
            K.gather_rows(store.rows, found.rows, rows)
            ops.native += 2
        recv_rows, _ = shards.comm.alltoall(rows, recv_counts, counts, ops, purpose)
        tr = TableRound(order, counts, recv_counts, recv_keys)
        rnd.packs.append(tr)
        if sp is None:
            continue
        unique_rows = np.empty((len(order), store.dim), np.float32)
        unique_rows[order] = recv_rows
        tr.leaf = torch.from_numpy(unique_rows).requires_grad_(rnd.train)
        ops.native += 2
        ops.torch += 1
        start = 0
        for name, column in columns:
            values, offsets = sp.feature(name)
            lengths = np.diff(offsets)
            index = torch.from_numpy(inverse[start:start + len(values)])
            bag = torch.repeat_interleave(torch.arange(sp.batch_size), torch.from_numpy(lengths))
            with torch.enable_grad():
                pooled = torch.zeros(sp.batch_size, store.dim).index_add(0, bag, tr.leaf.index_select(0, index))
                ops.torch += 3
                if store.config.pooling != "sum":  # as kernels._pool_scale: 1 for bags of 0 or 1
                    n = lengths.astype(np.float64)
                    scale = np.ones(len(n))
                    big = n > 1
                    scale[big] = 1.0 / (n[big] if store.config.pooling == "mean" else np.sqrt(n[big]))
                    pooled = pooled * torch.from_numpy(scale.astype(np.float32)).unsqueeze(1)
                    ops.torch += 1
            outputs[side][column] = pooled
            ops.native += 3
            start += len(values)
    if sp is None:
        return
    for side in shards.sides:
        with torch.enable_grad():
            rnd.outputs[side] = torch.stack(outputs[side], dim=1)
        ops.torch += 1
