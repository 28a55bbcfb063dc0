"""Pooling of a batch's embedding rows into one embedding per (sample, feature), and back.

For each table, the IDs of the features it serves are laid end to end (feature by feature,
each feature sample-major, as in `JaggedFeatures`) and deduplicated in order of first
appearance (`BatchLayout`). Rows of the unique keys are pooled into bags of (feature, sample)
with torch ops, one gather and one scatter-add per side over all its tables (`SideIndex`), so
the pooling is differentiable: the embedding worker pools rows it fetched,
and a trainer that receives only the unique rows (the lossless wire mode) pools them itself
and gets each unique row's gradient from autograd. `unpool` is the backward pass written out
for the embedding worker: each ID's gradient is its bag's gradient times the bag's pooling
scale (1 for sum, 1/n for mean, 1/sqrt(n) for sqrt-n, as `EmbeddingStore.pool` does locally).
Both processes compute the same layout from the same IDs, so no index travels on the wire.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np
import torch

from hybridrec.data.batch import JaggedFeatures
from hybridrec.embedding.dedupe import first_seen_unique


@dataclass(frozen=True)
class TableBags:
    """One table's share of a batch: its keys and the (feature, sample) bag of each key."""

    table: str
    keys: np.ndarray  # uint64[n]: the IDs of this table's features, feature after feature
    bag: torch.Tensor  # int64[n]: bag of each key, bag = local feature * B + sample
    scale: torch.Tensor | None  # float32[nf * B] per bag (mean / sqrtn), None for sum
    columns: list[int]  # where each of this table's features sits in the stacked output
    bag_count: int  # len(columns) * B


def _scale(lengths: np.ndarray, pooling: str) -> torch.Tensor | None:
    if pooling == "sum":
        return None
    n = lengths.astype(np.float32)
    with np.errstate(divide="ignore"):
        scale = 1.0 / (n if pooling == "mean" else np.sqrt(n))
    scale[lengths == 0] = 0.0  # an empty bag pools to zeros either way
    return torch.from_numpy(scale)


def table_bags(features: JaggedFeatures, names: list[str], feature_to_table: Mapping[str, str],
               pooling: Mapping[str, str], memo: dict | None = None) -> list[TableBags]:
    """How the features `names` (the stacked output's columns) fall onto their tables. Tables
    serving the same columns (a feature's deep and wide tables) share their keys and bags
    through `memo`."""
    memo = {} if memo is None else memo
    columns_of: dict[str, list[int]] = {}
    for column, name in enumerate(names):
        columns_of.setdefault(feature_to_table[name], []).append(column)
    lengths = features.lengths()
    out = []
    for table, columns in columns_of.items():
        key = tuple(columns)
        if key not in memo:
            positions = [features.names.index(names[c]) for c in columns]
            keys = np.ascontiguousarray(np.concatenate([features.feature(names[c])[0] for c in columns]))
            table_lengths = lengths[positions].ravel()  # (local feature, sample) bags
            bag = torch.repeat_interleave(torch.arange(len(table_lengths)), torch.from_numpy(table_lengths))
            memo[key] = (keys, table_lengths, bag)
        keys, table_lengths, bag = memo[key]
        out.append(TableBags(table, keys, bag, _scale(table_lengths, pooling[table]), columns, len(table_lengths)))
    return out


@dataclass(frozen=True)
class SideIndex:
    """One side (deep or wide) of a batch as single index tensors over all its tables, so that
    pooling the side is one gather and one scatter-add, whatever the number of tables. Rows of
    the side's tables are stacked in `tables` order; bag = sample * F + output column, so the
    pooled rows are [B, F, D] in memory order, exactly the layout of the pooled wire mode (the
    dense model's reductions then add in the same order in both modes)."""

    tables: list[str]
    rows: torch.Tensor  # int64[n]: each key's row in the stacked unique rows
    bag: torch.Tensor  # int64[n]: each key's bag
    scale: torch.Tensor | None  # float32[B * F] per bag (1 for sum tables), None if all sum


def side_index(bags_list: list[TableBags], inverse: Mapping[str, torch.Tensor],
               unique: Mapping[str, np.ndarray], batch_size: int, num_features: int) -> SideIndex:
    rows, bag, base = [], [], 0
    scale = None
    if any(b.scale is not None for b in bags_list):
        scale = np.ones((batch_size, num_features), dtype=np.float32)
    for bags in bags_list:
        rows.append(inverse[bags.table].numpy() + base)
        base += len(unique[bags.table])
        column = np.asarray(bags.columns, dtype=np.int64)
        local = bags.bag.numpy()  # local feature * B + sample
        bag.append((local % batch_size) * num_features + column[local // batch_size])
        if bags.scale is not None:
            scale[:, column] = bags.scale.numpy().reshape(len(column), batch_size).T
    return SideIndex([b.table for b in bags_list], torch.from_numpy(np.concatenate(rows).astype(np.int64)),
                     torch.from_numpy(np.concatenate(bag)), None if scale is None else torch.from_numpy(scale.ravel()))


@dataclass(frozen=True)
class BatchLayout:
    """Where a batch's IDs go: per table its bags, unique keys and each key's unique index."""

    batch_size: int
    num_features: int
    deep: list[TableBags]
    wide: list[TableBags]
    unique: dict[str, np.ndarray]  # table -> unique keys, first-seen order
    inverse: dict[str, torch.Tensor]  # table -> int64 index into unique[table] of each key of its bags
    sides: tuple[SideIndex | None, SideIndex | None]  # deep, wide

    def tables(self) -> list[str]:
        return [bags.table for bags in self.deep + self.wide]

    def assemble(self, rows: Mapping[str, torch.Tensor], deep_dim: int) -> tuple[torch.Tensor | None,
                                                                                  torch.Tensor | None]:
        """Deep [B, F, D] and wide [B, F] embeddings from the unique rows of each table
        (differentiable in `rows`; each bag sums its keys in position order, so the embedding worker's
        pooled mode and an NN worker pooling unique rows itself give bit-identical inputs)."""
        out = []
        for side, dim in zip(self.sides, (deep_dim, 1)):
            if side is None:
                out.append(None)
                continue
            stacked = torch.cat([rows[table] for table in side.tables]) if len(side.tables) > 1 else rows[side.tables[0]]
            pooled = torch.zeros(self.num_features * self.batch_size, dim, dtype=torch.float32)
            pooled = pooled.index_add(0, side.bag, stacked.index_select(0, side.rows))
            if side.scale is not None:
                pooled = pooled * side.scale.unsqueeze(1)
            out.append(pooled.view(self.batch_size, self.num_features, dim))
        deep, wide = out
        return deep, None if wide is None else wide.squeeze(2)


def batch_layout(features: JaggedFeatures, names: list[str], deep_map: Mapping[str, str],
                 wide_map: Mapping[str, str], pooling: Mapping[str, str]) -> BatchLayout:
    """The layout of `features` for the stacked columns `names` (empty maps: no such side)."""
    shared: dict = {}  # a feature's deep and wide tables hold the same keys: computed once
    deep = table_bags(features, names, deep_map, pooling, shared) if deep_map else []
    wide = table_bags(features, names, wide_map, pooling, shared) if wide_map else []
    unique, inverse, deduped = {}, {}, {}
    for bags in deep + wide:
        key = tuple(bags.columns)
        if key not in deduped:
            keys, index = first_seen_unique(bags.keys)
            deduped[key] = (keys, torch.from_numpy(index))
        unique[bags.table], inverse[bags.table] = deduped[key]
    sides = tuple(side_index(bags_list, inverse, unique, features.batch_size, len(names)) if bags_list else None
                  for bags_list in (deep, wide))
    return BatchLayout(features.batch_size, len(names), deep, wide, unique, inverse, sides)


def unpool(bags: TableBags, grad: torch.Tensor) -> np.ndarray:
    """The gradient of each key of `bags` from the gradient of the stacked output [B, F, D]."""
    dim = grad.shape[2]
    per_bag = grad[:, bags.columns, :].transpose(0, 1).reshape(bags.bag_count, dim)
    if bags.scale is not None:
        per_bag = per_bag * bags.scale.unsqueeze(1)
    return np.ascontiguousarray(per_bag.index_select(0, bags.bag).numpy(), dtype=np.float32)
