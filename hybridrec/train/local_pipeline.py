"""The pipelined local step: the embedding work of the next batch runs on its own thread beside the
dense step of this one, and the model trained is exactly the plain step's.

One thread ("emb-ahead") does every embedding operation of the local placement, in this order:
look batch t+1 up (dedupe, probe, insert: numba kernels that release the GIL) while the training
thread runs batch t's dense forward and backward; wait for batch t's gradients (its backward
records them, `push` says they are there); apply batch t's update; pool batch t+1 from the rows
as they are now (`LocalPlacement.pool_ahead`); hand batch t+1 to the training thread. So every
batch trains on rows that hold every earlier update (staleness 0).

Why that is the plain step's model: a lookup decides what it inserts and evicts from the stores'
metadata (index, recency, counts, admission sketch), which an update does not change, and an
update skips a row evicted since its lookup, a row whose updated values the plain order would
have overwritten at that eviction anyway. Only the pooled outputs could differ, and they are
pooled after the update. Around an evaluation or a checkpoint (`pause(k)`: the k-th batch of
this stream is followed by one) the next lookup waits until the training thread asks for the next
batch, so they see the stores exactly as the trained steps left them. At most `limit` batches are
looked up. A failure in the thread is raised in the training thread at its next call.
"""
from __future__ import annotations

import queue
import threading
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator

from hybridrec.data.batch import Batch
from hybridrec.data.loader import PrefetchLoader, put_unless_stopped
from hybridrec.errors import UserError
from hybridrec.embedding.stream import ReadyBatch, wait_for_updates

_POLL = 0.1  # seconds between looks at the stop flag while waiting
_END = object()
_JOIN_SECONDS = 60.0  # a kernel call in flight finishes well within this


class _Stopped(Exception):
    """The stream was closed while its thread waited."""


class _ReadFailed(Exception):
    """Reading the batches raised `error`, which the training thread raises as it is (as it would
    reading them itself: a bad row of strict data is the user's to fix, not a pipeline failure)."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


class LocalPipeline:
    """The embedding stream of the pipelined local step (module doc); the training loop uses it as
    it uses `InlineStream`. `embedding_threads`: numba threads of the pipeline's kernels."""

    tau = 0

    def __init__(self, placement, batches: Iterable[Batch], skip: int = 0, limit: int | None = None,
                 prefetch: int = 0, pause: Callable[[int], bool] | None = None, embedding_threads: int = 1):
        self._placement = placement
        self._loader = PrefetchLoader(batches, depth=prefetch) if prefetch else None
        self._source = self._loader if self._loader is not None else batches
        self._skip, self._limit = skip, limit
        self._pause = pause or (lambda looked_up: False)
        self._threads = embedding_threads
        self._ready: queue.Queue = queue.Queue(maxsize=1)
        self._cond = threading.Condition()
        self._lookup_lock = threading.Lock()  # held by a lookup in flight, or by `held()`
        self._requested = 0  # batches the training thread asked for
        self._pushed = 0  # batches whose gradients are recorded (or that will not be trained)
        self._applied = 0  # of those, batches whose update the pipeline applied
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._raise_as_is = False  # the error came from reading the batches
        self.staleness: list[int] = []
        self.figures = {"batches": 0, "shared_rows": 0, "unique_rows": 0}
        self._thread = threading.Thread(target=self._guard, name="emb-ahead", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the pipeline's thread
    def _guard(self) -> None:
        try:
            self._set_threads()
            self._run()
        except _Stopped:
            pass
        except BaseException as error:  # handed to the training thread at its next call
            # the data's errors and the user's (a batch too big for a table) are raised as they
            # are, as the plain step raises them; anything else is the pipeline's failure
            self._raise_as_is = isinstance(error, (_ReadFailed, UserError))
            self._error = error.error if isinstance(error, _ReadFailed) else error
            self._stop.set()
            with self._cond:
                self._cond.notify_all()

    def _set_threads(self) -> None:
        try:
            import numba

            numba.set_num_threads(min(self._threads, numba.config.NUMBA_NUM_THREADS))  # this thread's own count
        except (ImportError, ValueError):
            pass

    def _wait(self, ready: Callable[[], bool]) -> None:
        with self._cond:
            while not ready():
                if self._stop.is_set():
                    raise _Stopped
                self._cond.wait(_POLL)

    def _finish(self, pending: ReadyBatch) -> None:
        """Apply the update of `pending`, the batch handed out last, once its gradients are there."""
        self._wait(lambda: self._pushed > self._applied)
        self._placement.apply_ahead(pending.looked)
        with self._cond:
            self._applied += 1
            self._cond.notify_all()

    def _batches(self):
        """(index, batch) of the batches to look up: the source's, past the first `skip`, at most
        `limit` of them; an error reading them as a _ReadFailed."""
        source = enumerate(self._source)
        taken = 0
        while self._limit is None or taken < self._limit:
            try:
                index, batch = next(source)
            except StopIteration:
                return
            except BaseException as error:
                raise _ReadFailed(error) from error
            if index >= self._skip:
                taken += 1
                yield index, batch

    def _run(self) -> None:
        pending = None  # the batch handed out last, its update not applied yet
        looked_up = 0
        for index, batch in self._batches():
            if self._stop.is_set():
                return
            if pending is not None and self._pause(looked_up):  # an evaluation or checkpoint comes first
                self._finish(pending)
                pending = None
                self._wait(lambda: self._requested > looked_up)
            with self._lookup_lock:
                looked = self._placement.look_ahead(batch)
            if pending is not None:
                self._finish(pending)
            shared, unique = self._placement.pool_ahead(looked, None if pending is None else pending.looked)
            self.figures["shared_rows"] += shared
            self.figures["unique_rows"] += unique
            looked_up += 1
            ready = ReadyBatch(index, batch, looked, 0)
            if not put_unless_stopped(self._ready, ready, self._stop, _POLL):
                return
            pending = ready
        if pending is not None:
            self._finish(pending)
        put_unless_stopped(self._ready, _END, self._stop, _POLL)

    # ------------------------------------------------------------------ the training thread
    def _raise_if_failed(self) -> None:
        if self._error is not None and self._raise_as_is:
            raise self._error
        if self._error is not None:
            raise RuntimeError(f"embedding pipeline failed: {self._error}") from self._error

    def __iter__(self) -> Iterator[ReadyBatch]:
        while True:
            with self._cond:
                self._requested += 1
                self._cond.notify_all()
            while True:
                try:
                    item = self._ready.get(timeout=_POLL)
                    break
                except queue.Empty:
                    self._raise_if_failed()
            if item is _END:
                return
            self.staleness.append(0)
            self.figures["batches"] += 1
            yield item

    def push(self, ready: ReadyBatch, grads: dict) -> None:
        """`ready`'s gradients are recorded (its backward ran): the pipeline applies them."""
        self._raise_if_failed()
        with self._cond:
            self._pushed += 1
            self._cond.notify_all()

    def skip(self, ready: ReadyBatch) -> None:
        """`ready` will not be trained: its update applies nothing."""
        self.push(ready, {})

    def drain(self, timeout: float | None = None) -> None:
        """Wait until every pushed update is applied."""
        wait_for_updates(self._cond, lambda: self._applied >= self._pushed, self._stop, timeout, self._raise_if_failed,
                         "not applied")

    @contextmanager
    def held(self) -> Iterator[None]:
        """No lookup runs inside this block (one in flight is waited for)."""
        with self._lookup_lock:
            yield

    def stats(self) -> dict:
        return {"lost_batches": 0, "dropped_updates": 0, "unacknowledged_updates": 0, "bytes_sent": 0,
                "bytes_received": 0}

    def close(self) -> None:
        """Stop the thread (an update in flight finishes first) and the loader."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._loader is not None:
            self._loader.close()
        self._thread.join(_JOIN_SECONDS)

    def __enter__(self) -> "LocalPipeline":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
