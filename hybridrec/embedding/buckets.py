"""Virtual buckets: the fixed unit in which a table's keys are placed on PS servers.

A (table, key) falls in one of `NUM_BUCKETS` buckets by the project's one global hash
(`route(keys, table_route_id(table), NUM_BUCKETS)`), and a bucket lies on a server by a
routing table (`hybridrec.ps.routing`). Moving a server's share of the keys is moving
buckets, and the bucket of a key never changes, so a key's rows, checkpoints and HET's clocks
all follow the same map. `static_owners(n)` is the table every client starts from: contiguous
runs of buckets, one per server.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from hybridrec.embedding.hashing import route, route_one, route_salt

NUM_BUCKETS = 4096


def bucket_of(keys: np.ndarray, table_id: int) -> np.ndarray:
    """The bucket of each key of the table with route id `table_id`: int64 in [0, NUM_BUCKETS)."""
    return route(keys, table_id, NUM_BUCKETS)


def static_owners(num_servers: int) -> np.ndarray:
    """int32[NUM_BUCKETS]: the server of each bucket when `num_servers` servers split the buckets
    into contiguous runs of (nearly) equal length."""
    if not 1 <= num_servers <= NUM_BUCKETS:
        raise ValueError(f"num_servers must be in [1, {NUM_BUCKETS}], got {num_servers!r}")
    return (np.arange(NUM_BUCKETS, dtype=np.int64) * num_servers // NUM_BUCKETS).astype(np.int32)


@njit(cache=True, nogil=True)
def _shard_kernel(keys, salt, owners, out):
    for i in range(keys.shape[0]):
        out[i] = owners[route_one(keys[i], salt, NUM_BUCKETS)]


def shard_of(keys: np.ndarray, table_id: int, owners: np.ndarray) -> np.ndarray:
    """The server (an index into the routing table's servers) of each key: int64, the bucket
    and its owner in one pass."""
    keys = np.ascontiguousarray(keys)
    if keys.dtype != np.uint64:
        raise TypeError(f"shard_of: keys must be uint64, got {keys.dtype}")
    out = np.empty(keys.shape[0], dtype=np.int64)
    _shard_kernel(keys, route_salt(table_id), np.ascontiguousarray(owners, dtype=np.int32), out)
    return out
