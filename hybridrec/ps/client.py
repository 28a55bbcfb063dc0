"""PSClient: pull and push embedding rows on a set of PS shards as if they were one table.

Keys are deduplicated, routed to shards with the project's one global hash
`route(keys, table_id, num_shards)` (Persia's shuffled, uniform partition), sent to every
shard at once (one socket per server: send all, then receive all) and the rows are put back
in the caller's key order. Gradients of equal keys are summed before they leave. Rows and
gradients travel with the job's value codec ("none" or "fp16"). Lookups, stats, checkpoint,
load and ping are retried after a timeout; pushes are not (a retried push could apply twice).

Not thread-safe: use one PSClient per thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from numba import njit

from hybridrec.comm.codec import Encoded, make_value_codec
from hybridrec.comm.transport import Client, Message, request_all
from hybridrec.embedding import route
from hybridrec.embedding.hashing import table_route_id
from hybridrec.embedding.hashing import mix64

_EMPTY = np.int64(-1)


@njit(cache=True, nogil=True)
def _dedup(keys, slots, unique_keys, inverse):
    """Unique keys in first-seen order + each key's index among them (open addressing).

    `slots` is an int64 table of -1 whose length is a power of two larger than len(keys).
    """
    mask = np.int64(slots.shape[0] - 1)
    num_unique = 0
    for i in range(keys.shape[0]):
        key = keys[i]
        slot = np.int64(mix64(key) & np.uint64(mask))
        while True:
            u = slots[slot]
            if u == _EMPTY:
                slots[slot] = num_unique
                unique_keys[num_unique] = key
                inverse[i] = num_unique
                num_unique += 1
                break
            if unique_keys[u] == key:
                inverse[i] = u
                break
            slot = (slot + 1) & mask
    return num_unique


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


def _check_keys(keys: np.ndarray) -> np.ndarray:
    if not isinstance(keys, np.ndarray) or keys.dtype != np.uint64 or keys.ndim != 1:
        raise TypeError(
            f"keys must be a 1-D numpy uint64 array, got "
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
    """One logical embedding service over `addresses` (shard i = addresses[i])."""

    def __init__(self, addresses: Sequence[str], *, timeout: float = 10.0, retries: int = 2,
                 value_codec: str = "none", max_keys_per_request: int = 16384, **codec_options: Any):
        if isinstance(addresses, str) or not addresses:
            raise ValueError(f"addresses must be a non-empty list of 'tcp://host:port', got {addresses!r}")
        if not isinstance(max_keys_per_request, int) or max_keys_per_request < 1:
            raise ValueError(f"max_keys_per_request must be an int >= 1, got {max_keys_per_request!r}")
        self.addresses = list(addresses)
        self.max_keys_per_request = max_keys_per_request
        self.codec = make_value_codec(value_codec, **codec_options)
        self._clients = [Client(a, timeout=timeout, retries=retries) for a in self.addresses]
        self._dims: dict[str, int] = {}

    @property
    def num_shards(self) -> int:
        return len(self._clients)

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

    def _route(self, table: str, keys: np.ndarray) -> "_Fanout":
        """Deduplicate `keys` and group the unique ones by shard."""
        slots = np.full(1 << max(4, int(2 * len(keys)).bit_length()), _EMPTY, dtype=np.int64)
        unique_keys = np.empty(len(keys), dtype=np.uint64)
        inverse = np.empty(len(keys), dtype=np.int64)
        unique_keys = unique_keys[:_dedup(keys, slots, unique_keys, inverse)]
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

    def lookup(self, table: str, keys: np.ndarray, insert: bool = True) -> np.ndarray:
        """float32 [len(keys), dim] rows in the order of `keys` (absent keys read as zeros)."""
        keys = _check_keys(keys)
        dim = self.dim(table)
        fanout = self._route(table, keys)
        meta = {"table": table, "insert": bool(insert), "codec": self.codec.name}
        parts = self._parts(fanout)
        replies = request_all(
            [(self._clients[s], "lookup", {"keys": fanout.unique_keys[picked]}, meta)
             for s, _, picked in parts],
            idempotent=True,
        )
        rows = np.empty((len(keys), dim), dtype=np.float32)
        for (s, first, picked), reply in zip(parts, replies):
            encoded = Encoded(reply.meta.get("codec"), reply.arrays, reply.meta.get("codec_meta", {}))
            part_rows = self.codec.decode(encoded)
            if part_rows.shape != (len(picked), dim):
                raise ValueError(f"shard {s} ({self.addresses[s]}) answered {part_rows.shape} rows "
                                 f"for {len(picked)} keys of dim {dim}")
            _place_rows(rows, np.ascontiguousarray(part_rows), s, first, fanout.shard, fanout.local,
                        fanout.inverse)
        return rows

    def push(self, table: str, keys: np.ndarray, grads: np.ndarray) -> int:
        """Send gradients (one row per key; equal keys are summed); returns dropped updates.

        A dropped update is a key the shard no longer holds (evicted or never admitted).
        """
        keys = _check_keys(keys)
        dim = self.dim(table)
        if not isinstance(grads, np.ndarray) or grads.dtype != np.float32 or grads.shape != (len(keys), dim):
            raise ValueError(
                f"grads must be a float32 array of shape ({len(keys)}, {dim}), got "
                f"{getattr(grads, 'dtype', type(grads).__name__)} {getattr(grads, 'shape', '')}"
            )
        if not np.isfinite(grads).all():
            raise ValueError("grads holds NaN or inf; nothing was sent")
        fanout = self._route(table, keys)
        summed = np.zeros((len(fanout.unique_keys), dim), dtype=np.float32)
        _sum_by_unique(np.ascontiguousarray(grads), fanout.inverse, summed)
        requests = []
        for s, _, picked in self._parts(fanout):
            encoded = self.codec.encode(summed[picked], argument="grads")
            requests.append((self._clients[s], "push", {"keys": fanout.unique_keys[picked], **encoded.arrays},
                             {"table": table, "codec": encoded.codec, "codec_meta": encoded.meta}))
        return sum(int(reply.meta["dropped"]) for reply in request_all(requests, idempotent=False))

    def ping(self) -> list[dict[str, Any]]:
        return [reply.meta for reply in self._broadcast("ping")]

    def stats(self) -> list[dict[str, Any]]:
        """Each shard's {pid, tables: {name: store stats}}."""
        return [reply.meta for reply in self._broadcast("stats")]

    def checkpoint(self, directory: str | Path) -> list[Path]:
        """Every shard saves its tables under `directory` (a path the servers can write)."""
        paths = [shard_directory(directory, s, self.num_shards) for s in range(self.num_shards)]
        self._broadcast("checkpoint", lambda s: {"directory": str(paths[s])})
        return paths

    def load(self, directory: str | Path) -> None:
        """Every shard replaces its tables with the checkpoint `checkpoint(directory)` wrote."""
        self._broadcast("load", lambda s: {"directory": str(shard_directory(directory, s, self.num_shards))})

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
