"""Numba kernels of a bundle's read-only tables: a hash index over a table's keys, and the lookup
that pools a batch's rows of every feature of a side in one call (dequantizing fp16 and int8
rows), the missing keys counted. No Python runs per ID.

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


PRECISION_CODES = {"fp32": 0, "fp16": 1, "int8": 2}


@njit(inline="always")
def _bag_scale(n, mode):
    """The pooled sum's factor, as the stores pool (embedding.kernels.pool_bag): sum 1, mean 1/n,
    sqrtn 1/sqrt(n), n counting the bag's IDs whether the table holds them or not."""
    if n > 1 and mode != 0:
        return np.float32(1.0 / n) if mode == 1 else np.float32(1.0 / np.sqrt(n))
    return np.float32(1.0)


@njit(cache=True, nogil=True)
def pool_side(values, offsets, batch, feature_table, modes, keys, slots, weights, scales, biases, precision, out):
    """out[b, f] = the pooled rows of feature f's bag b, read from table feature_table[f] (`keys`,
    `slots`, `weights`, `scales`, `biases`: typed lists, one entry per table; `precision` a
    PRECISION_CODES value shared by them); a key the table does not hold reads as zeros. One call
    for every feature of a side. Returns how many keys were missing."""
    dim = out.shape[2]
    missing = 0
    for f in range(feature_table.shape[0]):
        t = feature_table[f]
        table_keys = keys[t]
        table_slots = slots[t]
        table_weights = weights[t]
        scale = scales[t]
        bias = biases[t]
        mask = np.uint64(table_slots.shape[0] - 1)
        for b in range(batch):
            start = offsets[f * batch + b]
            end = offsets[f * batch + b + 1]
            for d in range(dim):
                out[b, f, d] = 0.0
            for i in range(start, end):
                key = values[i]
                s = index_hash(key) & mask
                r = -1
                while table_slots[s] >= 0:
                    if table_keys[table_slots[s]] == key:
                        r = table_slots[s]
                        break
                    s = (s + np.uint64(1)) & mask
                if r < 0:
                    missing += 1
                    continue
                if precision == 0:
                    for d in range(dim):
                        out[b, f, d] += table_weights[r, d]
                elif precision == 1:
                    for d in range(dim):
                        out[b, f, d] += _half_to_float(np.int64(table_weights[r, d]))
                else:
                    for d in range(dim):
                        out[b, f, d] += np.float32(table_weights[r, d]) * scale[r] + bias[r]
            factor = _bag_scale(end - start, modes[f])
            if factor != 1.0:
                for d in range(dim):
                    out[b, f, d] *= factor
    return missing
