"""The sharded placement (PICASSO's hybrid strategy, §III-A): the embedding tables are split
among the trainers, the dense part is data-parallel.

Every trainer (torchrun rank) owns a shard of every table: the keys that the one global route
hash of (table, key) (`hashing.route`, the PS client's) sends to its rank, in in-process
`EmbeddingStore`s (admission, eviction and the fused optimizers as everywhere). A step sends
each of the batch's unique keys to its owner with `all_to_all_single` (gloo, on a process group
of this placement's own), the owner probes its stores and sends the rows back, and the rows are
pooled into the dense model's [B, F, D] inputs. In backward each key's gradient goes back to
its owner the same way, where the fused optimizer applies the sum over all trainers, divided by
their number: a step of W trainers on W batches of B rows is then the step one process takes
on the W*B rows together (DDP averages the dense gradients alike).

PICASSO's optimisations are switches of `strategy.picasso`:
- packing (§III-B): D-packing makes one packed lookup of all tables of one dim (a side: deep or
  wide), split by parameter volume (Eq. 1) with `split_packs`; K-packing fuses Unique&Partition
  and Shuffle&Stitch into single numba kernels (hybridrec.picasso.packing). Without packing
  every table is looked up on its own, with separate unique, route, partition, AllToAll, gather
  and pooling operations, the way a per-feature model-parallel lookup is written.
- D-interleaving (§III-C): the batch is looked up in `micro_batches` parts; the lookup of part
  i+1 runs on a communication thread while the dense model computes part i. Gradients of the
  parts are accumulated: the embeddings and the dense parameters are updated once per batch.
- K-interleaving: `k_groups` > 1 cuts the packs into groups of about equal parameter volume
  (Eq. 3's capacity) whose collectives are pipelined: every group's keys are on the wire while
  earlier groups are probed, and a group's rows travel back while the next one is probed.
- the HybridHash hot/cold cache (§III-D) is the `hot_cold` consistency (its module).

Lookups, updates and `close()` are collectives: every trainer makes them in the same order (the
training loop runs in lockstep). Checkpoints hold each trainer's shard (`stage`, then the
leader's `save` assembles them) and load into any number of trainers (`load`). A lookup runs where the dense model asks for
its inputs (`inputs`), after every trainer knows it has a batch; trainers that evaluate fewer
batches than others answer the others' lookups when they close their connection. The number of
native kernel calls, collectives and torch operations on the embedding path is counted per
training step (`facts()["ops_per_step"]`, PICASSO Table V). Wire bytes are counted once, by
the trainer that sends them (`bytes_sent`), excluding what a trainer sends to itself.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import shutil
import threading
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from hybridrec.embedding import EmbeddingStore
from hybridrec.embedding import kernels as K
from hybridrec.picasso import packing as P
from hybridrec.embedding.checkpoint import load_resharded
from hybridrec.embedding.dedupe import first_seen_unique
from hybridrec.embedding.hashing import route, route_salt, table_route_id
from hybridrec.embedding.table import POOLING_MODES
from hybridrec.embedding.table_arrays import TableArrays
from hybridrec.ps.client import shard_directory
from hybridrec.embedding.inputs import EmbeddingInputs
from hybridrec.strategy.placement import PlacementDefaults

SIDES = ("deep", "wide")


# ---------------------------------------------------------------- counting

@dataclasses.dataclass
class OpCounts:
    """Operations a step issues on the embedding path (PICASSO Table V): native kernel calls
    (numba kernels and numpy array operations), collectives, torch operations."""

    native: int = 0
    collectives: int = 0
    torch: int = 0

    def add(self, other: "OpCounts") -> None:
        self.native += other.native
        self.collectives += other.collectives
        self.torch += other.torch

    def as_dict(self, steps: int = 1) -> dict:
        steps = max(steps, 1)
        out = {k: getattr(self, k) / steps for k in ("native", "collectives", "torch")}
        out["total"] = sum(out.values())
        return out


class _Comm:
    """The placement's collectives on its own gloo process group (so that the DDP AllReduce on
    the default group and these never wait on each other's order), with the bytes each trainer
    sends to the others counted by purpose ("train" or "eval")."""

    def __init__(self, world):
        self.size, self.rank = world.size, world.rank
        self.group = dist.new_group(backend="gloo") if world.grouped and world.size > 1 else None
        self.bytes = {"train": 0, "eval": 0}

    def alltoall(self, send: np.ndarray, send_splits, recv_splits, ops: OpCounts, purpose: str,
                 async_op: bool = False):
        """(received array, work or None): rows send_splits[w] of `send` (laid out rank after
        rank) go to rank w; rows from rank w arrive as recv_splits[w] rows, rank after rank."""
        if self.size == 1:
            return send, None
        send = np.ascontiguousarray(send)
        recv_splits = [int(n) for n in recv_splits]
        send_splits = [int(n) for n in send_splits]
        recv = np.empty((sum(recv_splits),) + send.shape[1:], send.dtype)
        as_torch = (lambda a: torch.from_numpy(a.view(np.int64))) if send.dtype == np.uint64 else torch.from_numpy
        work = dist.all_to_all_single(as_torch(recv), as_torch(send), recv_splits, send_splits, group=self.group,
                                      async_op=async_op)
        ops.collectives += 1
        row_bytes = send.itemsize * int(np.prod(send.shape[1:], dtype=np.int64))
        self.bytes[purpose] += (sum(send_splits) - send_splits[self.rank]) * row_bytes
        return recv, work

    def allreduce(self, array: np.ndarray, ops: OpCounts, purpose: str) -> None:
        """Sum `array` over the trainers, in place (a ring moves 2 (W-1)/W of it per trainer)."""
        if self.size == 1 or array.size == 0:
            return
        dist.all_reduce(torch.from_numpy(array), group=self.group)
        ops.collectives += 1
        self.bytes[purpose] += int(2 * (self.size - 1) * array.nbytes // self.size)

    def barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)


# ---------------------------------------------------------------- packs and hot rows

class _HotTable:
    """Store-shaped arrays of one table's hot rows, for `TableArrays` (only rows and meta are read)."""

    def __init__(self, rows: np.ndarray, meta: np.ndarray):
        self.rows, self.meta = rows, meta
        self.index = np.full(1, -1, np.int32)
        self.parts = np.zeros((1, K.PARTS_WIDTH), np.int64)
        self.sketch = np.zeros((2, 1), np.uint16)
        self.scalars = np.zeros(K.SCALARS_WIDTH, np.int64)


class HotSet:
    """The hot rows of one pack, the same on every trainer: per pack table t, `rows[t]` [n_t,
    row width] (weights and optimizer state, as the owner's store holds them) and `meta[t]` (the
    key and the access count), with the index of (pack table, key) -> hot row the lookup kernel
    probes. The hot rows of all tables are numbered from `base[t]` in the gradient buffer."""

    def __init__(self, pack: "_Pack", rows: list[np.ndarray], meta: list[np.ndarray]):
        self.counts = np.array([len(r) for r in rows], np.int64)
        self.base = np.concatenate([[0], np.cumsum(self.counts)[:-1]]).astype(np.int64)
        self.total = int(self.counts.sum())
        self.rows, self.meta = rows, meta
        tables = []
        for t, store in enumerate(pack.stores):
            width = store.config.row_width
            r = rows[t] if len(rows[t]) else np.zeros((1, width), np.float32)
            m = meta[t] if len(meta[t]) else np.zeros((1, K.META_WIDTH), np.int32)
            tables.append(_HotTable(np.ascontiguousarray(r, np.float32), np.ascontiguousarray(m, np.int32)))
        self._tables = tables
        self.arrays = TableArrays(tables)
        size = 1
        while size < 2 * self.total:
            size *= 2
        keys = np.concatenate([m.view(np.uint64)[:, 0] for m in meta]) if self.total else np.empty(0, np.uint64)
        which = np.repeat(np.arange(len(rows), dtype=np.int64), self.counts)
        local = np.concatenate([np.arange(n, dtype=np.int64) for n in self.counts]) if self.total else \
            np.empty(0, np.int64)
        self.index_keys = np.zeros(size if self.total else 0, np.uint64)
        self.index_tables = np.zeros(size if self.total else 0, np.int64)
        self.index_rows = np.full(size if self.total else 0, -1, np.int64)
        if self.total:
            P.build_hot_index(np.ascontiguousarray(keys), which, local, self.index_keys, self.index_tables,
                              self.index_rows)

    def table_rows(self, t: int) -> np.ndarray:
        """Table t's hot rows as the kernels update them (a view)."""
        return self._tables[t].rows[:self.counts[t]]

    def table_meta(self, t: int) -> np.ndarray:
        return self._tables[t].meta[:self.counts[t]]

    @classmethod
    def empty(cls, pack: "_Pack") -> "HotSet":
        return cls(pack, [np.empty((0, s.config.row_width), np.float32) for s in pack.stores],
                   [np.empty((0, K.META_WIDTH), np.int32) for _ in pack.stores])


class _Pack:
    """Tables of one side and dim looked up together; `features[t]` lists the (feature, output
    column) pairs table t serves, and the segments are those pairs table after table."""

    def __init__(self, side: str, tables: list[str], features: dict[str, list[tuple[str, int]]]):
        self.side, self.tables = side, tables
        pairs = [(t, f, c) for t, table in enumerate(tables) for f, c in features[table]]
        self.seg_table = np.array([t for t, _, _ in pairs], np.int64)
        self.seg_features = [f for _, f, _ in pairs]
        self.seg_col = np.array([c for _, _, c in pairs], np.int64)
        self.tab_seg = np.searchsorted(self.seg_table, np.arange(len(tables) + 1)).astype(np.int64)
        self.table_index = np.arange(len(tables), dtype=np.int64)  # hot-set index of each pack table
        self._positions: dict = {}
        self.stores: list[EmbeddingStore] = []

    def bind(self, stores: dict[str, EmbeddingStore]) -> None:
        """Serve from these stores (at the start, and after a checkpoint was loaded)."""
        self.stores = [stores[t] for t in self.tables]
        self.dim = self.stores[0].dim
        self.arrays = TableArrays(self.stores)
        self.icfg = np.stack([s.icfg for s in self.stores])
        self.fcfg = np.stack([s.fcfg for s in self.stores])
        self.seeds = np.array([s.config.seed for s in self.stores], np.uint64)
        self.pool_modes = np.array([s.pool_mode for s in self.stores], np.int64)
        self.opt_codes = np.array([s.opt_code for s in self.stores], np.int64)
        self.opt_params = np.stack([s.opt_params for s in self.stores])
        self.salts = np.array([route_salt(table_route_id(t)) for t in self.tables], np.uint64)
        self.rooms = np.empty(len(self.stores), np.int64)

    def positions(self, names: list[str]) -> np.ndarray:
        """Each segment's feature position in a batch with these feature names."""
        key = tuple(names)
        found = self._positions.get(key)
        if found is None:
            where = {n: i for i, n in reversed(list(enumerate(names)))}
            missing = [f for f in self.seg_features if f not in where]
            if missing:
                raise ValueError(f"features: the batch has no features {missing}; it has {list(names)}")
            found = self._positions[key] = np.array([where[f] for f in self.seg_features], np.int64)
        return found

    def volume(self) -> int:
        """Parameter volume per sample (PICASSO Eq. 1 with one ID per feature and sample, known from
        the config alone so that every trainer makes the same packs): dim x features served."""
        return self.dim * len(self.seg_features)


def _split(pack: _Pack, shards: int, features, stores) -> list[_Pack]:
    """`pack` cut into `shards` packs of consecutive tables with about equal volume."""
    shards = max(1, min(shards, len(pack.tables)))
    if shards == 1:
        return [pack]
    weight = np.array([len(features[t]) for t in pack.tables], np.float64)
    cuts = np.searchsorted(np.cumsum(weight), weight.sum() * np.arange(1, shards) / shards, side="left") + 1
    bounds = sorted({0, *[int(c) for c in cuts if 0 < c < len(pack.tables)], len(pack.tables)})
    out = [_Pack(pack.side, pack.tables[a:b], features) for a, b in zip(bounds, bounds[1:])]
    for part in out:
        part.bind(stores)
    return out


def make_packs(tables, stores: dict[str, EmbeddingStore], split_packs: bool, k_groups: int) -> list[_Pack]:
    """D-packing: one pack per side and dim, each table's features (columns of the side's output)
    with it; then Eq. 1 (`split_packs`: a pack above the average volume split into shards of
    about the smallest pack's volume) and Eq. 3 (`k_groups`: capacity = total volume / k_groups,
    a larger pack cut to fit). The list's order is the interleaving order."""
    features: dict[str, list[tuple[str, int]]] = {}
    packs: list[_Pack] = []
    for side, mapping in (("deep", tables.deep_map), ("wide", tables.wide_map)):
        by_dim: dict[int, list[str]] = {}
        for column, name in enumerate(tables.sparse_names):
            table = mapping.get(name)
            if table is None:
                continue
            if table not in features:
                features[table] = []
                by_dim.setdefault(stores[table].dim, []).append(table)
            features[table].append((name, column))
        for dim_tables in by_dim.values():
            pack = _Pack(side, dim_tables, features)
            pack.bind(stores)
            packs.append(pack)
    if split_packs and len(packs) > 1:
        volumes = [p.volume() for p in packs]
        mean, least = float(np.mean(volumes)), min(volumes)
        packs = [q for p, v in zip(packs, volumes)
                 for q in (_split(p, int(round(v / least)), features, stores) if v > mean else [p])]
    if k_groups > 1:
        capacity = sum(p.volume() for p in packs) / k_groups
        packs = [q for p in packs for q in _split(p, int(np.ceil(p.volume() / capacity - 1e-9)), features, stores)]
    return packs


# ---------------------------------------------------------------- one lookup round

@dataclasses.dataclass
class _PackRound:
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
class _TableRound:
    """One table's share of an unpacked lookup round."""

    order: np.ndarray | None  # requester: unique keys in send order
    counts: np.ndarray  # [W]
    recv_counts: np.ndarray
    recv_keys: np.ndarray  # owner: the keys the ranks sent
    leaf: torch.Tensor | None = None  # requester: the unique keys' rows (autograd leaf)


@dataclasses.dataclass
class _Round:
    batch: object
    train: bool
    all_closing: bool
    packs: list = dataclasses.field(default_factory=list)
    outputs: dict = dataclasses.field(default_factory=dict)  # side -> numpy (packed) or tensor (unpacked)
    ops: OpCounts = dataclasses.field(default_factory=OpCounts)


class _Step:
    """A batch as the loop's stream hands it on: looked up only in `inputs` (a collective, run
    once every trainer knows it trains this step). Holds the step's rounds (one per micro-batch)
    and the gradient buffer of its hot rows until `update`."""

    def __init__(self, batch, train: bool):
        self.batch, self.train = batch, train
        self.rounds: list[_Round] = []
        self.parts: list | None = None
        self.futures: list | None = None
        self.hot_grad: dict[int, np.ndarray] = {}


@dataclasses.dataclass(frozen=True)
class _Part:
    step: _Step
    index: int


class _PackedBackward:
    """What the packed lookup's autograd node calls in backward: each pack's output gradient
    turned into one gradient per sent key (and per hot row), kept in the round until the update."""

    def __init__(self, placement: "ShardedPlacement", step: _Step, rnd: _Round):
        self.placement, self.step, self.round = placement, step, rnd

    def backward(self, grads: dict) -> None:
        pl, rnd = self.placement, self.round
        sp = rnd.batch.sparse
        with pl._kernel_lock:
            for pi, (pack, pr) in enumerate(zip(pl.packs, rnd.packs)):
                grad = grads.get(pack.side)
                if grad is None:
                    continue
                hot = pl.hot_sets[pi]
                pr.send_grad = np.zeros((int(pr.counts.sum()), pack.dim), np.float32)
                hot_grad = self.step.hot_grad.get(pi)
                if hot_grad is None:
                    hot_grad = self.step.hot_grad[pi] = np.zeros((hot.total, pack.dim + 1), np.float32)
                P.unstitch(grad, sp.offsets, sp.batch_size, pr.positions, pack.seg_col, pack.tab_seg, pr.slots,
                           pack.pool_modes, np.float32(1.0 / pl.world.size), pr.send_grad, hot_grad, hot.base)
                pl.ops.native += 2


class _ShardedFunction(torch.autograd.Function):
    """The packed lookup's outputs as tensors (made inside forward from numpy arrays, so autograd
    does not wrap them as views); backward hands their gradients to `_PackedBackward`."""

    @staticmethod
    def forward(ctx, anchor, backward, sides, *outputs):
        ctx.backward, ctx.sides = backward, sides
        tensors = tuple(torch.from_numpy(o) for o in outputs)
        return tensors if len(tensors) > 1 else tensors[0]

    @staticmethod
    def backward(ctx, *grads):
        ctx.backward.backward({side: None if g is None else g.detach().to("cpu", torch.float32).contiguous().numpy()
                               for side, g in zip(ctx.sides, grads)})
        ctx.backward = None
        return (None, None, None) + (None,) * len(grads)


# ---------------------------------------------------------------- the placement

class _Connection:
    """A connection of the sharded placement: lookups happen in `ShardedPlacement.inputs`; this
    hands the batch on, applies the step's update, counts this connection's training bytes and,
    on close, answers the other trainers' lookups until every trainer has closed."""

    bytes_received = 0  # every byte is counted once, by its sender

    def __init__(self, placement: "ShardedPlacement"):
        self.placement = placement
        self._base = placement.comm.bytes["train"]
        self._closed = False

    @property
    def bytes_sent(self) -> int:
        return self.placement.comm.bytes["train"] - self._base

    def prepare(self, batch):
        return batch

    def lookup(self, batch, train: bool) -> _Step:
        return _Step(batch, train)

    def update(self, looked: _Step, grads: dict) -> dict:
        return {"dropped": self.placement.update(looked)}

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.placement.close_connection()


class ShardedPlacement(PlacementDefaults):
    tables_on_trainers = True  # each trainer saves (stage) and loads its own shard

    def __init__(self, cfg, tables, world, endpoints=None):
        self.cfg, self.tables, self.world = cfg, tables, world
        self.options = options = cfg.strategy.picasso
        self.names = tables.sparse_names
        # one partition per store: the packed kernels serve a pack's tables in parallel instead
        self.stores = {name: EmbeddingStore(dataclasses.replace(config, num_threads=1))
                       for name, config in tables.all_tables().items()}
        self.packing = options.packing
        self.packs = make_packs(tables, self.stores, options.split_packs, options.k_groups) if self.packing else []
        self.unpacked = [] if self.packing else [(side, table, cols) for side, mapping in
                                                 (("deep", tables.deep_map), ("wide", tables.wide_map))
                                                 for table, cols in _columns(tables.sparse_names, mapping).items()]
        self.sides = [side for side, mapping in (("deep", tables.deep_map), ("wide", tables.wide_map)) if mapping]
        self.pipelined = options.k_groups > 1
        self.comm = _Comm(world)
        self.ops, self.eval_ops, self.steps = OpCounts(), OpCounts(), 0
        self.dropped = 0
        self.hot_sets = [HotSet.empty(p) for p in self.packs]
        self.hybrid = None
        if cfg.strategy.resolved["consistency"] == "hot_cold":
            if not self.packing:
                raise ValueError("strategy.consistency hot_cold: the hot rows are looked up inside the packed "
                                 "kernels; set strategy.picasso.packing true")
            from hybridrec.strategy.consistency.hot_cold import HybridHash

            self.hybrid = HybridHash(self, options.hot_rows, options.warmup_iters, options.flush_iters)
        self.interleaving = options.interleaving and options.micro_batches > 1
        # one thread makes every collective of this placement's group, in the order they were asked
        # for, so the lookup of the next micro-batch may run while the dense model computes
        self._executor = (concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hybridrec-alltoall")
                          if self.interleaving and world.size > 1 else None)
        self._kernel_lock = threading.Lock()  # numba's workqueue layer runs one parallel kernel at a time
        self._anchor = torch.zeros(0, requires_grad=True)

    # ------------------------------------------------------------ the loop's interface
    def connect(self) -> _Connection:
        return _Connection(self)

    def _call(self, fn, *args):
        """Run a collective of this placement's group after those asked for before it."""
        if self._executor is None:
            return fn(*args)
        return self._executor.submit(fn, *args).result()

    def micro_batches(self, looked: _Step, batch) -> list:
        """D-interleaving: (looked, part) pairs of the batch's micro-batches, whose embedding
        gradients the update sums (one update per batch); the first part's lookup starts now, and
        each later one while the dense model computes the part before it."""
        # every trainer takes as many rounds, whatever its batch holds (a part may be empty: a
        # partial batch, or a lockstep trainer whose stream ran dry), or their AllToAlls would not pair
        parts = self.options.micro_batches if self.interleaving and looked.train else 1
        if parts <= 1:
            return [(looked, batch)]
        bounds = np.linspace(0, batch.batch_size, parts + 1).round().astype(int)
        looked.parts = [batch.slice_rows(int(a), int(b)) for a, b in zip(bounds, bounds[1:])]
        looked.futures = [None] * parts
        looked.futures[0] = self._submit(looked, 0)
        return [(_Part(looked, i), part) for i, part in enumerate(looked.parts)]

    def _submit(self, step: _Step, index: int):
        if self._executor is None:
            return self._round(step.parts[index], step.train, False)
        return self._executor.submit(self._round, step.parts[index], step.train, False)

    def inputs(self, looked, batch, requires_grad: bool) -> EmbeddingInputs:
        if isinstance(looked, _Part):
            step = looked.step
            future = step.futures[looked.index]
            if looked.index + 1 < len(step.parts):
                step.futures[looked.index + 1] = self._submit(step, looked.index + 1)
            rnd = future.result() if isinstance(future, concurrent.futures.Future) else future
        else:
            step = looked
            rnd = self._call(self._round, batch, looked.train and requires_grad, False)
        if rnd.train:
            step.rounds.append(rnd)
        if self.packing:
            outputs = [rnd.outputs[side] for side in self.sides]
            if rnd.train:
                made = _ShardedFunction.apply(self._anchor, _PackedBackward(self, step, rnd), tuple(self.sides),
                                              *outputs)
                made = made if isinstance(made, tuple) else (made,)
            else:
                made = tuple(torch.from_numpy(o) for o in outputs)
            out = dict(zip(self.sides, made))
            rnd.ops.torch += 1
        else:
            out = rnd.outputs
        wide = out.get("wide")
        if wide is not None:
            wide = wide.view(wide.shape[0], wide.shape[1])
            rnd.ops.torch += 1
        if rnd.train:
            self.ops.add(rnd.ops)
        return EmbeddingInputs(out.get("deep"), wide)

    # ------------------------------------------------------------ lookup rounds
    def _round(self, batch, train: bool, closing: bool) -> _Round:
        rnd = _Round(batch, train, False)
        with torch.no_grad():
            if self.packing:
                self._round_packed(rnd, closing)
            else:
                self._round_unpacked(rnd, closing)
        if not train:
            self.eval_ops.add(rnd.ops)
        return rnd

    def _flags(self, rnd: _Round, closing: bool, counts: list[np.ndarray]) -> np.ndarray:
        """The round's header, exchanged first: per rank (closing, train) and the key counts."""
        W = self.world.size
        header = np.zeros((W, 2 + sum(c.shape[1] for c in counts)), np.int64)
        header[:, 0], header[:, 1] = int(closing), int(rnd.train)
        col = 2
        for c in counts:
            header[:, col:col + c.shape[1]] = c
            col += c.shape[1]
        received, _ = self.comm.alltoall(header, [1] * W, [1] * W, rnd.ops, self._purpose(rnd))
        rnd.all_closing = bool(received[:, 0].all())
        return received

    @staticmethod
    def _purpose(rnd: _Round) -> str:
        return "train" if rnd.train else "eval"

    def _mode(self, header: np.ndarray) -> int:
        return K.MODE_TRAIN if header[:, 1].any() else K.MODE_FIND

    def _round_packed(self, rnd: _Round, closing: bool) -> None:
        W, batch, ops, purpose = self.world.size, rnd.batch, rnd.ops, self._purpose(rnd)
        sends = []
        for pi, pack in enumerate(self.packs):
            T = len(pack.tables)
            if batch is None:
                rnd.packs.append(_PackRound(None, None, np.zeros((W, T), np.int64)))
                sends.append(np.empty(0, np.uint64))
                continue
            sp = batch.sparse
            hot = self.hot_sets[pi]
            positions = pack.positions(sp.names)
            slots = np.empty(len(sp.values), np.int64)
            send_keys = np.empty(len(sp.values), np.uint64)
            counts = np.empty((W, T), np.int64)
            nuniq, hits = np.empty(T, np.int64), np.empty(T, np.int64)
            with self._kernel_lock:
                sent = P.unique_partition(sp.values, sp.offsets, sp.batch_size, positions, pack.tab_seg,
                                          pack.table_index, pack.salts, W, hot.index_keys, hot.index_tables,
                                          hot.index_rows, slots, send_keys, counts, nuniq, hits)
            ops.native += 1
            if self.hybrid is not None and rnd.train:
                self.hybrid.record_hits(int(hits.sum()), int(nuniq.sum()))
            rnd.packs.append(_PackRound(slots, positions, counts))
            sends.append(send_keys[:sent])
        header = self._flags(rnd, closing, [pr.counts for pr in rnd.packs])
        mode = self._mode(header)
        col = 2
        for pr in rnd.packs:
            T = pr.counts.shape[1]
            pr.recv_counts = np.ascontiguousarray(header[:, col:col + T])
            col += T
        # keys to their owners: every pack's exchange is started before any is probed when the
        # packs are pipelined (K-interleaving), else one pack after the other
        keys = [None] * len(self.packs)
        for pi, pr in enumerate(rnd.packs):
            keys[pi] = self.comm.alltoall(sends[pi], pr.counts.sum(1), pr.recv_counts.sum(1), ops, purpose,
                                          async_op=self.pipelined)
        rows_back = [None] * len(self.packs)
        for pi, (pack, pr) in enumerate(zip(self.packs, rnd.packs)):
            recv_keys, work = keys[pi]
            if work is not None:
                work.wait()
            send_rows = self._owner_probe(pack, pr, recv_keys, mode, ops)
            rows_back[pi] = self.comm.alltoall(send_rows, pr.recv_counts.sum(1), pr.counts.sum(1), ops, purpose,
                                               async_op=self.pipelined)
        if batch is None:
            for _, work in rows_back:
                if work is not None:
                    work.wait()
            return
        sp = batch.sparse
        for side in self.sides:
            dim = next(p.dim for p in self.packs if p.side == side)
            rnd.outputs[side] = np.empty((sp.batch_size, len(self.names), dim), np.float32)
            ops.native += 1
        for pi, (pack, pr) in enumerate(zip(self.packs, rnd.packs)):
            recv_rows, work = rows_back[pi]
            if work is not None:
                work.wait()
            with self._kernel_lock:
                P.stitch(sp.offsets, sp.batch_size, pr.positions, pack.seg_col, pack.seg_table, pr.slots,
                         recv_rows, self.hot_sets[pi].arrays.table, pack.pool_modes, rnd.outputs[pack.side])
            ops.native += 1

    def _owner_probe(self, pack: _Pack, pr: _PackRound, recv_keys: np.ndarray, mode: int,
                     ops: OpCounts) -> np.ndarray:
        """Probe the owner's stores with the keys the ranks sent; the rows to send back."""
        n = len(recv_keys)
        T = len(pack.tables)
        pr.perm, pr.tspan = np.empty(n, np.int64), np.empty(T + 1, np.int64)
        out_rows = np.empty(n, np.int32)
        pr.inverse, pr.uniq_rows = np.empty(n, np.int32), np.empty(n, np.int32)
        pr.uniq_keys, pr.nuniq = np.empty(n, np.uint64), np.zeros(T, np.int64)
        send_rows = np.empty((n, pack.dim), np.float32)
        with self._kernel_lock:
            P.group_by_table(pr.recv_counts, pr.perm, pr.tspan)
            ops.native += 1
            if n == 0:
                return send_rows
            with _locks(pack.stores):
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

    def _round_unpacked(self, rnd: _Round, closing: bool) -> None:
        """The plain model-parallel lookup: each table on its own, with separate operations for
        unique, route, partition, AllToAll of counts, keys and rows, gather and pooling."""
        W, batch, ops, purpose = self.world.size, rnd.batch, rnd.ops, self._purpose(rnd)
        header = self._flags(rnd, closing, [])
        mode = self._mode(header)
        outputs: dict[str, list] = {side: [None] * len(self.names) for side in self.sides}
        sp = None if batch is None else batch.sparse
        for side, table, columns in self.unpacked:
            store = self.stores[table]
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
            recv_counts, _ = self.comm.alltoall(counts.reshape(W, 1), [1] * W, [1] * W, ops, purpose)
            recv_counts = recv_counts.reshape(W)
            recv_keys, _ = self.comm.alltoall(keys_u, counts, recv_counts, ops, purpose)
            rows = np.empty((len(recv_keys), store.dim), np.float32)
            if len(recv_keys):
                found = store.lookup(np.ascontiguousarray(recv_keys), insert=mode != K.MODE_FIND)
                K.gather_rows(store.rows, found.rows, rows)
                ops.native += 2
            recv_rows, _ = self.comm.alltoall(rows, recv_counts, counts, ops, purpose)
            tr = _TableRound(order, counts, recv_counts, recv_keys)
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
        for side in self.sides:
            with torch.enable_grad():
                rnd.outputs[side] = torch.stack(outputs[side], dim=1)
            ops.torch += 1

    # ------------------------------------------------------------ update
    def update(self, step: _Step) -> int:
        """Every trainer's gradients of the step to the owners, one optimizer step per table (and
        the hot rows' AllReduced step); returns the updates dropped (rows evicted meanwhile)."""
        ops = OpCounts()
        dropped = self._call(self._update_packed if self.packing else self._update_unpacked, step, ops)
        if self.hybrid is not None:
            self._call(self.hybrid.after_step, ops)
        self.ops.add(ops)
        self.steps += 1
        self.dropped += dropped
        return dropped

    def _update_packed(self, step: _Step, ops: OpCounts) -> int:
        W, rounds = self.world.size, step.rounds
        dropped = 0
        for pi, pack in enumerate(self.packs):
            prs = [rnd.packs[pi] for rnd in rounds]
            for pr in prs:
                if pr.send_grad is None:  # the loss did not reach this side
                    pr.send_grad = np.zeros((int(pr.counts.sum()), pack.dim), np.float32)
            send_splits = sum(pr.counts.sum(1) for pr in prs)
            recv_splits = sum(pr.recv_counts.sum(1) for pr in prs)
            if len(prs) == 1:
                send = prs[0].send_grad
            else:  # rank-major for the AllToAll: each rank's rows of every round together
                send = np.concatenate([pr.send_grad[a:b] for w in range(W) for pr in prs
                                       for a, b in [_span(pr.counts.sum(1), w)]])
                ops.native += 1
            recv, _ = self.comm.alltoall(send, send_splits, recv_splits, ops, "train")
            if len(prs) > 1:  # back to round-major, each round's rows as its probe saw them
                per_rank = np.concatenate([[0], np.cumsum(recv_splits)])
                pieces, cursor = [[] for _ in prs], per_rank[:-1].copy()
                for w in range(W):
                    for r, pr in enumerate(prs):
                        n = int(pr.recv_counts[w].sum())
                        pieces[r].append(recv[cursor[w]:cursor[w] + n])
                        cursor[w] += n
                recv = np.concatenate([np.concatenate(p) if p else np.empty((0, pack.dim), np.float32)
                                       for p in pieces])
                ops.native += 1
            sizes = [int(pr.recv_counts.sum()) for pr in prs]
            base = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
            join = (lambda name: getattr(prs[0], name)) if len(prs) == 1 else \
                (lambda name: np.concatenate([getattr(pr, name) for pr in prs]))
            dropped_t = np.zeros(len(pack.tables), np.int64)
            with self._kernel_lock, _locks(pack.stores):
                ok = P.owner_apply(pack.arrays.table, pack.icfg, pack.fcfg, pack.opt_codes, pack.opt_params,
                                   np.ascontiguousarray(recv), base, join("perm"), np.stack([pr.tspan for pr in prs]),
                                   join("inverse"), join("uniq_rows"), join("uniq_keys"),
                                   np.stack([pr.nuniq for pr in prs]), dropped_t)
            ops.native += 1
            if not ok:
                raise ValueError("embedding gradient contains NaN or inf; the update was refused and no row changed")
            dropped += int(dropped_t.sum())
        if any(h.total for h in self.hot_sets):
            self._update_hot(step, ops)
        return dropped

    def _update_hot(self, step: _Step, ops: OpCounts) -> None:
        """The hot rows' gradients summed over the trainers (one AllReduce for every pack), then
        the same optimizer step on every trainer's copy."""
        buffers = [step.hot_grad.get(pi) for pi in range(len(self.packs))]
        buffers = [np.zeros((h.total, p.dim + 1), np.float32) if b is None else b
                   for b, h, p in zip(buffers, self.hot_sets, self.packs)]
        flat = np.concatenate([b.ravel() for b in buffers])
        ops.native += 1
        self.comm.allreduce(flat, ops, "train")
        start = 0
        with self._kernel_lock:
            for pack, hot, b in zip(self.packs, self.hot_sets, buffers):
                summed = flat[start:start + b.size].reshape(b.shape)
                start += b.size
                if hot.total == 0:
                    continue
                steps = np.array([s.step for s in pack.stores], np.int64)
                P.hot_apply(hot.arrays.table, hot.counts, hot.base, summed, pack.icfg, pack.fcfg, pack.opt_codes,
                            pack.opt_params, steps)
                ops.native += 1

    def _update_unpacked(self, step: _Step, ops: OpCounts) -> int:
        W, dropped = self.world.size, 0
        for ti, (side, table, _) in enumerate(self.unpacked):
            store = self.stores[table]
            keys, grads = [], []
            for rnd in step.rounds:
                tr = rnd.packs[ti]
                leaf_grad = None if tr.leaf is None else tr.leaf.grad
                send = (np.zeros((len(tr.order), store.dim), np.float32) if leaf_grad is None
                        else leaf_grad.numpy()[tr.order] * np.float32(1.0 / W))
                ops.native += 2
                recv, _ = self.comm.alltoall(send, tr.counts, tr.recv_counts, ops, "train")
                keys.append(tr.recv_keys)
                grads.append(recv)
            keys = np.concatenate(keys) if len(keys) > 1 else keys[0]
            grads = np.concatenate(grads) if len(grads) > 1 else grads[0]
            dropped += store.push(np.ascontiguousarray(keys), np.ascontiguousarray(grads, np.float32))
            ops.native += 3  # probe, gradient scatter, optimizer
        return dropped

    # ------------------------------------------------------------ closing
    def close_connection(self) -> None:
        """Answer the other trainers' lookups, looking up nothing, until every trainer closed."""
        if self.world.size == 1:
            return
        while not self._call(self._round, None, False, True).all_closing:
            pass

    # ------------------------------------------------------------ checkpoints
    def stage(self, root: Path, step: int) -> None:
        """Every trainer, before the leader assembles checkpoint `step` under `root`: the hot rows
        written back to their owners, then this trainer's shard of every table written to
        <root>/.sharded-step-<step>/shard-<rank>-of-<W>/<table>/, where the leader's `save` takes
        it from (all trainers must see the same file system, as PS servers writing their shards
        do)."""
        self._staged = Path(root) / f".sharded-step-{step:09d}"
        self._call(self._stage_shard, self._staged)

    def _stage_shard(self, staged: Path) -> None:
        if self.hybrid is not None:
            self.hybrid.write_back()
        shard = shard_directory(staged, self.world.rank, self.world.size)
        shutil.rmtree(shard, ignore_errors=True)
        for table, store in self.stores.items():
            store.save(shard / table)

    def save(self, directory: Path) -> None:
        """The leader: move every trainer's staged shard into the checkpoint's `directory`
        (<directory>/shard-<rank>-of-<W>/<table>/, the layout PS servers write)."""
        staged, self._staged = getattr(self, "_staged", None), None
        directory = Path(directory)
        if staged is None and self.world.size == 1:  # nobody else holds a shard: written in place
            self._call(self._stage_shard, directory)
            return
        if staged is None:
            raise RuntimeError("sharded: save() before stage(): every trainer stages its shard first")
        directory.mkdir(parents=True, exist_ok=True)
        expected = {shard_directory(directory, r, self.world.size).name for r in range(self.world.size)}
        for shard in sorted(staged.glob("shard-*-of-*")):
            if shard.name in expected:
                shard.replace(directory / shard.name)
        shutil.rmtree(staged, ignore_errors=True)
        missing = sorted(expected - {p.name for p in directory.iterdir()})
        if missing:
            raise RuntimeError(f"sharded: the shards {missing} were not staged for {directory}; every trainer "
                               f"writes its shard under the checkpoint root, which they must all see")

    def load(self, directory: Path) -> None:
        """This trainer's keys (by the route hash for this number of trainers) from every shard of
        a checkpoint written by any number of trainers (`load_resharded`); no collective, so the
        leader may load while choosing a checkpoint and the others after it chose."""
        directory = Path(directory)
        shards = sorted(p for p in directory.glob("shard-*-of-*") if p.is_dir())
        if not shards:
            raise ValueError(f"{directory}: no shard-*-of-* directories; not a checkpoint of the sharded placement")
        loaded = {table: load_resharded([s / table for s in shards], self.world.rank, self.world.size,
                                        table_route_id(table), capacity=store.config.capacity, num_threads=1)
                  for table, store in self.stores.items()}
        self.stores = loaded
        for pack in self.packs:
            pack.bind(self.stores)
        self.hot_sets = [HotSet.empty(p) for p in self.packs]
        if self.hybrid is not None:
            self.hybrid.reset()

    def expire(self, step: int, now: float) -> int:
        """This trainer's shard of every table with `expire_after`, swept on the thread that runs
        the placement's lookups (so none is in flight)."""
        return self._call(lambda: sum(store.expire(step, now) for store in self.stores.values()
                                      if store.config.expire_after is not None))

    # ------------------------------------------------------------ facts
    def facts(self) -> dict:
        out = {"packs": [{"side": p.side, "dim": p.dim, "tables": len(p.tables)} for p in self.packs]
               if self.packing else len(self.unpacked),
               "ops_per_step": self.ops.as_dict(self.steps),
               "embedding_rows": {side: sum(len(self.stores[t]) for t in self._side_tables(side))
                                  for side in self.sides}}
        if self.hybrid is not None:
            out.update(self.hybrid.facts())
        return out

    def _side_tables(self, side: str) -> list[str]:
        mapping = self.tables.deep_map if side == "deep" else self.tables.wide_map
        return sorted(set(mapping.values()))

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)


def _columns(names: list[str], mapping: dict) -> dict[str, list[tuple[str, int]]]:
    """table -> the (feature, output column) pairs it serves."""
    out: dict[str, list] = {}
    for column, name in enumerate(names):
        if name in mapping:
            out.setdefault(mapping[name], []).append((name, column))
    return out


def _span(splits, w: int) -> tuple[int, int]:
    start = int(np.sum(splits[:w]))
    return start, start + int(splits[w])


class _locks:
    """Hold the locks of some stores (one when they share it)."""

    def __init__(self, stores):
        self._locks = list({id(s.lock): s.lock for s in stores}.values())

    def __enter__(self):
        for lock in self._locks:
            lock.acquire()

    def __exit__(self, *exc):
        for lock in reversed(self._locks):
            lock.release()


PLACEMENT = ShardedPlacement
