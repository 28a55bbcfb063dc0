"""Which buckets one PS server serves, and the operations that move them between servers.

A server holds the newest routing table it was given (`hybridrec.ps.routing`) and three masks
over the buckets: `owned` (it is the primary: lookups and pushes are served), `backed` (it is
the backup: the primary's forwarded rows are taken, `hybridrec.ps.replication`) and `outgoing`
(exported to another server, rows kept until `bucket_drop`). A lookup or push naming a key of a
bucket it does not own is answered with its routing table instead of data (`refusal`); the
client refreshes its table and sends those keys again, so a request is either applied whole or
not at all.

Every request holds the server's `SharedLock` shared while it checks ownership and applies;
moving buckets holds it exclusive for the instant the masks change and the rows are copied, so
an update is in the exported rows or refused, never both and never neither.

A server started `routed` (by a launcher) serves nothing until a routing table is installed,
and keeps its table and masks in a small file beside its shared memory: restarted onto the
same shared memory it serves again at once, restarted after its host was lost (shared memory
gone) it waits for the coordinator (`hybridrec.ps.migration`). A server not routed serves every
key until a table is installed, as before elastic routing existed.

Operations (added to the server's):
  routing        -> the server's table (none: meta routing absent), meta {slot, owned, backed,
                 replica_port: the port its primaries forward to, None: the main one}
  routing_set    a table (arrays routing.*, meta routing), meta {slot, assume, metrics, lanes}: keeps the table
                 when it is newer than its own; `assume` also takes the table's ownership of
                 `slot` as its own (a fresh job, or a backup promoted after a failover); `metrics`,
                 the coordinator's figures, are answered to `routing` requests (trainers report them);
                 `lanes` {server address: the address its forwards go to} replaces the known ones
  bucket_export  arrays buckets int64 + the new table, meta {tables}: stops serving the buckets
                 and answers, per table i, arrays <i>.rows and <i>.meta of their keys
  bucket_import  arrays buckets, <i>.rows, <i>.meta + the new table, meta {tables, backup,
                 keep_existing}: the rows (none: the buckets start empty) replace any held for those
                 buckets, which are then served
                 (or, with `backup`, kept as their backup); with `keep_existing` only the keys not
                 held are added (a backup filled while its primary forwards to it already)
  bucket_rows    arrays buckets, meta {tables}: a copy of those buckets' rows (nothing changes)
  bucket_drop    arrays buckets: the rows of those buckets, exported earlier, are deleted
  freeze         meta {seconds}: no bucket is exported or dropped for that long (a checkpoint
                 of the job runs; 0 ends it)
"""
from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from hybridrec.comm.transport import Message, Operation, check_address
from hybridrec.embedding import EmbeddingStore
from hybridrec.embedding.buckets import NUM_BUCKETS, bucket_of, static_owners
from hybridrec.embedding.hashing import table_route_id
from hybridrec.ps.resharding import SHARD
from hybridrec.ps.routing import RoutingTable

STATE_FILE = "state.json"
MAX_FREEZE_SECONDS = 4 * 3600.0
FROZEN = "buckets are frozen while a checkpoint runs; send this again once it is done"


class SharedLock:
    """A readers-writer lock: many holders `shared()`, or one `exclusive()` (waiting writers
    go first, so a bucket move is not starved by a stream of requests)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False
        self._waiting = 0

    @contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            while self._writer or self._waiting:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if not self._readers:
                    self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            self._waiting += 1
            while self._writer or self._readers:
                self._cond.wait()
            self._waiting -= 1
            self._writer = True
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()


def check_buckets(array: Any, name: str = "buckets") -> np.ndarray:
    """A 1-D int64 array of distinct bucket numbers, or ValueError."""
    if not isinstance(array, np.ndarray) or array.ndim != 1 or array.dtype != np.int64:
        raise ValueError(f"array {name!r} must be 1-D int64 bucket numbers")
    if len(array) and (array.min() < 0 or array.max() >= NUM_BUCKETS or len(np.unique(array)) != len(array)):
        raise ValueError(f"array {name!r} must hold distinct buckets in [0, {NUM_BUCKETS})")
    return array


def check_lanes(lanes: Any) -> dict[str, str]:
    """meta 'lanes' {server address: its forwarding address}, or ValueError."""
    if (not isinstance(lanes, dict) or len(lanes) > 4 * NUM_BUCKETS
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in lanes.items())):
        raise ValueError(f"meta 'lanes' must map server addresses to their forwarding addresses, got {lanes!r:.80}")
    return {check_address(k, "meta 'lanes' key"): check_address(v, "meta 'lanes' value") for k, v in lanes.items()}


def mask_hex(mask: np.ndarray) -> str:
    return np.packbits(mask).tobytes().hex()


def parse_mask(text: Any, name: str = "owned") -> np.ndarray:
    """bool[NUM_BUCKETS] from its hex form (`mask_hex`), or ValueError naming meta `name`."""
    if not isinstance(text, str) or len(text) != NUM_BUCKETS // 4:
        raise ValueError(f"meta {name!r} must be {NUM_BUCKETS // 4} hex digits (a bucket mask), got {text!r:.40}")
    try:
        return np.unpackbits(np.frombuffer(bytes.fromhex(text), np.uint8)).astype(bool)
    except ValueError:
        raise ValueError(f"meta {name!r} must be hex digits (a bucket mask), got {text!r:.40}") from None


def mask_of(buckets: np.ndarray) -> np.ndarray:
    mask = np.zeros(NUM_BUCKETS, dtype=bool)
    mask[buckets] = True
    return mask


def rows_message(stores: Mapping[str, EmbeddingStore], tables: Sequence[str],
                 select: Callable[[str], Callable[[np.ndarray], np.ndarray]]) -> tuple[dict[str, np.ndarray], int]:
    """Arrays <i>.rows / <i>.meta of the keys each table's `select(table)` picks; their bytes."""
    arrays, nbytes = {}, 0
    for i, table in enumerate(tables):
        rows, meta = stores[table].rows_where(select(table))
        arrays[f"{i}.rows"], arrays[f"{i}.meta"] = rows, meta
        nbytes += rows.nbytes + meta.nbytes
    return arrays, nbytes


def warm_move_kernels(stores: Mapping[str, EmbeddingStore]) -> None:
    """Run what a bucket move, a forward and a push do once, on a small scratch copy of one of
    `stores`' tables, so that numba compiles their kernels (or loads them from its cache) before
    the server reports ready: a new server's first import, which happens while its buckets are
    served by nobody, must not wait for a compile (a cold cache takes seconds to a minute). The
    kernels are typed by the arrays' dtypes, which every table shares."""
    if not stores:
        return
    name, store = next(iter(stores.items()))
    config = dataclasses.replace(store.config, capacity=max(256, 8 * store.config.num_threads), tier=None,
                                 expire_after=None, prefault=False, admit_probability=1.0, admit_min_frequency=1)
    scratch = EmbeddingStore(config)
    try:
        keys = np.arange(1, 65, dtype=np.uint64)
        scratch.lookup(keys)
        scratch.push(keys, np.zeros((len(keys), config.dim), np.float32))
        half = lambda table_keys: bucket_of(table_keys, table_route_id(name)) % 2 == 0  # noqa: E731
        rows, meta = scratch.rows_where(half)
        scratch.remove_where(half)
        scratch.insert_rows(rows, meta)
        scratch.rows_of(keys)
        scratch.lookup(keys, insert=False)
    finally:
        scratch.close()


class BucketOwnership:
    """The bucket state of one server (see the module docstring). `stores()` gives the server's
    current stores; `state_dir`: where a routed server keeps its table and masks (None: not kept)."""

    def __init__(self, stores: Callable[[], dict[str, EmbeddingStore]], *, routed: bool = False,
                 state_dir: Path | None = None):
        self._stores = stores
        self.routed = routed
        self.state_dir = state_dir
        self.lock = SharedLock()
        self.table: RoutingTable | None = None
        self.slot: int | None = None
        self.owned = np.zeros(NUM_BUCKETS, dtype=bool)
        self.backed = np.zeros(NUM_BUCKETS, dtype=bool)
        self.outgoing = np.zeros(NUM_BUCKETS, dtype=bool)
        self.job_metrics: dict[str, float] = {}  # the coordinator's figures, as it last sent them
        self.replica_port: int | None = None  # where this server takes forwards (None: its main port)
        self.lanes: dict[str, str] = {}  # server address -> where forwards to it go (the coordinator's word)
        self.frozen_until = 0.0  # buckets are not exported or dropped before (a checkpoint runs)
        self.counts = {"redirects": 0, "buckets_exported": 0, "buckets_imported": 0, "bytes_moved": 0}
        self._route_ids: dict[str, int] = {}
        self._restore()

    # ---------------------------------------------------------------- state
    @property
    def enforcing(self) -> bool:
        """Whether requests are checked against the masks (else every key is served)."""
        return self.routed or self.table is not None

    def route_id(self, table: str) -> int:
        if table not in self._route_ids:
            self._route_ids[table] = table_route_id(table)
        return self._route_ids[table]

    def buckets(self, table: str, keys: np.ndarray) -> np.ndarray:
        return bucket_of(keys, self.route_id(table))

    def in_mask(self, table: str, mask: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
        """A key selector: the keys of `table` whose bucket is in `mask`."""
        return lambda keys: mask[self.buckets(table, keys)]

    def _restore(self) -> None:
        if self.state_dir is None or not (self.state_dir / STATE_FILE).is_file():
            return
        state = json.loads((self.state_dir / STATE_FILE).read_text())
        self.table = RoutingTable.from_json(state["table"])
        self.slot = state["slot"]
        for name in ("owned", "backed", "outgoing"):
            setattr(self, name, parse_mask(state[name], name))

    def _persist(self) -> None:
        if self.state_dir is None or self.table is None:
            return
        self.state_dir.mkdir(parents=True, exist_ok=True)
        state = {"table": self.table.to_json(), "slot": self.slot,
                 **{name: mask_hex(getattr(self, name)) for name in ("owned", "backed", "outgoing")}}
        temporary = self.state_dir / f".{STATE_FILE}.tmp-{os.getpid()}"
        temporary.write_text(json.dumps(state))
        os.replace(temporary, self.state_dir / STATE_FILE)

    def _adopt(self, table: RoutingTable | None) -> None:
        if table is not None and (self.table is None or table.version > self.table.version):
            self.table = table

    def take(self, table: RoutingTable) -> None:
        """Keep `table` when it is newer than this server's (call it holding `lock`)."""
        self._adopt(table)
        self._persist()

    def claims(self, directory: str) -> dict[str, Any]:
        """What a checkpoint of this server into `directory` (.../shard-<i>-of-<n>) records: its
        routing table, the buckets it owned and those it exported but still holds
        (`hybridrec.ps.resharding.choose_sources` reads it). A server that checks no ownership
        held the buckets of shard i in the static table of n servers (every bucket, written
        elsewhere). Call it holding `lock`."""
        owned = self.owned
        if not self.enforcing:
            match = SHARD.fullmatch(os.path.basename(directory.rstrip("/")))
            owned = np.ones(NUM_BUCKETS, bool) if match is None else static_owners(int(match[2])) == int(match[1])
        return {"version": 0 if self.table is None else self.table.version,
                "table": None if self.table is None else json.loads(self.table.to_json()),
                "owned": mask_hex(owned), "outgoing": mask_hex(self.outgoing)}

    def frozen(self) -> bool:
        return time.monotonic() < self.frozen_until

    # ---------------------------------------------------------------- requests
    def refusal(self, op: str, tables: Sequence[str], keys: Sequence[np.ndarray], *,
                backup: bool = False) -> Message | None:
        """None when this server serves (or, with `backup`, backs) every key; else the reply that
        sends the client to the newer table. Call it holding `lock.shared()`."""
        if not self.enforcing:
            return None
        mask = self.backed if backup else self.owned
        for table, table_keys in zip(tables, keys):
            if len(table_keys) and not mask[self.buckets(table, table_keys)].all():
                self.counts["redirects"] += 1
                arrays, meta = self.table.to_wire() if self.table is not None else ({}, {})
                return Message(op, arrays, {**meta, "moved": True})
        return None

    # ---------------------------------------------------------------- operations
    def operations(self) -> dict[str, Operation]:
        return {"routing": Operation(self._routing), "routing_set": Operation(self._routing_set, arrays=None),
                "bucket_export": Operation(self._export, arrays=None),
                "bucket_import": Operation(self._import, arrays=None),
                "bucket_drop": Operation(self._drop, {"buckets": "int64"}),
                "bucket_rows": Operation(self._rows, arrays=None),
                "freeze": Operation(self._freeze)}

    def _freeze(self, request: Message) -> Message:
        """meta {seconds}: refuse to export or drop buckets for that long (0: from now on again)."""
        seconds = request.meta.get("seconds")
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds <= MAX_FREEZE_SECONDS:
            raise ValueError(f"meta 'seconds' must be a number in [0, {MAX_FREEZE_SECONDS}], got {seconds!r:.40}")
        with self.lock.exclusive():
            self.frozen_until = time.monotonic() + seconds
        return Message("freeze", meta={"frozen": seconds > 0})

    def _stores_named(self, tables: Any) -> tuple[list[str], dict[str, EmbeddingStore]]:
        stores = self._stores()
        if not isinstance(tables, list) or any(t not in stores for t in tables):
            raise ValueError(f"meta 'tables' must name tables of this server ({sorted(stores)}), got {tables!r:.200}")
        return tables, stores

    def _routing(self, request: Message) -> Message:
        arrays, meta = self.table.to_wire() if self.table is not None else ({}, {})
        return Message("routing", arrays, {**meta, "slot": self.slot, "owned": int(self.owned.sum()),
                                           "backed": int(self.backed.sum()), **self.counts,
                                           "job_metrics": self.job_metrics, "replica_port": self.replica_port})

    def _slot(self, table: RoutingTable, slot: Any) -> int:
        if not isinstance(slot, int) or isinstance(slot, bool) or not 0 <= slot < len(table.addresses):
            raise ValueError(f"meta 'slot' must index the table's {len(table.addresses)} servers, got {slot!r}")
        return slot

    def _routing_set(self, request: Message) -> Message:
        table = RoutingTable.from_wire(request.arrays, request.meta)
        if table is None:
            raise ValueError("routing_set needs a routing table (arrays routing.*, meta routing)")
        assume = request.meta.get("assume", False)
        lanes = request.meta.get("lanes")
        if lanes is not None:
            self.lanes = check_lanes(lanes)
        if isinstance(request.meta.get("metrics"), dict):
            self.job_metrics = {k: v for k, v in request.meta["metrics"].items() if isinstance(v, (int, float))}
        with self.lock.exclusive():
            if request.meta.get("slot") is not None:
                self.slot = self._slot(table, request.meta["slot"])
            if assume:
                if self.slot is None:
                    raise ValueError("routing_set with 'assume' needs meta 'slot'")
                self.table = table
                self.owned, self.backed = table.owned_by(self.slot), table.backed_by(self.slot)
                self.outgoing &= ~self.owned
            else:
                self._adopt(table)
            self._persist()
        return self._routing(request)

    def _export(self, request: Message) -> Message:
        buckets = check_buckets(request.arrays.get("buckets"))
        tables, stores = self._stores_named(request.meta.get("tables"))
        table = RoutingTable.from_wire(request.arrays, request.meta)
        moving = mask_of(buckets)
        with self.lock.exclusive():
            if self.frozen():
                raise ValueError(FROZEN)
            if self.enforcing and not self.owned[buckets].all():
                raise ValueError(f"bucket_export: this server does not own buckets "
                                 f"{buckets[~self.owned[buckets]][:8].tolist()}")
            self.owned &= ~moving
            self.backed &= ~moving
            self.outgoing |= moving
            self._adopt(table)
            self._persist()
            arrays, nbytes = rows_message(stores, tables, lambda t: self.in_mask(t, moving))
        self.counts["buckets_exported"] += len(buckets)
        self.counts["bytes_moved"] += nbytes
        return Message("bucket_export", arrays, {"tables": tables, "bytes": nbytes})

    def _rows(self, request: Message) -> Message:
        """A copy of the buckets' rows, serving them on (a new backup is filled from it)."""
        buckets = check_buckets(request.arrays.get("buckets"))
        tables, stores = self._stores_named(request.meta.get("tables"))
        copying = mask_of(buckets)
        arrays, nbytes = rows_message(stores, tables, lambda t: self.in_mask(t, copying))
        return Message("bucket_rows", arrays, {"tables": tables, "bytes": nbytes})

    def _import(self, request: Message) -> Message:
        buckets = check_buckets(request.arrays.get("buckets"))
        tables, stores = self._stores_named(request.meta.get("tables"))
        table = RoutingTable.from_wire(request.arrays, request.meta)
        backup = request.meta.get("backup", False)
        keep = request.meta.get("keep_existing", False)
        parts = []
        for i, name in enumerate(tables):
            rows, meta = request.arrays.get(f"{i}.rows"), request.arrays.get(f"{i}.meta")
            width = stores[name].config.row_width
            if rows is None and meta is None:  # no rows of this table: the buckets start empty here
                rows, meta = np.empty((0, width), np.float32), np.empty((0, 8), np.int32)
            if (not isinstance(rows, np.ndarray) or rows.dtype != np.float32 or rows.ndim != 2 or rows.shape[1] != width
                    or not isinstance(meta, np.ndarray) or meta.dtype != np.int32 or meta.shape[0] != rows.shape[0]):
                raise ValueError(f"bucket_import: arrays {i}.rows / {i}.meta must be float32 [n, {width}] rows "
                                 f"and int32 [n, 8] records of table {name!r}")
            parts.append((name, rows, meta))
        moving = mask_of(buckets)
        with self.lock.exclusive():
            for name, rows, meta in parts:
                store = stores[name]
                if keep:  # a backup being filled: rows forwarded to it meanwhile are newer
                    absent = store.lookup(np.ascontiguousarray(meta.view(np.uint64)[:, 0]), insert=False).rows < 0
                    rows, meta = rows[absent], meta[absent]
                else:
                    store.remove_where(self.in_mask(name, moving))  # rows left from an earlier stay
                store.insert_rows(rows, meta)
            if backup:
                self.backed |= moving
            else:
                self.owned |= moving
                self.backed &= ~moving
            self.outgoing &= ~moving
            self._adopt(table)
            self._persist()
        self.counts["buckets_imported"] += len(buckets)
        return Message("bucket_import", meta={"buckets": len(buckets)})

    def _drop(self, request: Message) -> Message:
        buckets = check_buckets(request.arrays["buckets"])
        stores = self._stores()
        with self.lock.exclusive():
            if self.frozen():
                raise ValueError(FROZEN)
            gone = mask_of(buckets) & ~self.owned & ~self.backed
            dropped = sum(store.remove_where(self.in_mask(name, gone)) for name, store in stores.items())
            self.outgoing &= ~gone
            self._persist()
        return Message("bucket_drop", meta={"rows": int(dropped)})
