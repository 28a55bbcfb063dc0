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
import threading
from typing import Mapping

import numpy as np
import torch

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


class _StoreLocks:
    """Holds every store's lock, taken in one fixed order, while a group kernel mutates them.
    Plain acquire/release over a list made once, with no generator frames around them (an
    ExitStack of 26 locks cost ~20 us per call, twice per step). A lock that several stores
    share is taken once: the stores a collection creates, or is given by `replace_store`, share
    one (`share_lock`)."""

    def __init__(self, stores):
        self._locks = list({id(store._lock): store._lock for store in stores}.values())

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


class _TableGroup:
    """The fast path: tables that each serve one feature, probed and updated in one kernel call
    per phase (group_kernels.py). Holds the stores' arrays as one address table, made once: a
    store keeps its arrays for life (its index grows inside a full-size array). Scratch arrays that
    live only inside one kernel call (the unique rows' gradient, each key's row) are kept between
    calls (`_scratch`): allocated anew each step, their megabytes were page-faulted in again
    every time."""

    def __init__(self, stores: list):
        self.stores = stores
        self.locks = _StoreLocks(stores)
        self.arrays = TableArrays(stores)
        self.rooms = np.empty(len(stores), np.int64)
        self._refresh_rooms()
        self._scratch_arrays: dict[str, np.ndarray] = {}
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
        self.rooms[:] = [s._room for s in self.stores]

    def _scratch(self, name: str, shape: tuple, dtype) -> np.ndarray:
        """A reusable uninitialised array; callers hold the stores' locks while they use it."""
        arr = self._scratch_arrays.get(name)
        size = math.prod(shape)
        if arr is None or arr.size < size or arr.dtype != dtype:
            arr = self._scratch_arrays[name] = aligned_empty((max(size, 1),), dtype, CACHE_LINE)
        return arr[:size].reshape(shape)

    def forward(self, features, positions, bsz, dim, train):
        """Pooled [bsz, tables, dim] output of the features at `positions` in the batch (one per
        table, in table order) and the pass its backward needs."""
        offsets = features.offsets
        feat_base = positions * bsz
        seg_lo = offsets[feat_base]
        seg_hi = offsets[feat_base + bsz]
        n = features.values.shape[0]
        inverse = np.empty(n, np.int32)
        uniq_rows = np.empty(n, np.int32)
        uniq_keys = np.empty(n, np.uint64)
        nuniq = np.zeros(len(self.stores), np.int64)
        out = aligned_empty((bsz, len(self.stores), dim), np.float32, CACHE_LINE)  # a 64-byte row, one line
        mode = K.MODE_TRAIN if train else K.MODE_FIND
        with self.locks:
            out_rows = self._scratch("out_rows", (n,), np.int32)  # each key's row, read only by the pooling
            for _ in range(2):  # a second call only after _service
                status = GK.lookup_pool_tables(
                    features.values, seg_lo, seg_hi, feat_base, offsets, bsz, self.arrays.table, self.icfg,
                    self.fcfg, self.seeds, self.pool_modes, mode, self.rooms, out_rows, inverse, uniq_rows, uniq_keys,
                    nuniq, out)
                if status != GK.NEEDS_SERVICE:
                    break
                self._service(seg_lo, seg_hi, train)
                self._refresh_rooms()
            else:
                raise RuntimeError("embedding tables still ask for index room or an epoch restart after "
                                   "being given them; this is a bug in hybridrec")
        if status > 0:
            self.stores[status - 1]._raise_full()
        return out, _GroupPass(self, inverse, seg_lo, feat_base, offsets, bsz, uniq_rows, uniq_keys, nuniq)

    def _service(self, seg_lo, seg_hi, train):
        """What the kernel asked for: room in each index for its segment, fresh epoch counts."""
        for store, lo, hi in zip(self.stores, seg_lo.tolist(), seg_hi.tolist()):
            if train:
                store._reserve(hi - lo)
            store._check_epoch()


@dataclasses.dataclass
class _GroupPass:
    group: _TableGroup
    inverse: np.ndarray
    seg_lo: np.ndarray
    feat_base: np.ndarray
    offsets: np.ndarray
    bsz: int
    uniq_rows: np.ndarray
    uniq_keys: np.ndarray
    nuniq: np.ndarray

    def backward(self, grad: np.ndarray) -> None:
        g = self.group
        dropped = np.zeros(len(g.stores), np.int64)
        with g.locks:
            ugrad = g._scratch("ugrad", (self.inverse.shape[0], grad.shape[2]), np.float32)
            ok = GK.backward_tables(grad, self.inverse, self.seg_lo, self.feat_base, self.offsets, self.bsz,
                                    g.arrays.table, self.uniq_rows, self.uniq_keys, self.nuniq, ugrad, g.icfg, g.fcfg,
                                    g.opt_codes, g.opt_params, g.pool_modes, dropped)
        if not ok:
            raise ValueError("embedding gradient contains NaN or inf; the update was refused and no row changed")


class _FusedEmbeddingFunction(torch.autograd.Function):
    """Outputs are computed before, as numpy arrays, and become tensors here; backward hands
    their gradient to the stores' optimizers. (Made outside and passed in, a tensor that forward
    returns is an input, which autograd then wraps as a view of itself: ~40 us more per call
    with the caches cold, and ~20 us more in backward.)"""

    @staticmethod
    def forward(ctx, anchor, passes, *outputs):
        ctx.passes = passes
        tensors = tuple(torch.from_numpy(o) for o in outputs)
        return tensors if len(tensors) > 1 else tensors[0]

    @staticmethod
    def backward(ctx, *grads):
        grads = [None if g is None else g.detach().to("cpu", torch.float32).contiguous().numpy() for g in grads]
        if isinstance(ctx.passes, _GroupPass):
            ctx.passes.backward(grads[0])
            ctx.passes = None
            return (None, None) + (None,) * len(grads)
        for tp in ctx.passes:
            ugrad = np.zeros((tp.lookup.num_unique, tp.store.dim), np.float32)
            used = False
            for group, column, offsets in tp.features:
                if grads[group] is not None:
                    tp.store.pooled_grad(tp.lookup, offsets, grads[group], ugrad, column=column)
                    used = True
            if used:
                tp.store.apply(tp.lookup, ugrad)
        ctx.passes = None
        return (None, None) + (None,) * len(grads)


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
        self.stores = {
            name: (EmbeddingStore.open_shared(f"{shm_prefix}-{name}", cfg) if shm_prefix else EmbeddingStore(cfg))
            for name, cfg in configs.items()
        }
        self._lock = threading.RLock()  # shared by the stores: the one-call path takes one lock, not one per table
        for store in self.stores.values():
            store.share_lock(self._lock)
        self.dims = {f: configs[t].dim for f, t in mapping.items()}
        self._table_users = {t: list(mapping.values()).count(t) for t in configs}
        self._groups: dict = {}
        self._layouts: dict = {}  # (batch's feature names, requested names) -> positions, see _positions
        # gives autograd a leaf that requires grad, so backward reaches the stores
        self._anchor = torch.nn.Parameter(torch.zeros(0), requires_grad=True)

    # ---------------------------------------------------------------- forward
    def _positions(self, features, names):
        """Validates the batch; returns its batch size and the position of each requested feature
        among the batch's features (int64 array, in the order of `names`)."""
        if not isinstance(features.values, np.ndarray) or features.values.dtype != np.uint64:
            check_keys(features.values, "features.values")
        offsets = features.offsets
        if not isinstance(offsets, np.ndarray) or offsets.dtype != np.int64:
            raise TypeError(f"features.offsets: must be an int64 numpy array, got "
                            f"{getattr(offsets, 'dtype', type(offsets).__name__)}")
        nfeat = len(features.names)
        if nfeat == 0 or (len(offsets) - 1) % nfeat:
            raise ValueError(f"features.offsets: length {len(offsets)} does not fit {nfeat} features")
        bsz = (len(offsets) - 1) // nfeat
        if offsets[0] != 0 or offsets[-1] != len(features.values):
            raise ValueError(f"features.offsets: must start at 0 and end at len(values)={len(features.values)}, "
                             f"got {offsets[0]} .. {offsets[-1]}")
        bad = K.first_decrease(offsets)
        if bad >= 0:
            f = bad // bsz if bsz else 0
            raise ValueError(f"features.offsets: offsets[{bad + 1}] = {offsets[bad + 1]} < offsets[{bad}] = "
                             f"{offsets[bad]} (a negative length, in feature {features.names[min(f, nfeat - 1)]!r})")
        layout = (tuple(features.names), tuple(names))
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
        return bsz, positions

    def _group_for(self, names):
        """The one-call fast path for these features, if each has a table of its own."""
        key = tuple(names)
        known = self._groups.get(key)  # (tables, their stores, the group or None)
        if known is not None and list(map(self.stores.__getitem__, known[0])) == known[1]:
            return known[2]  # the same stores as when decided (a checkpoint load replaces them)
        tables = [self.feature_to_table[n] for n in key]
        stores = [self.stores[t] for t in tables]
        eligible = len(set(tables)) == len(tables) and all(self._table_users[t] == 1 and s.nparts == 1
                                                           for t, s in zip(tables, stores))
        self._groups[key] = (tables, stores, _TableGroup(stores) if eligible else None)
        return self._groups[key][2]

    def _run(self, features, groups):
        """groups: list of feature-name lists, one output Tensor[B, len(g), dim] per group."""
        names = [n for g in groups for n in g]
        bsz, positions = self._positions(features, names)
        train = self.training and torch.is_grad_enabled()
        group = self._group_for(names) if len(groups) == 1 and bsz > 0 else None
        if group is not None:
            out, gpass = group.forward(features, positions, bsz, self.dims[names[0]], train)
            return [_FusedEmbeddingFunction.apply(self._anchor, gpass, out) if train else torch.from_numpy(out)]
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
                store.pool(lookup, offs, outputs[gi], column=ci)
                feats_info.append((gi, ci, offs))
            passes.append(_TablePass(store, lookup, feats_info))
        if not train:
            return [torch.from_numpy(o) for o in outputs]
        result = _FusedEmbeddingFunction.apply(self._anchor, passes, *outputs)
        return list(result) if isinstance(result, tuple) else [result]

    def forward(self, features) -> dict[str, torch.Tensor]:
        groups: dict[int, list] = {}
        for n in self.feature_names:
            groups.setdefault(self.dims[n], []).append(n)
        group_list = list(groups.values())
        tensors = self._run(features, group_list)
        out = {}
        for g, t in zip(group_list, tensors):
            for ci, n in enumerate(g):
                out[n] = t[:, ci, :]
        return {n: out[n] for n in self.feature_names}

    def forward_stacked(self, features, names: list[str] | None = None) -> torch.Tensor:
        """Tensor[B, F, dim] of the named features (default: all), which must share one dim."""
        names = list(self.feature_names if names is None else names)
        for n in names:
            if n not in self.dims:
                raise ValueError(f"names: unknown feature {n!r}{closest_hint(n, self.dims)}")
        dims = {self.dims[n] for n in names}
        if len(dims) != 1:
            raise ValueError(f"forward_stacked: features have different dims {sorted(dims)}; use forward()")
        return self._run(features, [names])[0]

    # ---------------------------------------------------------------- persistence helpers
    def replace_store(self, table: str, store: EmbeddingStore) -> None:
        """Serve `table` from `store` from now on (e.g. one loaded from a checkpoint). It must have
        the table's dim; it takes the collection's shared lock, so the one-call path still takes
        one lock per phase."""
        if table not in self.stores:
            raise ValueError(f"table: unknown table {table!r}{closest_hint(table, self.stores)}; "
                             f"tables: {sorted(self.stores)}")
        if store.dim != self.stores[table].dim:
            raise ValueError(f"store: table {table!r} has dim {self.stores[table].dim}, the new store has "
                             f"dim {store.dim}; a replacement must keep the dim")
        store.share_lock(self._lock)
        self.stores[table] = store

    def stats(self) -> dict:
        return {name: store.stats() for name, store in self.stores.items()}

    def extra_repr(self) -> str:
        return ", ".join(f"{t}: dim={s.dim} capacity={s.config.capacity} opt={s.config.optimizer.name}"
                         for t, s in self.stores.items())
