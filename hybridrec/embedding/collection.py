"""EmbeddingCollection: the torch.nn.Module that turns jagged ID features into embeddings.

Features map to tables (several features may share one table: their IDs are probed together so a
shared row gets one update with the summed gradient). The forward pass probes each table's
`EmbeddingStore` once per batch and pools per feature; the backward pass scatters the output
gradient onto the batch's unique rows and applies the table's fused sparse optimizer right there
(optimizer-in-backward, as TorchRec's fused tables do). A training step is therefore
`loss.backward()` plus the dense optimizer's step; the embedding rows are not torch parameters.
"""
from __future__ import annotations

import dataclasses
import math
import sys
import threading
from types import MappingProxyType
from typing import Mapping

import numpy as np
import torch

from hybridrec.data.batch import check_array

from . import group_kernels as GK
from . import kernels as K
from .cache_hints import CACHE_LINE
from .memory import aligned_empty
from .store import EmbeddingStore, Lookup, check_keys
from .table_arrays import TableArrays
from .table import TableConfig, closest_hint


@dataclasses.dataclass
class _TablePass:
    """One table's share of a batch: its lookup and where each of its features' IDs sit."""

    store: EmbeddingStore
    lookup: Lookup
    features: list  # (output group, column in the group, offsets into the table's keys)


_LAYOUTS_KEPT = 64  # batch layouts whose feature positions a collection remembers
_UNDECIDED = object()  # _group_for: these feature names were not asked for yet


class _StoreLocks:
    """Holds every store's lock, taken in one fixed order, while a group kernel mutates them.
    Plain acquire/release over a list made once, with no generator frames around them (an
    ExitStack would add one per lock, twice per step). A lock that several stores
    share is taken once: the stores a collection creates, or is given by `replace_store`, share
    one (`share_lock`)."""

    def __init__(self, stores):
        self._locks = list({id(store.lock): store.lock for store in stores}.values())

    def __enter__(self):
        taken = 0
        try:
            for lock in self._locks:
                lock.acquire()
                taken += 1
        except BaseException:
            for lock in reversed(self._locks[:taken]):
                lock.release()
            raise
        return self

    def __exit__(self, *exc_info):
        for lock in reversed(self._locks):
            lock.release()


def _lock_of(stores):
    """What a group kernel holds while it mutates `stores`: their one lock when they share one
    (the stores of a collection do), used directly as a context manager, else a `_StoreLocks`."""
    locks = {id(store.lock): store.lock for store in stores}
    return next(iter(locks.values())) if len(locks) == 1 else _StoreLocks(stores)


class _TableGroup:
    """The fast path: tables that each serve one feature, probed and updated in one kernel call
    per phase (group_kernels.py). Holds the stores' arrays as one address table, made once: a
    store keeps its arrays for life (its index grows inside a full-size array). Scratch arrays that
    live only inside one kernel call (the unique rows' gradient, each key's row) are kept between
    calls (`_scratch`): allocated anew each step, their megabytes would be page-faulted in again
    every time. The pooled output array is reused too once nothing refers to it any more
    (`_output`)."""

    def __init__(self, stores: list, tables: list):
        self.stores, self.tables = stores, tables  # tables: the stores' names, for error messages
        self.lock = _lock_of(stores)
        self.arrays = TableArrays(stores)
        self.rooms = np.empty(len(stores), np.int64)
        self._refresh_rooms()
        self._scratch_arrays: dict[str, np.ndarray] = {}
        self._outputs: list = [None, None]
        cfgs = [s.config for s in stores]
        self.icfg = np.stack([s.icfg for s in stores])
        self.fcfg = np.stack([s.fcfg for s in stores])
        self.seeds = np.array([c.seed for c in cfgs], dtype=np.uint64)
        self.pool_modes = np.array([s.pool_mode for s in stores], dtype=np.int64)
        self.opt_codes = np.array([s.opt_code for s in stores], dtype=np.int64)
        self.opt_params = np.stack([s.opt_params for s in stores])

    def _refresh_rooms(self):
        """Sets `rooms` to the keys each store's index may hold before it must grow. A store may
        grow outside this group too (a direct `pull`); a room read before that is only smaller
        than the store's, so the kernel asks for `_service` once more and this catches up."""
        self.rooms[:] = [s.index_room for s in self.stores]

    def _scratch(self, name: str, shape: tuple, dtype) -> np.ndarray:
        """A reusable uninitialised array; callers hold the stores' locks while they use it."""
        arr = self._scratch_arrays.get(name)
        size = math.prod(shape)
        if arr is None or arr.size < size or arr.dtype != dtype:
            arr = self._scratch_arrays[name] = aligned_empty((max(size, 1),), dtype, CACHE_LINE)
        return arr[:size].reshape(shape)

    def _output(self, bsz: int, dim: int) -> np.ndarray:
        """The [bsz, tables, dim] array to pool into, 64-byte aligned (a 64-byte row is one line):
        one of the last two handed out that nothing refers to any more (the tensor made from it,
        and every view of that, are gone; CPython's reference count says so exactly), else a new
        one in the place of the older: a new array each step means fresh pages, faulted in while
        the caches are cold. Two, because the pipelined step pools the next batch while the
        current one's output is still in use."""
        shape = (bsz, len(self.stores), dim)
        for i in range(len(self._outputs)):
            out = self._outputs[i]
            if out is not None and sys.getrefcount(out) == 3 and out.shape == shape:  # the list, `out`, the argument
                self._outputs.append(self._outputs.pop(i))  # the newest last
                return out
        out = aligned_empty(shape, np.float32, CACHE_LINE)
        self._outputs = [self._outputs[1], out]
        return out

    def forward(self, features, positions, bsz, dim, train, pool=True):
        """Pooled [bsz, tables, dim] output of the features at `positions` in the batch (one per
        table, in table order) and the pass its backward needs; without `pool` the output is
        left for `pool` to fill."""
        keys = features.values
        offsets = features.offsets
        n = keys.shape[0]
        ntab = positions.shape[0]
        inverse = np.empty(n, np.int32)
        uniq_rows = np.empty(n, np.int32)
        uniq_keys = np.empty(n, np.uint64)
        spans = np.empty((3, ntab), np.int64)  # filled by the kernel (group_kernels.SPAN_*)
        nuniq = np.zeros(ntab, np.int64)
        out = self._output(bsz, dim)
        mode = K.MODE_TRAIN if train else K.MODE_FIND
        with self.lock:
            out_rows = self._scratch("out_rows", (n,), np.int32)  # each key's row, read only by the pooling
            for _ in range(2):  # a second call only after _service
                status = GK.lookup_pool_tables(
                    keys, offsets, positions, bsz, self.arrays.table, self.icfg, self.fcfg, self.seeds,
                    self.pool_modes, mode, self.rooms, out_rows, inverse, uniq_rows, uniq_keys, spans, nuniq, out, pool)
                if status != GK.NEEDS_SERVICE:
                    break
                self._service(spans, train)
                self._refresh_rooms()
            else:
                raise RuntimeError("embedding tables still ask for index room or an epoch restart after "
                                   "being given them; this is a bug in hybridrec")
        if status > 0:
            raise self.stores[status - 1].batch_too_large_error(self.tables[status - 1])
        return out, _GroupPass(self, inverse, spans, offsets, bsz, uniq_rows, uniq_keys, nuniq)

    def pool(self, gpass, out) -> None:
        """Pool a batch `forward` probed without pooling into `out`, from the rows as they are now."""
        with self.lock:
            row_ids = self._scratch("out_rows", gpass.inverse.shape, np.int32)
            GK.pool_tables(gpass.inverse, gpass.uniq_rows, gpass.spans, gpass.offsets, gpass.bsz, self.arrays.table,
                           self.pool_modes, row_ids, out)

    def _service(self, spans, train):
        """What the kernel asked for: room in each index for its segment, fresh epoch counts."""
        for store, lo, hi in zip(self.stores, spans[GK.SPAN_LO].tolist(), spans[GK.SPAN_HI].tolist()):
            if train:
                store.make_index_room(hi - lo)
            store.restart_epoch_count_if_due()


@dataclasses.dataclass
class _GroupPass:
    group: _TableGroup
    inverse: np.ndarray
    spans: np.ndarray
    offsets: np.ndarray
    bsz: int
    uniq_rows: np.ndarray
    uniq_keys: np.ndarray
    nuniq: np.ndarray

    def backward(self, grad: np.ndarray) -> None:
        g = self.group
        dropped = np.zeros(len(g.stores), np.int64)
        with g.lock:
            ugrad = g._scratch("ugrad", (self.inverse.shape[0], grad.shape[2]), np.float32)
            ok = GK.backward_tables(grad, self.inverse, self.spans, self.offsets, self.bsz, g.arrays.table,
                                    self.uniq_rows, self.uniq_keys, self.nuniq, ugrad, g.icfg, g.fcfg, g.opt_codes,
                                    g.opt_params, g.pool_modes, dropped)
        if not ok:
            raise ValueError("embedding gradient contains NaN or inf; the update was refused and no row changed")


class _FusedEmbeddingFunction(torch.autograd.Function):
    """Outputs are computed before, as numpy arrays, and become tensors here; backward hands
    their gradient to the stores' optimizers. (Made outside and passed in, a tensor that forward
    returns would be an input, which autograd then wraps as a view of itself, at a cost in forward
    and again in backward.)"""

    @staticmethod
    def forward(ctx, anchor, passes, *outputs):
        ctx.passes = passes
        tensors = tuple(torch.from_numpy(o) for o in outputs)
        return tensors if len(tensors) > 1 else tensors[0]

    @staticmethod
    def backward(ctx, *grads):
        grads = [None if g is None else g.detach().to("cpu", torch.float32).contiguous().numpy() for g in grads]
        if isinstance(ctx.passes, LookedAhead):
            ctx.passes.grads = grads  # applied later, by `EmbeddingCollection.apply_ahead`
        else:
            _apply_passes(ctx.passes, grads)
        ctx.passes = None
        return (None, None) + (None,) * len(grads)


def _apply_passes(passes, grads: list) -> None:
    """The stores' optimizer steps for the gradients of one lookup's pooled outputs."""
    if isinstance(passes, _GroupPass):
        passes.backward(grads[0])
        return
    for tp, ugrad in _table_grads(passes, grads):
        tp.store.apply(tp.lookup, ugrad)


def _table_grads(passes: list, grads: list):
    """(table pass, the gradient summed onto its unique rows) of each table the gradients reach."""
    for tp in passes:
        ugrad = np.zeros((tp.lookup.num_unique, tp.store.dim), np.float32)
        used = False
        for group, column, offsets in tp.features:
            if grads[group] is not None:
                tp.store.pooled_grad(tp.lookup, offsets, grads[group], ugrad, column=column)
                used = True
        if used:
            yield tp, ugrad


def _shared_rows(before: Lookup, after: Lookup) -> int:
    """Rows both lookups of one store found holding the same key."""
    _, i, j = np.intersect1d(before.uniq_keys, after.uniq_keys, assume_unique=True, return_indices=True)
    rows = before.uniq_rows[i]
    return int(np.count_nonzero((rows >= 0) & (rows == after.uniq_rows[j])))


@dataclasses.dataclass
class LookedAhead:
    """A training batch's rows, looked up (keys inserted) ahead of its step by
    `EmbeddingCollection.look_ahead` and pooled by `pool_ahead`. The tensor `attach` makes
    records its gradient here in backward, and `apply_ahead` applies it later, so the lookup and
    the update may run on another thread than the dense step."""

    passes: object  # the _GroupPass, or the _TablePass of each table
    outputs: list  # numpy arrays, one per group of features, pooled by pool_ahead
    grads: list | None = None  # set by backward, taken by apply_ahead

    @property
    def unique_rows(self) -> int:
        """Distinct rows the batch reads, over its tables."""
        if isinstance(self.passes, _GroupPass):
            return int(self.passes.nuniq.sum())
        return sum(tp.lookup.num_unique for tp in self.passes)

    def unique_grads(self) -> list[tuple[EmbeddingStore, np.ndarray, np.ndarray, np.ndarray]]:
        """(store, the batch's distinct rows of it, their keys, each row's summed gradient) per
        table: the update backward recorded, summed as `apply_ahead` sums it, left unapplied for
        a caller that applies it in parts (`EmbeddingStore.apply` of some rows: the staleness
        lab replays each PS shard's share of an update when that shard applied it). Empty when
        the batch was not trained."""
        grads, p = self.grads, self.passes
        if grads is None:
            return []
        if not isinstance(p, _GroupPass):
            return [(tp.store, tp.lookup.uniq_rows, tp.lookup.uniq_keys, ugrad) for tp, ugrad in _table_grads(p, grads)]
        ugrad = np.zeros((p.inverse.shape[0], grads[0].shape[2]), np.float32)
        every = Lookup(p.inverse, p.inverse, p.uniq_rows, p.uniq_keys)  # unique-row numbers over all the tables
        out = []
        for t, store in enumerate(p.group.stores):
            base, lo, n = int(p.spans[GK.SPAN_BASE, t]), int(p.spans[GK.SPAN_LO, t]), int(p.nuniq[t])
            store.pooled_grad(every, p.offsets[base:base + p.bsz + 1], grads[0], ugrad, column=t)
            out.append((store, p.uniq_rows[lo:lo + n], p.uniq_keys[lo:lo + n], ugrad[lo:lo + n]))
        return out

    def rows_by_store(self) -> list[tuple[EmbeddingStore, np.ndarray]]:
        """(store, its distinct rows this batch reads) per table: which rows its update will
        change (a row evicted since the lookup is skipped then)."""
        p = self.passes
        if isinstance(p, _GroupPass):
            lows = p.spans[GK.SPAN_LO].tolist()
            return [(store, p.uniq_rows[lo:lo + n]) for store, lo, n in zip(p.group.stores, lows, p.nuniq.tolist())]
        return [(tp.store, tp.lookup.uniq_rows) for tp in p]


class EmbeddingCollection(torch.nn.Module):
    """Pooled embeddings of named sparse features, backed by `EmbeddingStore` tables.

    Args:
        tables: table name -> `TableConfig` (or a dict of its fields).
        feature_to_table: feature name -> table name; by default each table serves the feature of
            the same name. Features are output in this mapping's order.
        shm_prefix: when set, table `t` lives in named shared memory `{shm_prefix}-{t}`
            (attached if it already exists), so it survives the process.

    `forward(features)` returns {feature: Tensor[B, dim]}; `forward_stacked(features)` returns one
    Tensor[B, F, dim] when all features have the same dim (what the CTR models take). In training
    mode with grad enabled, new IDs are inserted and backward applies the optimizers; otherwise the
    stores are only read (unknown IDs read as zeros).
    """

    def __init__(self, tables: Mapping[str, TableConfig | dict], feature_to_table: Mapping[str, str] | None = None,
                 shm_prefix: str | None = None):
        super().__init__()
        if not tables:
            raise ValueError("tables: at least one table is needed")
        configs = {name: cfg if isinstance(cfg, TableConfig) else TableConfig.from_dict(cfg) for name, cfg in tables.items()}
        mapping = dict(feature_to_table) if feature_to_table is not None else {name: name for name in configs}
        for feature, table in mapping.items():
            if table not in configs:
                raise ValueError(f"feature_to_table: feature {feature!r} names unknown table {table!r}"
                                 f"{closest_hint(table, configs)}; tables: {sorted(configs)}")
        unused = set(configs) - set(mapping.values())
        if unused:
            raise ValueError(f"tables: {sorted(unused)} are used by no feature in feature_to_table")
        self.feature_names = list(mapping)
        self.feature_to_table = mapping
        self._stores = {
            name: (EmbeddingStore.open_shared(f"{shm_prefix}-{name}", cfg) if shm_prefix else EmbeddingStore(cfg))
            for name, cfg in configs.items()
        }
        # read-only: a table changes store only through replace_store, which drops the one-call
        # groups made over the old stores (so the forward need not check them every call)
        self.stores = MappingProxyType(self._stores)
        self._lock = threading.RLock()  # shared by the stores: the one-call path takes one lock, not one per table
        for store in self.stores.values():
            store.share_lock(self._lock)
        self.dims = {f: configs[t].dim for f, t in mapping.items()}
        by_dim: dict[int, list] = {}
        for name in self.feature_names:
            by_dim.setdefault(self.dims[name], []).append(name)
        self._dim_groups = tuple(tuple(names) for names in by_dim.values())  # forward()'s outputs
        self._table_users = {t: list(mapping.values()).count(t) for t in configs}
        self._groups: dict = {}  # requested feature names -> their _TableGroup, or None (see _group_for)
        self._layouts: dict = {}  # (batch's feature names, requested names) -> positions, see _positions
        self._last_layout = None  # (batch's feature names, requested names, positions) of the last call
        # gives autograd a leaf that requires grad, so backward reaches the stores
        self._anchor = torch.nn.Parameter(torch.zeros(0), requires_grad=True)

    # ---------------------------------------------------------------- forward
    def _positions(self, features, names: tuple):
        """Validates the batch; returns its batch size and the position of each requested feature
        among the batch's features (int64 array, in the order of `names`). Written for few Python
        operations: each is slow right after the kernels have swept the caches."""
        # the exact-type test is the cheap one; anything else (an np.memmap too) gets the full check,
        # which raises naming what is wrong or lets an ndarray subclass of the right kind through
        values = features.values
        if type(values) is not np.ndarray or values.dtype != np.uint64 or values.ndim != 1:
            check_keys(values, "features.values")
        offsets = features.offsets
        if type(offsets) is not np.ndarray or offsets.dtype != np.int64 or offsets.ndim != 1:
            check_array("features.offsets", offsets, np.int64, 1)
        nfeat = len(features.names)
        if nfeat == 0 or (len(offsets) - 1) % nfeat:
            raise ValueError(f"features.offsets: length {len(offsets)} does not fit {nfeat} features")
        bsz = (len(offsets) - 1) // nfeat
        problem = K.offsets_problem(offsets, values.shape[0])
        if problem == K.OFFSETS_ENDS_WRONG:
            raise ValueError(f"features.offsets: must start at 0 and end at len(values)={len(values)}, "
                             f"got {offsets[0]} .. {offsets[-1]}")
        if problem >= 0:
            f = problem // bsz if bsz else 0
            raise ValueError(f"features.offsets: offsets[{problem + 1}] = {offsets[problem + 1]} < offsets[{problem}] = "
                             f"{offsets[problem]} (a negative length, in feature {features.names[min(f, nfeat - 1)]!r})")
        last = self._last_layout
        if last is not None and last[1] is names and features.names == last[0]:
            return bsz, last[2]
        layout = (tuple(features.names), names)
        positions = self._layouts.get(layout)
        if positions is None:
            position = {name: f for f, name in reversed(list(enumerate(layout[0])))}  # the first of a twice-given name
            for name in names:
                if name not in position:
                    raise ValueError(f"features: the batch has no feature {name!r}"
                                     f"{closest_hint(name, layout[0])}; it has {list(layout[0])}")
            if len(self._layouts) >= _LAYOUTS_KEPT:
                self._layouts.clear()
            positions = self._layouts[layout] = np.array([position[n] for n in names], dtype=np.int64)
        self._last_layout = (list(layout[0]), names, positions)
        return bsz, positions

    def _group_for(self, names: tuple):
        """The one-call fast path for these features, if each has a table of its own, in one
        partition and without a disk tier (else None: the per-table path serves them)."""
        group = self._groups.get(names, _UNDECIDED)
        if group is not _UNDECIDED:
            return group
        tables = [self.feature_to_table[n] for n in names]
        stores = [self.stores[t] for t in tables]
        eligible = len(set(tables)) == len(tables) and all(self._table_users[t] == 1 and s.nparts == 1
                                                           and s.disk_tier is None for t, s in zip(tables, stores))
        group = self._groups[names] = _TableGroup(stores, tables) if eligible else None
        return group

    def _run(self, features, groups: tuple):
        """groups: tuple of feature-name tuples, one output Tensor[B, len(g), dim] per group."""
        train = self.training and torch.is_grad_enabled()
        passes, outputs = self._lookup(features, groups, train)
        if not train:
            return [torch.from_numpy(o) for o in outputs]
        result = _FusedEmbeddingFunction.apply(self._anchor, passes, *outputs)
        return list(result) if isinstance(result, tuple) else [result]

    def _lookup(self, features, groups: tuple, train: bool, pool: bool = True):
        """(passes, pooled numpy outputs, one per group) of a batch; with `train`, new keys are
        inserted and the passes are what the update needs; without `pool` the outputs are left
        unfilled (`pool_ahead` fills them)."""
        names = groups[0] if len(groups) == 1 else tuple(n for g in groups for n in g)
        bsz, positions = self._positions(features, names)
        group = self._group_for(names) if len(groups) == 1 and bsz > 0 else None
        if group is not None:
            out, gpass = group.forward(features, positions, bsz, self.dims[names[0]], train, pool)
            return gpass, [out]
        offsets = features.offsets
        where = {n: offsets[f * bsz:(f + 1) * bsz + 1] for n, f in zip(names, positions.tolist())}
        outputs = [aligned_empty((bsz, len(g), self.dims[g[0]]), np.float32, CACHE_LINE) for g in groups]
        slot = {n: (gi, ci) for gi, g in enumerate(groups) for ci, n in enumerate(g)}
        by_table: dict[str, list] = {}
        for n in names:
            by_table.setdefault(self.feature_to_table[n], []).append(n)
        passes = []
        for table, feats in by_table.items():
            store = self.stores[table]
            if len(feats) == 1:
                seg = where[feats[0]]
                keys = features.values[seg[0]:seg[-1]]
                local = [seg - seg[0]]
            else:
                keys = np.concatenate([features.values[where[n][0]:where[n][-1]] for n in feats])
                local, base = [], 0
                for n in feats:
                    seg = where[n]
                    local.append(seg - seg[0] + base)
                    base += int(seg[-1] - seg[0])
            lookup = store.lookup(keys, insert=train)
            feats_info = []
            for n, offs in zip(feats, local):
                gi, ci = slot[n]
                if pool:
                    store.pool(lookup, offs, outputs[gi], column=ci)
                feats_info.append((gi, ci, offs))
            passes.append(_TablePass(store, lookup, feats_info))
        return passes, outputs

    def forward(self, features) -> dict[str, torch.Tensor]:
        tensors = self._run(features, self._dim_groups)
        out = {}
        for g, t in zip(self._dim_groups, tensors):
            for ci, n in enumerate(g):
                out[n] = t[:, ci, :]
        return {n: out[n] for n in self.feature_names}

    def forward_stacked(self, features, names: list[str] | None = None) -> torch.Tensor:
        """Tensor[B, F, dim] of the named features (default: all), which must share one dim."""
        return self._run(features, self._stacked(names))[0]

    def _stacked(self, names: list[str] | None) -> tuple:
        """The one group of features `forward_stacked` outputs."""
        if names is None and len(self._dim_groups) == 1:
            return self._dim_groups
        names = tuple(self.feature_names if names is None else names)
        for n in names:
            if n not in self.dims:
                raise ValueError(f"names: unknown feature {n!r}{closest_hint(n, self.dims)}")
        dims = {self.dims[n] for n in names}
        if len(dims) != 1:
            raise ValueError(f"forward_stacked: features have different dims {sorted(dims)}; use forward()")
        return (names,)

    def read_ahead(self, features, names: list[str] | None = None) -> int:
        """Fault in the disk-tier records that the lookup of batch `features` will touch
        (`EmbeddingStore.read_ahead`), for the named features' tables that have a tier; meant for
        a thread other than the one looking batches up. Returns the records touched."""
        tiered = {table for table, store in self.stores.items() if store.disk_tier is not None}
        if not tiered or not features.names:
            return 0
        bsz = (len(features.offsets) - 1) // len(features.names)
        position = {name: f for f, name in reversed(list(enumerate(features.names)))}
        keys: dict[str, list] = {}
        for name in self.feature_names if names is None else names:
            table, f = self.feature_to_table.get(name), position.get(name)
            if table in tiered and f is not None:
                keys.setdefault(table, []).append(features.values[features.offsets[f * bsz]:features.offsets[(f + 1) * bsz]])
        return sum(self.stores[table].read_ahead(np.concatenate(parts)) for table, parts in keys.items())

    # ---------------------------------------------------------------- a step in two threads
    def look_ahead(self, features, names: list[str] | None = None) -> LookedAhead:
        """forward_stacked's training lookup (keys inserted) without the pooling, which
        `pool_ahead` does later, and without the autograd node, which `attach` makes later,
        possibly in another thread."""
        return LookedAhead(*self._lookup(features, self._stacked(names), True, pool=False))

    def pool_ahead(self, ahead: LookedAhead, previous: LookedAhead | None = None) -> int:
        """Pool a looked-ahead batch from the rows as they are now (after the updates of the
        batches before it). Returns the rows it reads that `previous` (the batch trained just
        before it) updated: what a lookup before that update would have read stale (0 when
        `previous` is None)."""
        cur = ahead.passes
        prev = None if previous is None else previous.passes
        if isinstance(cur, _GroupPass):
            g = cur.group
            g.pool(cur, ahead.outputs[0])
            if not (isinstance(prev, _GroupPass) and prev.group is g):
                return 0
            with g.lock:
                return int(GK.count_shared_rows(prev.uniq_rows, prev.spans, prev.nuniq, cur.uniq_rows, cur.spans,
                                                cur.nuniq, g.arrays.table, g.icfg))
        for tp in cur:
            for group, column, offsets in tp.features:
                tp.store.pool(tp.lookup, offsets, ahead.outputs[group], column=column)
        if isinstance(prev, _GroupPass) or prev is None:
            return 0
        before = {id(tp.store): tp.lookup for tp in prev}
        return sum(_shared_rows(before[id(tp.store)], tp.lookup) for tp in cur if id(tp.store) in before)

    def attach(self, ahead: LookedAhead) -> torch.Tensor:
        """The Tensor[B, F, dim] of a looked-ahead batch, inside autograd; its backward records the
        gradient in `ahead` for `apply_ahead` and changes no row."""
        return _FusedEmbeddingFunction.apply(self._anchor, ahead, *ahead.outputs)

    def apply_ahead(self, ahead: LookedAhead) -> bool:
        """The optimizer steps of the gradient backward recorded in `ahead` (False: there was none,
        the batch was not trained)."""
        grads, ahead.grads = ahead.grads, None
        if grads is None:
            return False
        _apply_passes(ahead.passes, grads)
        return True

    # ---------------------------------------------------------------- persistence helpers
    def replace_store(self, table: str, store: EmbeddingStore) -> None:
        """Serve `table` from `store` from now on (e.g. one loaded from a checkpoint). It must have
        the table's dim; it takes the collection's shared lock, so the one-call path still takes
        one lock per phase. `stores` is read-only: this is the way to change one."""
        if table not in self.stores:
            raise ValueError(f"table: unknown table {table!r}{closest_hint(table, self.stores)}; "
                             f"tables: {sorted(self.stores)}")
        if store.dim != self.stores[table].dim:
            raise ValueError(f"store: table {table!r} has dim {self.stores[table].dim}, the new store has "
                             f"dim {store.dim}; a replacement must keep the dim")
        store.share_lock(self._lock)
        self._stores[table] = store
        self._groups.clear()  # they hold the old store's arrays

    def stats(self) -> dict:
        return {name: store.stats() for name, store in self.stores.items()}

    def extra_repr(self) -> str:
        return ", ".join(f"{t}: dim={s.dim} capacity={s.config.capacity} opt={s.config.optimizer.name}"
                         for t, s in self.stores.items())
