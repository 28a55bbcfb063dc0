"""The embedding stream that runs in the training thread: each batch is looked up right before
its step and updated right after it, so every lookup sees every earlier update (staleness 0).

It is how the synchronous consistency runs over a placement whose lookup must stay in the
training thread (the local placement's fused lookup runs inside autograd). It offers the same
calls as the threaded `EmbeddingPipeline`, so the training loop does not tell them apart.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterable, Iterator

from hybridrec.data.batch import Batch
from hybridrec.data.loader import PrefetchLoader
from hybridrec.embedding.stream import ReadyBatch, update_counts


class InlineStream:
    """Iterate to get ReadyBatch objects (staleness 0); `push` applies each update at once.
    `skip` batches at the start are read and dropped (resuming mid-epoch); at most `limit` are
    looked up. Batches are read ahead by a `prefetch`-deep loader thread (0: read in this thread);
    a connection with a `coming` callable (the local placement with disk tiers) is told, as each
    batch is handed over, the batch after it when the loader has it ready."""

    tau = 0

    def __init__(self, batches: Iterable[Batch], connect: Callable, skip: int = 0, limit: int | None = None,
                 prefetch: int = 0):
        self._connection = connect()
        self._batches = batches
        self._loader = PrefetchLoader(batches, depth=prefetch) if prefetch else None
        self._skip, self._limit = skip, limit
        self.staleness: list[int] = []
        self.figures: dict = {}
        self.counts = {"lost_batches": 0, "dropped_updates": 0, "unacknowledged_updates": 0}

    def __iter__(self) -> Iterator[ReadyBatch]:
        looked_up = 0
        source = self._loader if self._loader is not None else self._batches
        coming = getattr(self._connection, "coming", None) if self._loader is not None else None
        for index, batch in enumerate(source):
            if index < self._skip:
                continue
            if self._limit is not None and looked_up >= self._limit:
                return
            looked = self._connection.lookup(self._connection.prepare(batch), train=True)
            if looked is None:
                self.counts["lost_batches"] += 1
                continue
            looked_up += 1
            self.staleness.append(0)
            if coming is not None and (following := self._loader.peek()) is not None:
                coming(following)
            yield ReadyBatch(index, batch, looked, 0)

    def push(self, ready: ReadyBatch, grads: dict) -> None:
        for key, count in zip(self.counts, update_counts(self._connection.update(ready.looked, grads))):
            self.counts[key] += count

    def skip(self, ready: ReadyBatch) -> None:
        """`ready` will not be trained; nothing was taken from the placement that needs returning."""

    def drain(self, timeout: float | None = None) -> None:
        """Every update is applied when `push` returns: nothing to wait for."""

    @contextmanager
    def held(self) -> Iterator[None]:
        yield  # no lookup runs outside the training thread's own calls

    def stats(self) -> dict:
        return {**self.counts, "bytes_sent": self._connection.bytes_sent,
                "bytes_received": self._connection.bytes_received}

    def close(self) -> None:
        if self._loader is not None:
            self._loader.close()
        self._connection.close()
