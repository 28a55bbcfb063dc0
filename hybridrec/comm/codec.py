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
    divided back on decode; only the block's L-infinity norm travels beside it.

Every `encode` returns an `Encoded` (named arrays + small JSON-able metadata) whose `nbytes`
is the payload it puts on the wire; `Encoded.arrays` are the frames `comm.transport` sends.
All work is vectorised numpy (IDs) or torch ops (fp16 casts, which numpy does slowly): no
Python loop per ID or per row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hybridrec.data.batch import JaggedFeatures

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


class UniqueIdCodec:
    """Persia's lossless ID codec: unique keys per feature + uint16 sample positions.

    Wire arrays (groups are (sub-batch, feature) pairs, sub-batch-major):
      ``keys`` uint64[U]: each group's unique keys, ascending;
      ``key_counts`` uint32[U]: occurrences of each key in its group;
      ``group_sizes`` int64[G]: how many unique keys each group has;
      ``positions`` uint16[N]: grouped by key, the sample (within its sub-batch) of every
      occurrence, ascending;
      ``ranks`` uint16|uint32[N] (only when some bag is not in ascending key order): each
      occurrence's index inside its bag, so any bag order round-trips exactly.
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
        num_groups = -(-batch_size // sub) * num_features
        num_bags = num_features * batch_size
        bag_lengths = np.diff(offsets)
        sample_of_bag = np.tile(np.arange(batch_size, dtype=np.int64), num_features)
        feature_of_bag = np.repeat(np.arange(num_features, dtype=np.int64), batch_size)
        group_of_bag = (sample_of_bag // sub) * num_features + feature_of_bag
        bag_of_occurrence = np.repeat(np.arange(num_bags, dtype=np.int64), bag_lengths)
        group_of_occurrence = group_of_bag[bag_of_occurrence]

        order = np.lexsort((values, group_of_occurrence))  # stable: samples stay ascending
        sorted_keys = values[order]
        sorted_groups = group_of_occurrence[order]
        is_first = np.ones(len(values), dtype=bool)
        is_first[1:] = (sorted_keys[1:] != sorted_keys[:-1]) | (sorted_groups[1:] != sorted_groups[:-1])
        first = np.flatnonzero(is_first)
        arrays = {
            "keys": sorted_keys[first],
            "key_counts": np.diff(np.append(first, len(values))).astype(np.uint32),
            "group_sizes": np.bincount(sorted_groups[first], minlength=num_groups).astype(np.int64),
            "positions": (sample_of_bag[bag_of_occurrence[order]] % sub).astype(np.uint16),
        }
        same_bag = bag_of_occurrence[1:] == bag_of_occurrence[:-1]
        if np.any(same_bag & (values[1:] < values[:-1])):
            rank_in_bag = np.arange(len(values), dtype=np.int64) - offsets[bag_of_occurrence]
            rank_dtype = np.uint16 if bag_lengths.max() <= 65536 else np.uint32
            arrays["ranks"] = rank_in_bag[order].astype(rank_dtype)
        meta = {"names": list(features.names), "batch_size": batch_size, "max_sub_batch": sub}
        return Encoded(self.name, arrays, meta)

    def decode(self, encoded: Encoded) -> JaggedFeatures:
        _expect_codec(encoded, self.name)
        names, batch_size = _check_names_meta(encoded)
        sub = encoded.meta.get("max_sub_batch")
        if not isinstance(sub, int) or not 1 <= sub <= MAX_SUB_BATCH:
            raise ValueError(f"encoded meta 'max_sub_batch' must be in [1, {MAX_SUB_BATCH}], got {sub!r}")
        keys = _array(encoded, "keys", np.uint64)
        key_counts = _array(encoded, "key_counts", np.uint32).astype(np.int64)
        group_sizes = _array(encoded, "group_sizes", np.int64)
        positions = _array(encoded, "positions", np.uint16).astype(np.int64)
        num_features = len(names)
        num_groups = -(-batch_size // sub) * num_features
        if len(group_sizes) != num_groups or np.any(group_sizes < 0) or group_sizes.sum() != len(keys):
            raise ValueError(
                f"encoded 'group_sizes' must hold {num_groups} non-negative counts summing to "
                f"len(keys)={len(keys)}"
            )
        if len(key_counts) != len(keys) or key_counts.sum() != len(positions):
            raise ValueError(
                f"encoded 'key_counts' must hold one count per key ({len(keys)}) summing to "
                f"len(positions)={len(positions)}"
            )
        group_of_occurrence = np.repeat(np.repeat(np.arange(num_groups), group_sizes), key_counts)
        sample = (group_of_occurrence // num_features) * sub + positions
        if np.any(positions >= sub) or np.any(sample >= batch_size):
            raise ValueError(f"encoded 'positions' point past the batch of {batch_size} samples")
        bag = (group_of_occurrence % num_features) * batch_size + sample
        bag_lengths = np.bincount(bag, minlength=num_features * batch_size)
        offsets = np.zeros(num_features * batch_size + 1, dtype=np.int64)
        np.cumsum(bag_lengths, out=offsets[1:])
        occurrence_keys = np.repeat(keys, key_counts)
        if "ranks" in encoded.arrays:
            ranks = np.asarray(encoded.arrays["ranks"])
            if ranks.dtype not in (np.uint16, np.uint32) or len(ranks) != len(positions):
                raise ValueError(
                    f"encoded 'ranks' must be uint16/uint32 with {len(positions)} entries, "
                    f"got {ranks.dtype} with {len(ranks)}"
                )
            ranks = ranks.astype(np.int64)
            if np.any(ranks >= bag_lengths[bag]):
                raise ValueError("encoded 'ranks' point past the end of their bag")
            slot = offsets[bag] + ranks
            if len(slot) and np.bincount(slot, minlength=len(slot)).max() > 1:
                raise ValueError("encoded 'ranks' put two IDs in the same place of a bag")
            values = np.empty(len(positions), dtype=np.uint64)
            values[slot] = occurrence_keys
        else:  # every bag was in ascending key order: a stable sort by bag restores it
            values = occurrence_keys[np.argsort(bag, kind="stable")]
        return JaggedFeatures(list(names), values, offsets)


def _tensor(array: np.ndarray) -> torch.Tensor:
    """A torch view of a contiguous array (a copy only if it is read-only, which torch refuses)."""
    return torch.from_numpy(array if array.flags.writeable else array.copy())


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
        blocks = _tensor(rows).view(n, dim // block, block)
        norms = blocks.abs().amax(dim=2) if rows.size else torch.zeros(n, dim // block)
        if not torch.isfinite(norms).all():  # amax propagates NaN and inf
            bad = int(rows.size - np.count_nonzero(np.isfinite(rows)))
            raise ValueError(f"{argument} holds {bad} NaN/inf values; fp16 encoding needs finite values")
        scales = (self.scale_target / norms).clamp_(max=FLOAT32_MAX)  # zero blocks: K/0 = inf -> max
        values = torch.empty((n, dim // block, block), dtype=torch.float16)
        torch.mul(blocks, scales.unsqueeze(2), out=values)  # computed in fp32, rounded once to fp16
        return Encoded(self.name, {"values": values.view(n, dim).numpy(), "scales": scales.numpy()},
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
        blocks = _tensor(values).view(n, dim // block, block)
        return torch.div(blocks, _tensor(scales).unsqueeze(2)).view(n, dim).numpy()


ID_CODECS = {RawIdCodec.name: RawIdCodec, UniqueIdCodec.name: UniqueIdCodec}
VALUE_CODECS = {RawValueCodec.name: RawValueCodec, Fp16BlockCodec.name: Fp16BlockCodec}


def make_id_codec(name: str, **options: Any) -> RawIdCodec | UniqueIdCodec:
    """The ID codec called `name` ("none" or "unique")."""
    if name not in ID_CODECS:
        raise ValueError(f"id codec must be one of {sorted(ID_CODECS)}, got {name!r}")
    return ID_CODECS[name](**options)


def make_value_codec(name: str, **options: Any) -> RawValueCodec | Fp16BlockCodec:
    """The value codec called `name` ("none" or "fp16")."""
    if name not in VALUE_CODECS:
        raise ValueError(f"value codec must be one of {sorted(VALUE_CODECS)}, got {name!r}")
    return VALUE_CODECS[name](**options)
