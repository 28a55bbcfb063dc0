"""Pooling on the embedding worker: rows fetched from the PS -> one embedding per (sample, feature).

For each table, the IDs of the features it serves are laid end to end (feature by feature,
each feature sample-major, as in `JaggedFeatures`), so one PS fetch serves them all and one
`index_add_` pools them into bags of (feature, sample). The backward pass is the same map read
the other way: each ID's gradient is its bag's gradient times the bag's pooling scale (1 for
sum, 1/n for mean, 1/sqrt(n) for sqrt-n, as `EmbeddingStore.pool` does locally). Torch ops only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np
import torch

from hybridrec.data.batch import JaggedFeatures


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
               pooling: Mapping[str, str]) -> list[TableBags]:
    """How the features `names` (the stacked output's columns) fall onto their tables."""
    columns_of: dict[str, list[int]] = {}
    for column, name in enumerate(names):
        columns_of.setdefault(feature_to_table[name], []).append(column)
    lengths = features.lengths()
    out = []
    for table, columns in columns_of.items():
        positions = [features.names.index(names[c]) for c in columns]
        keys = np.concatenate([features.feature(features.names[p])[0] for p in positions])
        table_lengths = lengths[positions].ravel()  # (local feature, sample) bags
        bag = torch.repeat_interleave(torch.arange(len(table_lengths)), torch.from_numpy(table_lengths))
        out.append(TableBags(table, np.ascontiguousarray(keys), bag, _scale(table_lengths, pooling[table]),
                             columns, len(table_lengths)))
    return out


def pool(bags: TableBags, rows: np.ndarray, out: torch.Tensor) -> None:
    """Pool `rows` (one per key of `bags`) into out[:, column, :] of each of its features."""
    batch, _, dim = out.shape
    pooled = torch.zeros(bags.bag_count, dim, dtype=torch.float32)
    pooled.index_add_(0, bags.bag, torch.from_numpy(rows))
    if bags.scale is not None:
        pooled.mul_(bags.scale.unsqueeze(1))
    out[:, bags.columns, :] = pooled.view(len(bags.columns), batch, dim).transpose(0, 1)


def unpool(bags: TableBags, grad: torch.Tensor) -> np.ndarray:
    """The gradient of each key of `bags` from the gradient of the stacked output [B, F, D]."""
    dim = grad.shape[2]
    per_bag = grad[:, bags.columns, :].transpose(0, 1).reshape(bags.bag_count, dim)
    if bags.scale is not None:
        per_bag = per_bag * bags.scale.unsqueeze(1)
    return np.ascontiguousarray(per_bag.index_select(0, bags.bag).numpy(), dtype=np.float32)
