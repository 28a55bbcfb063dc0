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
from typing import Mapping

import numpy as np
import torch

from .store import EmbeddingStore, Lookup, check_keys
from .table import TableConfig, closest_hint


@dataclasses.dataclass
class _TablePass:
    """One table's share of a batch: its lookup and where each of its features' IDs sit."""

    store: EmbeddingStore
    lookup: Lookup
    features: list  # (output group, column in the group, offsets into the table's keys)


class _FusedEmbeddingFunction(torch.autograd.Function):
    """Outputs are computed before; backward hands their gradient to the stores' optimizers."""

    @staticmethod
    def forward(ctx, anchor, passes, *outputs):
        ctx.passes = passes
        return outputs if len(outputs) > 1 else outputs[0]

    @staticmethod
    def backward(ctx, *grads):
        grads = [None if g is None else g.detach().to("cpu", torch.float32).contiguous().numpy() for g in grads]
        for tp in ctx.passes:
            ugrad = np.zeros((tp.lookup.num_unique, tp.store.dim), np.float32)
            used = False
            for group, column, offsets in tp.features:
                if grads[group] is not None:
                    tp.store.pooled_grad(tp.lookup, offsets, grads[group][:, column, :], ugrad)
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
        self.dims = {f: configs[t].dim for f, t in mapping.items()}
        # gives autograd a leaf that requires grad, so backward reaches the stores
        self._anchor = torch.nn.Parameter(torch.zeros(0), requires_grad=True)

    # ---------------------------------------------------------------- forward
    def _positions(self, features, names):
        """Validate and locate the requested features in the batch."""
        if not isinstance(features.values, np.ndarray) or features.values.dtype != np.uint64:
            check_keys(features.values, "features.values")
        offsets = features.offsets
        if not isinstance(offsets, np.ndarray) or offsets.dtype != np.int64:
            raise TypeError(f"features.offsets: must be an int64 numpy array, got "
                            f"{getattr(offsets, 'dtype', type(offsets).__name__)}")
        batch_names = list(features.names)
        nfeat = len(batch_names)
        if nfeat == 0 or (len(offsets) - 1) % nfeat:
            raise ValueError(f"features.offsets: length {len(offsets)} does not fit {nfeat} features")
        bsz = (len(offsets) - 1) // nfeat
        if offsets[0] != 0 or offsets[-1] != len(features.values):
            raise ValueError(f"features.offsets: must start at 0 and end at len(values)={len(features.values)}, "
                             f"got {offsets[0]} .. {offsets[-1]}")
        where = {}
        for name in names:
            if name not in batch_names:
                raise ValueError(f"features: the batch has no feature {name!r}{closest_hint(name, batch_names)}; "
                                 f"it has {batch_names}")
            f = batch_names.index(name)
            seg = offsets[f * bsz:(f + 1) * bsz + 1]
            if np.any(seg[1:] < seg[:-1]):
                raise ValueError(f"features.offsets: offsets of feature {name!r} decrease (negative lengths)")
            where[name] = seg
        return bsz, where

    def _run(self, features, groups):
        """groups: list of feature-name lists, one output Tensor[B, len(g), dim] per group."""
        names = [n for g in groups for n in g]
        bsz, where = self._positions(features, names)
        outputs = [np.empty((bsz, len(g), self.dims[g[0]]), np.float32) for g in groups]
        slot = {n: (gi, ci) for gi, g in enumerate(groups) for ci, n in enumerate(g)}
        by_table: dict[str, list] = {}
        for n in names:
            by_table.setdefault(self.feature_to_table[n], []).append(n)
        train = self.training and torch.is_grad_enabled()
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
                store.pool(lookup, offs, outputs[gi][:, ci, :])
                feats_info.append((gi, ci, offs))
            passes.append(_TablePass(store, lookup, feats_info))
        tensors = [torch.from_numpy(o) for o in outputs]
        if train:
            result = _FusedEmbeddingFunction.apply(self._anchor, passes, *tensors)
            tensors = list(result) if isinstance(result, tuple) else [result]
        return tensors

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
    def stats(self) -> dict:
        return {name: store.stats() for name, store in self.stores.items()}

    def extra_repr(self) -> str:
        return ", ".join(f"{t}: dim={s.dim} capacity={s.config.capacity} opt={s.config.optimizer.name}"
                         for t, s in self.stores.items())
