"""The embedding tables every emulated worker reads and updates, as a PS holds them: the local
placement's in-process stores (the real engine: its lookup, pooling and fused optimizer kernels),
with the updates the workers computed but the stores have not applied yet.

A read (`read`) is the local placement's look-ahead lookup and pooling from the rows as they are
at that moment; its gradient, recorded by the dense step's backward, waits in its worker's queue
(`enqueue`) until the emulator applies it (`apply`). Each worker's updates reach the stores in
the order it computed them, as one trainer's pushes do; between workers the schedule decides.
So what a read sees is exactly the updates applied before it.

Staleness is measured at every read, two ways: per worker, the steps whose updates it missed
(the steps the worker computed, or should have by the reader's step, that are not applied), and
per key, the updates of that key computed and not yet applied (each row's count of pending
updates, kept beside the stores). An `observer(event, **facts)` sees every read, enqueue and apply
(the property tests check the bounds with it against the stores' own row clocks).
"""
from __future__ import annotations

from collections import deque
from typing import Callable

import numpy as np

from hybridrec.metrics import StalenessHistogram


class SharedEmbeddings:
    def __init__(self, placement, workers: int, observer: Callable | None = None):
        self.placement = placement
        self.workers = workers
        self.queues: list[deque] = [deque() for _ in range(workers)]  # (step, looked) in compute order
        self.applied = np.zeros(workers, np.int64)  # updates applied, per worker (a prefix of its steps)
        self.computed = np.zeros(workers, np.int64)  # updates computed (enqueued), per worker
        self.observer = observer
        self.per_key = StalenessHistogram()  # updates of a key computed and unseen, per key read
        self.per_read = StalenessHistogram()  # the most steps of one worker a read missed
        self.dropped = 0
        self._offsets: dict[int, int] = {}  # id(store) -> first slot of its rows in `_pending`
        size = 0
        for collection in placement.collections.values():
            for store in collection.stores.values():
                self._offsets[id(store)] = size
                size += store.config.capacity
        self._pending = np.zeros(size, np.int32)  # per row of every store: updates computed, not applied

    def _rows(self, looked: dict) -> np.ndarray:
        """Slots in `_pending` of every row a looked-up batch reads (distinct per table)."""
        parts = [rows.astype(np.int64) + self._offsets[id(store)]
                 for ahead in looked.values() for store, rows in ahead.rows_by_store()]
        return np.concatenate(parts) if parts else np.empty(0, np.int64)

    def read(self, worker: int, step: int, batch, expected: np.ndarray | None = None) -> dict:
        """The batch's rows as the stores hold them now: {side: LookedAhead}, pooled. `expected`:
        per worker, the updates the reader should have seen by its step (default: every one
        computed); what it misses of them is its per-worker staleness."""
        looked = self.placement.look_ahead(batch)
        self.placement.pool_ahead(looked, None)
        rows = self._rows(looked)
        self.per_key.add(self._pending[rows])
        expected = self.computed if expected is None else expected
        self.per_read.add(int(np.max(np.maximum(expected - self.applied, 0), initial=0)))
        if self.observer is not None:
            self.observer("read", worker=worker, step=step, applied=self.applied.copy(), looked=looked)
        return looked

    def enqueue(self, worker: int, step: int, looked: dict) -> None:
        """The update of `looked` (its gradient recorded by backward) waits for `apply`."""
        self.queues[worker].append((step, looked, self._rows(looked)))
        self._pending[self.queues[worker][-1][2]] += 1
        self.computed[worker] += 1
        if self.observer is not None:
            self.observer("enqueue", worker=worker, step=step, looked=looked)

    def apply(self, worker: int) -> None:
        """The oldest waiting update of `worker` reaches the stores."""
        step, looked, rows = self.queues[worker].popleft()
        self.placement.apply_ahead(looked)
        self._pending[rows] -= 1
        self.applied[worker] += 1
        if self.observer is not None:
            self.observer("apply", worker=worker, step=step)

    def prepare_read(self, worker: int, step: int, required: np.ndarray, schedule) -> None:
        """Before a read: every update the bound requires (`required[w]` of worker w's) applied,
        and as many more as the schedule lets the read see."""
        targets = schedule.visible(required, self.computed, worker, step)
        schedule.note_applied(targets, np.maximum(self.applied, targets))
        self.catch_up(targets, schedule)

    def micro_batches(self, looked: dict, batch) -> list:
        return [(looked, batch)]

    def inputs(self, looked: dict, batch, requires_grad: bool):
        """The dense model's inputs of a read, inside autograd (backward records the gradient)."""
        return self.placement.inputs(looked, batch, requires_grad=requires_grad)

    def after_backward(self, worker: int, step: int, looked: dict, inputs) -> None:
        self.enqueue(worker, step, looked)

    def finish(self) -> None:
        self.drain()

    def catch_up(self, targets: np.ndarray, schedule) -> None:
        """Apply updates until every worker has `targets[w]` applied: the extra ones in the order
        the schedule draws."""
        extra = np.maximum(np.minimum(targets, self.computed) - self.applied, 0)
        for worker in schedule.apply_order(extra, self.applied.copy()):
            self.apply(int(worker))

    def drain(self) -> None:
        """Every waiting update applied (each worker's in order, the workers in turn)."""
        while any(self.queues):
            for worker in range(self.workers):
                if self.queues[worker]:
                    self.apply(worker)

    def facts(self) -> dict:
        return {"staleness_per_key": self.per_key.as_dict(), "staleness_per_read": self.per_read.as_dict()}
