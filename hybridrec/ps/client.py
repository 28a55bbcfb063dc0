"""PSClient: pull and push embedding rows on a set of PS shards as if they were one table.

Keys are deduplicated, put in virtual buckets by the project's one global hash
(`hybridrec.embedding.buckets`: Persia's shuffled, uniform partition) and routed to servers
by the newest routing table the client has seen (`hybridrec.ps.routing`; at first the static
table over `addresses`), sent to every server at once (one socket per server: send all, then
receive all) and the rows are put back in the caller's key order. A server that no longer
serves some bucket of a request answers with its newer table instead; the client takes it and
sends those keys again (`_routed`), so servers may be added, removed or lost while it runs.
With replication a server whose connection closes, or is refused (nothing listens there any
more), is taken for lost at once, not after the timeout: its requests go to whichever server the
newest table names, as soon as the coordinator has promoted the backups; a server that is only
slow keeps the whole timeout. Gradients of equal keys are summed before they leave. Rows and
gradients travel with the job's value codec ("none" or "fp16"). `lookup_tables` and
`push_tables` carry every table of a batch in one request per shard (`lookup`/`push` are the
one-table case). Lookups, stats, checkpoint, load, ping and dense init/pull are retried after
a timeout; pushes only when the routing table gives their buckets a backup (with their id,
which the backup knows when it applied them already). Checkpoints and loads run in the
background on the servers: the client polls them until done (`job_timeout`), and a retry, even
to a server restarted meanwhile, resumes the same one.

Dense parameters (`dense_init`, `dense_pull`, `dense_push`) live on shard
crc32(name) % len(addresses) of the addresses the client was made with; see `hybridrec.ps.dense`.

Not thread-safe: use one PSClient per thread.
"""

from __future__ import annotations

import secrets
import time
import zlib
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
from numba import njit

from hybridrec.comm.auth import FROM_ENVIRONMENT
from hybridrec.comm.codec import Encoded, make_value_codec
from hybridrec.comm.transport import Client, Message, check_addresses, request_all
from hybridrec.embedding.buckets import shard_of
from hybridrec.embedding.dedupe import first_seen_unique
from hybridrec.embedding.hashing import table_route_id
from hybridrec.ps.dense import check_optimizer, check_tensors
from hybridrec.ps.ownership import MAX_FREEZE_SECONDS, mask_hex
from hybridrec.ps.routing import RoutingTable


@njit(cache=True, nogil=True)
def _group_by_shard(shard, num_shards, order, bounds, local):
    """Counting sort of unique keys by shard: order, shard bounds, and each key's index in its shard."""
    bounds[:] = 0
    for u in range(shard.shape[0]):
        bounds[shard[u] + 1] += 1
    for s in range(num_shards):
        bounds[s + 1] += bounds[s]
    cursor = bounds[:-1].copy()
    for u in range(shard.shape[0]):
        s = shard[u]
        order[cursor[s]] = u
        local[u] = cursor[s] - bounds[s]
        cursor[s] += 1


@njit(cache=True, nogil=True)
def _sum_by_unique(grads, inverse, summed):
    for i in range(inverse.shape[0]):
        u = inverse[i]
        for j in range(grads.shape[1]):
            summed[u, j] += grads[i, j]


def shard_directory(directory: str | Path, shard: int, num_shards: int) -> Path:
    """Where shard `shard` of `num_shards` keeps its checkpoint inside `directory`."""
    return Path(directory) / f"shard-{shard:04d}-of-{num_shards:04d}"


def part_arrays(index: int, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The codec arrays of table `index` of a many-table message, named "<index>.<name>"."""
    return {f"{index}.{name}": array for name, array in arrays.items()}


def split_parts(arrays: Mapping[str, np.ndarray], count: int) -> list[dict[str, np.ndarray]]:
    """Inverse of `part_arrays` for tables 0..count-1; a name of no such table is an error."""
    parts: list[dict[str, np.ndarray]] = [{} for _ in range(count)]
    for name, array in arrays.items():
        index, dot, rest = name.partition(".")
        if not dot or not index.isdigit() or int(index) >= count or not rest:
            raise ValueError(f"array {name!r} is not '<i>.<name>' with i < {count} (the number of tables)")
        parts[int(index)][rest] = array
    return parts


def dense_shard(name: str, num_shards: int) -> int:
    """The shard that holds dense parameter `name`."""
    return zlib.crc32(name.encode()) % num_shards


def _check_keys(keys: np.ndarray, what: str = "keys") -> np.ndarray:
    if not isinstance(keys, np.ndarray) or keys.dtype != np.uint64 or keys.ndim != 1:
        raise TypeError(
            f"{what} must be a 1-D numpy uint64 array, got "
            f"{type(keys).__name__} {getattr(keys, 'dtype', '')} {getattr(keys, 'shape', '')}"
        )
    return np.ascontiguousarray(keys)


REFRESH_TIMEOUT = 2.0  # seconds a live server gets to answer a routing refresh (a gone one answers at once)


class PSClient:
    """One logical embedding service over `addresses` (shard i = addresses[i]); `key`: the job
    key (`hybridrec.comm.auth`), by default the environment's."""

    def __init__(self, addresses: Sequence[str], *, timeout: float = 10.0, retries: int = 2,
                 value_codec: str = "none", max_keys_per_request: int = 16384, key=FROM_ENVIRONMENT,
                 job_timeout: float = 3600.0, reroute_timeout: float = 60.0, **codec_options: Any):
        addresses = check_addresses(addresses)
        if not isinstance(max_keys_per_request, int) or max_keys_per_request < 1:
            raise ValueError(f"max_keys_per_request must be an int >= 1, got {max_keys_per_request!r}")
        self.addresses = list(addresses)
        if not job_timeout > 0:
            raise ValueError(f"job_timeout must be > 0 seconds, got {job_timeout!r}")
        self.max_keys_per_request, self.job_timeout = max_keys_per_request, float(job_timeout)
        self.codec = make_value_codec(value_codec, **codec_options)
        self.timeout, self.retries, self._key = timeout, retries, key
        self.reroute_timeout = float(reroute_timeout)
        self._connections: dict[str, Client] = {}
        self._clients = [self._client(a) for a in self.addresses]
        self.routing = RoutingTable.static(self.addresses)
        self._route_ids: dict[str, int] = {}
        self._client_id, self._push_sequence = secrets.token_hex(8), 0
        self._dims: dict[str, int] = {}
        self.bytes_sent = self.bytes_received = 0  # array payload of embedding lookups and pushes
        self.redirects = self.routing_changes = 0  # requests sent again; routing tables taken
        self._asked_routing = False  # whether the servers were asked for their table (a replicated job's)

    @property
    def num_shards(self) -> int:
        """The servers of the current routing table."""
        return len(self.routing.addresses)

    @property
    def shards(self) -> list[Client]:
        """The transport client of each server of the current routing table, in its order (for
        operations this class does not wrap, such as HET's in `hybridrec.het.clocks`, which
        route by the static table: HET jobs keep their servers)."""
        return [self._client(a) for a in self.routing.addresses]

    def tables(self) -> list[str]:
        """The names of the tables the shards serve."""
        self._dims.update(self.shards[0].request("ping", idempotent=True).meta["tables"])
        return sorted(self._dims)

    def _broadcast(self, op: str, meta_of_shard=lambda shard: {}, idempotent: bool = True) -> list[Message]:
        """`op` to every server of the current routing table."""
        return request_all([(c, op, {}, meta_of_shard(i)) for i, c in enumerate(self.shards)], idempotent=idempotent)

    def dim(self, table: str) -> int:
        """The row width of `table`, asked of the first shard once."""
        if table not in self._dims:
            tables = self.shards[0].request("ping", idempotent=True).meta["tables"]
            self._dims.update(tables)
            if table not in self._dims:
                raise ValueError(f"table {table!r} is not served; tables: {sorted(tables)}")
        return self._dims[table]

    # ------------------------------------------------------------------ routing
    def _set_routing(self, table: RoutingTable) -> None:
        self.routing = table
        self.routing_changes += 1

    def job_metrics(self) -> dict[str, float]:
        """The coordinator's figures of the elastic PS tier (routing version, buckets and bytes
        moved, longest pause, failovers) as the newest server has them, and this client's redirects."""
        self.refresh_routing()
        newest = self._client(self.routing.addresses[0]).request("routing", idempotent=True).meta
        return {**newest.get("job_metrics", {}), "routing_version": self.routing.version, "redirects": self.redirects}

    def refresh_routing(self) -> bool:
        """Ask every server this client knows of for its routing table and keep the newest;
        True when it is newer than the one held. A server that does not answer is passed over."""
        known = list(dict.fromkeys([*self.routing.addresses, *self.addresses]))
        newest, self._asked_routing = self.routing, True
        replies = self._each([(self._client(a), "routing", {}, {}) for a in known], timeout=REFRESH_TIMEOUT,
                             fail_fast=True)  # a server gone holds no table: not waited for
        for address, reply in zip(known, replies):
            if isinstance(reply, Message):
                table = RoutingTable.from_wire(reply.arrays, reply.meta)
                if table is not None and table.version > newest.version:
                    newest = table
        if newest is self.routing:
            return False
        self._set_routing(newest)
        return True

    def _client(self, address: str) -> Client:
        if address not in self._connections:
            self._connections[address] = Client(address, timeout=self.timeout, retries=self.retries, key=self._key)
        return self._connections[address]

    def _each(self, requests: list, timeout: float | None = None, fail_fast: bool = False) -> list:
        """Send every (client, op, arrays, meta), then collect each reply or the exception that
        ended its wait (one server failing does not lose the others' replies). `fail_fast`: a
        server nothing listens for any more answers ConnectionRefused at once (`Client.receive`)."""
        pending = []
        for client, op, arrays, meta in requests:
            try:
                pending.append(client.send(op, arrays, meta))
            except (TimeoutError, OSError) as error:
                pending.append(error)
        replies = []
        for (client, *_), request_id in zip(requests, pending):
            if isinstance(request_id, BaseException):
                replies.append(request_id)
                continue
            try:
                replies.append(client.receive(request_id, timeout, fail_fast=fail_fast))
            except (TimeoutError, OSError) as error:
                replies.append(error)
        return replies

    def _shard_of(self, table: str, keys: np.ndarray) -> np.ndarray:
        return shard_of(keys, self._route_id(table), self.routing.owners)

    def _route_id(self, table: str) -> int:
        if table not in self._route_ids:
            self._route_ids[table] = table_route_id(table)
        return self._route_ids[table]

    def _requests(self, tables: list[str], unique_keys: list[np.ndarray],
                  pending: list[np.ndarray]) -> list[tuple[int, list[tuple[int, np.ndarray]]]]:
        """(server, [(table index, unique-key indices)]) of every request for the `pending`
        unique keys of each table under the current routing table: all tables of a server in
        one request, unless together they exceed `max_keys_per_request` keys; then in several,
        a table larger than that split over some. A server's requests all go at once, so it
        computes one while the previous one is on the wire."""
        servers = len(self.routing.addresses)
        by_server: list[list[tuple[int, np.ndarray]]] = [[] for _ in range(servers)]
        for t, picked in enumerate(pending):
            if len(picked) == 0:
                continue
            shard = self._shard_of(tables[t], unique_keys[t][picked])
            order = np.empty(len(picked), dtype=np.int64)
            bounds = np.empty(servers + 1, dtype=np.int64)
            _group_by_shard(shard, servers, order, bounds, np.empty(len(picked), dtype=np.int64))
            for s in range(servers):
                mine = picked[order[bounds[s]:bounds[s + 1]]]
                for first in range(0, len(mine), self.max_keys_per_request):
                    by_server[s].append((t, mine[first:first + self.max_keys_per_request]))
        requests = []
        for s, parts in enumerate(by_server):
            current: list[tuple[int, np.ndarray]] = []
            size = 0
            for part in parts:
                if current and size + len(part[1]) > self.max_keys_per_request:
                    requests.append((s, current))
                    current, size = [], 0
                current.append(part)
                size += len(part[1])
            if current:
                requests.append((s, current))
        return requests

    def _routed(self, op: str, tables: list[str], unique_keys: list[np.ndarray], meta: dict[str, Any],
                receive, grads: list[np.ndarray] | None = None) -> None:
        """Send `op` for every unique key of every table to the servers the routing table names,
        `receive(server, parts, reply)` each answer that carries data; the keys of a request a
        server refused (their buckets moved) go again by the newer table, until every key is
        served or `reroute_timeout` passes.

        A push carries an id. A push whose server was lost (its connection closed or timed out)
        goes again whole, with the same id, to the one server that now holds all its buckets
        (with replication, their backup, which remembers the ids of the pushes forwarded to
        it), so it is applied exactly once; without a backup it is sent again only when the lost
        server has left the routing table (it had handed every bucket on, so it applied nothing
        after that), else the error is raised."""
        if not self._asked_routing:  # a replicated table may place buckets as the static one does:
            self.refresh_routing()  # only asking tells this client that a lost server has backups
        pending = [np.arange(len(k), dtype=np.int64) for k in unique_keys]
        resend: list[tuple[list[tuple[int, np.ndarray]], dict, dict]] = []  # lost pushes: parts, arrays, meta
        deadline, delay = time.monotonic() + self.reroute_timeout, 0.005
        while any(len(p) for p in pending) or resend:
            batch = []  # (server, parts, arrays, meta)
            for parts, arrays, part_meta in resend:
                servers = {int(s) for t, picked in parts for s in np.unique(self._shard_of(tables[t], unique_keys[t][picked]))}
                if len(servers) == 1:
                    batch.append((servers.pop(), parts, arrays, part_meta))
                else:  # its keys went different ways: sent afresh (a forwarded copy would apply twice)
                    for t, picked in parts:
                        pending[t] = np.concatenate([pending[t], picked])
            resend = []
            for s, parts in self._requests(tables, unique_keys, pending):
                arrays = {f"keys.{i}": unique_keys[t][picked] for i, (t, picked) in enumerate(parts)}
                part_meta = {**meta, "tables": [tables[t] for t, _ in parts], "codec": self.codec.name}
                if grads is not None:
                    encoded = [self.codec.encode(grads[t][picked], argument=f"grads of table {tables[t]!r}")
                               for t, picked in parts]
                    for i, one in enumerate(encoded):
                        arrays.update(part_arrays(i, one.arrays))
                    part_meta["codec_meta"] = [one.meta for one in encoded]
                    self._push_sequence += 1
                    part_meta["push_id"] = [self._client_id, self._push_sequence]
                batch.append((s, parts, arrays, part_meta))
            requests = [(self._client(self.routing.addresses[s]), op, arrays, part_meta)
                        for s, _, arrays, part_meta in batch]
            self.bytes_sent += sum(a.nbytes for _, _, arrays, _ in requests for a in arrays.values())
            replies = self._each(requests, fail_fast=self.routing.replicated)  # a lost server's backup takes over
            again: list[list[np.ndarray]] = [[] for _ in tables]
            newer, lost = False, None
            for (s, parts, arrays, part_meta), reply in zip(batch, replies):
                if isinstance(reply, Message) and not reply.meta.get("moved"):
                    self.bytes_received += sum(a.nbytes for a in reply.arrays.values())
                    receive(s, parts, reply)
                    continue
                self.redirects += 1
                if isinstance(reply, Message):
                    table = RoutingTable.from_wire(reply.arrays, reply.meta)
                    if table is not None and table.version > self.routing.version:
                        self._set_routing(table)
                        newer = True
                    for t, picked in parts:
                        again[t].append(picked)
                    continue
                lost = reply
                if grads is None:
                    for t, picked in parts:
                        again[t].append(picked)
                else:
                    resend.append((parts, arrays, part_meta, self.routing.addresses[s], reply))
            if resend:  # pushes whose server was lost: sent again only where that cannot apply them twice
                newer = self.refresh_routing() or newer
                for parts, arrays, part_meta, address, error in resend:
                    if not self.routing.replicated and address in self.routing.addresses:
                        raise error  # no backup to fail over to, and the push may have been applied
                resend = [(parts, arrays, part_meta) for parts, arrays, part_meta, _, _ in resend]
            pending = [np.concatenate(p) if p else np.empty(0, np.int64) for p in again]
            if not any(len(p) for p in pending) and not resend:
                break
            if not newer and not self.refresh_routing():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{op}: keys of {sorted({tables[t] for t, p in enumerate(pending) if len(p)})} "
                                       f"found no server that serves them within {self.reroute_timeout:.0f}s "
                                       f"(routing version {self.routing.version}; last error: {lost!r})")
                time.sleep(delay)
                delay = min(2 * delay, 0.2)

    def lookup_tables(self, keys_by_table: Mapping[str, np.ndarray], insert: bool = True,
                      unique: bool = False, versions: dict | None = None) -> dict[str, np.ndarray]:
        """{table: float32 [len(keys), dim] rows in the order of its keys} (absent keys read as zeros).

        One request per server carries every table (more only past `max_keys_per_request`
        keys). `unique`: each table's keys are distinct already (a batch layout's), so they are
        not deduplicated again. `versions`, a dict, receives {table: [per server of the routing
        table, how many updates its store of the table had applied when it read them]}
        (`_note_versions`).
        """
        tables, unique_keys, inverses = self._dedupe(keys_by_table, unique)
        rows = [np.empty((len(k), self.dim(t)), dtype=np.float32) for t, k in zip(tables, unique_keys)]

        def receive(s: int, parts, reply: Message) -> None:
            codec_meta = reply.meta.get("codec_meta")
            address = self.routing.addresses[s] if s < len(self.routing.addresses) else s
            if not isinstance(codec_meta, list) or len(codec_meta) != len(parts):
                raise ValueError(f"server {address} answered codec_meta {codec_meta!r:.200} for {len(parts)} tables")
            for (t, picked), arrays, meta in zip(parts, split_parts(reply.arrays, len(parts)), codec_meta):
                part_rows = self.codec.decode(Encoded(reply.meta.get("codec"), arrays, meta))
                if part_rows.shape != (len(picked), rows[t].shape[1]):
                    raise ValueError(f"server {address} answered {part_rows.shape} rows of table {tables[t]!r} "
                                     f"for {len(picked)} keys of dim {rows[t].shape[1]}")
                rows[t][picked] = part_rows
            self._note_versions(versions, tables, s, parts, reply)

        self._routed("lookup_many", tables, unique_keys, {"insert": bool(insert)}, receive)
        return {t: r if inverse is None else r[inverse] for t, r, inverse in zip(tables, rows, inverses)}

    def _note_versions(self, versions: dict | None, tables: list[str], server: int, parts, reply: Message) -> None:
        """Into `versions` ({table: [per server]}, -1 where not asked), the number a server's
        lookup_many or push_many reply gives each table of its request: how many updates that
        table's store had applied when it read the keys, or the update's place in the store's
        order. A table one server got in two requests (past `max_keys_per_request` keys) has no
        one number there: -2."""
        numbers = reply.meta.get("versions")
        if versions is None or not isinstance(numbers, list) or len(numbers) != len(parts):
            return
        for (t, _), number in zip(parts, numbers):
            row = versions.setdefault(tables[t], [-1] * len(self.routing.addresses))
            if server < len(row):
                row[server] = int(number) if row[server] == -1 else -2

    def tiered_tables(self) -> list[str]:
        """The tables whose servers keep a disk tier under them (as the first server says)."""
        return sorted(self.shards[0].request("ping", idempotent=True).meta.get("tiered", []))

    def read_ahead_tables(self, keys_by_table: Mapping[str, np.ndarray]) -> int:
        """Have each server fault in the disk-tier records that a coming lookup of these
        (distinct) keys will touch: a hint, answered with nothing but the count of records,
        which is returned (summed over the servers)."""
        tables, unique_keys, _ = self._dedupe(keys_by_table, unique=True)
        touched = []
        self._routed("read_ahead", tables, unique_keys, {},
                     lambda server, parts, reply: touched.append(int(reply.meta.get("touched", 0))))
        return sum(touched)

    def _dedupe(self, keys_by_table: Mapping[str, np.ndarray],
                unique: bool) -> tuple[list[str], list[np.ndarray], list[np.ndarray | None]]:
        """Tables, their unique keys (first-seen order) and each key's index among them (None:
        the keys are unique already), in the order of `keys_by_table`."""
        if not isinstance(keys_by_table, Mapping):
            raise TypeError(f"expected a dict of table name -> keys, got {type(keys_by_table).__name__}")
        tables = list(keys_by_table)
        keys = [_check_keys(keys_by_table[t], f"keys of table {t!r}") for t in tables]
        for table in tables:
            self.dim(table)  # every table is served
        if unique:
            return tables, keys, [None] * len(tables)
        pairs = [first_seen_unique(k) for k in keys]
        return tables, [u for u, _ in pairs], [inverse for _, inverse in pairs]

    def lookup(self, table: str, keys: np.ndarray, insert: bool = True) -> np.ndarray:
        """float32 [len(keys), dim] rows in the order of `keys` (absent keys read as zeros)."""
        return self.lookup_tables({table: keys}, insert)[table]

    def push_tables(self, grads_by_table: Mapping[str, tuple[np.ndarray, np.ndarray]], unique: bool = False,
                    versions: dict | None = None) -> int:
        """Send {table: (keys, grads)} (one row per key; equal keys are summed, unless the caller
        says the keys are `unique` already); returns dropped updates. `versions`, a dict,
        receives per table and server the update's place in the order that server's store of
        the table applied updates (`_note_versions`).

        A dropped update is a key the server no longer holds (evicted or never admitted). Every
        table is checked before anything is sent, and each server checks its whole request
        before applying any of it.
        """
        if not isinstance(grads_by_table, Mapping):
            raise TypeError(f"expected a dict of table name -> (keys, grads), got {type(grads_by_table).__name__}")
        for table, pair in grads_by_table.items():
            if not isinstance(pair, tuple) or len(pair) != 2:
                raise TypeError(f"grads_by_table[{table!r}] must be a (keys, grads) tuple, got {type(pair).__name__}")
        tables, unique_keys, inverses = self._dedupe({t: pair[0] for t, pair in grads_by_table.items()}, unique)
        summed = []
        for table, table_keys, inverse in zip(tables, unique_keys, inverses):
            grads, dim = grads_by_table[table][1], self.dim(table)
            count = len(table_keys) if inverse is None else len(inverse)
            if not isinstance(grads, np.ndarray) or grads.dtype != np.float32 or grads.shape != (count, dim):
                raise ValueError(
                    f"grads of table {table!r} must be a float32 array of shape ({count}, {dim}), "
                    f"got {getattr(grads, 'dtype', type(grads).__name__)} {getattr(grads, 'shape', '')}"
                )
            if not np.isfinite(grads).all():
                raise ValueError(f"grads of table {table!r} hold NaN or inf; nothing was sent")
            if inverse is None:
                summed.append(np.ascontiguousarray(grads))
            else:
                summed.append(np.zeros((len(table_keys), dim), dtype=np.float32))
                _sum_by_unique(np.ascontiguousarray(grads), inverse, summed[-1])
        dropped = [0]

        def receive(s: int, parts, reply: Message) -> None:
            dropped[0] += int(reply.meta["dropped"])
            self._note_versions(versions, tables, s, parts, reply)

        self._routed("push_many", tables, unique_keys, {}, receive, summed)
        return dropped[0]

    def push(self, table: str, keys: np.ndarray, grads: np.ndarray) -> int:
        """Send gradients (one row per key; equal keys are summed); returns dropped updates.

        A dropped update is a key the shard no longer holds (evicted or never admitted).
        """
        return self.push_tables({table: (keys, grads)})

    # ------------------------------------------------------------------ dense parameters
    def _dense(self, op: str, names: Iterable[str], arrays: Mapping[str, np.ndarray], meta: dict[str, Any],
               idempotent: bool) -> tuple[dict[str, np.ndarray], list[int]]:
        """One `op` request per shard holding some of `names`; the arrays the shards answer, and
        per shard the store version its reply names (-1: not asked, or no version answered)."""
        by_shard: dict[int, list[str]] = {}
        for name in names:
            by_shard.setdefault(dense_shard(name, len(self.addresses)), []).append(name)
        requests = [(self._clients[s], op, {n: arrays[n] for n in group if n in arrays},
                     {**meta, "names": group}) for s, group in by_shard.items()]
        answered: dict[str, np.ndarray] = {}
        versions = [-1] * len(self.addresses)
        for s, reply in zip(by_shard, request_all(requests, idempotent=idempotent)):
            answered.update(reply.arrays)
            versions[s] = int(reply.meta.get("version", -1))
        return answered, versions

    def _dense_values(self, names: list[str], answered: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        missing = [n for n in names if n not in answered]
        if missing:
            raise ValueError(f"the shards did not answer dense params {missing}")
        return {n: np.array(answered[n]) for n in names}  # writable copies of the frames

    def dense_init(self, params: dict[str, np.ndarray], optimizer: dict) -> dict[str, np.ndarray]:
        """Register float32 params (the first value any client gives for a name wins) with
        `optimizer` {"name": adam|adagrad|sgd, "lr", "weight_decay"}; returns the current values."""
        params = check_tensors(params, "params")
        check_optimizer(optimizer)
        answered, _ = self._dense("dense_init", params, params, {"optimizer": dict(optimizer)}, idempotent=True)
        return self._dense_values(list(params), answered)

    def dense_pull(self, names: Sequence[str]) -> dict[str, np.ndarray]:
        """{name: current float32 value} of the dense params `names`."""
        return self.dense_pull_versions(names)[0]

    def dense_pull_versions(self, names: Sequence[str]) -> tuple[dict[str, np.ndarray], list[int]]:
        """`dense_pull(names)`, and per shard how many pushes the values it sent hold (-1: a
        shard holding none of `names`): which pushes a step computed on, in each shard's order."""
        if isinstance(names, str) or not all(isinstance(n, str) for n in names):
            raise TypeError(f"names must be a list of dense param names, got {names!r}")
        answered, versions = self._dense("dense_pull", names, {}, {}, idempotent=True)
        return self._dense_values(list(names), answered), versions

    def dense_push(self, grads: dict[str, np.ndarray]) -> list[int]:
        """One optimizer step on each named param with its float32 gradient (not retried); per
        shard, the version the push made (its place in that shard's order of pushes; -1: a shard
        holding none of the params)."""
        grads = check_tensors(grads, "grads")
        return self._dense("dense_push", grads, grads, {}, idempotent=False)[1]

    def ping(self) -> list[dict[str, Any]]:
        return [reply.meta for reply in self._broadcast("ping")]

    def stats(self) -> list[dict[str, Any]]:
        """Each shard's {pid, tables: {name: store stats}}."""
        return [reply.meta for reply in self._broadcast("stats")]

    def expire(self, step: int, now: float) -> int:
        """Every shard's tables with `expire_after` drop the rows unseen for longer; the rows dropped."""
        replies = self._broadcast("expire", lambda s: {"step": int(step), "now": float(now)}, idempotent=False)
        return sum(sum(reply.meta["expired"].values()) for reply in replies)

    def checkpoint(self, directory: str | Path) -> list[Path]:
        """Every server saves its tables and the buckets it holds under `directory` (a path the
        servers can write), as shard i of the current routing table; waits until every one is
        done (at most `job_timeout` seconds). No bucket moves meanwhile (`freeze`)."""
        paths = [shard_directory(directory, s, self.num_shards) for s in range(self.num_shards)]
        self._broadcast("freeze", lambda s: {"seconds": min(self.job_timeout, MAX_FREEZE_SECONDS)})
        try:
            self._job("checkpoint", [{"directory": str(path)} for path in paths])
        finally:
            self._broadcast("freeze", lambda s: {"seconds": 0})
        return paths

    def load(self, directory: str | Path) -> None:
        """Every server replaces its tables with the rows of its buckets (by the current routing
        table) from the checkpoint `checkpoint(directory)` wrote, with any number of servers;
        the dense params from the shard of the same index."""
        owners = self.routing.owners
        self._job("load", [{"directory": str(directory), "owned": mask_hex(owners == s),
                            "dense_from": shard_directory(directory, s, len(self.addresses)).name}
                           for s in range(self.num_shards)])

    def _job(self, op: str, metas: list[dict]) -> None:
        """Start a checkpoint or load on every server (one meta each) and poll until each is
        done: the same request (one token for all its attempts) is sent again while a server
        answers "running", so a retry after a timeout, or to a server restarted meanwhile,
        resumes the same work."""
        token = secrets.token_hex(12)
        deadline = time.monotonic() + self.job_timeout
        waiting, delay = list(range(self.num_shards)), 0.05
        while True:
            shards = self.shards
            requests = [(shards[s], op, {}, {**metas[s], "token": token}) for s in waiting]
            replies = request_all(requests, idempotent=True)
            waiting = [s for s, reply in zip(waiting, replies) if reply.meta.get("state") == "running"]
            if not waiting:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{op} to {metas[waiting[0]]['directory']!r}: servers {waiting} still running "
                                   f"after {self.job_timeout:.0f}s (PSClient job_timeout)")
            time.sleep(delay)
            delay = min(2 * delay, 1.0)

    def shutdown(self) -> None:
        """Ask every shard to stop (each replies first)."""
        self._broadcast("shutdown", idempotent=False)

    def close(self) -> None:
        for client in self._connections.values():
            client.close()

    def __enter__(self) -> "PSClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
