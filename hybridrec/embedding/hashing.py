"""64-bit mixing functions shared by every part that hashes keys.

One place defines how a uint64 key becomes (a) a slot in a store's hash index, (b) a partition
inside a store, (c) a PS shard (the one global `route` of (table, key) -> shard), and (d) the
counter-based random numbers that initialise a row deterministically from (seed, key).
Each use mixes with its own salt so that the bits used by one never correlate with another's.
"""
import zlib

import numpy as np
from numba import njit

from hybridrec.mixing import mix64  # noqa: F401  (re-exported: the kernels import it from here)

U64_GOLDEN = np.uint64(0x9E3779B97F4A7C15)

INDEX_SALT = np.uint64(0x243F6A8885A308D3)
ROUTE_SALT = np.uint64(0x13198A2E03707344)
INIT_SALT = np.uint64(0xA4093822299F31D0)
ADMIT_SALT = np.uint64(0x082EFA98EC4E6C89)
SKETCH_SALT = np.uint64(0x452821E638D01377)
_LO32 = np.uint64(0xFFFFFFFF)
_S32 = np.uint64(32)
_S11 = np.uint64(11)
_INV53 = 1.0 / 9007199254740992.0


@njit(inline="always")
def index_hash(key):
    """The hash that places a key in a store's index (slot, tag and partition) and in the
    first-seen dedupe's table (dedupe.py), which hands it on to the index probe."""
    return mix64(key ^ INDEX_SALT)


@njit(inline="always")
def scale32(h, n):
    """Map the low 32 bits of `h` onto [0, n) without a division (n < 2**32)."""
    return np.int64(((h & _LO32) * np.uint64(n)) >> _S32)


@njit(inline="always")
def scale_hi32(h, n):
    """Map the high 32 bits of `h` onto [0, n)."""
    return np.int64(((h >> _S32) * np.uint64(n)) >> _S32)


@njit(inline="always")
def uniform01(x):
    """A float64 in [0, 1) from 64 random bits."""
    return np.float64(x >> _S11) * _INV53


@njit(inline="always")
def route_one(key, salt, num_shards):
    """The shard of one key under a table's `route_salt`: what `route` computes per key, for
    kernels that route keys as they read them (the sharded placement's Unique&Partition)."""
    return scale_hi32(mix64(key ^ salt), num_shards)


@njit(cache=True, nogil=True)
def _route_kernel(keys, salt, num_shards, out):
    for i in range(keys.shape[0]):
        out[i] = route_one(keys[i], salt, num_shards)


def table_route_id(table: str) -> int:
    """The `table_id` that `route` gets for a table name: stable across processes and runs
    (the PS client routes with it; `checkpoint.load_resharded` takes it as `table_id`)."""
    return zlib.crc32(table.encode("utf-8"))


def route(keys, table_id, num_shards):
    """The global shard of each (table, key): int64 array in [0, num_shards).

    Persia's shuffled partition: keys of one table spread uniformly over all shards, and the
    same (table, key) goes to the same shard in every process, PS client and checkpoint loader.
    """
    keys = np.ascontiguousarray(keys)
    if keys.dtype != np.uint64:
        raise TypeError(f"route: keys must be uint64, got {keys.dtype}")
    if not 1 <= int(num_shards) < 2**31:
        raise ValueError(f"route: num_shards must be in [1, 2**31), got {num_shards}")
    out = np.empty(keys.shape[0], dtype=np.int64)
    _route_kernel(keys, route_salt(table_id), int(num_shards), out)  # a Python int would type as int64
    return out


def route_salt(table_id) -> np.uint64:
    """The salt `route` mixes a table's keys with (`route_one` takes it)."""
    return np.uint64(mix64(np.uint64((int(ROUTE_SALT) + int(table_id) * int(U64_GOLDEN)) % 2**64)))


@njit(inline="always")
def stays_in_run(home, hole, j, ns):
    """Backward-shift deletion in a linear-probing table of ns slots: whether the entry at slot j,
    whose home slot is `home`, must stay where it is when slot `hole` (before j in the run) is
    freed, because its home lies after the hole (moving it there would put it before its home).
    All three lie in [0, ns), so the cyclic distances need a conditional add, not a modulo (an
    integer division per entry shifted, on the path of every eviction)."""
    to_home = home - hole
    if to_home < 0:
        to_home += ns
    to_j = j - hole
    if to_j < 0:
        to_j += ns
    return 0 < to_home <= to_j
