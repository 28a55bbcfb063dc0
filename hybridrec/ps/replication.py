"""Replicated buckets (`strategy.ps_replicas: 2`): synchronous forwarding from each bucket's
primary to its backup, exactly-once pushes across a failover, and rebuilding a backup.

The guarantee. A push acknowledged by a primary has been applied on the primary and, when the
bucket has a backup in the primary's routing table and that backup answers, written on the
backup before the acknowledgement left: after each push the primary sends the pushed keys'
whole rows (embedding and optimizer state, `replica_put`), so the backup holds exactly the
primary's rows of every key ever pushed. A failover (the primary lost, `Coordinator.fail_over`)
therefore loses no acknowledged update. Keys only ever looked up, never pushed, are not
forwarded: the backup makes them again with the same first value (a row's first value depends
only on the table's seed and the key), on a lookup or on a push (with replication a push makes
the rows it does not find, where an unreplicated server drops their update). When a backup does not answer (it
refuses the connection: gone; or it times out), the primary acknowledges alone; the coordinator
sees the lost server and gives the buckets a new backup. A routed server takes forwards on a
port of its own with worker threads of their own (`EmbeddingServer.replica_lane`; the
coordinator sends every server the others' forwarding addresses, `BucketOwnership.lanes`): a
forward never waits for a worker thread that is itself waiting on a forward the other way.

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

from hybridrec.comm.transport import Client, Message, Operation
from hybridrec.embedding import EmbeddingStore
from hybridrec.ps.ownership import BucketOwnership
from hybridrec.ps.routing import NO_SERVER

REMEMBERED_PUSHES = 1 << 16  # ids of applied pushes kept (per server): far more than a failover re-sends
FORWARD_TIMEOUT = 10.0


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
    """Forwarding and rebuilding for one server; `key` is the job key its clients use."""

    def __init__(self, ownership: BucketOwnership, stores: Callable[[], dict[str, EmbeddingStore]], key=None):
        self.ownership, self._stores, self._key = ownership, stores, key
        self.applied = AppliedPushes()
        self._local = threading.local()
        self.counts = {"forwarded": 0, "forward_failures": 0}

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

    def forward(self, tables: Sequence[str], keys: Sequence[np.ndarray], pushed: tuple[str, int] | None) -> None:
        """Send the pushed keys' rows to their buckets' backups (call it holding the ownership
        lock shared, after applying the push)."""
        table = self.ownership.table
        if table is None or not table.replicated:
            return
        stores = self._stores()
        by_backup: dict[int, list[tuple[int, np.ndarray]]] = {}
        for t, (name, table_keys) in enumerate(zip(tables, keys)):
            backups = table.backups[self.ownership.buckets(name, table_keys)]
            for backup in np.unique(backups):
                if backup != NO_SERVER:
                    by_backup.setdefault(int(backup), []).append((t, table_keys[backups == backup]))
        for backup, parts in by_backup.items():
            names = [tables[t] for t, _ in parts]
            arrays = {}
            for i, (t, part_keys) in enumerate(parts):
                rows, meta = stores[tables[t]].rows_of(part_keys)
                arrays[f"{i}.rows"], arrays[f"{i}.meta"] = rows, meta
            request = {"tables": names, **({} if pushed is None else {"push_id": list(pushed)})}
            try:
                address = table.addresses[backup]
                lane = self._client(self.ownership.lanes.get(address, address))
                lane.request("replica_put", arrays, request, fail_fast=True)
                self.counts["forwarded"] += 1
            except (TimeoutError, OSError, RuntimeError):  # the backup is lost: the coordinator replaces it
                self.counts["forward_failures"] += 1

    def _put(self, request: Message) -> Message:
        """Overwrite the rows a primary forwarded (of buckets this server backs)."""
        stores = self._stores()
        tables = request.meta.get("tables")
        if not isinstance(tables, list) or any(t not in stores for t in tables):
            raise ValueError(f"meta 'tables' must name tables of this server ({sorted(stores)}), got {tables!r:.200}")
        pushed = push_id(request.meta)
        parts = []
        for i, name in enumerate(tables):
            rows, meta = request.arrays.get(f"{i}.rows"), request.arrays.get(f"{i}.meta")
            width = stores[name].config.row_width
            if (not isinstance(rows, np.ndarray) or rows.dtype != np.float32 or rows.ndim != 2 or rows.shape[1] != width
                    or not isinstance(meta, np.ndarray) or meta.dtype != np.int32 or meta.shape != (len(rows), 8)):
                raise ValueError(f"replica_put: arrays {i}.rows / {i}.meta must be float32 [n, {width}] rows and "
                                 f"int32 [n, 8] records of table {name!r}")
            parts.append((name, rows, meta))
        with self.ownership.lock.shared():
            moved = self.ownership.refusal("replica_put", tables,
                                           [np.ascontiguousarray(m.view(np.uint64)[:, 0]) for _, _, m in parts],
                                           backup=True)
            if moved is not None:
                return moved
            for name, rows, meta in parts:
                stores[name].insert_rows(rows, meta)
            self.applied.remember(pushed, {"dropped": 0})
        return Message("replica_put", meta={"rows": int(sum(len(r) for _, r, _ in parts))})
