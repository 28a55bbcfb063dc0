"""The field_sharded placement (DES): the sparse features (fields) are split among the trainers
(hybridrec.des.fields deals them by table size, the same on every trainer), and each trainer
holds only its fields' tables, deep and first-order, as in-process stores.

It offers the other axes this trainer's `fields` (a `FieldShare`: the fields, the wire bytes the
des dense sync's AllReduce sends, the input the trainer uses) and `whole_batches`: every trainer
reads the whole global batch stream (the rows a one-trainer job would read), looks up its own
fields' IDs only and keeps the dense features and labels, which the replicated layers after the
substitution need. The IDs of the other fields are read and dropped.

Lookups and updates are the local placement's fused calls inside autograd (the update is applied
in backward), so nothing about an embedding row crosses the network: no row, no gradient, no
key. What crosses is the des dense sync's AllReduce of partial results, whose bytes the
connections report to the training loop.

Checkpoints: each trainer writes its own tables (`tables_on_trainers`): `stage()` writes them
under the checkpoint root before the leader's checkpoint is assembled (all trainers must see the
same file system, as PS servers writing their shards do), and the leader's `save()` moves them
into the checkpoint's `embeddings/<deep|wide>/<table>/`, the local placement's layout. Each
trainer loads its own tables on resume.
"""
from __future__ import annotations

import shutil
from pathlib import Path

from hybridrec.config import ConfigError
from hybridrec.des.fields import FieldShare, deal_fields, field_groups
from hybridrec.embedding import EmbeddingCollection
from hybridrec.strategy.placement.checkpoint_layout import local_directory
from hybridrec.strategy.placement.local import LocalPlacement
from hybridrec.strategy.services import Services


def assign_fields(tables, trainers: int) -> list[list[int]]:
    """The feature indices each trainer owns (sorted), balanced by table size. ConfigError when
    there are fewer groups of features than trainers."""
    groups = field_groups(tables)
    if len(groups) < trainers:
        raise ConfigError(f"strategy.placement field_sharded: {trainers} trainers but only {len(groups)} groups of "
                          f"features to split among them (features sharing a table stay together); use at most "
                          f"{len(groups)} trainers")
    return deal_fields(tables, groups, trainers)


class _Connection:
    """The local placement's in-process connection, counting this trainer's input bytes and
    reporting the wire bytes this trainer sent while it was open."""

    def __init__(self, share: FieldShare):
        self.share = share
        self._sent = share.wire.sent

    @property
    def bytes_sent(self) -> int:
        return self.share.wire.sent - self._sent

    bytes_received = 0  # every byte is counted once, by the trainer that sends it

    def prepare(self, batch):
        return batch

    def lookup(self, prepared, train: bool):
        if train:
            self.share.count_input(prepared)
        return prepared

    def update(self, looked, grads: dict) -> dict:
        return {}  # applied in backward

    def close(self) -> None:
        pass


class FieldShardedPlacement(LocalPlacement):
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
        self.share = FieldShare(self.fields, self.names, self.rows)
        self.services = Services(fields=self.share, whole_batches=True)
        self._staged: Path | None = None

    def connect(self) -> _Connection:
        return _Connection(self.share)

    # ------------------------------------------------------------------ checkpoints
    def stage(self, root: Path, step: int) -> None:
        """Every trainer, before the leader assembles checkpoint `step` under `root`: write this
        trainer's tables where the leader's `save` will take them from."""
        self._staged = Path(root) / f".field-sharded-step-{step:09d}"
        for side, _, table, store in self._tables():
            path = local_directory(self._staged, side, table)
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

