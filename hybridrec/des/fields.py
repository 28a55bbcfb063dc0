"""DES's fields (§5): which trainer owns which sparse features, and what a trainer's share of a
job holds and counts.

The split is computed from the config alone, the same on every trainer: features that share a
table form one group (`field_groups`: a table lives on one trainer), each group weighs the
estimated size of its tables (`table_weight`: capacity x dim), and the groups are dealt largest
first to the trainer with the least weight so far (`deal_fields`; ties: the lower rank). DES §5
deals fields by their index modulo N; weighing them balances memory when tables differ in size.

Every trainer reads the whole global batch and uses of it its own fields' IDs, the dense
features and the labels: `input_bytes_of` counts that (8 bytes per ID of its fields, 4 per
(sample, field) length, the dense features and labels as float32), what a sample server feeding
the trainers would send each. What crosses between trainers is the des dense sync's AllReduce of
partial results, counted by a `WireCounter`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np


def field_groups(tables) -> list[list[int]]:
    """Feature indices (into `tables.sparse_names`) grouped so that features sharing a deep or
    first-order table are in one group; groups in order of their first feature."""
    names = tables.sparse_names
    parent = list(range(len(names)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for mapping in (tables.deep_map, tables.wide_map):
        first_user: dict[str, int] = {}
        for index, name in enumerate(names):
            table = mapping.get(name)
            if table is None:
                continue
            if table in first_user:
                parent[root(index)] = root(first_user[table])
            else:
                first_user[table] = index
    groups: dict[int, list[int]] = {}
    for index in range(len(names)):
        groups.setdefault(root(index), []).append(index)
    return sorted(groups.values(), key=lambda group: group[0])


def table_weight(tables, group: list[int]) -> int:
    """Estimated size of a group's tables: capacity x dim, summed over its distinct tables."""
    names = [tables.sparse_names[i] for i in group]
    used = {("deep", tables.deep_map[n]) for n in names if n in tables.deep_map}
    used |= {("wide", tables.wide_map[n]) for n in names if n in tables.wide_map}
    configs = {"deep": tables.deep, "wide": tables.wide}
    return sum(configs[side][name].capacity * configs[side][name].dim for side, name in used)


def deal_fields(tables, groups: list[list[int]], trainers: int) -> list[list[int]]:
    """The feature indices each of `trainers` trainers owns (sorted): `groups` (field_groups) dealt
    largest `table_weight` first to the trainer with the least weight so far (ties: the lower rank)."""
    load, owned = [0] * trainers, [[] for _ in range(trainers)]
    for group in sorted(groups, key=lambda g: (-table_weight(tables, g), g[0])):
        rank = min(range(trainers), key=lambda r: (load[r], r))
        load[rank] += table_weight(tables, group)
        owned[rank] += group
    return [sorted(fields) for fields in owned]


class WireCounter:
    """Bytes this trainer sent in collectives while training (the des dense sync adds each
    AllReduce of partial results), and how many collectives there were."""

    def __init__(self):
        self.sent = self.collectives = 0
        self.payload = 0  # bytes of the tensors reduced (before the ring's 2(N-1)/N)


@dataclass
class FieldShare:
    """One trainer's share of a DES job: the features it owns (indices into the job's sparse
    names, and the names), the wire bytes it sends in collectives, the input it uses of the
    training batches, and `rows()`, the rows its tables hold per side."""

    fields: list[int]
    names: list[str]
    rows: Callable[[], dict]
    wire: WireCounter = field(default_factory=WireCounter)
    input_bytes: int = 0
    input_batches: int = 0

    def count_input(self, batch) -> None:
        """Add what this trainer uses of a training batch: its fields' IDs and lengths, the dense
        features and the labels."""
        self.input_bytes += input_bytes_of(batch, self.names)
        self.input_batches += 1


def input_bytes_of(batch, names) -> int:
    """What a trainer owning features `names` uses of `batch`: 8 bytes per ID of those features,
    4 per (sample, feature) length, and the dense features and labels as float32."""
    sparse, size = batch.sparse, batch.batch_size
    position = {name: f for f, name in enumerate(sparse.names)}
    ids = sum(int(sparse.offsets[(position[n] + 1) * size] - sparse.offsets[position[n] * size]) for n in names)
    return 8 * ids + 4 * size * len(names) + int(np.asarray(batch.dense).nbytes + np.asarray(batch.labels).nbytes)
