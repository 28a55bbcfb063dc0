"""Stale synchronous parallel (SSP, Ho et al. 2013), the classic baseline HET compares with:
worker clocks, not embedding clocks. A trainer's clock is the number of its iterations whose
updates the PS servers acknowledged (a batch looked up but skipped at the end of an epoch, when
another trainer ran out of data, is not an iteration);
the lookup of its iteration c waits until every trainer's clock is at least c - s, with
s = `strategy.ssp.staleness`. So no trainer runs more than s iterations ahead of the slowest, a
lookup sees every update of every iteration before c - s, and s = 0 is BSP: every lookup sees
every update of every earlier iteration of every trainer.

The clocks live on PS shard 0 (`worker_clock`, hybridrec.het.clocks); a restarted trainer group
reports under a new generation (torchrun's restart count), which starts the table afresh. This
trainer's own updates in flight are bounded by s as well (the threaded pipeline's tau).
"""
from __future__ import annotations

import os
import threading
from typing import Callable, Iterable

from hybridrec.data.batch import Batch
from hybridrec.het.clocks import WorkerClockClient
from hybridrec.ps.client import PSClient
from hybridrec.strategy.consistency import Consistency
from hybridrec.persia.pipeline import EmbeddingPipeline

_SKIPPED = object()  # what the pusher gets for a batch that was looked up but not trained


class _Closing(Exception):
    """Ends the feeder while it waits for the slowest trainer: the stream is closing."""


class _Clocked:
    """A placement connection whose lookups wait for the slowest trainer and whose updates
    advance this trainer's clock."""

    def __init__(self, owner: "Ssp", connection, clocks: WorkerClockClient, closing: threading.Event):
        self._owner, self._connection, self._clocks, self._closing = owner, connection, clocks, closing

    @property
    def bytes_sent(self) -> int:
        return self._connection.bytes_sent

    @property
    def bytes_received(self) -> int:
        return self._connection.bytes_received

    def prepare(self, batch):
        return self._connection.prepare(batch)

    def lookup(self, prepared, train: bool):
        owner = self._owner
        if train:
            if not self._clocks.wait_for(owner.lookups - owner.staleness, self._closing.is_set):
                raise _Closing()  # the feeder ends (close() does not report a feeder's error)
            owner.lookups += 1
        return self._connection.lookup(prepared, train)

    def update(self, looked, grads: dict) -> dict:
        if looked is _SKIPPED:  # looked up, not trained: not an iteration (skip() took back its lookup)
            return {}
        reply = self._connection.update(looked, grads)
        self._owner.acknowledged += 1
        self._clocks.report(self._owner.acknowledged)
        return reply

    def close(self) -> None:
        self._clocks.close()
        self._connection.close()


class _ClockClient(WorkerClockClient):
    def __init__(self, client: PSClient, rank: int, world: int, generation: int):
        super().__init__(client, rank, world, generation)
        self._client = client

    def close(self) -> None:
        self._client.close()


class SspPipeline(EmbeddingPipeline):
    def __init__(self, batches: Iterable[Batch], connect: Callable, staleness: int, skip: int = 0,
                 limit: int | None = None, on_skip: Callable[[], None] = lambda: None):
        self._closing = threading.Event()
        self._on_skip = on_skip
        super().__init__(batches, lambda: connect(self._closing), staleness, skip=skip, limit=limit)

    def skip(self, ready) -> None:
        """`ready` will not be trained (another trainer ran out of data): its lookup is not an
        iteration, so the clocks of trainers in lockstep stay equal across epochs."""
        self._on_skip()
        self._pushes.put((_SKIPPED, {}))

    def close(self) -> None:
        self._closing.set()
        super().close()


class Ssp(Consistency):
    def __init__(self, cfg, tables, world, services):
        super().__init__(cfg, tables, world, services)
        services.need_background_lookups("consistency ssp")  # the pipeline's feeder waits for the clocks
        self.servers = services.ps_endpoints("consistency ssp")  # shard 0 keeps the worker clocks
        self.staleness = cfg.strategy.ssp.staleness
        self.tau = self.staleness
        self.lookups = 0  # this trainer's training lookups so far (the feeder's)
        self.acknowledged = 0  # its iterations done (the pusher's): its clock
        self.generation = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    def open(self, placement, batches, skip: int = 0, limit: int | None = None, prefetch: int = 0,
             lockstep: bool = False):
        world = self.world

        def connect(closing: threading.Event):
            client = self.servers.clock_client()
            clocks = _ClockClient(client, world.rank, world.size, self.generation)
            return _Clocked(self, placement.connect(), clocks, closing)

        pipeline = SspPipeline(batches, connect, self.staleness, skip=skip, limit=limit, on_skip=self._took_back)
        self.telemetry.add(pipeline.timeline)
        return pipeline

    def _took_back(self) -> None:
        self.lookups -= 1


CONSISTENCY = Ssp
