"""Replicated buckets (`strategy.ps_replicas: 2`): synchronous forwarding from each bucket's
primary to its backup, exactly-once pushes across a failover, and rebuilding a backup.

The guarantee. After each push the primary sends the pushed keys' whole rows (embedding and
optimizer state, `replica_put`), as it reads them after applying the push, to each bucket's
backup, and acknowledges the push once the backup took them. The forwards of one primary to one
backup reach it in the order the primary read the rows (`hybridrec.ps.forward_stream`: one
request in flight per backup, the waiting forwards sent together next), so for every key the
backup keeps the newest row read, never an older one delivered late. Hence, when the primary is
lost (`Coordinator.fail_over`), every push it acknowledged after its backup took the forward is
in the new primary's rows, applied once (see Exactly once). What this does not cover: a push
the primary acknowledged alone because its backup did not answer (it refuses the connection:
gone; or it times out) and that the primary lost before its next forward request to the same
backup succeeded (that request carries the missed keys' rows read again; the coordinator sees a
lost backup and gives its buckets a new one);
a row the primary or the backup itself evicts (each is an LRU store of its own capacity; rows a
server backs count against it). Keys only ever looked up, never pushed, are not forwarded: the
backup makes them again with the same first value (a row's first value depends only on the
table's seed and the key), on a lookup or on a push (with replication a push makes the rows it
does not find, where an unreplicated server drops their update). A routed server takes
forwards on a port of its own with worker threads of their own (`EmbeddingServer.replica_lane`;
the coordinator sends every server the others' forwarding addresses, `BucketOwnership.lanes`):
a forward never waits for a worker thread that is itself waiting on a forward the other way.

Exactly once. Every push carries an id (client, sequence); a server remembers the ids it
applied, and a backup the ids of the pushes forwarded to it (`AppliedPushes`). A client whose
primary was lost while it waited sends the same push, with the same id, to the new primary
(the former backup): when the push had been forwarded it is answered without being applied
again.

Rebuilding a backup (`Coordinator._rebackup`): the new backup takes the buckets empty, the
primary takes the table that names it and forwards from then on, then the primary's rows of the
buckets are copied to the backup, which adds only the keys no forward brought it (those are
newer). No server holds its lock while it waits for another, so two servers forwarding to each
other never wait on each other.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from hybridrec.comm.transport import MAX_HEADER_BYTES, Client, Message, Operation
from hybridrec.embedding import EmbeddingStore
from hybridrec.ps.forward_stream import Forward, ForwardStream
from hybridrec.ps.ownership import BucketOwnership
from hybridrec.ps.routing import NO_SERVER

REMEMBERED_PUSHES = 1 << 16  # ids of applied pushes kept (per server): far more than a failover re-sends
FORWARD_TIMEOUT = 10.0
REMEMBERED_STREAMS = 1024  # streams (primary, backup) whose last sequence a backup keeps
MAX_FORWARD_PARTS = 512  # tables' parts (pushes' forwards x their tables) one replica_put carries at most


def push_id(meta: Mapping[str, Any]) -> tuple[str, int] | None:
    """A request's push id [client, sequence], None when it carries none; ValueError when malformed."""
    value = meta.get("push_id")
    if value is None:
        return None
    if (not isinstance(value, list) or len(value) != 2 or not isinstance(value[0], str) or len(value[0]) > 64
            or isinstance(value[1], bool) or not isinstance(value[1], int)):
        raise ValueError(f"meta 'push_id' must be [client id (at most 64 characters), sequence number], got {value!r:.80}")
    return value[0], value[1]


class AppliedPushes:
    """The ids of the pushes this server applied (directly or forwarded), the newest
    `REMEMBERED_PUSHES`, with the reply each got."""

    def __init__(self) -> None:
        self._seen: OrderedDict[tuple[str, int], dict] = OrderedDict()
        self._lock = threading.Lock()
        self.duplicates = 0

    def reply_of(self, key: tuple[str, int] | None) -> dict | None:
        if key is None:
            return None
        with self._lock:
            reply = self._seen.get(key)
            if reply is not None:
                self.duplicates += 1
            return reply

    def remember(self, key: tuple[str, int] | None, reply: dict) -> None:
        if key is None:
            return
        with self._lock:
            self._seen[key] = reply
            while len(self._seen) > REMEMBERED_PUSHES:
                self._seen.popitem(last=False)


class Replication:
    """Forwarding and rebuilding for one server; `key` is the job key its clients use;
    `max_forward_rows`: the most rows one forward request carries (its bytes must fit the
    backup's forwarding port, `forward_bytes_limit`)."""

    def __init__(self, ownership: BucketOwnership, stores: Callable[[], dict[str, EmbeddingStore]], key=None,
                 max_forward_rows: int = 1 << 16):
        self.ownership, self._stores, self._key = ownership, stores, key
        self.applied = AppliedPushes()
        self._local = threading.local()
        self._max_forward_rows = max_forward_rows
        self._streams: dict[str, ForwardStream] = {}  # forwarding address -> the stream to it
        self._streams_lock = threading.Lock()
        self._last_applied: OrderedDict[str, int] = OrderedDict()  # stream id -> the last sequence applied here
        self._put_lock = threading.Lock()
        self.counts = {"forwarded": 0, "forward_failures": 0, "forward_requests": 0, "stale_forwards": 0,
                       "refused_forwards": 0}

    def _client(self, address: str) -> Client:
        clients = self._local.__dict__.setdefault("clients", {})
        if address not in clients:
            clients[address] = Client(address, timeout=FORWARD_TIMEOUT, retries=0, key=self._key)
        return clients[address]

    def operations(self) -> dict[str, Operation]:
        return {"replica_put": Operation(self._put, arrays=None)}

    # ---------------------------------------------------------------- forwarding
    def active(self) -> bool:
        """Whether the job replicates its buckets (this server's table gives them backups)."""
        table = self.ownership.table
        return table is not None and table.replicated

    def _stream(self, address: str) -> ForwardStream:
        with self._streams_lock:
            if address not in self._streams:
                self._streams[address] = ForwardStream(lambda *batch: self._send(address, *batch),
                                                       self._max_forward_rows, MAX_FORWARD_PARTS,
                                                       reread=self._reread, counts=self.counts)
            return self._streams[address]

    def waiting(self) -> int:
        """How many forwards wait behind another to the same backup (all streams)."""
        with self._streams_lock:
            streams = list(self._streams.values())
        return sum(stream.waiting() for stream in streams)

    def forward(self, tables: Sequence[str], keys: Sequence[np.ndarray], pushed: tuple[str, int] | None) -> None:
        """Send the pushed keys' rows to their buckets' backups (call it holding the ownership
        lock shared, after applying the push); returns once each backup took them or is given up."""
        table = self.ownership.table
        if table is None or not table.replicated:
            return
        stores = self._stores()
        by_backup: dict[int, list[tuple[str, np.ndarray]]] = {}
        for name, table_keys in zip(tables, keys):
            backups = table.backups[self.ownership.buckets(name, table_keys)]
            for backup in np.unique(backups):
                if backup != NO_SERVER:
                    by_backup.setdefault(int(backup), []).append((name, table_keys[backups == backup]))
        for backup, parts in by_backup.items():
            address = table.addresses[backup]
            stream = self._stream(self.ownership.lanes.get(address, address))

            def read(parts=parts) -> Forward:  # under the stream's lock: the queue is in read order
                return Forward(pushed, [(name, *stores[name].rows_of(part_keys)) for name, part_keys in parts])

            if stream.forward(read):
                self.counts["forwarded"] += 1
            else:  # the backup is lost (the coordinator replaces it) or timed out: acknowledged alone
                self.counts["forward_failures"] += 1

    def _reread(self, keys: dict[str, np.ndarray]) -> Forward:
        """The current rows of `keys` (table -> keys) for a backup that missed them."""
        stores = self._stores()
        return Forward(None, [(name, *stores[name].rows_of(table_keys)) for name, table_keys in keys.items()
                              if name in stores])

    def _send(self, address: str, stream: str, sequence: int, forwards: list[Forward]) -> bool:
        """One replica_put of `forwards`, in order; whether the backup took it."""
        arrays, entries, part = {}, [], 0
        for forward in forwards:
            names = []
            for name, rows, meta in forward.parts:
                arrays[f"{part}.rows"], arrays[f"{part}.meta"] = rows, meta
                names.append(name)
                part += 1
            entries.append([None if forward.pushed is None else list(forward.pushed), names])
        try:
            self._client(address).request("replica_put", arrays, {"stream": [stream, sequence], "entries": entries},
                                          fail_fast=True)
        except (TimeoutError, OSError, RuntimeError):
            return False
        self.counts["forward_requests"] += 1
        return True

    def _put(self, request: Message) -> Message:
        """Overwrite the rows a primary forwarded (of buckets this server backs), forward by
        forward in the order sent; a request older than one already applied from its stream is
        ignored (`hybridrec.ps.forward_stream`)."""
        stores = self._stores()
        stream, sequence = check_stream(request.meta.get("stream"))
        entries = check_entries(request.meta.get("entries"), stores)
        forwards, part = [], 0
        for pushed, names in entries:
            parts = []
            for name in names:
                rows, meta = request.arrays.get(f"{part}.rows"), request.arrays.get(f"{part}.meta")
                width = stores[name].config.row_width
                if (not isinstance(rows, np.ndarray) or rows.dtype != np.float32 or rows.ndim != 2
                        or rows.shape[1] != width or not isinstance(meta, np.ndarray) or meta.dtype != np.int32
                        or meta.shape != (len(rows), 8)):
                    raise ValueError(f"replica_put: arrays {part}.rows / {part}.meta must be float32 [n, {width}] "
                                     f"rows and int32 [n, 8] records of table {name!r}")
                parts.append((name, rows, meta))
                part += 1
            forwards.append(Forward(pushed, parts))
        applied = 0
        with self._put_lock:
            if sequence <= self._last_applied.get(stream, 0):
                self.counts["stale_forwards"] += 1
                return Message("replica_put", meta={"rows": 0, "stale": True})
            with self.ownership.lock.shared():
                for forward in forwards:
                    moved = self.ownership.refusal(
                        "replica_put", [name for name, _, _ in forward.parts],
                        [np.ascontiguousarray(m.view(np.uint64)[:, 0]) for _, _, m in forward.parts], backup=True)
                    if moved is not None:  # not (or no longer) this server's to back
                        self.counts["refused_forwards"] += 1
                        continue
                    for name, rows, meta in forward.parts:
                        stores[name].insert_rows(rows, meta)
                    self.applied.remember(forward.pushed, {"dropped": 0})
                    applied += forward.rows
            self._last_applied[stream] = sequence
            self._last_applied.move_to_end(stream)
            while len(self._last_applied) > REMEMBERED_STREAMS:
                self._last_applied.popitem(last=False)
        return Message("replica_put", meta={"rows": applied})


def check_stream(value: Any) -> tuple[str, int]:
    """meta 'stream' [stream id, sequence number], or ValueError."""
    if (not isinstance(value, list) or len(value) != 2 or not isinstance(value[0], str) or len(value[0]) > 64
            or isinstance(value[1], bool) or not isinstance(value[1], int) or value[1] < 1):
        raise ValueError(f"meta 'stream' must be [stream id (at most 64 characters), sequence number >= 1], "
                         f"got {value!r:.80}")
    return value[0], value[1]


def check_entries(value: Any, stores: Mapping[str, EmbeddingStore]) -> list[tuple[tuple[str, int] | None, list[str]]]:
    """meta 'entries' [[push id or null, [table names]], ...] (one per forward), or ValueError."""
    if not isinstance(value, list) or not value or len(value) > MAX_FORWARD_PARTS:
        raise ValueError(f"meta 'entries' must list 1 to {MAX_FORWARD_PARTS} forwards, got {value!r:.80}")
    entries = []
    for entry in value:
        if not isinstance(entry, list) or len(entry) != 2 or not isinstance(entry[1], list):
            raise ValueError(f"meta 'entries' items must be [push id or null, [table names]], got {entry!r:.80}")
        names = entry[1]
        if not names or any(not isinstance(n, str) or n not in stores for n in names):
            raise ValueError(f"meta 'entries' table names must name tables of this server ({sorted(stores)}), "
                             f"got {names!r:.200}")
        entries.append((push_id({"push_id": entry[0]}), names))
    if sum(len(names) for _, names in entries) > MAX_FORWARD_PARTS:
        raise ValueError(f"meta 'entries' name more than {MAX_FORWARD_PARTS} tables' parts together")
    return entries


def forward_bytes_limit(stores: Mapping[str, EmbeddingStore], max_rows: int) -> int:
    """The most bytes a forward request of `max_rows` rows takes (the widest table's rows with
    their metadata records, plus a header)."""
    widest = max(4 * store.config.row_width for store in stores.values())
    return MAX_HEADER_BYTES + max_rows * (widest + 4 * 8)
