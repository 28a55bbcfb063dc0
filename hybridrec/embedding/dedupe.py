"""First-seen deduplication of uint64 keys: the one implementation in hybridrec.

`first_seen_unique(keys)` gives a batch's distinct keys in order of first appearance and each
key's index among them. The order depends on the keys alone, so two processes that deduplicate
the same keys agree on it: one can send rows for the unique keys and the other map them back
without an index on the wire. The `dedupe` kernel under it is what the store's probe, the PS
client, the batch layout and the wire codec call, the numba callers from inside their kernels.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from .hashing import index_hash

_NO_ORDER = np.empty(0, dtype=np.int64)  # positions taken in order
_NO_HASHES = np.empty(0, dtype=np.uint64)  # dedupe hashes each key as it reads it


@njit(cache=True, nogil=True)
def dedupe(keys, hashes, order, lo, hi, ukeys, uhash, mult, local_inverse):
    """Unique keys of positions lo..hi (through `order` when it is not empty), in first-seen
    order, with their index hash and multiplicity, and each position's index among them
    (local_inverse[j - lo]), through a small open-addressing table that stays in L1/L2. The
    store probes its big index once per distinct key this way, never per duplicate. `hashes`
    holds each key's `index_hash` when the caller computed them already (to partition the
    keys); when it is empty they are computed here, which saves a pass that writes and reads
    them back. Returns the number of distinct keys."""
    n = hi - lo
    size = 16
    while size < 2 * n:
        size *= 2
    mask = np.uint64(size - 1)
    table = np.full(size, -1, np.int32)
    nu = 0
    use_order = order.shape[0] > 0
    hashed = hashes.shape[0] > 0
    # Unsigned indices throughout: numba turns every access with a signed index into a check
    # for a negative one (and the add that wraps it), which costs registers in this loop.
    base = np.uint64(lo)
    last = np.uint64(n - 1)
    # The next position's key and hash are read one iteration early, so that hashing (a chain
    # of multiplies) runs before this iteration's unpredictable new-or-seen branch rather than
    # after each misprediction.
    next_key = np.uint64(0)
    next_h = np.uint64(0)
    if n > 0:
        i = np.uint64(order[base]) if use_order else base
        next_key = keys[i]
        next_h = hashes[i] if hashed else index_hash(next_key)
    for jj in range(n):
        j = np.uint64(jj)
        key = next_key
        h = next_h
        if j < last:
            i = np.uint64(order[base + j + np.uint64(1)]) if use_order else base + j + np.uint64(1)
            next_key = keys[i]
            next_h = hashes[i] if hashed else index_hash(next_key)
        s = h & mask
        while True:
            u = table[s]
            if u < 0:
                u = nu
                table[s] = u
                ukeys[np.uint64(u)] = key
                uhash[np.uint64(u)] = h
                mult[np.uint64(u)] = 0
                nu += 1
                break
            if ukeys[np.uint64(u)] == key:
                break
            s = (s + np.uint64(1)) & mask
        mult[np.uint64(u)] += 1
        local_inverse[j] = u
    return nu


def first_seen_unique(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(unique keys in order of first appearance, int64 index of each key among them):
    `keys == unique_keys[inverse]`. `keys` is a 1-D uint64 array."""
    if not isinstance(keys, np.ndarray) or keys.dtype != np.uint64 or keys.ndim != 1:
        raise TypeError(f"keys: expected a 1-D numpy uint64 array, got "
                        f"{getattr(keys, 'dtype', type(keys).__name__)} of shape {getattr(keys, 'shape', None)}")
    keys = np.ascontiguousarray(keys)
    n = len(keys)
    unique_keys, inverse = np.empty(n, dtype=np.uint64), np.empty(n, dtype=np.int64)
    count = dedupe(keys, _NO_HASHES, _NO_ORDER, 0, n, unique_keys, np.empty(n, dtype=np.uint64),
                   np.empty(n, dtype=np.int64), inverse)
    return unique_keys[:count], inverse
