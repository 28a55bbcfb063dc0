"""PSClient: pull and push embedding rows on a set of PS shards as if they were one table.

Keys are deduplicated, routed to shards with the project's one global hash
`route(keys, table_id, num_shards)` (Persia's shuffled, uniform partition), sent to every
shard at once (one socket per server: send all, then receive all) and the rows are put back
in the caller's key order. Gradients of equal keys are summed before they leave. Rows and
gradients travel with the job's value codec ("none" or "fp16"). `lookup_tables` and
`push_tables` carry every table of a batch in one request per shard (`lookup`/`push` are the
one-table case). Lookups, stats, checkpoint, load, ping and dense init/pull are retried after
a timeout; pushes are not (a retried push could apply twice). Checkpoints and loads run in the
background on the servers: the client polls them until done (`job_timeout`), and a retry, even
to a server restarted meanwhile, resumes the same one.

Dense parameters (`dense_init`, `dense_pull`, `dense_push`) live on shard
crc32(name) % num_shards; see `hybridrec.ps.dense`.

Not thread-safe: use one PSClient per thread.
"""

from __future__ import annotations

import secrets
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
from numba import njit

from hybridrec.comm.auth import FROM_ENVIRONMENT
from hybridrec.comm.codec import Encoded, make_value_codec
from hybridrec.comm.transport import Client, Message, check_addresses, request_all
from hybridrec.embedding import route
from hybridrec.embedding.dedupe import first_seen_unique
from hybridrec.embedding.hashing import table_route_id
from hybridrec.ps.dense import check_optimizer, check_tensors


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
def _place_rows(out, part_rows, shard_id, first, shard, local, inverse):
    """out[i] = the returned row of key i, for the keys of shard `shard_id` whose index in
    that shard's key list lies in [first, first + len(part_rows))."""
    end = first + part_rows.shape[0]
    for i in range(inverse.shape[0]):
        u = inverse[i]
        if shard[u] == shard_id and first <= local[u] < end:
            row = local[u] - first
            for j in range(out.shape[1]):
                out[i, j] = part_rows[row, j]


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


@dataclass(frozen=True)
class _Fanout:
    """How one batch of keys is spread over the shards (see `PSClient._route`)."""

    unique_keys: np.ndarray  # uint64[U], first-seen order
    inverse: np.ndarray  # int64[n]: keys[i] == unique_keys[inverse[i]]
    shard: np.ndarray  # int64[U]: shard of each unique key
    order: np.ndarray  # int64[U]: unique keys grouped by shard
    bounds: np.ndarray  # int64[S+1]: shard s holds order[bounds[s]:bounds[s+1]]
    local: np.ndarray  # int64[U]: index of each unique key within its shard's request

    def busy_shards(self) -> list[int]:
        return [s for s in range(len(self.bounds) - 1) if self.bounds[s + 1] > self.bounds[s]]

    def of_shard(self, s: int) -> np.ndarray:
        return self.order[self.bounds[s]:self.bounds[s + 1]]


class PSClient:
    """One logical embedding service over `addresses` (shard i = addresses[i]); `key`: the job
    key (`hybridrec.comm.auth`), by default the environment's."""

    def __init__(self, addresses: Sequence[str], *, timeout: float = 10.0, retries: int = 2,
                 value_codec: str = "none", max_keys_per_request: int = 16384, key=FROM_ENVIRONMENT,
                 job_timeout: float = 3600.0, **codec_options: Any):
        addresses = check_addresses(addresses)
        if not isinstance(max_keys_per_request, int) or max_keys_per_request < 1:
            raise ValueError(f"max_keys_per_request must be an int >= 1, got {max_keys_per_request!r}")
        self.addresses = list(addresses)
        if not job_timeout > 0:
            raise ValueError(f"job_timeout must be > 0 seconds, got {job_timeout!r}")
        self.max_keys_per_request, self.job_timeout = max_keys_per_request, float(job_timeout)
        self.codec = make_value_codec(value_codec, **codec_options)
        self._clients = [Client(a, timeout=timeout, retries=retries, key=key) for a in self.addresses]
        self._dims: dict[str, int] = {}
        self.bytes_sent = self.bytes_received = 0  # array payload of embedding lookups and pushes

    def _exchange(self, requests: list, idempotent: bool) -> list[Message]:
        """`request_all`, counting the array payload each way."""
        self.bytes_sent += sum(a.nbytes for _, _, arrays, _ in requests for a in arrays.values())
        replies = request_all(requests, idempotent=idempotent)
        self.bytes_received += sum(a.nbytes for reply in replies for a in reply.arrays.values())
        return replies

    @property
    def num_shards(self) -> int:
        return len(self._clients)

    @property
    def shards(self) -> list[Client]:
        """The transport client of each shard, in shard order (for operations this class does
        not wrap, such as HET's in `hybridrec.het.clocks`)."""
        return list(self._clients)

    def tables(self) -> list[str]:
        """The names of the tables the shards serve."""
        self._dims.update(self._clients[0].request("ping", idempotent=True).meta["tables"])
        return sorted(self._dims)

    def _broadcast(self, op: str, meta_of_shard=lambda shard: {}, idempotent: bool = True) -> list[Message]:
        return request_all([(c, op, {}, meta_of_shard(i)) for i, c in enumerate(self._clients)],
                           idempotent=idempotent)

    def dim(self, table: str) -> int:
        """The row width of `table`, asked of the first shard once."""
        if table not in self._dims:
            tables = self._clients[0].request("ping", idempotent=True).meta["tables"]
            self._dims.update(tables)
            if table not in self._dims:
                raise ValueError(f"table {table!r} is not served; tables: {sorted(tables)}")
        return self._dims[table]

    def _route(self, table: str, keys: np.ndarray, unique: bool = False) -> "_Fanout":
        """Deduplicate `keys` (unless the caller made them `unique` already) and group the unique
        ones by shard."""
        unique_keys, inverse = (keys, np.arange(len(keys), dtype=np.int64)) if unique else first_seen_unique(keys)
        shard = route(unique_keys, table_route_id(table), self.num_shards)
        order = np.empty(len(unique_keys), dtype=np.int64)
        bounds = np.empty(self.num_shards + 1, dtype=np.int64)
        local = np.empty(len(unique_keys), dtype=np.int64)
        _group_by_shard(shard, self.num_shards, order, bounds, local)
        return _Fanout(unique_keys, inverse, shard, order, bounds, local)

    def _parts(self, fanout: "_Fanout") -> list[tuple[int, int, np.ndarray]]:
        """(shard, first index in the shard's keys, unique-key indices) of every request.

        A shard's keys go in requests of at most `max_keys_per_request`, all sent at once, so
        the server computes one part while the previous one is on the wire.
        """
        parts = []
        for s in fanout.busy_shards():
            picked = fanout.of_shard(s)
            for first in range(0, len(picked), self.max_keys_per_request):
                parts.append((s, first, picked[first:first + self.max_keys_per_request]))
        return parts

    def _requests(self, fanouts: Sequence["_Fanout"]) -> list[tuple[int, list[tuple[int, int, np.ndarray]]]]:
        """(shard, [(table index, first index in the shard's keys of it, unique-key indices)]) of
        every request: all tables of a shard in one request, unless together they exceed
        `max_keys_per_request` keys; then in several, a table larger than that split over some."""
        by_shard: list[list[tuple[int, int, np.ndarray]]] = [[] for _ in range(self.num_shards)]
        for t, fanout in enumerate(fanouts):
            for s, first, picked in self._parts(fanout):
                by_shard[s].append((t, first, picked))
        requests = []
        for s, parts in enumerate(by_shard):
            current: list[tuple[int, int, np.ndarray]] = []
            size = 0
            for part in parts:
                if current and size + len(part[2]) > self.max_keys_per_request:
                    requests.append((s, current))
                    current, size = [], 0
                current.append(part)
                size += len(part[2])
            if current:
                requests.append((s, current))
        return requests

    def _route_tables(self, keys_by_table: Mapping[str, np.ndarray],
                      unique: bool = False) -> tuple[list[str], list[np.ndarray], list["_Fanout"]]:
        """Tables, their checked keys and their fanouts, in the order of `keys_by_table`."""
        if not isinstance(keys_by_table, Mapping):
            raise TypeError(f"expected a dict of table name -> keys, got {type(keys_by_table).__name__}")
        tables = list(keys_by_table)
        keys = [_check_keys(keys_by_table[t], f"keys of table {t!r}") for t in tables]
        for table in tables:
            self.dim(table)  # every table is served
        return tables, keys, [self._route(t, k, unique) for t, k in zip(tables, keys)]

    def _many_requests(self, op: str, tables: list[str], fanouts: list["_Fanout"], meta: dict[str, Any],
                       grads: list[np.ndarray] | None = None):
        """The plan of `_requests` and its (client, op, arrays, meta) requests; with `grads`
        (summed per unique key, one array per table) each request carries them encoded."""
        plan = self._requests(fanouts)
        requests = []
        for s, parts in plan:
            arrays = {f"keys.{i}": fanouts[t].unique_keys[picked] for i, (t, _, picked) in enumerate(parts)}
            part_meta = {**meta, "tables": [tables[t] for t, _, _ in parts], "codec": self.codec.name}
            if grads is not None:
                encoded = [self.codec.encode(grads[t][picked], argument=f"grads of table {tables[t]!r}")
                           for t, _, picked in parts]
                for i, one in enumerate(encoded):
                    arrays.update(part_arrays(i, one.arrays))
                part_meta["codec_meta"] = [one.meta for one in encoded]
            requests.append((self._clients[s], op, arrays, part_meta))
        return plan, requests

    def lookup_tables(self, keys_by_table: Mapping[str, np.ndarray], insert: bool = True,
                      unique: bool = False) -> dict[str, np.ndarray]:
        """{table: float32 [len(keys), dim] rows in the order of its keys} (absent keys read as zeros).

        One request per shard carries every table (more only past `max_keys_per_request` keys).
        `unique`: each table's keys are distinct already (a batch layout's), so they are not
        deduplicated again.
        """
        tables, keys, fanouts = self._route_tables(keys_by_table, unique)
        plan, requests = self._many_requests("lookup_many", tables, fanouts, {"insert": bool(insert)})
        replies = self._exchange(requests, idempotent=True)
        rows = [np.empty((len(k), self.dim(t)), dtype=np.float32) for t, k in zip(tables, keys)]
        for (s, parts), reply in zip(plan, replies):
            codec_meta = reply.meta.get("codec_meta")
            if not isinstance(codec_meta, list) or len(codec_meta) != len(parts):
                raise ValueError(f"shard {s} ({self.addresses[s]}) answered codec_meta {codec_meta!r} "
                                 f"for {len(parts)} tables")
            for (t, first, picked), arrays, meta in zip(parts, split_parts(reply.arrays, len(parts)), codec_meta):
                part_rows = self.codec.decode(Encoded(reply.meta.get("codec"), arrays, meta))
                if part_rows.shape != (len(picked), rows[t].shape[1]):
                    raise ValueError(f"shard {s} ({self.addresses[s]}) answered {part_rows.shape} rows of "
                                     f"table {tables[t]!r} for {len(picked)} keys of dim {rows[t].shape[1]}")
                _place_rows(rows[t], np.ascontiguousarray(part_rows), s, first, fanouts[t].shard,
                            fanouts[t].local, fanouts[t].inverse)
        return dict(zip(tables, rows))

    def lookup(self, table: str, keys: np.ndarray, insert: bool = True) -> np.ndarray:
        """float32 [len(keys), dim] rows in the order of `keys` (absent keys read as zeros)."""
        return self.lookup_tables({table: keys}, insert)[table]

    def push_tables(self, grads_by_table: Mapping[str, tuple[np.ndarray, np.ndarray]], unique: bool = False) -> int:
        """Send {table: (keys, grads)} (one row per key; equal keys are summed, unless the caller
        says the keys are `unique` already); returns dropped updates.

        A dropped update is a key the shard no longer holds (evicted or never admitted). Every
        table is checked before anything is sent, and each shard checks its whole request
        before applying any of it.
        """
        if not isinstance(grads_by_table, Mapping):
            raise TypeError(f"expected a dict of table name -> (keys, grads), got {type(grads_by_table).__name__}")
        for table, pair in grads_by_table.items():
            if not isinstance(pair, tuple) or len(pair) != 2:
                raise TypeError(f"grads_by_table[{table!r}] must be a (keys, grads) tuple, got {type(pair).__name__}")
        tables, keys, fanouts = self._route_tables({t: pair[0] for t, pair in grads_by_table.items()}, unique)
        summed = []
        for table, table_keys, fanout in zip(tables, keys, fanouts):
            grads, dim = grads_by_table[table][1], self.dim(table)
            if not isinstance(grads, np.ndarray) or grads.dtype != np.float32 or grads.shape != (len(table_keys), dim):
                raise ValueError(
                    f"grads of table {table!r} must be a float32 array of shape ({len(table_keys)}, {dim}), "
                    f"got {getattr(grads, 'dtype', type(grads).__name__)} {getattr(grads, 'shape', '')}"
                )
            if not np.isfinite(grads).all():
                raise ValueError(f"grads of table {table!r} hold NaN or inf; nothing was sent")
            summed.append(np.zeros((len(fanout.unique_keys), dim), dtype=np.float32))
            _sum_by_unique(np.ascontiguousarray(grads), fanout.inverse, summed[-1])
        _, requests = self._many_requests("push_many", tables, fanouts, {}, summed)
        return sum(int(reply.meta["dropped"]) for reply in self._exchange(requests, idempotent=False))

    def push(self, table: str, keys: np.ndarray, grads: np.ndarray) -> int:
        """Send gradients (one row per key; equal keys are summed); returns dropped updates.

        A dropped update is a key the shard no longer holds (evicted or never admitted).
        """
        return self.push_tables({table: (keys, grads)})

    # ------------------------------------------------------------------ dense parameters
    def _dense(self, op: str, names: Iterable[str], arrays: Mapping[str, np.ndarray], meta: dict[str, Any],
               idempotent: bool) -> dict[str, np.ndarray]:
        """One `op` request per shard holding some of `names`; the arrays the shards answer."""
        by_shard: dict[int, list[str]] = {}
        for name in names:
            by_shard.setdefault(dense_shard(name, self.num_shards), []).append(name)
        requests = [(self._clients[s], op, {n: arrays[n] for n in group if n in arrays},
                     {**meta, "names": group}) for s, group in by_shard.items()]
        answered: dict[str, np.ndarray] = {}
        for reply in request_all(requests, idempotent=idempotent):
            answered.update(reply.arrays)
        return answered

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
        answered = self._dense("dense_init", params, params, {"optimizer": dict(optimizer)}, idempotent=True)
        return self._dense_values(list(params), answered)

    def dense_pull(self, names: Sequence[str]) -> dict[str, np.ndarray]:
        """{name: current float32 value} of the dense params `names`."""
        if isinstance(names, str) or not all(isinstance(n, str) for n in names):
            raise TypeError(f"names must be a list of dense param names, got {names!r}")
        return self._dense_values(list(names), self._dense("dense_pull", names, {}, {}, idempotent=True))

    def dense_push(self, grads: dict[str, np.ndarray]) -> None:
        """One optimizer step on each named param with its float32 gradient (not retried)."""
        grads = check_tensors(grads, "grads")
        self._dense("dense_push", grads, grads, {}, idempotent=False)

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
        """Every shard saves its tables under `directory` (a path the servers can write); waits
        until every shard is done (at most `job_timeout` seconds)."""
        paths = [shard_directory(directory, s, self.num_shards) for s in range(self.num_shards)]
        self._job("checkpoint", [str(path) for path in paths])
        return paths

    def load(self, directory: str | Path) -> None:
        """Every shard replaces its tables with the checkpoint `checkpoint(directory)` wrote."""
        self._job("load", [str(shard_directory(directory, s, self.num_shards)) for s in range(self.num_shards)])

    def _job(self, op: str, directories: list[str]) -> None:
        """Start a checkpoint or load on every shard and poll until each is done: the same
        request (one token for all its attempts) is sent again while a shard answers "running",
        so a retry after a timeout, or to a shard restarted meanwhile, resumes the same work."""
        token = secrets.token_hex(12)
        deadline = time.monotonic() + self.job_timeout
        waiting, delay = list(range(self.num_shards)), 0.05
        while True:
            requests = [(self._clients[s], op, {}, {"directory": directories[s], "token": token}) for s in waiting]
            replies = request_all(requests, idempotent=True)
            waiting = [s for s, reply in zip(waiting, replies) if reply.meta.get("state") == "running"]
            if not waiting:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{op} to {directories[waiting[0]]!r}: shards {waiting} still running after "
                                   f"{self.job_timeout:.0f}s (PSClient job_timeout)")
            time.sleep(delay)
            delay = min(2 * delay, 1.0)

    def shutdown(self) -> None:
        """Ask every shard to stop (each replies first)."""
        self._broadcast("shutdown", idempotent=False)

    def close(self) -> None:
        for client in self._clients:
            client.close()

    def __enter__(self) -> "PSClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
