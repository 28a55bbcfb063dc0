"""Wire codecs: how a batch's ID features and embedding rows are packed for the network.

Two independent choices, each selected per job by name (Persia §4.2.3):

* ID codecs turn a batch's `JaggedFeatures` into arrays for the wire and back, exactly:
  - ``"none"``: one int64 key per (sample, feature) occurrence plus the offsets; the byte
    baseline every other codec is compared with.
  - ``"unique"``: per feature, the batch's unique keys (uint64), how often each occurs and,
    grouped by key, the uint16 position of every sample containing it. A batch of more than
    65535 samples is split into sub-batches of at most 65535, not rejected.
* Value codecs for embedding rows (forward) and their gradients (backward):
  - ``"none"``: float32 rows.
  - ``"fp16"``: every block of a row is scaled by K / ||block||_inf, cast to float16, and
    divided back on decode; the block's scale travels beside it as one float32.
  - ``"bf16"``: bfloat16 bits (uint16), rounded to nearest even; no scale (bf16 keeps
    float32's exponent range), relative error at most 2**-8 (see hybridrec.comm.compression).

Every `encode` returns an `Encoded` (named arrays + small JSON-able metadata) whose `nbytes`
is the payload it puts on the wire; `Encoded.arrays` are the frames `comm.transport` sends.
ID work and the fp16 casts run in numba kernels over numpy arrays: no torch op (they run in the
NN worker's feeder and pusher threads) and no Python loop per ID, row or value. The fp16 kernels
round float32 to float16 bits themselves, to nearest even with subnormals, exactly as a cast
does (numpy's float16 casts are slower).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numba import njit

from hybridrec.comm.compression import bf16_bits, bf16_floats
from hybridrec.data.batch import JaggedFeatures
from hybridrec.embedding.dedupe import dedupe

MAX_SUB_BATCH = 65535  # sample positions must fit in uint16
FP16_SCALE_TARGET = 16384.0  # K: a block's largest magnitude maps here, well inside fp16's 65504
FLOAT32_MAX = float(np.finfo(np.float32).max)


@dataclass(frozen=True)
class Encoded:
    """What one codec puts on the wire: named contiguous arrays plus small metadata."""

    codec: str
    arrays: dict[str, np.ndarray]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Payload bytes on the wire (the arrays; the metadata header is a few dozen bytes)."""
        return int(sum(array.nbytes for array in self.arrays.values()))


def _expect_codec(encoded: Encoded, name: str) -> None:
    if not isinstance(encoded, Encoded):
        raise TypeError(f"encoded must be an Encoded, got {type(encoded).__name__}")
    if encoded.codec != name:
        raise ValueError(f"encoded.codec is {encoded.codec!r} but this codec decodes {name!r}")


def _array(encoded: Encoded, name: str, dtype: np.dtype | type) -> np.ndarray:
    """One named array of an encoded message, checked for presence and dtype."""
    if name not in encoded.arrays:
        raise ValueError(f"encoded arrays lack {name!r}; present: {sorted(encoded.arrays)}")
    array = np.asarray(encoded.arrays[name])
    if array.dtype != np.dtype(dtype):
        raise ValueError(f"encoded array {name!r} has dtype {array.dtype}, expected {np.dtype(dtype)}")
    return array


def _check_features(features: JaggedFeatures) -> tuple[np.ndarray, np.ndarray, int]:
    """(values, offsets, batch_size) of a JaggedFeatures, with its layout checked."""
    if not isinstance(features, JaggedFeatures):
        raise TypeError(f"features must be a JaggedFeatures, got {type(features).__name__}")
    features.validate()
    return features.values, features.offsets, features.batch_size


def _check_names_meta(encoded: Encoded) -> tuple[list[str], int]:
    names = encoded.meta.get("names")
    batch_size = encoded.meta.get("batch_size")
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"encoded meta 'names' must be a list of str, got {names!r}")
    if not isinstance(batch_size, int) or batch_size < 0:
        raise ValueError(f"encoded meta 'batch_size' must be an int >= 0, got {batch_size!r}")
    return names, batch_size


class RawIdCodec:
    """The baseline: every (sample, feature) ID as an int64, plus the int64 offsets."""

    name = "none"

    def encode(self, features: JaggedFeatures) -> Encoded:
        values, offsets, batch_size = _check_features(features)
        return Encoded(
            self.name,
            {"keys": values.view(np.int64), "offsets": offsets},
            {"names": list(features.names), "batch_size": batch_size},
        )

    def decode(self, encoded: Encoded) -> JaggedFeatures:
        _expect_codec(encoded, self.name)
        names, batch_size = _check_names_meta(encoded)
        keys = _array(encoded, "keys", np.int64)
        offsets = _array(encoded, "offsets", np.int64)
        if len(offsets) != len(names) * batch_size + 1:
            raise ValueError(
                f"encoded 'offsets' has {len(offsets)} entries, expected "
                f"{len(names)} features * {batch_size} samples + 1"
            )
        return JaggedFeatures(list(names), keys.view(np.uint64).copy(), offsets.copy()).validate()


@njit(cache=True, nogil=True)
def _unique_encode(values, offsets, batch_size, num_features, sub,
                   keys, key_counts, group_sizes, positions, ranks):
    """Fill the wire arrays of `UniqueIdCodec`; returns (number of unique keys, ranks needed).

    Per group (sub-batch c, feature f), whose IDs are the contiguous
    values[offsets[f*B + c*sub] : offsets[f*B + end of sub-batch]]: deduplicate in first-seen
    order with counts (`dedupe`), then place each occurrence's sample position (and in-bag rank)
    in its key's run with a counting sort.
    """
    local = np.empty(values.shape[0], np.int64)  # index of each occurrence's key in its group
    hashes = np.empty(values.shape[0], np.uint64)  # dedupe's per-key hashes, not needed here
    counts = np.empty(values.shape[0], np.int64)  # occurrences of each of a group's keys
    cursor = np.empty(values.shape[0], np.int64)
    no_hashes = np.empty(0, np.uint64)
    no_order = np.empty(0, np.int64)
    unique_base = 0
    occurrence_base = 0  # groups are laid out sub-batch-major, unlike the feature-major values
    needs_ranks = False
    for c in range((batch_size + sub - 1) // sub):
        first_sample = c * sub
        end_sample = min(batch_size, first_sample + sub)
        for f in range(num_features):
            bag0 = f * batch_size
            lo = offsets[bag0 + first_sample]
            hi = offsets[bag0 + end_sample]
            num_unique = dedupe(values, no_hashes, no_order, lo, hi, keys[unique_base:], hashes, counts,
                                local[lo:hi])
            group_sizes[c * num_features + f] = num_unique
            run = occurrence_base  # the group's k-th key's occurrences start at cursor[k]
            for k in range(num_unique):
                key_counts[unique_base + k] = counts[k]
                cursor[k] = run
                run += counts[k]
            for b in range(first_sample, end_sample):
                start = offsets[bag0 + b]
                for i in range(start, offsets[bag0 + b + 1]):
                    k = local[i]
                    positions[cursor[k]] = b - first_sample
                    ranks[cursor[k]] = i - start
                    cursor[k] += 1
                    if i > start and k < local[i - 1]:
                        needs_ranks = True
            unique_base += num_unique
            occurrence_base += hi - lo
    return unique_base, needs_ranks


@njit(cache=True, nogil=True)
def _unique_decode(keys, key_counts, group_sizes, positions, ranks, has_ranks, batch_size,
                   num_features, sub, values, offsets):
    """Rebuild (values, offsets) from the wire arrays; returns 0 or an error code:
    1 a position past its sub-batch, 2 a rank past its bag, 3 two IDs given one place."""
    num_bags = num_features * batch_size
    bag_of = np.empty(positions.shape[0], np.int64)
    lengths = np.zeros(num_bags + 1, np.int64)
    occurrence = 0
    key = 0
    for g in range(group_sizes.shape[0]):
        first_sample = (g // num_features) * sub
        samples = min(sub, batch_size - first_sample)
        bag0 = (g % num_features) * batch_size + first_sample
        for _ in range(group_sizes[g]):
            for _ in range(key_counts[key]):
                position = np.int64(positions[occurrence])
                if position >= samples:
                    return 1
                bag_of[occurrence] = bag0 + position
                lengths[bag0 + position + 1] += 1
                occurrence += 1
            key += 1
    offsets[0] = 0
    for b in range(num_bags):
        offsets[b + 1] = offsets[b] + lengths[b + 1]
    filled = np.zeros(positions.shape[0], np.bool_)
    fill = np.zeros(num_bags, np.int64)  # next free place per bag, without ranks
    occurrence = 0
    for k in range(keys.shape[0]):
        for _ in range(key_counts[k]):
            bag = bag_of[occurrence]
            if has_ranks:
                rank = np.int64(ranks[occurrence])
                if rank >= offsets[bag + 1] - offsets[bag]:
                    return 2
            else:
                rank = fill[bag]
                fill[bag] += 1
            place = offsets[bag] + rank
            if filled[place]:
                return 3
            filled[place] = True
            values[place] = keys[k]
            occurrence += 1
    return 0


_DECODE_ERRORS = {
    1: "encoded 'positions' point past the samples of their sub-batch",
    2: "encoded 'ranks' point past the end of their bag",
    3: "encoded 'ranks' put two IDs in the same place of a bag",
}


class UniqueIdCodec:
    """Persia's lossless ID codec: unique keys per feature + uint16 sample positions.

    Wire arrays (groups are (sub-batch, feature) pairs, sub-batch-major):
      ``keys`` uint64[U]: each group's unique keys, in order of first appearance;
      ``key_counts`` uint32[U]: occurrences of each key in its group;
      ``group_sizes`` int64[G]: how many unique keys each group has;
      ``positions`` uint16[N]: grouped by key, the sample (within its sub-batch) of every
      occurrence, ascending;
      ``ranks`` uint16|uint32[N] (only when some bag lists a key before one that appeared
      earlier in the batch, which never happens for one-hot features): each occurrence's
      index inside its bag, so any bag order round-trips exactly.
    Encode and decode are numba kernels, linear in the number of IDs.
    """

    name = "unique"

    def __init__(self, max_sub_batch: int = MAX_SUB_BATCH):
        if not isinstance(max_sub_batch, int) or not 1 <= max_sub_batch <= MAX_SUB_BATCH:
            raise ValueError(
                f"max_sub_batch must be an int in [1, {MAX_SUB_BATCH}], got {max_sub_batch!r}"
            )
        self.max_sub_batch = max_sub_batch

    def encode(self, features: JaggedFeatures) -> Encoded:
        values, offsets, batch_size = _check_features(features)
        num_features = len(features.names)
        sub = self.max_sub_batch
        num_ids = len(values)
        keys = np.empty(num_ids, np.uint64)
        key_counts = np.empty(num_ids, np.uint32)
        group_sizes = np.empty(-(-batch_size // sub) * num_features, np.int64)
        positions = np.empty(num_ids, np.uint16)
        ranks = np.empty(num_ids, np.uint32)
        num_unique, needs_ranks = _unique_encode(values, offsets, batch_size, num_features, sub,
                                                 keys, key_counts, group_sizes, positions, ranks)
        arrays = {"keys": keys[:num_unique], "key_counts": key_counts[:num_unique],
                  "group_sizes": group_sizes, "positions": positions}
        if needs_ranks:
            arrays["ranks"] = ranks.astype(np.uint16) if ranks.max() < 65536 else ranks
        meta = {"names": list(features.names), "batch_size": batch_size, "max_sub_batch": sub}
        return Encoded(self.name, arrays, meta)

    def decode(self, encoded: Encoded) -> JaggedFeatures:
        _expect_codec(encoded, self.name)
        names, batch_size = _check_names_meta(encoded)
        sub = encoded.meta.get("max_sub_batch")
        if not isinstance(sub, int) or not 1 <= sub <= MAX_SUB_BATCH:
            raise ValueError(f"encoded meta 'max_sub_batch' must be in [1, {MAX_SUB_BATCH}], got {sub!r}")
        keys = _array(encoded, "keys", np.uint64)
        key_counts = _array(encoded, "key_counts", np.uint32)
        group_sizes = _array(encoded, "group_sizes", np.int64)
        positions = _array(encoded, "positions", np.uint16)
        num_groups = -(-batch_size // sub) * len(names)
        if len(group_sizes) != num_groups or np.any(group_sizes < 0) or group_sizes.sum() != len(keys):
            raise ValueError(
                f"encoded 'group_sizes' must hold {num_groups} non-negative counts summing to "
                f"len(keys)={len(keys)}"
            )
        if len(key_counts) != len(keys) or key_counts.sum(dtype=np.int64) != len(positions):
            raise ValueError(
                f"encoded 'key_counts' must hold one count per key ({len(keys)}) summing to "
                f"len(positions)={len(positions)}"
            )
        ranks = encoded.arrays.get("ranks")
        if ranks is not None and (ranks.dtype not in (np.uint16, np.uint32) or len(ranks) != len(positions)):
            raise ValueError(
                f"encoded 'ranks' must be uint16/uint32 with {len(positions)} entries, "
                f"got {ranks.dtype} with {len(ranks)}"
            )
        values = np.empty(len(positions), np.uint64)
        offsets = np.empty(len(names) * batch_size + 1, np.int64)
        error = _unique_decode(keys, key_counts, group_sizes, positions,
                               positions if ranks is None else ranks, ranks is not None,
                               batch_size, len(names), sub, values, offsets)
        if error:
            raise ValueError(_DECODE_ERRORS[error])
        return JaggedFeatures(list(names), values, offsets)


@njit(cache=True, nogil=True)
def _half_bits(bits):
    """The float16 bit pattern nearest (ties to even) the float32 whose bit pattern is `bits`."""
    sign = (bits >> np.uint32(16)) & np.uint32(0x8000)
    magnitude = bits & np.uint32(0x7FFFFFFF)
    if magnitude >= np.uint32(0x477FF000):  # from 65520 on: inf (NaN stays a NaN)
        return np.uint16(sign | (np.uint32(0x7E00) if magnitude > np.uint32(0x7F800000) else np.uint32(0x7C00)))
    if magnitude >= np.uint32(0x38800000):  # a normal fp16 (>= 2**-14): drop 13 mantissa bits
        half = (magnitude - np.uint32(0x38000000)) >> np.uint32(13)
        rest = magnitude & np.uint32(0x1FFF)
        if rest > np.uint32(0x1000) or (rest == np.uint32(0x1000) and half & np.uint32(1)):
            half += np.uint32(1)  # a carry into the exponent is still the right number
        return np.uint16(sign | half)
    exponent = magnitude >> np.uint32(23)
    if exponent < np.uint32(102):  # below 2**-25, so nearer 0 than the smallest subnormal
        return np.uint16(sign)
    mantissa = (magnitude & np.uint32(0x7FFFFF)) | np.uint32(0x800000)
    shift = np.uint32(126) - exponent  # 14..24: value = mantissa / 2**shift fp16 subnormal steps
    half = mantissa >> shift
    rest = mantissa & ((np.uint32(1) << shift) - np.uint32(1))
    halfway = np.uint32(1) << (shift - np.uint32(1))
    if rest > halfway or (rest == halfway and half & np.uint32(1)):
        half += np.uint32(1)
    return np.uint16(sign | half)


@njit(cache=True, nogil=True)
def _float_bits(half):
    """The float32 bit pattern of the float16 whose bit pattern is `half` (exact)."""
    half = np.uint32(half)
    sign = (half & np.uint32(0x8000)) << np.uint32(16)
    exponent = (half >> np.uint32(10)) & np.uint32(0x1F)
    mantissa = half & np.uint32(0x3FF)
    if exponent == np.uint32(0x1F):  # inf or NaN
        return sign | np.uint32(0x7F800000) | (mantissa << np.uint32(13))
    if exponent != np.uint32(0):
        return sign | ((exponent + np.uint32(112)) << np.uint32(23)) | (mantissa << np.uint32(13))
    if mantissa == np.uint32(0):
        return sign
    exponent = np.uint32(113)  # a subnormal, mantissa * 2**-24: move the leading 1 to bit 10
    while mantissa < np.uint32(0x400):
        mantissa <<= np.uint32(1)
        exponent -= np.uint32(1)
    return sign | (exponent << np.uint32(23)) | ((mantissa & np.uint32(0x3FF)) << np.uint32(13))


@njit(cache=True, nogil=True, error_model="numpy")
def _fp16_encode(blocks, scale_target, values, scales):
    """Fill uint16 `values` [B, block] with the float16 bits of float32 `blocks` [B, block] times
    their block's scale, min(FLOAT32_MAX, (1 / ||block||_inf) * scale_target) in float32 (0 for a
    zero block), stored in `scales` [B]; False (with the arrays part-filled) if some block's
    max |value| is NaN or inf. Each product is a float32 rounded once to float16, to nearest even.
    """
    num_blocks, block = blocks.shape
    bits_in = blocks.view(np.uint32)
    norm_box = np.empty(1, np.uint32)  # reads the max |value| bit pattern back as a float32
    norm = norm_box.view(np.float32)
    product = np.empty(block, np.float32)
    product_bits = product.view(np.uint32)
    float32_max = np.float32(FLOAT32_MAX)
    for b in range(num_blocks):
        norm_bits = np.uint32(0)  # non-negative floats order as their bit patterns; NaN above inf
        for k in range(block):
            norm_bits = max(norm_bits, bits_in[b, k] & np.uint32(0x7FFFFFFF))
        if norm_bits >= np.uint32(0x7F800000):
            return False
        norm_box[0] = norm_bits
        scale = float32_max  # zero block: 1/0 = inf, capped
        if norm_bits:
            scale = min(np.float32(1.0) / norm[0] * scale_target, float32_max)
        scales[b] = scale
        for k in range(block):
            product[k] = blocks[b, k] * scale
        irregular = np.uint32(0)
        for k in range(block):  # the normal-fp16 rounding, branch-free so that it vectorizes
            bits = product_bits[k]
            magnitude = bits & np.uint32(0x7FFFFFFF)
            irregular |= (((magnitude - np.uint32(0x38800000))  # bit 31 set below 2**-14 ...
                           | (np.uint32(0x477FEFFF) - magnitude))  # ... or from 65520 on
                          & np.uint32(0x80000000))
            half = (magnitude + np.uint32(0xFFF) + ((magnitude >> np.uint32(13)) & np.uint32(1))
                    - np.uint32(0x38000000)) >> np.uint32(13)
            values[b, k] = np.uint16(((bits >> np.uint32(16)) & np.uint32(0x8000)) | half)
        if irregular:  # zeros, fp16 subnormals (or overflow) in this block: round one by one
            for k in range(block):
                values[b, k] = _half_bits(product_bits[k])
    return True


@njit(cache=True, nogil=True, error_model="numpy")
def _fp16_decode(values, scales, rows):
    """Fill float32 `rows` [B, block] with the float16 `values` [B, block] (given as uint16 bits)
    divided in float32 by their block's scale, `scales` [B]."""
    num_blocks, block = values.shape
    rows_bits = rows.view(np.uint32)
    for b in range(num_blocks):
        special = np.uint32(0)
        for k in range(block):  # normal fp16: rebias the exponent, branch-free so that it vectorizes
            half = np.uint32(values[b, k])
            exponent = half & np.uint32(0x7C00)
            special |= (((exponent - np.uint32(0x400)) & np.uint32(0xFFFF8000))
                        | ((exponent + np.uint32(0x400)) & np.uint32(0x8000)))  # exponent 0 or 31
            rows_bits[b, k] = (((half & np.uint32(0x8000)) << np.uint32(16))
                               | (((half & np.uint32(0x7FFF)) << np.uint32(13)) + np.uint32(0x38000000)))
        if special:  # zeros, subnormals, inf or NaN in this block
            for k in range(block):
                rows_bits[b, k] = _float_bits(values[b, k])
        scale = scales[b]
        for k in range(block):
            rows[b, k] = rows[b, k] / scale


def _check_rows(rows: np.ndarray, argument: str) -> np.ndarray:
    rows = np.asarray(rows)
    if rows.dtype != np.float32:
        raise TypeError(f"{argument} must be float32, got {rows.dtype}")
    if rows.ndim != 2:
        raise ValueError(f"{argument} must be 2-D (rows, dim), got shape {rows.shape}")
    return np.ascontiguousarray(rows)


class RawValueCodec:
    """The baseline: float32 rows as they are."""

    name = "none"

    def encode(self, rows: np.ndarray, argument: str = "rows") -> Encoded:
        return Encoded(self.name, {"values": _check_rows(rows, argument)})

    def decode(self, encoded: Encoded) -> np.ndarray:
        _expect_codec(encoded, self.name)
        return _check_rows(_array(encoded, "values", np.float32), "encoded 'values'")


class Fp16BlockCodec:
    """Persia's lossy codec: per block, scale by K/||v||_inf, cast to fp16, divide back.

    Each block's scale travels as a float32 beside the fp16 values. The scale is capped at
    float32's largest value, so blocks of tiny (even subnormal) values or zeros need no special
    case. Each decoded value is within ``||block||_inf * 2**-11`` of the original (fp16 keeps
    11 significant bits); all-zero blocks decode to exact zeros. NaN or inf input is an error.
    """

    name = "fp16"

    def __init__(self, block_size: int | None = None, scale_target: float = FP16_SCALE_TARGET):
        if block_size is not None and (not isinstance(block_size, int) or block_size < 1):
            raise ValueError(f"block_size must be a positive int or None (whole row), got {block_size!r}")
        if not 1.0 <= float(scale_target) <= 32768.0:
            raise ValueError(f"scale_target must be in [1, 32768] to stay inside fp16, got {scale_target!r}")
        self.block_size = block_size
        self.scale_target = float(scale_target)

    def _block(self, dim: int, argument: str) -> int:
        block = dim if self.block_size is None else self.block_size
        if dim and dim % block:
            raise ValueError(f"{argument} dim {dim} is not a multiple of block_size {block}")
        return max(block, 1)

    def encode(self, rows: np.ndarray, argument: str = "rows") -> Encoded:
        rows = _check_rows(rows, argument)
        n, dim = rows.shape
        block = self._block(dim, argument)
        values = np.empty((n * dim // block, block), np.uint16)  # float16 bits
        scales = np.empty(n * (dim // block), np.float32)
        if not _fp16_encode(rows.reshape(-1, block), np.float32(self.scale_target), values, scales):
            bad = int(rows.size - np.count_nonzero(np.isfinite(rows)))
            raise ValueError(f"{argument} holds {bad} NaN/inf values; fp16 encoding needs finite values")
        return Encoded(self.name, {"values": values.view(np.float16).reshape(n, dim),
                                   "scales": scales.reshape(n, dim // block)},
                       {"block_size": block})

    def decode(self, encoded: Encoded) -> np.ndarray:
        _expect_codec(encoded, self.name)
        values = _array(encoded, "values", np.float16)
        scales = _array(encoded, "scales", np.float32)
        block = encoded.meta.get("block_size")
        if values.ndim != 2 or not isinstance(block, int) or block < 1 or values.shape[1] % block:
            raise ValueError(
                f"encoded 'values' shape {values.shape} does not split into blocks of {block!r}"
            )
        n, dim = values.shape
        if scales.shape != (n, dim // block) or not (scales > 0).all() or not np.isfinite(scales).all():
            raise ValueError(f"encoded 'scales' must be finite and > 0 with shape {(n, dim // block)}, "
                             f"got shape {scales.shape}")
        rows = np.empty((n * dim // block, block), np.float32)
        _fp16_decode(np.ascontiguousarray(values).view(np.uint16).reshape(-1, block),
                     np.ascontiguousarray(scales).reshape(-1), rows)
        return rows.reshape(n, dim)


class Bf16ValueCodec:
    """bfloat16 rows: the upper 16 bits of each float32, rounded to nearest even (uint16 on the
    wire, 2 bytes a value, no scale)."""

    name = "bf16"

    def encode(self, rows: np.ndarray, argument: str = "rows") -> Encoded:
        return Encoded(self.name, {"values": bf16_bits(_check_rows(rows, argument))})

    def decode(self, encoded: Encoded) -> np.ndarray:
        _expect_codec(encoded, self.name)
        values = _array(encoded, "values", np.uint16)
        if values.ndim != 2:
            raise ValueError(f"encoded 'values' must be 2-D (rows, dim), got shape {values.shape}")
        return bf16_floats(values)


ID_CODECS = {RawIdCodec.name: RawIdCodec, UniqueIdCodec.name: UniqueIdCodec}
VALUE_CODECS = {RawValueCodec.name: RawValueCodec, Fp16BlockCodec.name: Fp16BlockCodec,
                Bf16ValueCodec.name: Bf16ValueCodec}


def make_id_codec(name: str, **options: Any) -> RawIdCodec | UniqueIdCodec:
    """The ID codec called `name` ("none" or "unique")."""
    if name not in ID_CODECS:
        raise ValueError(f"id codec must be one of {sorted(ID_CODECS)}, got {name!r}")
    return ID_CODECS[name](**options)


def make_value_codec(name: str, **options: Any) -> RawValueCodec | Fp16BlockCodec | Bf16ValueCodec:
    """The value codec called `name` ("none", "fp16" or "bf16")."""
    if name not in VALUE_CODECS:
        raise ValueError(f"value codec must be one of {sorted(VALUE_CODECS)}, got {name!r}")
    return VALUE_CODECS[name](**options)


def with_prefix(encoded: Encoded, prefix: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """`encoded`'s arrays renamed `<prefix>.<name>` plus {codec, meta}, so several encoded
    values travel in one message (see `without_prefix`)."""
    arrays = {f"{prefix}.{name}": array for name, array in encoded.arrays.items()}
    return arrays, {"codec": encoded.codec, "meta": encoded.meta}


def without_prefix(arrays: dict[str, np.ndarray], prefix: str, described: Any) -> Encoded:
    """The Encoded that `with_prefix(encoded, prefix)` put into `arrays` and `described`."""
    if not isinstance(described, dict) or not isinstance(described.get("codec"), str):
        raise ValueError(f"meta for {prefix!r} must be {{'codec': name, 'meta': {{...}}}}, got {described!r}")
    start = prefix + "."
    own = {name[len(start):]: array for name, array in arrays.items() if name.startswith(start)}
    meta = described.get("meta", {})
    if not isinstance(meta, dict):
        raise ValueError(f"meta of {prefix!r} must be a JSON object, got {meta!r}")
    return Encoded(described["codec"], own, meta)


NARROW_ROW_BLOCK = 16  # rows narrower than half this travel in blocks of this many values


def encode_rows(codec: RawValueCodec | Fp16BlockCodec, rows: np.ndarray, argument: str = "rows") -> Encoded:
    """`codec.encode` for rows of any width: rows narrower than 8 values (the dim-1 wide
    weights) are cut into blocks of 16 values first, so fp16 carries one scale per 16 values
    instead of one per value. `decode_rows` restores the shape."""
    rows = _check_rows(rows, argument)
    n, dim = rows.shape
    if codec.name != "none" and dim < NARROW_ROW_BLOCK // 2:
        flat = np.zeros(-(-rows.size // NARROW_ROW_BLOCK) * NARROW_ROW_BLOCK, np.float32)
        flat[:rows.size] = rows.ravel()
        rows = flat.reshape(-1, NARROW_ROW_BLOCK)
    encoded = codec.encode(rows, argument)
    return Encoded(encoded.codec, encoded.arrays, {**encoded.meta, "rows": [n, dim]})


def decode_rows(codec: RawValueCodec | Fp16BlockCodec, encoded: Encoded) -> np.ndarray:
    """The [n, dim] float32 rows `encode_rows` encoded."""
    shape = encoded.meta.get("rows")
    if not (isinstance(shape, list) and len(shape) == 2 and all(isinstance(v, int) and v >= 0 for v in shape)):
        raise ValueError(f"encoded meta 'rows' must be [n, dim], got {shape!r}")
    values = codec.decode(encoded)
    n, dim = shape
    if values.size < n * dim:
        raise ValueError(f"encoded values hold {values.size} numbers, fewer than rows {shape} need")
    return values.reshape(-1)[:n * dim].reshape(n, dim) if values.shape != (n, dim) else values
