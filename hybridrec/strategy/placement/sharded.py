"""The sharded placement (PICASSO, preset `picasso`): every trainer owns a shard of every table
and looks rows up from their owners over AllToAll; the mechanisms are PICASSO's package
(hybridrec.picasso: the sharded tables, lookup and gradient rounds, packing, interleaving, the
HybridHash hot rows).

This adapter gives the training loop the placement interface over a trainer's `ShardedTables`
and offers them to the other axes as the `shards` service (the hot_cold consistency attaches its
hot-row policy there). Lookups happen where the dense model asks for its inputs (`inputs`), after
every trainer knows it trains the step, so a connection only hands the batch on, applies the
step's update and, on close, answers the other trainers' lookups until every trainer closed.
Wire bytes are counted once, by the trainer that sends them (`bytes_sent`), excluding what a
trainer sends to itself.
"""
from __future__ import annotations

from pathlib import Path

from hybridrec.embedding.inputs import EmbeddingInputs
from hybridrec.picasso.lookup_rounds import Step
from hybridrec.picasso.sharded_tables import ShardedTables
from hybridrec.strategy.placement import PlacementDefaults
from hybridrec.strategy.services import Services


class _Connection:
    bytes_received = 0  # every byte is counted once, by its sender

    def __init__(self, shards: ShardedTables):
        self.shards = shards
        self._base = shards.comm.bytes["train"]
        self._closed = False

    @property
    def bytes_sent(self) -> int:
        return self.shards.comm.bytes["train"] - self._base

    def prepare(self, batch):
        return batch

    def lookup(self, batch, train: bool) -> Step:
        return Step(batch, train)

    def update(self, looked: Step, grads: dict) -> dict:
        return {"dropped": self.shards.update(looked)}

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.shards.close_connection()


class ShardedPlacement(PlacementDefaults):
    tables_on_trainers = True  # each trainer saves (stage) and loads its own shard

    def __init__(self, cfg, tables, world, endpoints=None):
        self.shards = ShardedTables(cfg.strategy.picasso, tables, world)
        self.services = Services(shards=self.shards)

    def connect(self) -> _Connection:
        return _Connection(self.shards)

    def micro_batches(self, looked: Step, batch) -> list:
        return self.shards.micro_batches(looked, batch)

    def inputs(self, looked, batch, requires_grad: bool) -> EmbeddingInputs:
        return self.shards.inputs(looked, batch, requires_grad)

    def stage(self, root: Path, step: int) -> None:
        self.shards.stage(root, step)

    def save(self, directory: Path) -> None:
        self.shards.save(directory)

    def load(self, directory: Path) -> None:
        self.shards.load(directory)

    def stores(self) -> dict:
        """{table: EmbeddingStore} of this trainer's shard of every table (hot rows written back)."""
        return self.shards.written_back()

    def expire(self, step: int, now: float) -> int:
        return self.shards.expire(step, now)

    def facts(self) -> dict:
        return self.shards.facts()

    def close(self) -> None:
        self.shards.close()


PLACEMENT = ShardedPlacement
