"""The placement axis: where a job's embedding rows live, and how a trainer reads and updates them.

A placement gives the training loop three things:
  connect()   a `Connection` for one thread: `prepare(batch)` (what may run before the
              consistency rule allows the lookup, e.g. sending the IDs ahead), `lookup(prepared,
              train)` (the batch's rows, or None when the rows were lost), `update(looked, grads)`
              (apply the gradients; returns counts {lost, dropped, unacknowledged}), byte counters
              and `close()`;
  inputs()    in the training thread: the dense model's `EmbeddingInputs` for a looked-up batch;
  save/load   the embedding tables into / from a checkpoint's `embeddings` directory;
  services    what it offers the other axes (hybridrec.strategy.services, declared in
              hybridrec.axes): e.g. `background_lookups` (lookups may run in another thread
              than the training step: remote rows yes, the local fused lookup runs inside
              autograd, no), `whole_batches` (every trainer reads every row, each computing a part
              of every sample: DES's field_sharded; the loop then deals the data as to one
              trainer and every trainer scores every test row), the PS servers' endpoints;
and members with defaults in `PlacementDefaults`, which a placement overrides where it differs:
`tables_on_trainers` (the
trainers hold the tables: before the leader writes a checkpoint every trainer calls
`stage(checkpoint_root, step)` to write its own tables, which the leader's `save` gathers, and on
resume every trainer `load`s its own); `micro_batches(looked, batch)` (the parts a step's
forward and backward run in: PICASSO's D-interleaving cuts a batch, the rest keep it whole).
`expire(step, now)` drops the rows of tables with `expire_after` that training has not used for
longer, between steps (`EmbeddingStore.expire`), and returns how many.
`make_placement` builds the value named by `strategy.placement` from the module hybridrec.axes
names for it.
"""
from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Protocol

from hybridrec.axes import AXES
from hybridrec.strategy.services import Services


class Connection(Protocol):
    bytes_sent: int
    bytes_received: int

    def prepare(self, batch) -> Any: ...

    def lookup(self, prepared, train: bool) -> Any | None: ...

    def update(self, looked, grads: dict) -> dict: ...

    def close(self) -> None: ...


class Placement(Protocol):
    services: Services
    tables_on_trainers: bool

    def connect(self) -> Connection: ...

    def micro_batches(self, looked, batch) -> list: ...

    def stage(self, root: Path, step: int) -> None: ...

    def inputs(self, looked, batch, requires_grad: bool): ...

    def save(self, directory: Path) -> None: ...

    def load(self, directory: Path) -> None: ...

    def facts(self) -> dict: ...

    def expire(self, step: int, now: float) -> int: ...

    def close(self) -> None: ...


class PlacementDefaults:
    """The optional members of `Placement` as most placements have them."""

    services = Services()  # none
    tables_on_trainers = False

    def micro_batches(self, looked, batch) -> list:
        """[(looked, batch)]: the step runs on the whole batch."""
        return [(looked, batch)]

    def stage(self, root: Path, step: int) -> None:
        """Nothing: the leader's `save` writes every table (see `tables_on_trainers`)."""

    def expire(self, step: int, now: float) -> int:
        """Nothing to expire (a placement whose tables cannot expire rows)."""
        return 0


def make_placement(name: str, cfg, tables, world, endpoints) -> Placement:
    """The placement `name` for this job; `endpoints` holds the addresses of remote services."""
    module = importlib.import_module(f"hybridrec.strategy.{AXES['placement'][name].module}")
    return module.PLACEMENT(cfg, tables, world, endpoints)
