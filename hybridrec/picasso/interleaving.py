"""PICASSO's D-interleaving (§III-C): a training batch is looked up in micro-batches, and the
lookup of part i+1 runs on a communication thread while the dense model computes part i. The
gradients of the parts are accumulated: the embeddings and the dense parameters are updated once
per batch.

`CommThread` is the one thread that makes every collective of the sharded tables' group, in the
order they were asked for (collectives must run in the same order on every trainer); `cut` cuts a
step into its parts and starts the first part's lookup, `part_round` gives a part's looked-up
round and starts the next part's.
"""
from __future__ import annotations

import concurrent.futures

import numpy as np

from hybridrec.picasso.lookup_rounds import Part, Round, Step


class CommThread:
    """Runs collectives one after the other on a thread of its own (`active`), or, inactive, in
    the caller's thread."""

    def __init__(self, active: bool):
        self._executor = (concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hybridrec-alltoall")
                          if active else None)

    def call(self, fn, *args):
        """`fn(*args)`, run after every collective asked for before it."""
        if self._executor is None:
            return fn(*args)
        return self._executor.submit(fn, *args).result()

    def submit(self, fn, *args):
        """`fn(*args)` started after those asked for before it: a future (inactive: the result)."""
        if self._executor is None:
            return fn(*args)
        return self._executor.submit(fn, *args)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)


def cut(step: Step, batch, parts: int, start) -> list:
    """(Part, micro-batch) pairs of `batch` cut into `parts` parts of about equal rows, after
    `start(step, 0)` began the first part's lookup; [(step, batch)] when it is not cut. Every
    trainer takes as many parts, whatever its batch holds (a part may be empty: a partial batch,
    or a lockstep trainer whose stream ran dry), or their AllToAlls would not pair."""
    if parts <= 1:
        return [(step, batch)]
    bounds = np.linspace(0, batch.batch_size, parts + 1).round().astype(int)
    step.parts = [batch.slice_rows(int(a), int(b)) for a, b in zip(bounds, bounds[1:])]
    step.futures = [None] * parts
    step.futures[0] = start(step, 0)
    return [(Part(step, i), part) for i, part in enumerate(step.parts)]


def part_round(part: Part, start) -> Round:
    """The looked-up round of `part`, once the next part's lookup was started (`start(step, i)`)."""
    step = part.step
    future = step.futures[part.index]
    if part.index + 1 < len(step.parts):
        step.futures[part.index + 1] = start(step, part.index + 1)
    return future.result() if isinstance(future, concurrent.futures.Future) else future
