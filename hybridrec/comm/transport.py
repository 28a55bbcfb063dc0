"""ZeroMQ request/reply for numpy arrays: zero-copy frames, timeouts, retries, a threaded server.

One message (request or reply) is a ZeroMQ multipart message:
  frame 0   UTF-8 JSON header: {"op", "id", "arrays": [[name, dtype, shape], ...], "meta"};
            a reply also carries "ok" and, when not ok, "error" and "kind".
  frame 1.. the raw bytes of each array in header order, C-contiguous, little-endian; sent with
            ``copy=False`` and received with ``np.frombuffer`` (never pickled): received
            arrays are views of the frame's memory, not copies.

`Client` talks to one server over a DEALER socket: every request has a timeout; after a
timeout the socket is dropped and recreated (so a late reply or a queued request can never be
mistaken for a new one) and idempotent requests are retried. `Server` binds a ROUTER socket
(127.0.0.1 by default), hands requests over inproc to worker threads that validate and run
the registered handlers, and stops within a bound. Malformed or oversized requests get an error
reply that says what was wrong (and one rate-limited log line), and the server keeps serving.

Both sides authenticate with the job key (`hybridrec.comm.auth`) when one is configured: a
server off loopback refuses to start without it, and a client whose handshake is refused gets
an AuthError at once instead of a timeout.
"""

from __future__ import annotations

import itertools
import json
import re
import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

from hybridrec.comm.auth import (FROM_ENVIRONMENT, FULL_STATUS, HOW_TO, AuthError, JobKey, ZapHandler, resolve_key,
                                 server_key)
from hybridrec.comm.flow import ConnectionCount, Flow, FlowLimits
from hybridrec.comm.log_limit import RateLimitedLog

log = logging.getLogger(__name__)

WIRE_DTYPES = frozenset(
    np.dtype(name).newbyteorder("<").str
    for name in ("bool", "int8", "uint8", "int16", "uint16", "int32", "uint32",
                 "int64", "uint64", "float16", "float32", "float64")
)
MAX_HEADER_BYTES = 1 << 20
MAX_REQUEST_BYTES = 1 << 30  # a Server's default limit on one request (all frames)
POLL_MS = 50  # how often idle loops look at their stop flag
LIMITS_OP = "transport.limits"  # answered by every Server itself: meta {max_request_bytes}
HANDSHAKE_MS = 5000  # a connection that has not finished its handshake by then is closed
REQUEST_FAULTS = (ValueError, TypeError, KeyError, OverflowError, MemoryError)  # the request's fault: one line
FD_RESERVE = 128  # descriptors kept for files, pipes and the sockets' own, beyond one per connection
HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


REFUSAL_GRACE = 1.0  # seconds a client watches for a second broken handshake


class ConnectionLost(TimeoutError):
    """The connection to the server closed while a reply was awaited (the server stopped or
    restarted, or a handshake broke off): the request is lost, and a retry goes to the server as
    soon as it listens again. `handshake` holds the monitor event of a broken handshake, if one
    ended the connection."""

    def __init__(self, message: str, handshake: dict | None = None):
        super().__init__(message)
        self.handshake = handshake


class ConnectionRefused(ConnectionLost):
    """Nothing listened at the server's address when the client connected (`receive` with
    `fail_fast`): the request never reached a server."""


class ProtocolError(ValueError):
    """A message that does not follow the wire format."""


class RequestTooLarge(ValueError):
    """A request over the server's `max_request_bytes`, refused by the client before sending."""


class ServerFull(ConnectionError):
    """The server refused the connection at its handshake: it serves as many as it may."""


class RemoteError(RuntimeError):
    """The server answered a request with an error; `kind` is the server-side exception type."""

    def __init__(self, op: str, kind: str, message: str):
        super().__init__(f"{op}: {kind}: {message}")
        self.op, self.kind, self.message = op, kind, message


@dataclass
class Message:
    """One request or reply: an operation name, named arrays and JSON-able metadata."""

    op: str
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)


def encode_frames(message: Message, request_id: int, **header_extra: Any) -> list:
    """The multipart frames of `message`: a JSON header, then one raw buffer per array."""
    descriptors, buffers = [], []
    for name, array in message.arrays.items():
        array = np.asarray(array)
        wire = array.dtype.newbyteorder("<") if array.dtype.byteorder == "=" else array.dtype
        if wire.str not in WIRE_DTYPES:
            raise TypeError(
                f"array {name!r} has dtype {array.dtype}, which the wire does not carry; "
                f"allowed: {sorted(WIRE_DTYPES)}"
            )
        array = np.ascontiguousarray(array, dtype=wire).reshape(array.shape)  # 0-d stays 0-d
        descriptors.append([name, wire.str, list(array.shape)])
        buffers.append(array.data if array.size else b"")
    header = {"op": message.op, "id": request_id, "arrays": descriptors, "meta": message.meta}
    header.update(header_extra)
    return [json.dumps(header, separators=(",", ":")).encode(), *buffers]


def _frame_bytes(frame: zmq.Frame | bytes) -> memoryview:
    return frame.buffer if isinstance(frame, zmq.Frame) else memoryview(frame)


def parse_header(frame: zmq.Frame | bytes) -> dict[str, Any]:
    """The JSON header of a message, with its fields' types checked."""
    raw = _frame_bytes(frame)
    if len(raw) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header is {len(raw)} bytes, more than the {MAX_HEADER_BYTES} allowed")
    try:
        header = json.loads(bytes(raw).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ProtocolError(f"header frame is not UTF-8 JSON: {error}") from None
    except RecursionError:
        raise ProtocolError("header frame nests JSON too deeply to parse") from None
    if not isinstance(header, dict):
        raise ProtocolError(f"header must be a JSON object, got {type(header).__name__}")
    if not isinstance(header.get("op"), str):
        raise ProtocolError(f"header 'op' must be a string, got {header.get('op')!r}")
    if not isinstance(header.get("id"), int):
        raise ProtocolError(f"header 'id' must be an integer, got {header.get('id')!r}")
    if not isinstance(header.get("arrays", []), list):
        raise ProtocolError("header 'arrays' must be a list of [name, dtype, shape]")
    if not isinstance(header.get("meta", {}), dict):
        raise ProtocolError("header 'meta' must be a JSON object")
    return header


_HEADER_START = re.compile(rb'\{\s*"op"\s*:\s*"([^"\\]{0,64})"\s*,\s*"id"\s*:\s*(-?[0-9]{1,19})\s*[,}]')


def _op_and_id(frame: zmq.Frame | bytes) -> tuple[str, int]:
    """The op and id at the start of a header that begins {"op": ..., "id": ...} (as
    `encode_frames` writes it), without parsing the rest (("?", -1) when it does not begin so),
    so that a header too large or malformed to parse still gets an error reply its client can
    match."""
    match = _HEADER_START.match(bytes(_frame_bytes(frame)[:128]))
    return (match[1].decode(), int(match[2])) if match else ("?", -1)


def decode_frames(header: dict[str, Any], frames: Sequence[zmq.Frame | bytes]) -> Message:
    """The Message whose header is `header` and whose array payloads are `frames`."""
    descriptors = header.get("arrays", [])
    if len(frames) != len(descriptors):
        raise ProtocolError(
            f"header declares {len(descriptors)} arrays but {len(frames)} array frames arrived"
        )
    arrays = {}
    for descriptor, frame in zip(descriptors, frames):
        if (not isinstance(descriptor, list) or len(descriptor) != 3
                or not isinstance(descriptor[0], str) or not isinstance(descriptor[2], list)):
            raise ProtocolError(f"array descriptor must be [name, dtype, shape], got {descriptor!r}")
        name, dtype, shape = descriptor
        if dtype not in WIRE_DTYPES:
            raise ProtocolError(f"array {name!r} has dtype {dtype!r}; allowed: {sorted(WIRE_DTYPES)}")
        if not all(isinstance(n, int) and n >= 0 for n in shape):
            raise ProtocolError(f"array {name!r} has shape {shape!r}; dimensions must be ints >= 0")
        buffer = _frame_bytes(frame)
        expected = math.prod(shape) * np.dtype(dtype).itemsize
        if len(buffer) != expected:
            raise ProtocolError(
                f"array {name!r} declared {dtype}{tuple(shape)} = {expected} bytes "
                f"but its frame has {len(buffer)} bytes"
            )
        if name in arrays:
            raise ProtocolError(f"array {name!r} appears twice")
        arrays[name] = np.frombuffer(buffer, dtype=dtype).reshape(shape)
    return Message(header["op"], arrays, header.get("meta", {}))


def check_address(address: str, what: str = "address") -> str:
    """`address` if it looks like 'tcp://host:port' (what ZeroMQ connects to), else ValueError."""
    if not isinstance(address, str) or "://" not in address:
        raise ValueError(f"{what} must look like 'tcp://host:port', got {address!r}")
    return address


def check_addresses(addresses, what: str = "addresses") -> list[str]:
    """A non-empty list of 'tcp://host:port' addresses, each checked."""
    if isinstance(addresses, str) or not addresses:
        raise ValueError(f"{what} must be a non-empty list of 'tcp://host:port', got {addresses!r}")
    return [check_address(a, f"{what} entry") for a in addresses]


def _handshake_error(address: str, key: JobKey | None, event: dict[str, Any]) -> AuthError | ServerFull:
    if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH and event["value"] == FULL_STATUS:
        return ServerFull(f"{address} refused the connection: it serves as many connections as it may "
                          f"(serve-ps --max-connections); close idle clients of it or raise that limit")
    if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        why = "the server refused this client's job key"
    elif key is None:
        why = "the server requires the job key and this client has none"
    else:
        why = "the handshake failed: the server may use no job key, or another one"
    return AuthError(f"{address}: {why}; {HOW_TO}")


class Client:
    """Requests to one server. Not thread-safe: use one Client per thread.

    `request` sends and waits; `send` + `receive` let a caller fan out to several servers
    (send to all, then receive from all). `timeout` is seconds per attempt; `retries` is how
    many more attempts an idempotent request gets after a timeout.
    """

    def __init__(self, address: str, *, timeout: float = 10.0, retries: int = 2,
                 context: zmq.Context | None = None, key: JobKey | None = FROM_ENVIRONMENT):
        check_address(address)
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        if not isinstance(retries, int) or retries < 0:
            raise ValueError(f"retries must be an int >= 0, got {retries!r}")
        self.address, self.timeout, self.retries = address, float(timeout), retries
        self.key = resolve_key(key)
        self._context = context or zmq.Context.instance()
        self._connect()
        self._ids = itertools.count(1)
        self._pending: set[int] = set()  # sent on the current socket, reply not yet taken
        self._early: dict[int, tuple[dict[str, Any], list]] = {}  # replies that overtook others
        self._limit: int | None = None  # the server's max_request_bytes, asked before the first large request

    def send(self, op: str, arrays: dict[str, np.ndarray] | None = None,
             meta: dict[str, Any] | None = None) -> int:
        """Send one request without waiting; returns its id for `receive`."""
        if not self._pending:  # what the connection did while nothing was awaited concerns no request,
            while self._monitor.poll(0):  # unless the server refused this client's key
                event = recv_monitor_message(self._monitor)
                if self._refused(event):
                    self.reconnect()
                    raise _handshake_error(self.address, self.key, event)
        request_id = next(self._ids)
        frames = encode_frames(Message(op, arrays or {}, meta or {}), request_id)
        if len(frames[0]) > MAX_HEADER_BYTES:
            raise RequestTooLarge(f"{op} to {self.address}: its header (meta and array names) takes {len(frames[0])} "
                                  f"bytes, more than the {MAX_HEADER_BYTES} a server reads")
        size = sum(memoryview(frame).nbytes for frame in frames)
        if size > MAX_HEADER_BYTES:
            self._check_size(op, size)
        try:
            self._socket.send_multipart(frames, copy=False)
        except zmq.Again:  # no connection took it within the timeout (a refused handshake leaves none)
            error = self._unsendable(op)
            self.reconnect()
            raise error from None
        self._pending.add(request_id)
        return request_id

    def _unsendable(self, op: str) -> Exception:
        """Why a request could not be sent: the server refused this client's key, or no
        connection came up within the timeout."""
        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)
            if self._refused(event):
                return _handshake_error(self.address, self.key, event)
        return TimeoutError(f"{op} to {self.address}: no connection took the request within the timeout")

    def _check_size(self, op: str, size: int) -> None:
        """RequestTooLarge when a request of `size` bytes is over the server's limit (asked once,
        with a small request, before the first large one: ZeroMQ drops a frame far over it with
        the connection, unanswered)."""
        if self._limit is None:
            try:
                self._limit = int(self.request(LIMITS_OP, idempotent=True).meta["max_request_bytes"])
            except (RemoteError, KeyError, TypeError, ValueError):
                self._limit = 0  # a server that does not say: send, and let it answer
        if self._limit and size > self._limit:
            raise RequestTooLarge(f"{op} to {self.address}: the request of {size} bytes is larger than this "
                                  f"server's limit of {self._limit} bytes; send fewer keys or arrays per request")

    def receive(self, request_id: int, timeout: float | None = None, *, fail_fast: bool = False) -> Message:
        """The reply to `request_id`; TimeoutError (socket recreated) if none comes in time,
        AuthError (socket recreated) when the server refuses the handshake. With `fail_fast`, a
        connection refused (nothing listens at the address: the server is gone) raises
        ConnectionRefused at once instead of waiting for the server to come back; a slow server
        still gets the whole timeout.

        Replies may arrive in any order (the server runs requests on several threads): a
        reply to another pending request is kept until that one is received.
        """
        if request_id in self._early:
            self._pending.discard(request_id)
            return self._reply(*self._early.pop(request_id))
        if request_id not in self._pending:
            raise TimeoutError(f"request {request_id} to {self.address} was dropped when the "
                               "connection was reset after an earlier timeout")
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while True:
            remaining_ms = int(max(0.0, deadline - time.monotonic()) * 1000)
            ready = dict(self._poller.poll(remaining_ms))
            if self._socket not in ready:
                if self._monitor in ready:
                    event = recv_monitor_message(self._monitor)
                    if event["event"] & (zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_CONNECTED):
                        if not (fail_fast and self._nobody_listens(event)):
                            continue  # a connection attempt: the server may come (back) within the timeout
                        error = ConnectionRefused(f"{self.address} refused the connection: nothing listens there "
                                                  "(the server is gone)")
                    elif self._refused(event):
                        error = _handshake_error(self.address, self.key, event)
                    else:  # the server stopped, or a restarting one broke a handshake off: worth another attempt
                        error = ConnectionLost(f"the connection to {self.address} closed before the reply "
                                               "(the server stopped or restarted)",
                                               event if event["event"] & HANDSHAKE_FAILED else None)
                else:
                    error = TimeoutError(f"no reply from {self.address} within the timeout")
                self.reconnect()
                raise error
            frames = self._socket.recv_multipart(copy=False)
            header = parse_header(frames[0])
            if header["id"] == request_id:
                self._pending.discard(request_id)
                return self._reply(header, frames)
            if header["id"] in self._pending:
                self._early[header["id"]] = (header, frames)
            # otherwise: a reply to a request abandoned before a reconnect, dropped

    def _nobody_listens(self, event: dict[str, Any]) -> bool:
        """Whether a monitor event says the connection was refused with no later attempt connected."""
        connected = False
        while self._monitor.poll(0):
            connected = connected or recv_monitor_message(self._monitor)["event"] == zmq.EVENT_CONNECTED
        return event["event"] == zmq.EVENT_CONNECT_RETRIED and not connected

    def _refused(self, event: dict[str, Any]) -> bool:
        """Whether a monitor event means the server will not talk to this client's key (and not
        that a restarting server broke one handshake off): a refusal by its ZAP handler, a key-less
        client meeting a CURVE server (mechanism mismatch), or a broken handshake that happens
        again within REFUSAL_GRACE seconds (a wrong or missing key breaks every one)."""
        kind = event["event"]
        if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            return True
        if kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and event["value"] == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            return True
        if not kind & HANDSHAKE_FAILED:
            return False
        deadline = time.monotonic() + REFUSAL_GRACE
        while (left := deadline - time.monotonic()) > 0:
            if self._monitor.poll(int(left * 1000) + 1) and recv_monitor_message(self._monitor)["event"] & HANDSHAKE_FAILED:
                return True
        return False

    def abandon(self, request_id: int) -> None:
        """Stop waiting for `request_id`: its reply is dropped when it comes."""
        self._pending.discard(request_id)
        self._early.pop(request_id, None)

    @staticmethod
    def _reply(header: dict[str, Any], frames: list) -> Message:
        if not header.get("ok", False):
            raise RemoteError(header["op"], str(header.get("kind", "Error")),
                              str(header.get("error", "unknown error")))
        return decode_frames(header, frames[1:])

    def request(self, op: str, arrays: dict[str, np.ndarray] | None = None,
                meta: dict[str, Any] | None = None, *, idempotent: bool = False,
                timeout: float | None = None, retries: int | None = None, fail_fast: bool = False) -> Message:
        """Send a request and wait for its reply, retrying after timeouts if `idempotent`.

        `retries` overrides the client's retry count for this call. A non-idempotent request
        that times out raises TimeoutError: it may or may not have been applied by the server.
        `fail_fast`: a refused connection ends the wait at once (see `receive`).
        """
        attempts = 1 + ((self.retries if retries is None else retries) if idempotent else 0)
        for attempt in range(attempts):
            request_id = self.send(op, arrays, meta)
            try:
                return self.receive(request_id, timeout, fail_fast=fail_fast)
            except TimeoutError as error:
                if attempt + 1 == attempts:
                    raise type(error)(
                        f"{op} to {self.address}: no reply after {attempts} attempt(s) ({error})"
                        + ("" if idempotent else "; it may or may not have been applied")
                    ) from None
        raise AssertionError("unreachable")

    def _connect(self) -> None:
        """A DEALER connected to the server (a CURVE client with the job key) and a monitor
        that reports failed handshakes."""
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SNDTIMEO, int(self.timeout * 1000))  # a send never blocks for good
        if self.key is not None:
            self.key.secure_client(self._socket)
        self._monitor = self._socket.get_monitor_socket(HANDSHAKE_FAILED | zmq.EVENT_DISCONNECTED
                                                        | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_CONNECTED)
        self._poller = zmq.Poller()
        self._poller.register(self._socket, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._socket.connect(self.address)

    def reconnect(self) -> None:
        """Drop the socket (and anything queued on it) and connect a fresh one."""
        self.close()
        self._connect()
        self._pending.clear()
        self._early.clear()

    def close(self) -> None:
        self._socket.disable_monitor()
        self._monitor.close(linger=0)
        self._socket.close(linger=0)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def request_all(requests: Sequence[tuple[Client, str, dict[str, np.ndarray], dict[str, Any]]],
                *, idempotent: bool = False) -> list[Message]:
    """Send every (client, op, arrays, meta) first, then collect the replies in order.

    The servers work in parallel; a server that times out is retried on its own when the
    op is idempotent.
    """
    pending = [client.send(op, arrays, meta) for client, op, arrays, meta in requests]
    replies = []
    try:
        for (client, op, arrays, meta), request_id in zip(requests, pending):
            try:
                replies.append(client.receive(request_id))
            except TimeoutError:
                if not idempotent or client.retries == 0:
                    raise
                replies.append(client.request(op, arrays, meta, idempotent=True,
                                              retries=client.retries - 1))
    except BaseException:
        for (client, *_), request_id in zip(requests[len(replies):], pending[len(replies):]):
            client.abandon(request_id)  # their replies will be dropped, not kept forever
        raise
    return replies


Handler = Callable[[Message], Message]


@dataclass(frozen=True)
class Operation:
    """A server operation: its handler and the arrays (name -> dtype) a request must carry.

    `arrays=None` lets any arrays through (the handler checks them).
    """

    handler: Handler
    arrays: dict[str, str] | None = field(default_factory=dict)

    def check(self, message: Message) -> None:
        if self.arrays is None:
            return
        expected = {name: np.dtype(dtype) for name, dtype in self.arrays.items()}
        if set(message.arrays) != set(expected):
            raise ProtocolError(
                f"op {message.op!r} takes arrays {sorted(expected)}, got {sorted(message.arrays)}"
            )
        for name, dtype in expected.items():
            if message.arrays[name].dtype != dtype:
                raise ProtocolError(
                    f"op {message.op!r} array {name!r} must be {dtype}, got {message.arrays[name].dtype}"
                )




def _descriptors_for(connections: int) -> int:
    """How many connections the process's descriptor limit leaves room for, once the soft limit
    is raised (up to the hard one) to hold `connections` of them."""
    try:
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        wanted = connections + FD_RESERVE
        if soft != resource.RLIM_INFINITY and soft < wanted:
            raised = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
        return connections if soft == resource.RLIM_INFINITY else max(1, min(connections, soft - FD_RESERVE))
    except (ImportError, ValueError, OSError):
        return connections


class Server:
    """A ROUTER front on `host:port` feeding `threads` worker threads that run handlers.

    `port=0` picks a free port (see `.port` after `start`). `request_stop()` may be called
    from a handler: the reply in flight is still delivered. `key`: the job key (by default the
    environment's, see `hybridrec.comm.auth`); off loopback there must be one.

    Limits (`hybridrec.comm.flow`): a request of more than `max_request_bytes` (all frames) gets
    an error reply (a single frame over twice that breaks the connection, as ZeroMQ drops it
    unread; `Client` never sends one); at most `max_connections` connections are served at once
    (a client past it is refused at its handshake, `ServerFull`); each connection may have
    `held_bytes_per_connection` of requests waiting while it does not read its replies, and all
    requests waiting for a worker thread are at most `queued_bytes_total`.
    """

    def __init__(self, operations: dict[str, Operation], *, host: str = "127.0.0.1",
                 port: int = 0, threads: int = 2, max_request_bytes: int = MAX_REQUEST_BYTES,
                 key: JobKey | None = FROM_ENVIRONMENT, max_connections: int = 256,
                 held_bytes_per_connection: int | None = None, queued_bytes_total: int | None = None):
        if not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be an int >= 1, got {threads!r}")
        if not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"port must be an int in [0, 65535], got {port!r}")
        if not isinstance(max_request_bytes, int) or max_request_bytes < MAX_HEADER_BYTES:
            raise ValueError(f"max_request_bytes must be an int >= {MAX_HEADER_BYTES}, got {max_request_bytes!r}")
        self.limits = FlowLimits.make(max_request_bytes, held_bytes_per_connection=held_bytes_per_connection,
                                      queued_bytes_total=queued_bytes_total, max_connections=max_connections)
        self.operations = dict(operations)
        self.host, self.port, self.threads = host, port, threads
        self.max_request_bytes = max_request_bytes
        self.key = server_key(host, key)
        self._bad_requests = RateLimitedLog(log)
        self._failures = RateLimitedLog(log)
        self._stop = threading.Event()
        self._stopped = threading.Event()
        self._context: zmq.Context | None = None
        self._zap: ZapHandler | None = None
        self._connections: ConnectionCount | None = None
        self._workers: list[threading.Thread] = []
        self._proxy: threading.Thread | None = None
        self.flow = Flow(self.limits)

    @property
    def address(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    def start(self) -> int:
        """Bind and start serving in background threads; returns the bound port."""
        self._context = zmq.Context()
        front = self._context.socket(zmq.ROUTER)
        front.setsockopt(zmq.LINGER, 1000)  # let the last replies out on stop
        front.setsockopt(zmq.MAXMSGSIZE, 2 * self.max_request_bytes)  # a frame; requests over the limit get an error
        front.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full reply queue raises Again instead of dropping the reply
        front.setsockopt(zmq.SNDHWM, 1)  # one reply queued per connection; the rest is `flow`'s
        front.setsockopt(zmq.RCVHWM, 2)  # requests ZeroMQ reads ahead per connection while the proxy does not
        front.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_MS)
        front.zap_domain = b"hybridrec"  # every connection, keyed or not, goes through the ZAP handler
        max_connections = _descriptors_for(self.limits.max_connections)
        if max_connections < self.limits.max_connections:
            log.warning("server on %s: the descriptor limit leaves room for %d connections, not %d",
                        self.host, max_connections, self.limits.max_connections)
        self._connections = ConnectionCount(front.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
                                                                     | zmq.EVENT_CLOSED), max_connections)
        try:
            self._zap = ZapHandler(self._context, self.key, self._connections.refusal)
            if self.key is not None:
                self.key.secure_server(front)
            if self.port:
                front.bind(f"tcp://{self.host}:{self.port}")
            else:
                self.port = front.bind_to_random_port(f"tcp://{self.host}")
        except zmq.ZMQError:
            front.disable_monitor()
            front.close(linger=0)
            self._terminate()
            raise
        back = self._context.socket(zmq.ROUTER)
        back.setsockopt(zmq.LINGER, 0)
        backend = f"inproc://workers-{id(self)}"
        back.bind(backend)
        self._workers = [
            threading.Thread(target=self._work, args=(backend, i), name=f"ps-worker-{i}", daemon=True)
            for i in range(self.threads)
        ]
        for worker in self._workers:
            worker.start()
        self._proxy = threading.Thread(target=self._forward, args=(front, back), name="ps-proxy",
                                       daemon=True)
        self._proxy.start()
        return self.port

    # ---------------------------------------------------------------- the proxy thread
    def _forward(self, front: zmq.Socket, back: zmq.Socket) -> None:
        """Move requests from the front socket to idle workers and replies back, keeping
        `self.flow`'s books (see hybridrec.comm.flow)."""
        flow, idle = self.flow, deque()
        poller = zmq.Poller()
        poller.register(back, zmq.POLLIN)
        reading = False
        try:
            while True:
                stopping = self._stop.is_set()
                if stopping:
                    flow.drop_waiting()
                    if not any(worker.is_alive() for worker in self._workers):
                        break
                want = not stopping and flow.accepting()
                if want and not reading:
                    poller.register(front, zmq.POLLIN)
                elif reading and not want:
                    poller.unregister(front)
                reading = want
                retry = flow.next_retry()
                wait = POLL_MS if retry is None else min(POLL_MS, max(0, int((retry - time.monotonic()) * 1000)))
                events = dict(poller.poll(wait))
                if back in events:  # replies first, also while stopping
                    while back.poll(0, zmq.POLLIN):
                        worker, peer, *reply = back.recv_multipart(copy=False)
                        idle.append(worker.bytes)
                        if peer.bytes:  # an empty peer: the worker's first "ready"
                            self._reply(front, peer.bytes, reply)
                self._retry_parked(front)
                if reading and front in events:
                    while flow.accepting() and front.poll(0, zmq.POLLIN):
                        self._arrived(front.recv_multipart(copy=False))
                while idle and not stopping:
                    taken = flow.next_request()
                    if taken is None:
                        break
                    peer, frames = taken
                    back.send_multipart([idle.popleft(), peer, *frames], copy=False)
            while back.poll(POLL_MS, zmq.POLLIN):  # replies the last workers sent
                _worker, peer, *reply = back.recv_multipart(copy=False)
                if peer.bytes:
                    self._reply(front, peer.bytes, reply)
        finally:
            back.close()
            front.disable_monitor()
            front.close()
            self._stopped.set()

    def _arrived(self, frames: list[zmq.Frame]) -> None:
        """Queue one request read from the front socket: [peer, header, arrays...]. A request
        over the size limit keeps only its header (for the error reply) and its size."""
        peer, request = frames[0].bytes, frames[1:]
        size = sum(len(_frame_bytes(frame)) for frame in request)
        control, kept = b"", size
        if size > self.max_request_bytes:
            request, control = request[:1], str(size).encode()
            kept = len(_frame_bytes(request[0])) if request else 0
        if not self.flow.arrived(peer, [control, *request], kept):
            self._bad_requests.warning("discarded a request from a connection that does not read its replies "
                                       "(%d discarded so far)", self.flow.discarded)

    def _reply(self, front: zmq.Socket, peer: bytes, reply: list) -> None:
        if not self.flow.answered(peer):
            self.flow.park(peer, reply, time.monotonic())
            return
        outcome = self._send(front, peer, reply)
        if outcome == "full":
            self.flow.park(peer, reply, time.monotonic())
        elif outcome == "gone":
            self.flow.gone(peer)
        else:
            self.flow.sent(peer)

    def _retry_parked(self, front: zmq.Socket) -> None:
        now = time.monotonic()
        for peer, reply in self.flow.due(now):
            outcome = self._send(front, peer, reply)
            if outcome == "sent":
                self.flow.parked_sent(peer)
            elif outcome == "gone":
                self.flow.gone(peer)
            else:
                self.flow.still_full(peer, now)

    @staticmethod
    def _send(front: zmq.Socket, peer: bytes, reply: list) -> str:
        """"sent", "full" (the connection's queue is full) or "gone" (it closed)."""
        try:
            front.send_multipart([peer, *reply], copy=False, flags=zmq.NOBLOCK)
            return "sent"
        except zmq.Again:
            return "full"
        except zmq.ZMQError as error:
            if error.errno == zmq.EHOSTUNREACH:
                return "gone"
            raise

    # ---------------------------------------------------------------- worker threads
    def _work(self, backend: str, index: int) -> None:
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 1000)  # a reply sent just before stopping still leaves
        socket.setsockopt(zmq.IDENTITY, b"w%d" % index)
        socket.connect(backend)
        socket.send_multipart([b""])  # ready
        try:
            while not self._stop.is_set():
                if not socket.poll(POLL_MS, zmq.POLLIN):
                    continue
                peer, control, *frames = socket.recv_multipart(copy=False)
                socket.send_multipart([peer, *self._answer(frames, control.bytes)], copy=False)
        finally:
            socket.close()

    def _answer(self, frames: list[zmq.Frame], oversize: bytes = b"") -> list:
        """The reply frames for one request's frames (header + arrays); never raises.
        `oversize`: the request's size, when it was over the limit (its arrays were dropped)."""
        op, request_id = _op_and_id(frames[0])  # for the error reply of a header that does not parse
        try:
            header = parse_header(frames[0])
            op, request_id = header["op"], header["id"]
            if oversize:
                raise ProtocolError(f"request of {int(oversize)} bytes is larger than this server's limit of "
                                    f"{self.max_request_bytes} bytes; send fewer keys or arrays per request")
            if op == LIMITS_OP:
                return encode_frames(Message(op, meta={"max_request_bytes": self.max_request_bytes}), request_id,
                                     ok=True)
            operation = self.operations.get(op)
            if operation is None:
                raise ProtocolError(f"unknown op {op!r}; this server knows {sorted(self.operations)}")
            request = decode_frames(header, frames[1:])
            operation.check(request)
            reply = operation.handler(request)
            return encode_frames(reply, request_id, ok=True)
        except Exception as error:  # a bad request must never take the server down
            if isinstance(error, REQUEST_FAULTS):  # the request's fault: one line
                self._bad_requests.warning("refused a bad request (op %.64r): %s: %.300s", op, type(error).__name__,
                                           " ".join(str(error).split()))
            elif isinstance(error, OSError):  # the machine's (a full disk, a name too long): one line too
                self._failures.warning("op %.64r failed: %s: %.300s", op, type(error).__name__,
                                       " ".join(str(error).split()))
            else:  # our bug: its traceback, rate-limited too
                self._failures.exception("op %.64r failed", op)
            kind = type(error).__name__
            return encode_frames(Message(op), request_id, ok=False, kind=kind, error=str(error))

    def request_stop(self) -> None:
        """Ask the server to stop; returns at once (see `stop` to wait)."""
        self._stop.set()

    def stop(self, timeout: float = 5.0) -> bool:
        """Stop and wait up to `timeout` seconds; True when every thread has ended."""
        self._stop.set()
        if self._proxy is None:
            return True
        deadline = time.monotonic() + timeout
        for thread in [*self._workers, *([self._proxy] if self._proxy else [])]:
            thread.join(max(0.0, deadline - time.monotonic()))
        finished = self._stopped.is_set() and not any(t.is_alive() for t in self._workers)
        if finished:
            self._terminate()
        else:
            log.warning("server on %s: threads still busy after %.1fs; left as daemons",
                        self.address, timeout)
        return finished

    def _terminate(self) -> None:
        """End the ZAP handler, then the context (every other socket of it is closed)."""
        if self._zap is not None:
            self._zap.stop()
            self._zap = None
        if self._connections is not None:
            self._connections.close()
            self._connections = None
        if self._context is not None:
            self._context.term()
            self._context = None

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the server has stopped (e.g. after a shutdown request)."""
        return self._stopped.wait(timeout)

    def __enter__(self) -> "Server":
        if self._proxy is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class Service:
    """The lifecycle of an object that answers requests through `self.transport` (a Server):
    `start()` then `wait()`/`stop()`, or use it as a context manager. Subclasses release their
    own resources in `_release()`, called once the transport has stopped."""

    transport: Server

    def start(self) -> int:
        return self.transport.start()

    @property
    def address(self) -> str:
        return self.transport.address

    def wait(self, timeout: float | None = None) -> bool:
        return self.transport.wait(timeout)

    def stop(self, timeout: float = 5.0) -> bool:
        stopped = self.transport.stop(timeout)
        self._release()
        return stopped

    def _release(self) -> None:
        pass

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
