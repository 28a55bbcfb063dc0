"""Flow control of a server's front socket: how many bytes each connection, and all of them
together, may have waiting in the server, so that a client that sends and never reads its
replies, or a crowd of clients, costs a bounded amount of memory.

ZeroMQ's high-water marks count messages, not bytes, and a ROUTER socket cannot stop reading
one connection while it reads the others. So the server (`transport.Server`'s proxy thread)
keeps its own books here:

* Each connection has at most `max_in_flight` requests waiting for a worker, running, or with
  their reply parked; the front socket queues at most one more reply per connection (SNDHWM 1,
  with ROUTER_MANDATORY so a full queue is reported instead of dropping the reply).
* A reply the front socket does not take is parked here and the connection is *blocked*: none
  of its requests runs until its parked replies have left, so a connection that does not read
  makes no more replies.
* The requests of a connection past `max_in_flight`, or blocked, are held, up to
  `held_bytes_per_connection` (and `queued_bytes_total` for all connections); past that they
  are discarded unanswered and counted (a client that does not read times out).
* Requests waiting for a worker thread are at most `queued_bytes_total`; past that the proxy
  stops reading the front socket altogether, so TCP pushes back on every client until the
  workers catch up.

Not thread-safe: only the proxy thread uses a `Flow`.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

RETRY_FIRST = 0.001  # seconds before a parked reply is offered again; doubled up to RETRY_MOST
RETRY_MOST = 0.05


@dataclass(frozen=True)
class FlowLimits:
    """A server's byte and connection limits (see the module docstring)."""

    max_request_bytes: int
    held_bytes_per_connection: int
    queued_bytes_total: int
    max_connections: int
    max_in_flight: int

    @classmethod
    def make(cls, max_request_bytes: int, *, held_bytes_per_connection: int | None = None,
             queued_bytes_total: int | None = None, max_connections: int = 256,
             max_in_flight: int = 8) -> "FlowLimits":
        """Limits with defaults that let each connection hold two of the largest requests and
        the server, 16 of them (at least 64 MiB per connection and 1 GiB in all)."""
        held = max(2 * max_request_bytes, 64 << 20) if held_bytes_per_connection is None else held_bytes_per_connection
        total = max(16 * max_request_bytes, 1 << 30) if queued_bytes_total is None else queued_bytes_total
        for name, value, least in (("held_bytes_per_connection", held, max_request_bytes),
                                   ("queued_bytes_total", total, held), ("max_connections", max_connections, 1),
                                   ("max_in_flight", max_in_flight, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
        return cls(max_request_bytes, held, total, max_connections, max_in_flight)


class _Connection:
    __slots__ = ("queued", "parked", "held", "held_bytes", "retry_at", "backoff")

    def __init__(self) -> None:
        self.queued = 0  # requests waiting for a worker or running
        self.parked: deque[list] = deque()  # replies the front socket did not take yet
        self.held: deque[tuple[list, int]] = deque()  # requests that wait for their turn
        self.held_bytes = 0
        self.retry_at = 0.0
        self.backoff = RETRY_FIRST

    def idle(self) -> bool:
        return not (self.parked or self.held or self.queued)


class Flow:
    """The proxy's books of requests waiting, running and replies parked, per connection."""

    def __init__(self, limits: FlowLimits):
        self.limits = limits
        self._connections: dict[bytes, _Connection] = {}
        self._pending: deque[tuple[bytes, list, int]] = deque()
        self.pending_bytes = 0
        self.held_bytes = 0
        self.discarded = 0  # requests dropped past their connection's bound

    # ---------------------------------------------------------------- requests
    def accepting(self) -> bool:
        """Whether the front socket may be read (requests waiting for a worker are under the bound)."""
        return self.pending_bytes < self.limits.queued_bytes_total

    def arrived(self, peer: bytes, frames: list, nbytes: int) -> bool:
        """Take a request of `nbytes`; False when it was discarded (its connection has as many
        requests in flight and held as it may)."""
        connection = self._connection(peer)
        if not connection.held and self._may_run(connection):
            self._queue(peer, connection, frames, nbytes)
            return True
        if (connection.held_bytes + nbytes > self.limits.held_bytes_per_connection
                or self.held_bytes + nbytes > self.limits.queued_bytes_total):
            self.discarded += 1
            self._forget_if_idle(peer, connection)
            return False
        connection.held.append((frames, nbytes))
        connection.held_bytes += nbytes
        self.held_bytes += nbytes
        return True

    def next_request(self) -> tuple[bytes, list] | None:
        """The oldest request waiting for a worker (None: none)."""
        if not self._pending:
            return None
        peer, frames, nbytes = self._pending.popleft()
        self.pending_bytes -= nbytes
        return peer, frames

    def drop_waiting(self) -> None:
        """Forget every request not yet running (the server is stopping)."""
        for peer, _frames, _nbytes in self._pending:
            self._connections[peer].queued -= 1
        self._pending.clear()
        self.pending_bytes = 0
        for connection in self._connections.values():
            connection.held.clear()
            connection.held_bytes = 0
        self.held_bytes = 0

    # ---------------------------------------------------------------- replies
    def answered(self, peer: bytes) -> bool:
        """A worker finished one of `peer`'s requests; True when its reply may be sent now
        (False: park it, the connection has replies parked already)."""
        connection = self._connection(peer)
        connection.queued = max(0, connection.queued - 1)
        return not connection.parked

    def park(self, peer: bytes, reply: list, now: float) -> None:
        """The front socket did not take `reply`: keep it and block the connection."""
        connection = self._connection(peer)
        if not connection.parked:
            connection.backoff = RETRY_FIRST
            connection.retry_at = now + connection.backoff
        connection.parked.append(reply)

    def sent(self, peer: bytes) -> None:
        """A reply that `answered` let through went out."""
        connection = self._connections.get(peer)
        if connection is not None:
            self._release(peer, connection)

    def parked_sent(self, peer: bytes) -> None:
        """The oldest parked reply of `peer` went out."""
        connection = self._connections.get(peer)
        if connection is not None and connection.parked:
            connection.parked.popleft()
            self._release(peer, connection)

    def still_full(self, peer: bytes, now: float) -> None:
        """A parked reply was offered again and not taken: offer it later, backing off."""
        connection = self._connection(peer)
        connection.backoff = min(2 * connection.backoff, RETRY_MOST)
        connection.retry_at = now + connection.backoff

    def gone(self, peer: bytes) -> None:
        """The connection closed: its parked replies and held requests are dropped."""
        connection = self._connections.get(peer)
        if connection is None:
            return
        self.held_bytes -= connection.held_bytes
        connection.parked.clear()
        connection.held.clear()
        connection.held_bytes = 0
        self._forget_if_idle(peer, connection)

    def due(self, now: float) -> list[tuple[bytes, list]]:
        """(peer, oldest parked reply) of every blocked connection whose retry time has come."""
        return [(peer, c.parked[0]) for peer, c in self._connections.items() if c.parked and c.retry_at <= now]

    def next_retry(self) -> float | None:
        """When the next parked reply is due (None: nothing is parked)."""
        return min((c.retry_at for c in self._connections.values() if c.parked), default=None)

    def stats(self) -> dict[str, Any]:
        return {"pending_bytes": self.pending_bytes, "held_bytes": self.held_bytes, "discarded": self.discarded,
                "parked_replies": sum(len(c.parked) for c in self._connections.values()),
                "blocked_connections": sum(1 for c in self._connections.values() if c.parked)}

    # ---------------------------------------------------------------- books
    def _may_run(self, connection: _Connection) -> bool:
        return not connection.parked and connection.queued + len(connection.parked) < self.limits.max_in_flight

    def _queue(self, peer: bytes, connection: _Connection, frames: list, nbytes: int) -> None:
        connection.queued += 1
        self._pending.append((peer, frames, nbytes))
        self.pending_bytes += nbytes

    def _release(self, peer: bytes, connection: _Connection) -> None:
        """Queue the held requests of `peer` that may run now; forget an idle connection."""
        while connection.held and self._may_run(connection):
            frames, nbytes = connection.held.popleft()
            connection.held_bytes -= nbytes
            self.held_bytes -= nbytes
            self._queue(peer, connection, frames, nbytes)
        self._forget_if_idle(peer, connection)

    def _connection(self, peer: bytes) -> _Connection:
        connection = self._connections.get(peer)
        if connection is None:
            connection = self._connections[peer] = _Connection()
        return connection

    def _forget_if_idle(self, peer: bytes, connection: _Connection) -> None:
        if connection.idle():
            self._connections.pop(peer, None)


class ConnectionCount:
    """The open connections of a front socket, counted from its monitor's events (accepted and
    not yet closed), for the ZAP handler's `admit`: a connection past `max_connections` is
    refused at its handshake. Only the ZAP handler's thread uses it."""

    def __init__(self, monitor, max_connections: int):
        self._monitor = monitor
        self.max_connections = max_connections
        self._open: set[int] = set()

    def refusal(self) -> str | None:
        """Why the connection in its handshake now is refused (None: it is admitted)."""
        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)
            if event["event"] == zmq.EVENT_ACCEPTED:
                self._open.add(event["value"])
            elif event["event"] & (zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED):
                self._open.discard(event["value"])
        if len(self._open) > self.max_connections:
            return (f"this server serves at most {self.max_connections} connections "
                    f"({len(self._open) - 1} are open)")
        return None

    def close(self) -> None:
        self._monitor.close(linger=0)
