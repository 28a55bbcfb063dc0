"""The embedding parameter server: one process hosting this shard's EmbeddingStores over ZeroMQ.

Persia §4.2.2-4.2.4: each table of the shard is an `EmbeddingStore` (hash index + array-list
LRU, fused optimizer); clients route keys here with the global `route` hash. With
`shm_prefix`, every store lives in named shared memory (`<prefix>.<table>`), so a server
killed and restarted with the same prefix reattaches and keeps every update it acknowledged
(a store is written before the reply leaves). With `--tier-path DIR --tier-capacity N` every
table has a disk tier in DIR/<table> (hybridrec/embedding/disk_tier.py): rows evicted from
memory go there and come back at their next lookup, and a restarted server finds them.

Operations (see `hybridrec.comm.transport` for the wire format):
  ping        -> meta {pid, tables: {name: dim}}
  lookup      keys uint64[n], meta {table, insert, codec}       -> rows encoded with `codec`
  push        keys uint64[n] + grads encoded with meta codec    -> meta {dropped}
  lookup_many keys.<i> uint64 per table i, meta {tables, insert, codec}
              -> arrays "<i>.<codec array>" per table, meta {codec, codec_meta: [per table],
              versions: [per table, the updates its store had applied when it was read]}
  push_many   keys.<i> + "<i>.<codec array>" per table, meta {tables, codec, codec_meta: [...]}
              -> meta {dropped: total, versions: [per table, the update's number in its store's
              order]}; every table is checked before any is changed
  dense_init  {name: float32 array}, meta {optimizer: {name, lr, weight_decay}}
              -> the current value of each name (the first value given for a name wins)
  dense_pull  meta {names}                        -> {name: current value}, meta {version}
  dense_push  {name: float32 grad}: one optimizer step each     -> meta {version}
  stats       -> meta {pid, tables: {name: store.stats()}, dense: {params, version}, replication:
              {forwarded, forward_failures (pushes acknowledged alone), forward_requests,
              stale_forwards, refused_forwards}}
  checkpoint  meta {directory, token, wait}: each table saved to directory/<table>, dense params
              to directory/dense (when the server holds any), in the background
              -> meta {state: running | done, directory, tables}; the same request again polls
              it, or, after a failure or a restart of this server, resumes it
              (`hybridrec.ps.checkpoints`)
  load        meta {directory, token, wait}: each table replaced by the one saved in
              directory/<table>, the dense params by directory/dense (none there: no dense
              params), in the background, polled the same way
  shutdown    stop after replying
  het_sync, worker_clock: HET's write-backs, fetches and clock-only checks in one request, and
              SSP's worker clocks (`hybridrec.het.clocks`)

Limits: a request carries at most `max_keys_per_request` keys (all its tables together) and
its frames at most what that many rows, or the job's whole dense model, take; `dense_init`
takes only the job's dense parameters, with their shapes (`dense_params`, derived from
`--config`). `checkpoint` and `load` directories lie inside the server's `checkpoint_root`,
reached through directory handles that no symlink or rename can redirect (a relative path is
taken from the root, an absolute one must start with it; symlinks inside it are refused), and
a checkpoint goes only to a directory that is new, empty, or holds an unfinished attempt of the
same request, so it never replaces or deletes files it did not write. A server without a root
refuses both. SSP's worker clocks serve at most `max_trainers` trainers; at most
`max_connections` clients are served at once (see `hybridrec.comm.transport.Server` for the
bytes queued per connection).

Run one with `python -m hybridrec.ps.server --port 7001 --table user:16:1000000` (or
`--config job.yaml [--set KEY=VALUE ...]` for every table and dense parameter of a job) or call
`serve(...)` (the `hybridrec serve-ps` command does). Off loopback a server needs the job key
(`hybridrec.comm.auth`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import select
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from hybridrec.comm.auth import FROM_ENVIRONMENT, AuthError, JobKey, resolve_key, server_key
from hybridrec.comm.codec import Encoded, make_value_codec
from hybridrec.comm.transport import MAX_HEADER_BYTES, Message, Operation, Server, Service
from hybridrec.embedding import EmbeddingStore, TableConfig
from hybridrec.embedding import checkpoint_format
from hybridrec.embedding.dir_handle import DirHandle, Entry
from hybridrec.embedding.memory import shm_path, unlink_shared
from hybridrec.embedding.store import check_grad, check_keys
from hybridrec.ps.client import part_arrays, split_parts
from hybridrec.het.clocks import MAX_WORLD, ClockOps
from hybridrec.ps.checkpoints import CheckpointJobs, CheckpointRoot
from hybridrec.ps.dense import DenseStore
from hybridrec.ps.ownership import BucketOwnership, parse_mask, warm_move_kernels
from hybridrec.ps.replication import Replication, forward_bytes_limit, push_id
from hybridrec.ps.resharding import ROUTING_FILE, load_owned

TableSpec = TableConfig | Mapping[str, Any] | EmbeddingStore
LISTENING = " listening on "  # what `main` prints, with the address, once it serves
DENSE_DIRECTORY = "dense"  # inside a checkpoint directory; no table may be called so
MAX_KEYS_PER_REQUEST = 1 << 16  # 4x what a PSClient sends by default


def _table_config(name: str, spec: TableConfig | Mapping[str, Any]) -> TableConfig:
    if isinstance(spec, TableConfig):
        return spec
    if isinstance(spec, Mapping):
        try:
            return TableConfig.from_dict(dict(spec))
        except (TypeError, ValueError) as error:
            raise ValueError(f"table {name!r}: {error}") from None
    raise TypeError(
        f"tables[{name!r}] must be a TableConfig, a dict of its fields or an EmbeddingStore, "
        f"got {type(spec).__name__}"
    )


def table_shm_name(shm_prefix: str, table: str) -> str:
    """The shared-memory name of one table of a server started with `shm_prefix`.

    ':' (in wide tables' names, '<table>:wide') is not allowed in shared-memory names; it
    becomes '..', which no generated table name contains."""
    return f"{shm_prefix}.{table.replace(':', '..')}"


def routing_state_name(shm_prefix: str) -> str:
    """The shared-memory name under which a server started with `shm_prefix` keeps its routing
    state (beside its tables: deleted with them, so a server that lost its memory lost it too)."""
    return f"{shm_prefix}..routing-state"


def open_stores(tables: Mapping[str, TableSpec], shm_prefix: str | None = None) -> dict[str, EmbeddingStore]:
    """One store per table; with `shm_prefix`, reattached from shared memory when it exists."""
    if not isinstance(tables, Mapping) or not tables:
        raise ValueError(f"tables must be a non-empty dict of table name -> config, got {tables!r}")
    stores = {}
    for name, spec in tables.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"table names must be non-empty strings, got {name!r}")
        if name == DENSE_DIRECTORY:
            raise ValueError(f"table name {name!r} is reserved for the dense params' checkpoint")
        if isinstance(spec, EmbeddingStore):
            stores[name] = spec
        elif shm_prefix is None:
            stores[name] = EmbeddingStore(_table_config(name, spec))
        else:
            stores[name] = EmbeddingStore.open_shared(table_shm_name(shm_prefix, name),
                                                      _table_config(name, spec))
    return stores


def request_bytes_limit(stores: Mapping[str, EmbeddingStore], dense_params: Mapping[str, Sequence[int]],
                        max_keys: int) -> int:
    """The most bytes a good request takes: `max_keys` keys with float32 rows of the widest
    table, or every dense parameter, plus a header."""
    widest = max(store.dim for store in stores.values())
    dense = sum(4 * math.prod(shape) for shape in dense_params.values())
    return MAX_HEADER_BYTES + max(max_keys * (8 + 4 * widest), dense)


class EmbeddingServer(Service):
    """The stores of one shard behind a `transport.Server`; `start()` then `wait()`/`stop()`.

    `dense_params`: name -> shape of the job's dense parameters (the only ones `dense_init`
    takes); `checkpoint_root`: the directory inside which checkpoints are written and loaded
    (None: refused); `key`: the job key (`hybridrec.comm.auth`)."""

    def __init__(self, stores: dict[str, EmbeddingStore], *, host: str = "127.0.0.1",
                 port: int = 0, threads: int = 2, dense_params: Mapping[str, Sequence[int]] | None = None,
                 checkpoint_root: str | Path | None = None, max_keys_per_request: int = MAX_KEYS_PER_REQUEST,
                 key: JobKey | None = FROM_ENVIRONMENT, max_trainers: int = MAX_WORLD, max_connections: int = 256,
                 routed: bool = False, state_dir: Path | None = None):
        if not isinstance(max_keys_per_request, int) or max_keys_per_request < 1:
            raise ValueError(f"max_keys_per_request must be an int >= 1, got {max_keys_per_request!r}")
        if not isinstance(max_trainers, int) or not 1 <= max_trainers <= MAX_WORLD:
            raise ValueError(f"max_trainers must be an int in [1, {MAX_WORLD}], got {max_trainers!r}")
        self.stores = dict(stores)
        self.dense = DenseStore(dense_params)
        self.max_keys_per_request = max_keys_per_request
        self._swap = threading.Lock()  # guards replacing stores on `load`
        root = None if checkpoint_root is None else CheckpointRoot(checkpoint_root)
        self.checkpoint_root = None if root is None else Path(root.path)
        self.checkpoints = CheckpointJobs(root, self._checkpoint_entries, self._write_checkpoint,
                                          self._read_checkpoint)
        operations = {
            "ping": Operation(self._ping),
            "lookup": Operation(self._lookup, {"keys": "uint64"}),
            "push": Operation(self._push, arrays=None),  # keys + the codec's arrays
            "lookup_many": Operation(self._lookup_many, arrays=None),  # keys.<i>
            "read_ahead": Operation(self._read_ahead, arrays=None),  # keys.<i>
            "push_many": Operation(self._push_many, arrays=None),  # keys.<i> + <i>.<codec array>
            "dense_init": Operation(self._dense_init, arrays=None),
            "dense_pull": Operation(self._dense_pull),
            "dense_push": Operation(self._dense_push, arrays=None),
            "stats": Operation(self._stats),
            "expire": Operation(self._expire),
            "checkpoint": Operation(self._checkpoint),
            "load": Operation(self._load),
            "shutdown": Operation(self._shutdown),
        }
        self.ownership = BucketOwnership(self._current_stores, routed=routed, state_dir=state_dir)
        self.replication = Replication(self.ownership, self._current_stores, key=resolve_key(key),
                                       max_forward_rows=max_keys_per_request)
        operations.update(self.ownership.operations())
        operations.update(self.replication.operations())
        self.clock_ops = ClockOps(self._stores_of, self._count_keys, max_trainers)
        operations.update(self.clock_ops.operations())
        limit = request_bytes_limit(self.stores, self.dense.declared, max_keys_per_request)
        self.transport = Server(operations, host=host, port=port, threads=threads, max_request_bytes=limit,
                                key=key, max_connections=max_connections)
        # A routed server takes its primaries' forwards on a port of their own, served by threads of
        # their own: on the main port a forward could wait for a worker that itself waits on a
        # forward the other way (every worker of two servers forwarding to each other).
        self.replica_lane = None if not routed else Server(
            self.replication.operations(), host=host, port=0, threads=threads, key=key,
            max_request_bytes=max(limit, forward_bytes_limit(self.stores, max_keys_per_request)),
            max_connections=max_connections)

    def start(self) -> int:
        if self.replica_lane is not None:
            self.ownership.replica_port = self.replica_lane.start()
        return self.transport.start()

    def _release(self) -> None:
        if self.replica_lane is not None:
            self.replica_lane.stop(STOP_SECONDS)
        for store in self.stores.values():
            store.close()
        if self.checkpoints.root is not None:
            self.checkpoints.root.close()

    # ------------------------------------------------------------------ operations
    def _current_stores(self) -> dict[str, EmbeddingStore]:
        with self._swap:
            return dict(self.stores)

    def _store(self, meta: dict[str, Any]) -> tuple[str, EmbeddingStore]:
        table = meta.get("table")
        with self._swap:
            store = self.stores.get(table) if isinstance(table, str) else None
        if store is None:
            raise ValueError(f"meta 'table' is {table!r}; this server holds {sorted(self.stores)}")
        return table, store

    def _ping(self, request: Message) -> Message:
        return Message("ping", meta={"pid": os.getpid(),
                                     "tables": {n: s.dim for n, s in self.stores.items()},
                                     "tiered": sorted(n for n, s in self.stores.items() if s.disk_tier is not None)})

    def _stores_of(self, meta: dict[str, Any]) -> list[EmbeddingStore]:
        """The store of each name in meta 'tables' (a many-table request)."""
        tables = meta.get("tables")
        if not isinstance(tables, list) or not all(isinstance(t, str) for t in tables):
            raise ValueError(f"meta 'tables' must be a list of table names, got {tables!r}")
        with self._swap:
            stores = dict(self.stores)
        unknown = sorted({t for t in tables if t not in stores})
        if unknown:
            raise ValueError(f"meta 'tables' names {unknown}; this server holds {sorted(stores)}")
        return [stores[t] for t in tables]

    @staticmethod
    def _insert(meta: dict[str, Any]) -> bool:
        insert = meta.get("insert", True)
        if not isinstance(insert, bool):
            raise ValueError(f"meta 'insert' must be true or false, got {insert!r}")
        return insert

    def _count_keys(self, keys: Sequence[np.ndarray]) -> None:
        """ValueError when a request's keys (all its tables together) are more than allowed."""
        count = sum(len(k) for k in keys)
        if count > self.max_keys_per_request:
            raise ValueError(f"the request carries {count} keys; this server takes at most "
                             f"{self.max_keys_per_request} per request (PSClient max_keys_per_request)")

    def _many_keys(self, arrays: dict[str, np.ndarray], count: int) -> list[np.ndarray]:
        """keys.0 .. keys.<count-1>, each a 1-D uint64 array; removed from `arrays`."""
        keys = []
        for i in range(count):
            if f"keys.{i}" not in arrays:
                raise ValueError(f"array 'keys.{i}' is missing (one per table of meta 'tables')")
            keys.append(check_keys(arrays.pop(f"keys.{i}"), f"array 'keys.{i}'"))
        self._count_keys(keys)
        return keys

    @staticmethod
    def _grads(store: EmbeddingStore, keys: np.ndarray, codec, arrays: dict[str, np.ndarray],
               codec_meta: Any, name: str) -> np.ndarray:
        """The decoded gradients of `keys`, checked (shape, finite) against `store`."""
        if not isinstance(codec_meta, dict):
            raise ValueError(f"{name} codec_meta must be a dict, got {codec_meta!r}")
        grads = codec.decode(Encoded(codec.name, arrays, codec_meta))
        return check_grad(grads, keys.shape[0], store.dim, f"{name} grads")

    def _lookup(self, request: Message) -> Message:
        _, store = self._store(request.meta)
        insert = self._insert(request.meta)
        codec = make_value_codec(request.meta.get("codec", "none"))
        self._count_keys([request.arrays["keys"]])
        with self.ownership.lock.shared():
            moved = self.ownership.refusal("lookup", [request.meta["table"]], [request.arrays["keys"]])
            if moved is not None:
                return moved
            encoded = codec.encode(store.pull(np.ascontiguousarray(request.arrays["keys"]), insert=insert))
        return Message("lookup", encoded.arrays, {"codec": codec.name, "codec_meta": encoded.meta})

    def _push(self, request: Message) -> Message:
        table, store = self._store(request.meta)
        arrays = dict(request.arrays)
        keys = arrays.pop("keys", None)
        if keys is None or keys.dtype != np.uint64:
            raise ValueError("push needs a uint64 array 'keys'")
        self._count_keys([keys])
        codec = make_value_codec(request.meta.get("codec", "none"))
        grads = self._grads(store, keys, codec, arrays, request.meta.get("codec_meta", {}), f"table {table!r}")
        with self.ownership.lock.shared():
            moved = self.ownership.refusal("push", [table], [keys])
            if moved is not None:
                return moved
            return Message("push", meta={"dropped": int(store.push(np.ascontiguousarray(keys), grads))})

    def _lookup_many(self, request: Message) -> Message:
        stores = self._stores_of(request.meta)
        insert = self._insert(request.meta)
        codec = make_value_codec(request.meta.get("codec", "none"))
        arrays = dict(request.arrays)
        keys = self._many_keys(arrays, len(stores))
        if arrays:
            raise ValueError(f"lookup_many takes only arrays keys.0..keys.{len(stores) - 1}, "
                             f"also got {sorted(arrays)}")
        reply, codec_meta = {}, []
        with self.ownership.lock.shared():
            moved = self.ownership.refusal("lookup_many", request.meta["tables"], keys)
            if moved is not None:
                return moved
            versions = []
            for i, (store, table_keys) in enumerate(zip(stores, keys)):
                with store.lock:  # the rows and the count of updates they hold, of one instant
                    rows = store.pull(table_keys, insert=insert)
                    versions.append(store.step)
                encoded = codec.encode(rows)
                reply.update(part_arrays(i, encoded.arrays))
                codec_meta.append(encoded.meta)
        return Message("lookup_many", reply, {"codec": codec.name, "codec_meta": codec_meta, "versions": versions})

    def _read_ahead(self, request: Message) -> Message:
        """Fault in the disk-tier records that a coming lookup of these keys will touch
        (`EmbeddingStore.read_ahead`; an embedding worker sends it for the batch after the one it
        has just pulled). It changes no row, so keys of buckets that moved are no reason to refuse it."""
        stores = self._stores_of(request.meta)
        arrays = dict(request.arrays)
        keys = self._many_keys(arrays, len(stores))
        if arrays:
            raise ValueError(f"read_ahead takes only arrays keys.0..keys.{len(stores) - 1}, also got {sorted(arrays)}")
        return Message("read_ahead", meta={"touched": sum(store.read_ahead(k) for store, k in zip(stores, keys))})

    def _push_many(self, request: Message) -> Message:
        stores = self._stores_of(request.meta)
        tables = request.meta["tables"]
        codec = make_value_codec(request.meta.get("codec", "none"))
        codec_meta = request.meta.get("codec_meta", [{}] * len(stores))
        if not isinstance(codec_meta, list) or len(codec_meta) != len(stores):
            raise ValueError(f"meta 'codec_meta' must be a list of {len(stores)} dicts (one per table), "
                             f"got {codec_meta!r}")
        arrays = dict(request.arrays)
        keys = self._many_keys(arrays, len(stores))
        parts = split_parts(arrays, len(stores))
        # Check every table before applying any, so a bad request changes nothing.
        grads = [self._grads(store, k, codec, part, m, f"table {i} ({t!r})")
                 for i, (store, k, part, m, t) in enumerate(zip(stores, keys, parts, codec_meta, tables))]
        pushed = push_id(request.meta)
        with self.ownership.lock.shared():
            moved = self.ownership.refusal("push_many", tables, keys)
            if moved is not None:
                return moved
            done = self.replication.applied.reply_of(pushed)
            if done is not None:  # sent again after a failover: applied here (or forwarded here) already
                return Message("push_many", meta=done)
            if self.replication.active():  # a key only looked up on a lost primary is made again here
                for store, k in zip(stores, keys):
                    store.lookup(k, insert=True)
            dropped, versions = 0, []
            for store, k, g in zip(stores, keys, grads):
                with store.lock:  # the update's number: its store's step count once it is applied
                    dropped += store.push(k, g)
                    versions.append(store.step)
            self.replication.forward(tables, keys, pushed)
            self.replication.applied.remember(pushed, {"dropped": int(dropped), "versions": versions})
        return Message("push_many", meta={"dropped": int(dropped), "versions": versions})

    def _dense_init(self, request: Message) -> Message:
        values = self.dense.init(request.arrays, request.meta.get("optimizer"))
        return Message("dense_init", values)

    def _dense_pull(self, request: Message) -> Message:
        names = request.meta.get("names")
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ValueError(f"meta 'names' must be a list of dense param names, got {names!r}")
        values, version = self.dense.snapshot(names)
        return Message("dense_pull", values, meta={"version": version})

    def _dense_push(self, request: Message) -> Message:
        return Message("dense_push", meta={"version": self.dense.push(request.arrays)})

    def _stats(self, request: Message) -> Message:
        with self._swap:
            stores = dict(self.stores)
        dense = self.dense
        return Message("stats", meta={"pid": os.getpid(),
                                      "tables": {n: s.stats() for n, s in stores.items()},
                                      "dense": {"params": dense.shapes(), "version": dense.version},
                                      "replication": dict(self.replication.counts)})

    def _expire(self, request: Message) -> Message:
        """Every table with `expire_after` drops the rows unseen for longer (EmbeddingStore.expire)
        at the job's step meta 'step' and time meta 'now'."""
        step, now = request.meta.get("step"), request.meta.get("now")
        if not isinstance(step, int) or isinstance(step, bool) or not isinstance(now, (int, float)):
            raise ValueError(f"meta 'step' must be an int and 'now' a number, got {step!r} and {now!r}")
        with self._swap:
            stores = dict(self.stores)
        return Message("expire", meta={"expired": {n: s.expire(step, float(now)) for n, s in stores.items()
                                                   if s.config.expire_after is not None}})

    def _checkpoint(self, request: Message) -> Message:
        return Message("checkpoint", meta=self.checkpoints.request("checkpoint", request.meta))

    def _load(self, request: Message) -> Message:
        return Message("load", meta=self.checkpoints.request("load", request.meta))

    def _checkpoint_entries(self) -> list[str]:
        """What a checkpoint writes into its directory: each table, the dense params and the
        routing claims (`hybridrec.ps.resharding`)."""
        with self._swap:
            return [*self.stores, DENSE_DIRECTORY, ROUTING_FILE]

    def _write_checkpoint(self, directory: DirHandle) -> list[str]:
        """Save every table, the dense params and which buckets this server held into the open
        `directory`; the tables' names. The tables are copied and the buckets read at one
        instant (no request is applied meanwhile), then written."""
        with self._swap:
            stores, dense = dict(self.stores), self.dense
        with self.ownership.lock.exclusive():
            claims = self.ownership.claims(directory.path)
            snapshots = {name: store.snapshot() for name, store in stores.items()}
        for name, snapshot in snapshots.items():
            checkpoint_format.write(Entry(directory, name), snapshot)
        dense.save(Entry(directory, DENSE_DIRECTORY))
        directory.write_durably(ROUTING_FILE, json.dumps(claims).encode())
        return list(stores)

    def _read_checkpoint(self, directory: DirHandle, meta: dict) -> list[str]:
        """Replace every table and the dense params by the checkpoint in the open `directory`;
        with meta 'owned' (the buckets this server serves, hex), `directory` holds every shard
        of a checkpoint, and of each table the rows of those buckets are read from them all
        (`hybridrec.ps.resharding`), the dense params from the shard meta 'dense_from' names."""
        if meta.get("owned") is not None:
            owned = parse_mask(meta["owned"])
            with self._swap:
                current = dict(self.stores)
            parts = load_owned(directory, current, owned)
            loaded = {}
            for name, (rows, row_meta) in parts.items():  # (a disk tier is taken over in _replace)
                loaded[name] = EmbeddingStore(dataclasses.replace(current[name].config, tier=None))
                loaded[name].insert_rows(rows, row_meta)
            dense_from = meta.get("dense_from")
            dense = DenseStore(self.dense.declared)
            if isinstance(dense_from, str) and directory.is_dir(dense_from):
                with directory.sub(dense_from) as shard:
                    dense = DenseStore.load(Entry(shard, DENSE_DIRECTORY), self.dense.declared)
            return self._replace(loaded, dense, lambda name, shm_name: EmbeddingStore(
                current[name].config, shm_name=shm_name), parts)
        missing = [name for name in self.stores if not directory.is_dir(name)]
        if missing:
            raise ValueError(f"meta 'directory' {directory.path!r} has no checkpoint of tables {missing}")
        # Read (and checksum) every table before replacing any, so a bad checkpoint changes nothing.
        # A table with a disk tier is verified whole here and loaded in _replace, once its old
        # store has let the tier go (one store at a time may hold a tier's directory).
        with self._swap:
            tiers = {name: {} if store.disk_tier is None else {"tier": store.config.tier}
                     for name, store in self.stores.items()}
        loaded = {name: (checkpoint_format.verify(Entry(directory, name)) if tier
                         else EmbeddingStore.load(Entry(directory, name))) for name, tier in tiers.items()}
        dense = DenseStore.load(Entry(directory, DENSE_DIRECTORY), self.dense.declared)
        return self._replace(loaded, dense, lambda name, shm_name: EmbeddingStore.load(
            Entry(directory, name), shm_name=shm_name, **tiers[name]))

    def _replace(self, loaded: dict[str, EmbeddingStore], dense: DenseStore, reopen,
                 parts: dict | None = None) -> list[str]:
        """Put the `loaded` stores and `dense` in place; a store kept in shared memory is made
        again there by `reopen(name, shm_name)` (and refilled from `parts`)."""
        with self._swap:
            self.dense = dense
            for name, old in list(self.stores.items()):
                shm_name = old.shm_name
                if shm_name is not None or old.disk_tier is not None:  # a restarted server must find the rows
                    old.close()
                    if shm_name is not None:
                        unlink_shared(shm_name)
                    loaded[name] = reopen(name, shm_name)
                    if parts is not None:
                        loaded[name].insert_rows(*parts[name])
                self.stores[name] = loaded[name]
        return sorted(self.stores)

    def _shutdown(self, request: Message) -> Message:
        self.transport.request_stop()
        return Message("shutdown", meta={"pid": os.getpid()})


def serve(host: str = "127.0.0.1", port: int = 0, tables: Mapping[str, TableSpec] | None = None,
          shm_prefix: str | None = None, threads: int = 2, *, block: bool = True,
          key: JobKey | None = FROM_ENVIRONMENT, **limits: Any) -> EmbeddingServer:
    """Serve `tables` (name -> TableConfig / dict of its fields / EmbeddingStore) on host:port.

    `port=0` picks a free port (read it from the returned server's `.address`). With
    `block=True` this returns only after a `shutdown` request, SIGTERM or Ctrl-C, with the
    server stopped; with `block=False` it returns the running server at once. `limits`:
    `dense_params`, `checkpoint_root`, `max_keys_per_request`, `max_trainers`, `max_connections`,
    `routed` of `EmbeddingServer`. With `shm_prefix` the server keeps its routing state beside
    its tables. The job key
    is checked (AuthError off loopback without one) before any table is opened.
    """
    key = server_key(host, key)
    state_dir = None if shm_prefix is None else shm_path(routing_state_name(shm_prefix))
    stores = open_stores(tables or {}, shm_prefix)
    warm_move_kernels(stores)  # before it listens: a first bucket import must not wait for a compile
    server = EmbeddingServer(stores, host=host, port=port, threads=threads, key=key, state_dir=state_dir, **limits)
    server.start()
    if block:
        run_until_stopped(server)
    return server


STOP_SECONDS = 10.0  # a server told to stop that is still busy after this long exits anyway


def run_until_stopped(server: EmbeddingServer, on_ready: Callable[[], None] | None = None) -> None:
    """Block until a shutdown request, SIGTERM or Ctrl-C (main thread), then stop the server.

    `on_ready` runs once the signal handlers are in place (so a SIGTERM sent right after it
    stops the server cleanly instead of killing the process). From the moment it stops, the
    process ends within STOP_SECONDS, even when a handler is still busy with a long request or
    a clean-up waits on a peer (the launcher's SIGTERM, also the kernel's when the launcher is
    killed, must end a busy server promptly).
    """
    deadline = threading.Timer(STOP_SECONDS, os._exit, (1,))
    deadline.daemon = True  # ends the process if stopping, or the interpreter's exit, hangs

    def stop_on_signal(*_) -> None:
        # the bound runs from the signal: the server counts as stopped only once its handlers
        # return, and one may wait out a request to a peer that is gone (its timeout and retries)
        if not deadline.is_alive():
            deadline.start()
        server.transport.request_stop()

    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, stop_on_signal)
    if on_ready is not None:
        on_ready()
    try:
        while not server.wait(0.2):  # short waits so signal handlers get to run
            pass
    finally:
        if not deadline.is_alive():
            deadline.start()
        server.stop()


def launch(args: Sequence[str], *, env: Mapping[str, str] | None = None,
           startup_timeout: float = 120.0) -> tuple[subprocess.Popen, str]:
    """Start `python -m hybridrec.ps.server *args` and return (process, address) once it listens.

    The caller owns the process (kill it when done). A server that does not report within
    `startup_timeout` seconds (a cold numba cache compiles the store kernels first) is killed
    and RuntimeError is raised.
    """
    process = subprocess.Popen([sys.executable, "-m", "hybridrec.ps.server", *args],
                               stdout=subprocess.PIPE, text=True,
                               env=None if env is None else dict(env))
    return process, listening_address(process, LISTENING, f"PS server {list(args)}", startup_timeout)


def listening_address(process: subprocess.Popen, marker: str, what: str, startup_timeout: float) -> str:
    """The address a server process prints after `marker` on its first line; the process is
    killed and RuntimeError raised when no such line comes within `startup_timeout` seconds."""
    ready, _, _ = select.select([process.stdout], [], [], startup_timeout)
    line = process.stdout.readline() if ready else ""
    if marker not in line:
        process.kill()
        process.wait(10)
        raise RuntimeError(f"{what} did not start within {startup_timeout}s (exit code {process.returncode}, "
                           f"said {line!r})")
    return line.split(marker)[1].split()[0]


def _parse_table(text: str) -> tuple[str, dict[str, Any]]:
    parts = text.split(":")
    if len(parts) != 3 or not parts[0] or not parts[1].isdigit() or not parts[2].isdigit():
        raise argparse.ArgumentTypeError(f"--table must be NAME:DIM:CAPACITY, got {text!r}")
    return parts[0], {"dim": int(parts[1]), "capacity": int(parts[2])}


def _config_job(parser: argparse.ArgumentParser, path: str,
                sets: list[str]) -> tuple[dict[str, TableConfig], dict[str, tuple[int, ...]]]:
    """Every table and the dense parameters' shapes of the job config at `path` (with `--set`
    overrides), as the trainers derive them."""
    from hybridrec.config import ConfigError, load_config
    from hybridrec.job.tables import job_dense_model, job_tables  # imports the models: only when asked

    try:
        cfg = load_config(path, sets)
        tables = job_tables(cfg)
        model = job_dense_model(cfg, tables)
    except (ConfigError, ValueError) as error:
        parser.error(f"--config {path}: {error}")
    return tables.all_tables(), {name: tuple(p.shape) for name, p in model.named_parameters()}


def _tables_json(parser: argparse.ArgumentParser, text: str) -> dict[str, Any]:
    """--tables-json's {name: {TableConfig fields}}, or a one-line parser error."""
    try:
        tables = json.loads(text)
    except json.JSONDecodeError as error:
        parser.error(f"--tables-json is not valid JSON ({error}); give {{\"NAME\": {{\"dim\": D, \"capacity\": N}}}}")
    if not isinstance(tables, dict) or not all(isinstance(fields, dict) for fields in tables.values()):
        parser.error(f"--tables-json must be an object of table name -> object of its fields, got {text[:100]!r}")
    return tables


def _with_tiers(parser: argparse.ArgumentParser, tables: Mapping[str, TableSpec], root: str,
                capacity_rows: int) -> dict[str, dict[str, Any]]:
    """Every table with a disk tier of `capacity_rows` rows in `root`/<table>, or a parser error."""
    from hybridrec.embedding.disk_tier import table_tier_path
    from hybridrec.embedding.table import parse_tier

    try:
        return {name: {**_table_config(name, spec).to_dict(),
                       "tier": parse_tier({"path": table_tier_path(root, name), "capacity_rows": capacity_rows})}
                for name, spec in tables.items()}
    except ValueError as error:
        parser.error(f"--tier-path/--tier-capacity: {error}")


def _check_memory(tables: Mapping[str, TableSpec]) -> None:
    """ValueError when the tables' rows alone need more memory than this machine has."""
    need = sum(config.capacity * config.row_width * 4 for config in
               (_table_config(name, spec) for name, spec in tables.items() if not isinstance(spec, EmbeddingStore)))
    have = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if need > have:
        raise ValueError(f"the tables' rows alone need {need / 2**30:.1f} GiB, more than this machine's "
                         f"{have / 2**30:.1f} GiB of memory; lower their capacity or dim")


def main(argv: list[str] | None = None, prog: str = "python -m hybridrec.ps.server") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port (printed on start)")
    parser.add_argument("--config", metavar="PATH",
                        help="a YAML job config: serve every table of that job")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="override a --config value, as `hybridrec train --set` (repeatable)")
    parser.add_argument("--table", action="append", type=_parse_table, default=[],
                        metavar="NAME:DIM:CAPACITY", help="a table to serve (repeatable)")
    parser.add_argument("--tables-json", help='tables as JSON: {"name": {TableConfig fields}}')
    parser.add_argument("--optimizer", default="adagrad", help="optimizer of --table tables")
    parser.add_argument("--lr", type=float, default=None, help="learning rate of --table tables")
    parser.add_argument("--seed", type=int, default=0, help="initialisation seed of --table tables")
    parser.add_argument("--shm-name", dest="shm_prefix", help="keep tables in named shared memory")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--routed", action="store_true",
                        help="serve no bucket until a routing table is installed (a launcher's coordinator does; "
                             "hybridrec.ps.ownership), so a server restarted without its memory serves nothing stale")
    parser.add_argument("--tier-path", metavar="DIR",
                        help="a disk tier under every table: rows evicted from memory go to DIR/<table> with their "
                             "optimizer state and come back at their next lookup; a restarted server finds them")
    parser.add_argument("--tier-capacity", type=int, metavar="N", help="rows each table's disk tier may hold")
    parser.add_argument("--checkpoint-root", metavar="DIR",
                        help="checkpoint and load requests may only name directories inside DIR "
                             "(without it they are refused)")
    parser.add_argument("--max-keys-per-request", type=int, default=MAX_KEYS_PER_REQUEST, metavar="N",
                        help=f"refuse requests with more keys (default {MAX_KEYS_PER_REQUEST})")
    parser.add_argument("--max-trainers", type=int, default=MAX_WORLD, metavar="N",
                        help=f"SSP's worker clocks serve at most N trainers (default {MAX_WORLD})")
    parser.add_argument("--max-connections", type=int, default=256, metavar="N",
                        help="refuse connections past N at their handshake (default 256)")
    args = parser.parse_args(argv)
    if args.sets and not args.config:
        parser.error("--set overrides values of --config; give --config PATH too")
    try:
        key = server_key(args.host)  # before anything is opened: off loopback the job key is needed
    except AuthError as error:
        parser.error(f"--host: {error}")
    tables: dict[str, Any] = {}
    dense_params: dict[str, tuple[int, ...]] = {}
    if args.config:
        tables, dense_params = _config_job(parser, args.config, args.sets)
    given = [_tables_json(parser, args.tables_json) if args.tables_json else {}]
    for name, fields in args.table:
        optimizer = {"name": args.optimizer, **({} if args.lr is None else {"lr": args.lr})}
        given.append({name: {**fields, "optimizer": optimizer, "seed": args.seed}})
    for more in given:
        twice = sorted(set(tables) & set(more))
        if twice:
            parser.error(f"tables {twice} are given twice (by --config, --tables-json or --table)")
        tables.update(more)
    if not tables:
        parser.error("give at least one --table NAME:DIM:CAPACITY, --tables-json or --config")
    if (args.tier_path is None) != (args.tier_capacity is None):
        parser.error("--tier-path and --tier-capacity go together: the directory of the disk tiers and the rows "
                     "each may hold")
    if args.tier_path is not None:
        tables = _with_tiers(parser, tables, args.tier_path, args.tier_capacity)
    # Requests run in parallel on --threads workers; torch's own pool (used by the fp16 codec)
    # would only oversubscribe the cores, so it gets one thread per worker.
    torch.set_num_threads(1)
    try:
        _check_memory(tables)
        server = serve(args.host, args.port, tables, args.shm_prefix, args.threads, block=False, key=key,
                       dense_params=dense_params, checkpoint_root=args.checkpoint_root,
                       max_keys_per_request=args.max_keys_per_request, max_trainers=args.max_trainers,
                       max_connections=args.max_connections, routed=args.routed)
    except (ValueError, TypeError) as error:
        parser.error(" ".join(str(error).split()))
    except MemoryError as error:
        parser.error(f"the tables do not fit in this machine's memory ({error}); lower their capacity or dim")
    run_until_stopped(server, on_ready=lambda: print(
        f"hybridrec-ps{LISTENING}{server.address} pid {os.getpid()}", flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
