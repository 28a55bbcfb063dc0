"""Numba kernels of a bundle's read-only tables: a hash index over a table's keys, and the lookup
that reads a batch's rows back as float32 (dequantizing fp16 and int8 rows) with the missing
keys counted. No Python runs per ID.

The index is open addressing with linear probing over int32 slots (-1 empty), at most half full,
the slot of a key taken from `hashing.index_hash` (the stores' own hash).
"""
import numpy as np
from numba import njit

from hybridrec.embedding.hashing import index_hash


def index_slots(n_keys: int) -> int:
    """Slots of the index for n_keys keys: a power of two at least twice as large."""
    return 1 << max(4, int(2 * max(n_keys, 1) - 1).bit_length())


@njit(cache=True, nogil=True)
def build_index(keys, slots):
    """Fill `slots` (all -1, a power of two in size) with the positions of `keys`; returns the
    position of the first key seen twice, or -1 when they are all distinct."""
    mask = np.uint64(slots.shape[0] - 1)
    for i in range(keys.shape[0]):
        s = index_hash(keys[i]) & mask
        while slots[s] >= 0:
            if keys[slots[s]] == keys[i]:
                return i
            s = (s + np.uint64(1)) & mask
        slots[s] = i
    return -1


@njit(cache=True, nogil=True)
def find_rows(query, keys, slots, out):
    """out[i] = the position of query[i] among `keys`, or -1; returns how many were missing."""
    mask = np.uint64(slots.shape[0] - 1)
    missing = 0
    for i in range(query.shape[0]):
        s = index_hash(query[i]) & mask
        found = -1
        while slots[s] >= 0:
            if keys[slots[s]] == query[i]:
                found = slots[s]
                break
            s = (s + np.uint64(1)) & mask
        out[i] = found
        if found < 0:
            missing += 1
    return missing


@njit(cache=True, nogil=True)
def gather_fp32(weights, rows, out):
    """out[i] = weights[rows[i]] (zeros where rows[i] is -1)."""
    dim = out.shape[1]
    for i in range(rows.shape[0]):
        r = rows[i]
        for d in range(dim):
            out[i, d] = weights[r, d] if r >= 0 else np.float32(0.0)


@njit(cache=True, nogil=True)
def gather_int8(codes, scale, bias, rows, out):
    """out[i] = codes[rows[i]] * scale + bias of that row (zeros where rows[i] is -1)."""
    dim = out.shape[1]
    for i in range(rows.shape[0]):
        r = rows[i]
        if r < 0:
            for d in range(dim):
                out[i, d] = 0.0
        else:
            s = scale[r]
            b = bias[r]
            for d in range(dim):
                out[i, d] = np.float32(codes[r, d]) * s + b


@njit(inline="always")
def _half_to_float(h):
    """IEEE 754 binary16 bits -> float32 value."""
    sign = -1.0 if (h >> 15) & 1 else 1.0
    exponent = (h >> 10) & 0x1F
    fraction = h & 0x3FF
    if exponent == 0:
        return np.float32(sign * fraction * 2.0 ** -24)
    if exponent == 31:
        return np.float32(sign * np.inf) if fraction == 0 else np.float32(np.nan)
    return np.float32(sign * (1.0 + fraction / 1024.0) * 2.0 ** (exponent - 15))


@njit(cache=True, nogil=True)
def gather_fp16(bits, rows, out):
    """out[i] = the fp16 row rows[i] (stored as uint16 bits) as float32 (zeros for -1)."""
    dim = out.shape[1]
    for i in range(rows.shape[0]):
        r = rows[i]
        for d in range(dim):
            out[i, d] = _half_to_float(np.int64(bits[r, d])) if r >= 0 else np.float32(0.0)
