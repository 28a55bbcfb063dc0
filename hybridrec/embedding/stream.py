"""The stream of ready batches that every consistency gives the training loop, and what its
implementations share.

A stream (`EmbeddingStream`) is iterated for `ReadyBatch`es (a batch with its looked-up rows and
the staleness it was looked up at); the loop hands each one's embedding gradients back with
`push`, gives back one it will not train with `skip`, waits for every update in flight with
`drain`, holds lookups back around an evaluation or a checkpoint with `held()`, and at the end
reads `staleness`, `stats()` (wire bytes and lost, dropped or unacknowledged updates) and
`figures` (what only some streams measure, such as the pipelined local step's shared rows).
Implementations: the inline stream (hybridrec.strategy.consistency.inline), Persia's threaded
pipeline (hybridrec.persia.pipeline) and its ASP and SSP variants, HET's cached stream
(hybridrec.het.stream) and the pipelined local step (hybridrec.train.local_pipeline).
"""
from __future__ import annotations

import threading
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Callable, Iterator, Protocol

from hybridrec.data.batch import Batch


@dataclass
class ReadyBatch:
    """A batch with its embeddings, as the dense step gets it."""

    index: int  # position in this trainer's stream of batches (skipped ones count)
    batch: Batch
    looked: object  # what the placement's lookup returned
    staleness: int


class EmbeddingStream(Protocol):
    tau: int
    staleness: list[int]
    figures: dict

    def __iter__(self) -> Iterator[ReadyBatch]: ...

    def push(self, ready: ReadyBatch, grads: dict) -> None: ...

    def skip(self, ready: ReadyBatch) -> None: ...

    def drain(self, timeout: float | None = None) -> None: ...

    def held(self) -> AbstractContextManager: ...

    def stats(self) -> dict: ...

    def close(self) -> None: ...


def update_counts(reply: dict) -> tuple[int, int, int]:
    """(lost batches, dropped updates, unacknowledged updates) of one update's reply."""
    return int(bool(reply.get("lost"))), int(reply.get("dropped", 0)), int(bool(reply.get("unacknowledged")))


def wait_for_updates(cond: threading.Condition, done: Callable[[], bool], stop: threading.Event,
                     timeout: float | None, raise_if_failed: Callable[[], None], state: str) -> None:
    """A stream's `drain`: wait under `cond` until `done()` (every update in flight is through) or
    the stream stopped; then raise the stream's failure if any, or TimeoutError after `timeout`."""
    with cond:
        ok = cond.wait_for(lambda: done() or stop.is_set(), timeout)
    raise_if_failed()
    if not ok:
        raise TimeoutError(f"embedding updates still {state} after {timeout}s")
