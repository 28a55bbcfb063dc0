"""The field_sharded placement (DES): the sparse features (fields) are split among the trainers,
and each trainer holds only its fields' tables, deep and first-order, as in-process stores.

The split is computed from the config alone, the same on every trainer: features that share a
table form one group (a table lives on one trainer), each group weighs the estimated size of its
tables (capacity x dim), and the groups are dealt largest first to the trainer with the least
weight so far (ties: the lower rank). DES §5 deals fields by their index modulo N; weighing them
balances memory when tables differ in size. Each trainer also holds the block of the first
layer's weights that multiplies its fields (the des dense sync keeps it, see
hybridrec.des.substitution).

How the data reaches the trainers: every trainer reads the whole global batch stream (the rows a
one-trainer job would read, `whole_batches`), looks up its own fields' IDs only and keeps the
dense features and labels, which the replicated layers after the substitution need. The IDs of
the other fields are read and dropped. A trainer's input bytes (`input_bytes`) count what it
uses: 8 per ID of its fields, 4 per (sample, field) length, and the dense features and labels
(float32); a sample server feeding the trainers would send each exactly that.

Lookups and updates are the local placement's fused calls inside autograd (the update is applied
in backward), so nothing about an embedding row crosses the network: no row, no gradient, no
key. What crosses is the des dense sync's AllReduce of partial results, counted by `wire` (whose
bytes the connections report to the training loop).

Checkpoints: each trainer writes its own tables (`tables_on_trainers`): `stage()` writes them
under the checkpoint root before the leader's checkpoint is assembled (all trainers must see the
same file system, as PS servers writing their shards do), and the leader's `save()` moves them
into the checkpoint's `embeddings/<deep|wide>/<table>/`, the local placement's layout. Each
trainer loads its own tables on resume.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from hybridrec.config import ConfigError
from hybridrec.embedding import EmbeddingCollection
from hybridrec.strategy.placement.local import LocalPlacement


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


def assign_fields(tables, trainers: int) -> list[list[int]]:
    """The feature indices each trainer owns (sorted), balanced by `table_weight`. ConfigError when
    there are fewer groups of features than trainers."""
    groups = field_groups(tables)
    if len(groups) < trainers:
        raise ConfigError(f"strategy.placement field_sharded: {trainers} trainers but only {len(groups)} groups of "
                          f"features to split among them (features sharing a table stay together); use at most "
                          f"{len(groups)} trainers")
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


class _Connection:
    """The local placement's in-process connection, counting this trainer's input bytes and
    reporting the wire bytes this trainer sent while it was open."""

    def __init__(self, placement: "FieldShardedPlacement"):
        self.placement = placement
        self._sent = placement.wire.sent

    @property
    def bytes_sent(self) -> int:
        return self.placement.wire.sent - self._sent

    bytes_received = 0  # every byte is counted once, by the trainer that sends it

    def prepare(self, batch):
        return batch

    def lookup(self, prepared, train: bool):
        if train:
            self.placement.count_input(prepared)
        return prepared

    def update(self, looked, grads: dict) -> dict:
        return {}  # applied in backward

    def close(self) -> None:
        pass


class FieldShardedPlacement(LocalPlacement):
    whole_batches = True  # every trainer reads every row: its fields' IDs of every sample
    tables_on_trainers = True  # each trainer saves and loads its own tables

    def __init__(self, cfg, tables, world, endpoints=None):  # noqa: super().__init__ refuses several trainers
        self.world = world
        self.assignment = assign_fields(tables, world.size)
        self.fields = self.assignment[world.rank]
        self.names = [tables.sparse_names[i] for i in self.fields]
        self.collections = {}
        for side, side_tables, mapping in (("deep", tables.deep, tables.deep_map),
                                           ("wide", tables.wide, tables.wide_map)):
            own = {name: mapping[name] for name in self.names if name in mapping}
            if own:  # the job's table configs (seeds included), so rows start as in one process
                self.collections[side] = EmbeddingCollection({t: side_tables[t] for t in own.values()}, own)
        self.job_tables = {"deep": list(tables.deep), "wide": list(tables.wide)}
        self.owner = {tables.sparse_names[i]: rank for rank, fields in enumerate(self.assignment) for i in fields}
        self.wire = WireCounter()
        self.input_bytes = 0
        self.input_batches = 0
        self._staged: Path | None = None

    def connect(self) -> _Connection:
        return _Connection(self)

    def count_input(self, batch) -> None:
        """Add what this trainer uses of a training batch: its fields' IDs and lengths, the dense
        features and the labels."""
        self.input_bytes += input_bytes_of(batch, self.names)
        self.input_batches += 1

    # ------------------------------------------------------------------ checkpoints
    def stage(self, root: Path, step: int) -> None:
        """Every trainer, before the leader assembles checkpoint `step` under `root`: write this
        trainer's tables where the leader's `save` will take them from."""
        self._staged = Path(root) / f".field-sharded-step-{step:09d}"
        for _, _, store, path in self._directories(self._staged):
            shutil.rmtree(path, ignore_errors=True)
            store.save(path)

    def save(self, directory: Path) -> None:
        """The leader: move every trainer's staged tables into the checkpoint's `directory`."""
        if self._staged is None:
            raise RuntimeError("field_sharded: save() before stage(): every trainer stages its tables first")
        staged, self._staged = self._staged, None
        for side in sorted(p.name for p in staged.iterdir()) if staged.is_dir() else []:
            (Path(directory) / side).mkdir(parents=True, exist_ok=True)
            for table in sorted((staged / side).iterdir()):
                table.replace(Path(directory) / side / table.name)
        shutil.rmtree(staged, ignore_errors=True)
        expected = {(side, table.replace(":", "_")) for side, names in self.job_tables.items() for table in names}
        found = {(p.parent.name, p.name) for p in Path(directory).glob("*/*")}
        if expected - found:
            raise RuntimeError(f"field_sharded: the checkpoint misses tables {sorted(expected - found)}: a trainer "
                               f"did not stage them under {staged} (do all trainers see one file system?)")

    def rows(self) -> dict:
        """Rows this trainer's tables hold, per side."""
        return {side: sum(len(s) for s in c.stores.values()) for side, c in self.collections.items()}

    def facts(self) -> dict:
        return {"fields_by_trainer": [[n for n, r in self.owner.items() if r == rank]
                                      for rank in range(len(self.assignment))]}


PLACEMENT = FieldShardedPlacement


def input_bytes_of(batch, names) -> int:
    """What a trainer owning features `names` uses of `batch`: 8 bytes per ID of those features,
    4 per (sample, feature) length, and the dense features and labels as float32."""
    sparse, size = batch.sparse, batch.batch_size
    position = {name: f for f, name in enumerate(sparse.names)}
    ids = sum(int(sparse.offsets[(position[n] + 1) * size] - sparse.offsets[position[n] * size]) for n in names)
    return 8 * ids + 4 * size * len(names) + int(np.asarray(batch.dense).nbytes + np.asarray(batch.labels).nbytes)
