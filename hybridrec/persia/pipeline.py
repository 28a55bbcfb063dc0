"""The threaded embedding stream of one trainer over a remote placement: bounded staleness
(Persia's hybrid algorithm, §3.2), and with tau = 0 the synchronous discipline.

A feeder thread reads batches, prepares them (the embedding-worker route puts their IDs ahead)
and looks their rows up ahead of the dense step; a pusher thread sends the gradients behind it,
each thread with its own placement connection. Between the
lookup of a batch and the update of its embeddings at most `tau` later lookups may be served:
the lookup of the t-th batch waits until the updates of batches 0 .. t-1-tau were acknowledged
by the PS. Its staleness — this trainer's earlier batches whose updates were not yet applied
when it was looked up — is measured and is never more than `tau`. `tau = 0` is the synchronous
discipline: every lookup sees every earlier update of this trainer. Other trainers' updates of
the step before may still be in flight then (each trainer sends its own as soon as its dense step
ends); `across`, the trainers' barrier, closes that gap for the synchronous discipline with several
trainers: after each push the training thread waits for its acknowledgement, then for `across()`,
and only then may the next lookup be sent, so it sees every trainer's updates of every earlier step.

Otherwise other trainers' updates interleave freely with this one's (the PS applies pushes as they
come, without locks across trainers), as in Persia. The pipeline's `timeline` records when each
lookup and update was sent and answered, from which the job learns how many steps of every
trainer each lookup missed, and where the PS numbers them, how many updates each of its stores
had applied when it served a lookup and each update's place in that order
(hybridrec.persia.staleness).
"""
from __future__ import annotations

import queue
import threading
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator

import numpy as np

from hybridrec.data.batch import Batch
from hybridrec.data.loader import put_unless_stopped
from hybridrec.embedding.stream import ReadyBatch, update_counts, wait_for_updates
from hybridrec.persia.staleness import Timeline

_POLL = 0.1  # seconds between looks at the stop flag while waiting
_END = object()


class EmbeddingPipeline:
    """Iterate to get ReadyBatch objects; hand each one's gradients back with `push`.

    `connect` makes a fresh placement connection (one per thread). `skip` batches at the
    start of `batches` are read and dropped (resuming mid-epoch). At most `limit` batches are looked
    up (a run's remaining steps): a lookup inserts keys, so one of a batch that will never be trained
    would change what the final evaluation reads. `across` (tau = 0 only): a barrier of every
    trainer, called on the training thread once a push was acknowledged; the next lookup waits for
    it. Always `close()` (or use `with`).
    """

    def __init__(self, batches: Iterable[Batch], connect: Callable, tau: int, skip: int = 0,
                 limit: int | None = None, across: Callable[[], None] | None = None):
        if not isinstance(tau, int) or tau < 0:
            raise ValueError(f"tau must be an int >= 0, got {tau!r}")
        if limit is not None and (not isinstance(limit, int) or limit < 0):
            raise ValueError(f"limit must be None or an int >= 0, got {limit!r}")
        if across is not None and tau != 0:
            raise ValueError(f"across (the trainers' barrier) is for tau = 0, got tau={tau!r}")
        self.tau = tau
        self._across = across
        self._limit = limit
        self._batches = batches
        self._skip = skip
        self._feeder_connection = connect()
        self._pusher_connection = connect()
        self._ready: queue.Queue = queue.Queue(maxsize=tau + 1)
        self._pushes: queue.Queue = queue.Queue()
        self._cond = threading.Condition()
        self._pull_lock = threading.Lock()  # held by a lookup in flight, or by `held()`
        self._handed = 0  # batches given to the dense step (in order)
        self._acked = 0  # of those, batches whose update the PS acknowledged (pushes run in order)
        self._released = 0  # with `across`: of those, batches after whose update every trainer's were in
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self.staleness: list[int] = []
        self.timeline = Timeline()  # when each lookup and update was sent and answered (persia.staleness)
        self.figures: dict = {}
        self.lost_batches = 0  # pulls or pushes of batches the embedding worker no longer held
        self.dropped_updates = 0  # updates of keys the PS no longer held (evicted, not admitted)
        self.unacknowledged_updates = 0  # pushes a PS shard died under (not retried, maybe not applied)
        self._feeder = threading.Thread(target=self._guard, args=(self._feed,), name="emb-feeder", daemon=True)
        self._pusher = threading.Thread(target=self._guard, args=(self._push_loop,), name="emb-pusher", daemon=True)
        self._feeder.start()
        self._pusher.start()

    # ------------------------------------------------------------------ threads
    def _guard(self, body: Callable[[], None]) -> None:
        try:
            body()
        except BaseException as error:  # handed to the main thread at its next call
            self._error = self._error or error
            self._stop.set()
            with self._cond:
                self._cond.notify_all()

    def _offer(self, item) -> bool:
        return put_unless_stopped(self._ready, item, self._stop, _POLL)

    def _feed(self) -> None:
        connection = self._feeder_connection
        looked_up = 0
        for index, batch in enumerate(self._batches):
            if self._stop.is_set():
                return
            if index < self._skip:
                continue
            if self._limit is not None and looked_up >= self._limit:
                break
            prepared = connection.prepare(batch)
            with self._cond:  # bounded staleness: wait for the updates of batches <= looked_up-1-tau
                while looked_up - self._done() > self.tau and not self._stop.is_set():
                    self._cond.wait(_POLL)
                staleness = looked_up - self._done()
            with self._pull_lock:
                if self._stop.is_set():
                    return
                sent = Timeline.now()
                looked = connection.lookup(prepared, train=True)
            if looked is None:
                self.lost_batches += 1
                continue
            self.timeline.lookups.append((sent, Timeline.now()))
            self.timeline.note_versions("lookup_versions", getattr(looked, "versions", None))
            looked_up += 1
            if not self._offer(ReadyBatch(index, batch, looked, staleness)):
                return
        self._offer(_END)

    def _push_loop(self) -> None:
        connection = self._pusher_connection
        while True:
            try:
                item = self._pushes.get(timeout=_POLL)
            except queue.Empty:
                if self._stop.is_set():
                    return
                continue
            if item is _END:
                return
            looked, grads = item
            if looked is not None:
                sent = Timeline.now()
                reply = connection.update(looked, grads)
                self.timeline.updates.append((sent, Timeline.now()))
                self.timeline.note_versions("update_versions", reply.get("versions"))
                lost, dropped, unacknowledged = update_counts(reply)
                self.lost_batches += lost
                self.dropped_updates += dropped
                self.unacknowledged_updates += unacknowledged
            with self._cond:
                self._acked += 1
                self._cond.notify_all()

    def _done(self) -> int:
        """Batches whose update the next lookup may count on (the condition's lock is held)."""
        return self._acked if self._across is None else self._released

    # ------------------------------------------------------------------ main thread
    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"embedding pipeline failed: {self._error}") from self._error

    def __iter__(self) -> Iterator[ReadyBatch]:
        while True:
            try:
                item = self._ready.get(timeout=_POLL)
            except queue.Empty:
                self._raise_if_failed()
                continue
            if item is _END:
                return
            self.staleness.append(item.staleness)
            self._handed += 1
            yield item

    def push(self, ready: ReadyBatch, grads: dict[str, np.ndarray]) -> None:
        """Queue the gradients of `ready`'s pulled parts (sent in order, in the background)."""
        self._raise_if_failed()
        self._pushes.put((ready.looked, grads))
        if self._across is not None:
            self.drain()
            self._across()
            self._release()

    def skip(self, ready: ReadyBatch) -> None:
        """`ready` will not be trained (e.g. another rank ran out of data): count it as done
        (without `across`: the other trainers may have no batch to skip)."""
        self._pushes.put((None, {}))
        if self._across is not None:
            self.drain()
            self._release()

    def _release(self) -> None:
        with self._cond:
            self._released = self._acked
            self._cond.notify_all()

    def drain(self, timeout: float | None = None) -> None:
        """Wait until every queued update was acknowledged by the PS."""
        wait_for_updates(self._cond, lambda: self._acked >= self._handed, self._stop, timeout, self._raise_if_failed,
                         "unacknowledged")

    @contextmanager
    def held(self) -> Iterator[None]:
        """No lookup runs inside this block (one in flight is waited for). A lookup inserts keys,
        so an evaluation or checkpoint taken here sees the PS exactly as the trained steps left
        it; with sync, where the next lookup waits for the last update, that makes it
        deterministic."""
        with self._pull_lock:
            yield

    def stats(self) -> dict:
        s = np.asarray(self.staleness or [0])
        return {"max_staleness": int(s.max()), "mean_staleness": float(s.mean()),
                "lost_batches": self.lost_batches, "dropped_updates": self.dropped_updates,
                "unacknowledged_updates": self.unacknowledged_updates,
                "bytes_sent": self._feeder_connection.bytes_sent + self._pusher_connection.bytes_sent,
                "bytes_received": self._feeder_connection.bytes_received + self._pusher_connection.bytes_received}

    def close(self) -> None:
        """Stop both threads (queued updates are sent first) and close the connections."""
        self._pushes.put(_END)
        self._pusher.join()
        self._stop.set()
        self._feeder.join()
        self._feeder_connection.close()
        self._pusher_connection.close()

    def __enter__(self) -> "EmbeddingPipeline":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
