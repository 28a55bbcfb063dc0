"""The coordinator of the PS tier: installs the routing table, moves buckets between servers
while training runs, and fails over to the backups when a server is lost.

One coordinator per job (the launcher's, `hybridrec.parallel.scale`); it keeps no state of its
own that the servers do not hold: it starts from the newest table any server has.

Moving a batch of buckets from server A to server B (`_move`), under table version v -> v + 1:

1. `bucket_export` on A: A stops serving the buckets (holding its lock exclusive, so every
   update it applied is in the rows it hands over, and every later one is refused with table
   v + 1) and answers their rows (embedding and optimizer state);
2. `bucket_import` on B (and on the buckets' new backup first, with replication): B replaces
   whatever it held of them by those rows and serves them from then on;
3. `bucket_drop` on A: the exported rows are deleted.

Between 1 and 2 the buckets are served by nobody: a client sent there by table v + 1 is
refused by B (table older than its own), refreshes and tries again shortly. That window is the
pause a bucket sees; it is measured per batch (`longest_pause_s`) and kept short by moving
`batch` buckets at a time. A request is applied by A before 1 or by B after 2, never by both
and never by neither; pushes are never re-sent after a refusal by a server that applied them.

Failover (`fail_over`): the buckets whose primary was on the lost server are given to their
backup (which holds every acknowledged update, `hybridrec.ps.replication`) in one new table
installed on every live server; then each bucket left without a backup gets one again, copied
from its primary in batches (`rebuild_backups`), on the lost server's replacement when it is
back, else on the next live server.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from hybridrec.comm.auth import FROM_ENVIRONMENT
from hybridrec.comm.transport import Client, Message, RemoteError
from hybridrec.embedding.buckets import NUM_BUCKETS
from hybridrec.ps.ownership import FROZEN
from hybridrec.ps.routing import NO_SERVER, RoutingTable, backups_for, compact, plan_servers

FROZEN_WAIT_SECONDS = 3600.0  # how long a move waits for the job's checkpoint to finish
MOVE_BATCH = 64  # buckets moved per step: the pause of one step is the copy of this many buckets


@dataclass
class MigrationMetrics:
    """What the PS tier's changes cost: reported in metrics.jsonl and final_metrics.json."""

    routing_version: int = 0
    scale_events: int = 0
    buckets_moved: int = 0
    bytes_moved: int = 0
    longest_pause_s: float = 0.0
    failovers: int = 0
    backups_rebuilt: int = 0
    pauses_s: list[float] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"routing_version": self.routing_version, "scale_events": self.scale_events,
                "buckets_moved": self.buckets_moved, "bytes_moved": self.bytes_moved,
                "longest_pause_s": round(self.longest_pause_s, 4), "failovers": self.failovers,
                "backups_rebuilt": self.backups_rebuilt}


class Coordinator:
    """Drives the servers of one job (their `ownership` operations). `tables`: the names of the
    job's tables; `replicas`: 1, or 2 for a backup of every bucket. Thread-safe: one change at
    a time."""

    def __init__(self, addresses: Sequence[str], tables: Sequence[str], *, replicas: int = 1,
                 key=FROM_ENVIRONMENT, timeout: float = 30.0, batch: int = MOVE_BATCH,
                 log: Callable[[str], None] | None = None):
        if replicas not in (1, 2):
            raise ValueError(f"replicas must be 1 or 2, got {replicas!r}")
        self.tables, self.replicas, self.batch = list(tables), replicas, batch
        self._key, self._timeout = key, timeout
        self._clients: dict[str, Client] = {}
        self._lock = threading.Lock()
        self.log = log or (lambda message: None)
        self.metrics = MigrationMetrics()
        self.table = RoutingTable.static(addresses)
        self.lanes: dict[str, str] = {}  # server address -> the address its forwards go to

    def _client(self, address: str) -> Client:
        if address not in self._clients:
            self._clients[address] = Client(address, timeout=self._timeout, retries=2, key=self._key)
        return self._clients[address]

    def _call(self, address: str, op: str, arrays: dict | None = None, meta: dict | None = None,
              table: RoutingTable | None = None, idempotent: bool = True) -> Message:
        if table is not None:
            wire_arrays, wire_meta = table.to_wire()
            arrays, meta = {**(arrays or {}), **wire_arrays}, {**(meta or {}), **wire_meta}
        deadline = time.monotonic() + FROZEN_WAIT_SECONDS
        while True:
            try:
                return self._client(address).request(op, arrays or {}, meta or {}, idempotent=idempotent)
            except RemoteError as error:  # a checkpoint runs: moves wait for it
                if error.message != FROZEN or time.monotonic() > deadline:
                    raise
            time.sleep(0.2)

    def _lanes_of(self, addresses: Sequence[str]) -> dict[str, str]:
        """Where forwards to each of `addresses` go: the port a routed server takes them on
        (asked once per server; a server that does not answer is asked again next time)."""
        for address in addresses:
            if address in self.lanes:
                continue
            try:
                reply = self._client(address).request("routing", idempotent=True, retries=0, timeout=5.0,
                                                      fail_fast=True)
            except (TimeoutError, OSError):
                continue
            port = reply.meta.get("replica_port")
            self.lanes[address] = address if not isinstance(port, int) else f"{address.rsplit(':', 1)[0]}:{port}"
        return {address: self.lanes[address] for address in addresses if address in self.lanes}

    def _install(self, table: RoutingTable, addresses: Sequence[str], assume: bool) -> None:
        lanes = self._lanes_of(table.addresses)
        for address in addresses:
            self._call(address, "routing_set", meta={"slot": table.slot(address), "assume": assume,
                                                     "metrics": self.metrics.as_dict(), "lanes": lanes}, table=table)
        self.table = table
        self.metrics.routing_version = table.version

    def close(self) -> None:
        for client in self._clients.values():
            client.close()

    # ---------------------------------------------------------------- start
    def start(self) -> RoutingTable:
        """Install the first table (version 1: the static placement, with backups when
        replicated) on every server, each taking its buckets as its own. Servers that hold a
        newer table already (a launcher restarted... or a resumed coordinator) are followed."""
        with self._lock:
            newest = self.newest()
            if newest is not None and newest.version >= 1:
                self.table = newest
                self.metrics.routing_version = newest.version
                return newest
            static = self.table
            first = RoutingTable(1, static.addresses, static.owners,
                                 backups_for(static.owners, [True] * len(static.addresses), self.replicas))
            self._install(first, first.addresses, assume=True)
            return first

    def newest(self, addresses: Sequence[str] | None = None) -> RoutingTable | None:
        """The newest table any of `addresses` (default: the current table's) answers with."""
        newest = None
        for address in addresses or self.table.addresses:
            try:
                reply = self._client(address).request("routing", idempotent=True, retries=0, timeout=5.0)
            except (TimeoutError, OSError):
                continue
            table = RoutingTable.from_wire(reply.arrays, reply.meta)
            if table is not None and (newest is None or table.version > newest.version):
                newest = table
        return newest

    # ---------------------------------------------------------------- scale
    def scale_to(self, addresses: Sequence[str]) -> RoutingTable:
        """Move buckets so that exactly `addresses` serve them, evenly; servers new to the job
        must be running. Returns the final table (servers that left own nothing in it and may
        be stopped once the clients have moved on)."""
        with self._lock:
            target = plan_servers(self.table, addresses, self.replicas)
            joining = [a for a in target.addresses if a not in self.table.addresses]
            self.log(f"scale: {len(self.table.addresses)} -> {len(addresses)} PS servers "
                     f"({int((target.owners != np.resize(self.table.owners, NUM_BUCKETS)).sum())} buckets to move)")
            wider = RoutingTable(self.table.version + 1, target.addresses, self.table.owners, self.table.backups)
            self._install(wider, joining, assume=True)  # they own nothing yet: they know their slot
            self._install(wider, self.table.addresses, assume=False)
            self._move_all(target)
            self.metrics.scale_events += 1
            final = compact(self.table)
            self._install(final, target.addresses, assume=False)
            self.log(f"scale done: routing version {final.version}, {self.metrics.buckets_moved} buckets and "
                     f"{self.metrics.bytes_moved} bytes moved so far, longest pause {self.metrics.longest_pause_s:.3f}s")
            return final

    def _move_all(self, target: RoutingTable) -> None:
        """Move every bucket whose owner differs in `target`, and give a new backup to every one
        whose backup alone differs, `batch` at a time, grouped by (from, to)."""
        current = self.table
        moved = current.owners != target.owners
        for move, mask, source, destination in ((self._move, moved, current.owners, target.owners),
                                               (self._rebackup, ~moved & (current.backups != target.backups),
                                                current.owners, target.backups)):
            changed = np.flatnonzero(mask)
            pairs = source[changed].astype(np.int64) * 1_000_003 + destination[changed]
            for pair in np.unique(pairs):
                group = changed[pairs == pair]
                for first in range(0, len(group), self.batch):
                    move(group[first:first + self.batch], target)

    def _step(self, buckets: np.ndarray, target: RoutingTable) -> RoutingTable:
        """The current table with `buckets` placed as in `target`, one version on."""
        current = self.table
        owners, backups = current.owners.copy(), current.backups.copy()
        owners[buckets], backups[buckets] = target.owners[buckets], target.backups[buckets]
        return current.changed(current.version + 1, addresses=target.addresses, owners=owners, backups=backups)

    def _rebackup(self, buckets: np.ndarray, target: RoutingTable) -> None:
        """Give `buckets` (one primary) the backup `target` names: the primary copies their rows
        to it under its lock and forwards from then on; the old backup drops them."""
        current, step = self.table, self._step(buckets, target)
        primary = current.addresses[int(current.owners[buckets[0]])]
        backup = int(target.backups[buckets[0]])
        if backup == NO_SERVER:
            self._call(primary, "routing_set", meta={"slot": step.slot(primary)}, table=step)
        else:
            target_address = step.addresses[backup]
            self._call(target_address, "bucket_import", {"buckets": buckets},
                       {"tables": self.tables, "backup": True}, table=step)
            self._call(primary, "routing_set", meta={"slot": step.slot(primary)}, table=step)
            rows = self._call(primary, "bucket_rows", {"buckets": buckets}, {"tables": self.tables})
            self._call(target_address, "bucket_import", {"buckets": buckets, **rows.arrays},
                       {"tables": self.tables, "backup": True, "keep_existing": True}, table=step)
            self.metrics.bytes_moved += int(rows.meta.get("bytes", 0))
            self.metrics.backups_rebuilt += len(buckets)
        self._commit(step)
        for old in {current.addresses[int(s)] for s in np.unique(current.backups[buckets]) if s != NO_SERVER}:
            if backup == NO_SERVER or old != step.addresses[backup]:
                self._drop(old, buckets)

    def _commit(self, table: RoutingTable) -> None:
        self.table = table
        self.metrics.routing_version = table.version

    def _drop(self, address: str, buckets: np.ndarray) -> None:
        try:
            self._call(address, "bucket_drop", {"buckets": buckets})
        except (TimeoutError, OSError):  # a lost server holds nothing to drop
            pass

    def _move(self, buckets: np.ndarray, target: RoutingTable) -> None:
        current, step = self.table, self._step(buckets, target)
        owners, backups = step.owners, step.backups
        source = current.addresses[int(current.owners[buckets[0]])]
        destination = step.addresses[int(owners[buckets[0]])]
        start = time.monotonic()
        exported = self._call(source, "bucket_export", {"buckets": buckets}, {"tables": self.tables},
                              table=step, idempotent=False)
        rows = {name: array for name, array in exported.arrays.items() if not name.startswith("routing.")}
        new_backups = {step.addresses[int(s)] for s in np.unique(backups[buckets]) if s != NO_SERVER}
        for address in sorted(new_backups):
            self._call(address, "bucket_import", {"buckets": buckets, **rows},
                       {"tables": self.tables, "backup": True}, table=step)
        if source != destination:
            self._call(destination, "bucket_import", {"buckets": buckets, **rows}, {"tables": self.tables}, table=step)
        pause = time.monotonic() - start
        self._commit(step)
        old_holders = {current.addresses[int(s)] for s in np.unique(current.backups[buckets]) if s != NO_SERVER}
        for address in sorted((old_holders | {source}) - new_backups - {destination}):
            self._drop(address, buckets)
        self.metrics.buckets_moved += len(buckets)
        self.metrics.bytes_moved += int(exported.meta.get("bytes", 0))
        self.metrics.pauses_s.append(pause)
        self.metrics.longest_pause_s = max(self.metrics.longest_pause_s, pause)

    # ---------------------------------------------------------------- failover
    def fail_over(self, lost: str) -> RoutingTable:
        """Server `lost` is gone with its memory: its buckets go to their backups (one new table
        on every live server), every bucket left without a backup gets one on the live servers,
        and `lost` leaves the table (a replacement joins with `scale_to`)."""
        with self._lock:
            table = self.table
            slot = table.slot(lost)
            if slot is None:
                return table
            owners, backups = table.owners.copy(), table.backups.copy()
            orphaned = owners == slot
            if (backups[orphaned] == NO_SERVER).any():
                raise RuntimeError(f"PS server {lost} was lost and {int((backups[orphaned] == NO_SERVER).sum())} of its "
                                   f"buckets have no backup (strategy.ps_replicas is 1, or a backup was still being "
                                   f"rebuilt); the job must go back to its last checkpoint")
            start = time.monotonic()
            self.lanes.pop(lost, None)  # its replacement takes forwards on a port of its own
            owners[orphaned] = backups[orphaned]
            backups[orphaned | (backups == slot)] = NO_SERVER
            promoted = table.changed(table.version + 1, owners=owners, backups=backups)
            live = [a for a in table.addresses if a != lost]
            self._install(promoted, live, assume=True)
            self.metrics.failovers += 1
            self.metrics.longest_pause_s = max(self.metrics.longest_pause_s, time.monotonic() - start)
            self.log(f"failover: {lost} lost; {int(orphaned.sum())} buckets now served by their backups "
                     f"(routing version {promoted.version}); rebuilding their backups")
            staying = [a != lost for a in table.addresses]
            self._move_all(promoted.changed(promoted.version + 1, backups=backups_for(owners, staying, self.replicas)))
            final = compact(self.table)
            self._install(final, final.addresses, assume=False)
            backed = ("every bucket has a backup again" if (final.backups >= 0).all()
                      else "no other server is left to back its buckets")
            self.log(f"failover done: {backed} (routing version {final.version})")
            return final
