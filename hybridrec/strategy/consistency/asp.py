"""Asynchronous parallel (ASP), HET's PS baseline: no cache and no waiting. A batch is looked up
as soon as the feeder reaches it, `strategy.asp.read_ahead` batches ahead of the training step,
whatever updates (this trainer's or another's) are still on their way; each update is applied by
the PS servers when it arrives. The staleness a lookup saw (this trainer's updates not yet
acknowledged) is measured, never bounded."""
from __future__ import annotations

import threading
from typing import Callable, Iterable

from hybridrec.data.batch import Batch
from hybridrec.strategy.consistency import Consistency
from hybridrec.persia.pipeline import EmbeddingPipeline

_UNBOUNDED = 1 << 40  # the pipeline's bound on own updates in flight: never reached
_POLL = 0.1


class AspPipeline(EmbeddingPipeline):
    """The threaded pipeline without its staleness wait; the feeder instead stops `read_ahead`
    looked-up batches ahead of the training thread."""

    def __init__(self, batches: Iterable[Batch], connect: Callable, read_ahead: int, skip: int = 0,
                 limit: int | None = None):
        self.read_ahead = read_ahead
        self._moved = threading.Condition()
        self._closing = threading.Event()
        self._fed = 0  # batches the feeder looked up (or lost)
        self._taken = 0  # of those, batches the training thread took
        super().__init__(self._gated(batches, skip), connect, _UNBOUNDED, skip=skip, limit=limit)

    def _gated(self, batches: Iterable[Batch], skip: int):
        for index, batch in enumerate(batches):
            if index >= skip:
                with self._moved:
                    while (self._fed - self._taken - self.lost_batches >= self.read_ahead
                           and not self._closing.is_set()):
                        self._moved.wait(_POLL)
                if self._closing.is_set():
                    return
            yield batch
            if index >= skip:
                self._fed += 1  # the feeder came back for the next batch: this one is looked up

    def __iter__(self):
        for ready in super().__iter__():
            with self._moved:
                self._taken += 1
                self._moved.notify_all()
            yield ready

    def close(self) -> None:
        self._closing.set()
        super().close()


class Asp(Consistency):
    def __init__(self, cfg, tables, world, services):
        super().__init__(cfg, tables, world, services)
        services.need_background_lookups("consistency asp")  # its lookups run off the training thread
        self.read_ahead = cfg.strategy.asp.read_ahead
        self.tau = self.read_ahead

    def open(self, placement, batches, skip: int = 0, limit: int | None = None, prefetch: int = 0,
             lockstep: bool = False):
        return AspPipeline(batches, placement.connect, self.read_ahead, skip=skip, limit=limit)


CONSISTENCY = Asp
