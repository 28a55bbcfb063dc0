"""Feeding batches to training: a background prefetch thread and train/test row splits.

`PrefetchLoader(source, depth)` iterates `source` (any re-iterable of `Batch`es, e.g. a
reader) on a daemon thread into a bounded queue, so parsing overlaps training (the numba
kernels release the GIL). A reader exception is re-raised in the consumer; `close()` (or
leaving the `with` block, or dropping the iterator early) stops the thread, and every wait
is bounded so nothing can hang.

`RowRange(source, start, stop)` keeps the rows whose sample id (the global row index every
reader assigns) lies in [start, stop) and stops reading once past `stop`;
`split_first_rows` and `split_fraction` build the train/test pair from it.
"""
from __future__ import annotations

import queue
import threading
from typing import Iterable, Iterator

import numpy as np

from hybridrec.data.batch import Batch

_POLL_SECONDS = 0.1


class _Finished:
    """Queue marker: the source is exhausted (error None) or raised `error`."""

    def __init__(self, error: BaseException | None) -> None:
        self.error = error


def put_unless_stopped(q: queue.Queue, item, stop: threading.Event, poll: float = _POLL_SECONDS) -> bool:
    """Put `item` on a bounded queue, waiting for room; False (not put) once `stop` is set."""
    while not stop.is_set():
        try:
            q.put(item, timeout=poll)
            return True
        except queue.Full:
            continue
    return False


class PrefetchLoader:
    """Iterates `source` on a background thread, keeping up to `depth` batches ready."""

    def __init__(self, source: Iterable[Batch], depth: int = 4,
                 join_timeout_seconds: float = 10.0) -> None:
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 1:
            raise ValueError(f"depth must be an int >= 1, got {depth!r}")
        if not join_timeout_seconds > 0:
            raise ValueError(f"join_timeout_seconds must be > 0, got {join_timeout_seconds!r}")
        self.source = source
        self.depth = depth
        self.join_timeout_seconds = join_timeout_seconds
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._queue: queue.Queue = queue.Queue(maxsize=depth)

    def _produce(self) -> None:
        error = None
        try:
            for batch in self.source:
                if not self._put(batch):
                    return
        except BaseException as exc:  # handed to the consumer, who re-raises it
            error = exc
        self._put(_Finished(error))

    def _put(self, item) -> bool:
        return put_unless_stopped(self._queue, item, self._stop)

    def __iter__(self) -> Iterator[Batch]:
        self.close()
        self._stop = threading.Event()
        self._queue = queue.Queue(maxsize=self.depth)
        self._thread = threading.Thread(target=self._produce, name="hybridrec-prefetch",
                                        daemon=True)
        self._thread.start()
        return self._consume()

    def _consume(self) -> Iterator[Batch]:
        try:
            while True:
                try:
                    item = self._queue.get(timeout=_POLL_SECONDS)
                except queue.Empty:
                    if self._thread is not None and not self._thread.is_alive() \
                            and self._queue.empty():
                        raise RuntimeError("the prefetch thread ended without a result")
                    continue
                if isinstance(item, _Finished):
                    if item.error is not None:
                        raise item.error
                    return
                yield item
        finally:
            self.close()

    def peek(self) -> Batch | None:
        """The batch the consumer gets next, if the thread has it ready now (it stays queued);
        else None. For reading a coming batch's rows ahead."""
        with self._queue.mutex:
            item = self._queue.queue[0] if self._queue.queue else None
        return None if item is None or isinstance(item, _Finished) else item

    def close(self) -> None:
        """Stops the producer thread (waits at most join_timeout_seconds)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is None:
            return
        while True:  # unblock a producer waiting on a full queue
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        thread.join(self.join_timeout_seconds)
        if thread.is_alive():
            raise RuntimeError(f"the prefetch thread did not stop within "
                               f"{self.join_timeout_seconds} s (its source is blocked)")

    def __enter__(self) -> "PrefetchLoader":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class RowRange:
    """The rows of `source` with sample id in [start, stop) (stop None = to the end)."""

    def __init__(self, source: Iterable[Batch], start: int = 0, stop: int | None = None) -> None:
        if not isinstance(start, int) or start < 0:
            raise ValueError(f"start must be an int >= 0, got {start!r}")
        if stop is not None and (not isinstance(stop, int) or stop < start):
            raise ValueError(f"stop must be None or an int >= start ({start}), got {stop!r}")
        self.source = source
        self.start = start
        self.stop = stop

    def __iter__(self) -> Iterator[Batch]:
        for batch in self.source:
            ids = batch.sample_ids
            if not len(ids):
                continue
            if self.stop is not None and ids[0] >= self.stop:
                return  # readers emit rows in increasing sample id order
            low = int(np.searchsorted(ids, np.uint64(self.start)))
            high = len(ids) if self.stop is None else \
                int(np.searchsorted(ids, np.uint64(self.stop)))
            if low == 0 and high == len(ids):
                yield batch
            elif low < high:
                yield batch.slice_rows(low, high)


def split_first_rows(source: Iterable[Batch], train_rows: int) -> tuple[RowRange, RowRange]:
    """(train, test): rows 0..train_rows-1 train, the rest test."""
    if not isinstance(train_rows, int) or train_rows < 0:
        raise ValueError(f"train_rows must be an int >= 0, got {train_rows!r}")
    return RowRange(source, 0, train_rows), RowRange(source, train_rows, None)


def split_fraction(source: Iterable[Batch], test_fraction: float,
                   total_rows: int | None = None) -> tuple[RowRange, RowRange]:
    """(train, test) with the last `test_fraction` of the rows as test. `total_rows`
    defaults to `source.count_rows()` (every reader has it; text files are scanned once)."""
    if not isinstance(test_fraction, (int, float)) or not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction!r}")
    if total_rows is None:
        if not hasattr(source, "count_rows"):
            raise TypeError(f"total_rows is needed: {type(source).__name__} has no count_rows()")
        total_rows = source.count_rows()
    return split_first_rows(source, int(round(total_rows * (1.0 - test_fraction))))
