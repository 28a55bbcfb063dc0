"""The forwards of one primary PS to one backup, delivered in the order their rows were read.

Why an order is needed. A primary forwards, after each push, the pushed keys' whole rows as it
reads them after applying the push (`hybridrec.ps.replication`). Two pushes of the same key that
run at once on two worker threads each read the row after their own apply; if the forward read
later reaches the backup first, the older row overwrites it there and the backup has lost an
update the primary acknowledged. A clock or count stored in the row cannot say which is newer:
a row evicted and made again starts from its first value and a fresh count.

So each `ForwardStream` reads rows and queues them under one lock (the queue's order is the
order of the reads), and one request at a time is in flight: the thread that finds no request
in flight sends the queued forwards (up to `max_rows` rows and `max_parts` tables' parts, at
least one forward) as one request, in queue order, and the others wait for theirs to be sent (group commit: concurrent
pushes share one round trip). The backup applies a request's forwards in order, so for every
key it keeps the row of the newest read. Each request carries the stream's id and a sequence
number; a backup applies a request only when its number is above the last one it applied from
that stream, so a request that timed out at the primary (which gave it up and went on) and
arrives late cannot overwrite rows sent after it.

A request that fails (the backup refused the connection or timed out) leaves its pushes
acknowledged by the primary alone. Their keys are kept, and the next request carries their rows
read again at that moment (`reread`), after the forwards it sends: read last, they are the
newest, so a backup that was only slow catches up at the next push. The keys kept are bounded by
`max_rows`; past that the backup is too far behind to catch up this way (it is lost, and the
coordinator rebuilds it) and they are given up, counted in `counts["resends_given_up"]`.
"""
from __future__ import annotations

import dataclasses
import secrets
import threading
from typing import Callable, Sequence

import numpy as np


@dataclasses.dataclass
class Forward:
    """The rows one push forwards: per table (name, rows [n, row_width], meta [n, 8]), and the
    push's id (None: none)."""

    pushed: tuple[str, int] | None
    parts: Sequence[tuple[str, np.ndarray, np.ndarray]]
    done: bool = False
    delivered: bool = False

    @property
    def rows(self) -> int:
        return sum(len(rows) for _, rows, _ in self.parts)


Send = Callable[[str, int, list[Forward]], bool]  # (stream id, sequence, forwards) -> the backup took them


class ForwardStream:
    """Ordered, group-committed forwarding to one backup through `send` (see the module docstring)."""

    def __init__(self, send: Send, max_rows: int, max_parts: int,
                 reread: Callable[[dict[str, np.ndarray]], Forward] | None = None, counts: dict | None = None):
        self.id = secrets.token_hex(8)
        self._send, self._max_rows, self._max_parts, self._reread = send, max_rows, max_parts, reread
        self._cond = threading.Condition()
        self._queue: list[Forward] = []
        self._sending = False
        self._sequence = 0
        self._behind: dict[str, list[np.ndarray]] = {}  # table -> keys of forwards the backup did not take
        self._behind_rows = 0
        self.requests = 0  # requests sent (each carries one forward or more)
        self.counts = counts if counts is not None else {}
        for name in ("resent_rows", "resends_given_up"):
            self.counts.setdefault(name, 0)

    def waiting(self) -> int:
        """How many forwards are queued behind the request in flight."""
        with self._cond:
            return len(self._queue)

    def forward(self, read: Callable[[], Forward]) -> bool:
        """Queue the rows `read()` gives (called under the stream's lock, so the queue is in read
        order) and return once they are sent: True when the backup took them."""
        with self._cond:
            mine = read()
            self._queue.append(mine)
            while True:
                while self._sending and not mine.done:
                    self._cond.wait()
                if mine.done:
                    return mine.delivered
                batch = self._take()
                self._catch_up(batch)
                self._sending = True
                self._sequence += 1
                sequence = self._sequence
                self._cond.release()
                delivered = False
                try:
                    delivered = self._send(self.id, sequence, batch)
                finally:
                    self._cond.acquire()
                    for forward in batch:
                        forward.done, forward.delivered = True, delivered
                    if not delivered:
                        self._fell_behind(batch)
                    self._sending = False
                    self.requests += 1
                    self._cond.notify_all()

    def _take(self) -> list[Forward]:
        """The queue's first forwards holding at most `max_rows` rows and `max_parts` parts
        together (at least one forward)."""
        count, rows, parts = 1, self._queue[0].rows, len(self._queue[0].parts)
        while (count < len(self._queue) and rows + self._queue[count].rows <= self._max_rows
               and parts + len(self._queue[count].parts) <= self._max_parts):
            rows += self._queue[count].rows
            parts += len(self._queue[count].parts)
            count += 1
        batch, self._queue = self._queue[:count], self._queue[count:]
        return batch

    def _fell_behind(self, batch: list[Forward]) -> None:
        """Keep the keys of a batch the backup did not take (bounded; see the module docstring)."""
        for forward in batch:
            for name, rows, meta in forward.parts:
                self._behind.setdefault(name, []).append(np.ascontiguousarray(meta.view(np.uint64)[:, 0]))
                self._behind_rows += len(rows)
        if self._behind_rows > self._max_rows:
            self.counts["resends_given_up"] += self._behind_rows
            self._behind, self._behind_rows = {}, 0

    def _catch_up(self, batch: list[Forward]) -> None:
        """Append to `batch` the rows, read now, of the keys the backup missed, when they fit."""
        if not self._behind or self._reread is None:
            return
        if (self._behind_rows + sum(f.rows for f in batch) > self._max_rows
                or len(self._behind) + sum(len(f.parts) for f in batch) > self._max_parts):
            return  # the next request, or the one after, carries them
        again = self._reread({name: np.unique(np.concatenate(keys)) for name, keys in self._behind.items()})
        self._behind, self._behind_rows = {}, 0
        if again.parts:
            self.counts["resent_rows"] += again.rows
            batch.append(again)
