"""Synthetic CTR data with a planted ground-truth model, so the best achievable AUC is known.

Every field draws Zipf-distributed ranks over its vocabulary. Rank -> token is a bijective
32-bit mix salted by (seed, field) and token -> uint64 ID is the reader's own hash
(`kernels.hex_token_key`), so IDs are spread over the whole uint64 space, never collide
across fields, and a file written by `write_synthetic` reads back (with `CriteoReader` or
the returned `TabularSchema`) into exactly the batches `SyntheticReader` yields.

Dense features are counts c >= 0 (geometric, a different mean per column) delivered as
log(1 + c), like Criteo's. Labels are Bernoulli(sigmoid(logit)) with the planted
logit = bias + sum over single-ID fields of w(ID) + sum over multi-hot fields of the mean
w(ID) of the sample's IDs + sum_j v_j * (dense_j - log(1 + mean count of column j)), where w and v are hashes of (seed, ID) and
(seed, j) scaled to a given standard deviation. `planted_probabilities` evaluates that model
on any batch and `planted_auc` gives its AUC on generated (e.g. held-out) rows.

Rows are generated in blocks of BLOCK_ROWS seeded by (seed, block index), so row r is the
same whatever the batch size, rank split or first row asked for; rank r gets every
world_size-th block.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
from numba import njit

from hybridrec.data import kernels
from hybridrec.data.batch import Batch, JaggedFeatures, rebatch
from hybridrec.data.tabular import TabularSchema, check_sharding

BLOCK_ROWS = 4096
_WEIGHT_SALT = np.uint64(0x5851F42D4C957F2D)
_DENSE_SALT = np.uint64(0x14057B7EF767814F)
_FIELD_SALT = np.uint64(0x2545F4914F6CDD1D)
_UNIT = 1.0 / 18446744073709551616.0  # 2**-64


@dataclass(frozen=True)
class SyntheticConfig:
    """Shape of the synthetic data and strength of its planted model."""

    n_categorical: int = 26
    n_dense: int = 13
    n_multi_hot: int = 0
    multi_hot_max_length: int = 5
    vocab_size: int = 100_000
    zipf_exponent: float = 1.05
    id_weight_std: float = 0.2
    dense_weight_std: float = 0.3
    bias: float = -1.5

    def __post_init__(self) -> None:
        for name in ("n_categorical", "n_dense", "n_multi_hot", "multi_hot_max_length",
                     "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if self.n_categorical + self.n_multi_hot == 0:
            raise ValueError("n_categorical + n_multi_hot must be >= 1 (no sparse fields)")
        if not 1 <= self.vocab_size <= 1 << 32:
            raise ValueError(f"vocab_size must be in [1, 2**32], got {self.vocab_size}")
        if self.n_multi_hot and self.multi_hot_max_length < 1:
            raise ValueError(f"multi_hot_max_length must be >= 1 with multi-hot fields, got "
                             f"{self.multi_hot_max_length}")
        if not self.zipf_exponent > 0:
            raise ValueError(f"zipf_exponent must be > 0, got {self.zipf_exponent!r}")
        for name in ("id_weight_std", "dense_weight_std"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")

    @property
    def n_sparse(self) -> int:
        return self.n_categorical + self.n_multi_hot

    @property
    def dense_names(self) -> tuple[str, ...]:
        return tuple(f"I{i}" for i in range(1, self.n_dense + 1))

    @property
    def sparse_names(self) -> tuple[str, ...]:
        return (tuple(f"C{i}" for i in range(1, self.n_categorical + 1))
                + tuple(f"M{i}" for i in range(1, self.n_multi_hot + 1)))

    def schema(self) -> TabularSchema:
        """How a file written by `write_synthetic` with this config is read back."""
        categorical = self.sparse_names[:self.n_categorical]
        multi = self.sparse_names[self.n_categorical:]
        return TabularSchema(
            labels=("label",), dense=self.dense_names, categorical=categorical,
            multi_categorical=multi, multi_separator=",", delimiter="\t", header=False,
            column_names=("label",) + self.dense_names + categorical + multi,
            dense_transform="log1p", standardize=False)


CRITEO_LIKE = SyntheticConfig()
PRESETS = {"criteo-like": CRITEO_LIKE}


@njit(cache=True, nogil=True)
def _permute32(ranks, salts):
    """Bijective 32-bit mix (murmur3 fmix32) of rank ^ salt: the token of each rank."""
    tokens = np.empty(ranks.shape[0], dtype=np.uint32)
    for i in range(ranks.shape[0]):
        x = (np.uint64(ranks[i]) ^ np.uint64(salts[i])) & np.uint64(0xFFFFFFFF)
        x ^= x >> np.uint64(16)
        x = (x * np.uint64(0x85EBCA6B)) & np.uint64(0xFFFFFFFF)
        x ^= x >> np.uint64(13)
        x = (x * np.uint64(0xC2B2AE35)) & np.uint64(0xFFFFFFFF)
        x ^= x >> np.uint64(16)
        tokens[i] = x
    return tokens


@njit(cache=True, nogil=True)
def _signed_units(keys, salt):
    """A hash of each key mapped to a uniform number in [-sqrt(3), sqrt(3)) (variance 1)."""
    out = np.empty(keys.shape[0], dtype=np.float64)
    for i in range(keys.shape[0]):
        u = kernels.mix64(keys[i] ^ salt) * _UNIT
        out[i] = (2.0 * u - 1.0) * 1.7320508075688772
    return out


def _seed_salt(seed: int, salt: np.uint64) -> np.uint64:
    # numba hands uint64 results back as Python ints: keep the numpy type for later calls
    return np.uint64(kernels.mix64(np.uint64(seed & 0xFFFFFFFFFFFFFFFF) ^ salt))


def _dense_typical_values(n_dense: int) -> tuple[np.ndarray, np.ndarray]:
    """Per dense column: the mean count, and log(1 + mean) which centres the planted term."""
    means = np.exp(np.linspace(0.0, 6.0, n_dense))
    return means, np.log1p(means)


def _zipf_ranks(rng: np.random.Generator, size: int, vocab: int, exponent: float) -> np.ndarray:
    """Ranks in [0, vocab) with P(rank k) ~ (k+1)**-exponent (inverse CDF of the continuous
    power law, so any vocabulary size costs the same)."""
    u = rng.random(size)
    if abs(exponent - 1.0) < 1e-9:
        x = np.exp(u * math.log(vocab + 1.0))
    else:
        power = 1.0 - exponent
        x = ((math.pow(vocab + 1.0, power) - 1.0) * u + 1.0) ** (1.0 / power)
    return np.minimum(x.astype(np.int64) - 1, vocab - 1).clip(0)


@dataclass
class _Block:
    """One generated block: the batch plus the raw tokens and counts a writer needs."""

    batch: Batch
    tokens: np.ndarray  # uint32, feature-major like batch.sparse.values
    counts: np.ndarray  # int64 (B, n_dense)


def _generate_block(config: SyntheticConfig, seed: int, block: int) -> _Block:
    rng = np.random.default_rng([seed, block])
    rows = BLOCK_ROWS
    lengths = np.ones((config.n_sparse, rows), dtype=np.int64)
    if config.n_multi_hot:
        lengths[config.n_categorical:] = rng.integers(
            0, config.multi_hot_max_length + 1, size=(config.n_multi_hot, rows))
    offsets = np.zeros(lengths.size + 1, dtype=np.int64)
    np.cumsum(lengths.ravel(), out=offsets[1:])
    field_of_id = np.repeat(np.arange(config.n_sparse, dtype=np.int64), lengths.sum(axis=1))
    ranks = _zipf_ranks(rng, len(field_of_id), config.vocab_size, config.zipf_exponent)
    field_salts = np.array([kernels.mix64(_seed_salt(seed, _FIELD_SALT) + np.uint64(f))
                            for f in range(config.n_sparse)], dtype=np.uint64)
    tokens = _permute32(ranks, field_salts[field_of_id])
    keys = kernels.hex_token_keys(tokens, field_of_id)
    column_means, _ = _dense_typical_values(config.n_dense)
    counts = rng.geometric(1.0 / (1.0 + column_means), size=(rows, config.n_dense)) - 1
    dense = np.log1p(counts.astype(np.float64)).astype(np.float32)
    sparse = JaggedFeatures(list(config.sparse_names), keys, offsets)
    sample_ids = np.arange(block * rows, (block + 1) * rows, dtype=np.uint64)
    batch = Batch(sparse, dense, np.zeros((rows, 1), np.float32), sample_ids)
    probabilities = planted_probabilities(batch, config, seed)
    batch.labels[:, 0] = rng.random(rows) < probabilities
    return _Block(batch, tokens, counts.astype(np.int64))


def planted_logits(batch: Batch, config: SyntheticConfig, seed: int) -> np.ndarray:
    """The planted model's logit of every sample of `batch` (float64, shape (B,))."""
    rows = batch.batch_size
    sparse = batch.sparse
    if sparse.names != list(config.sparse_names):
        raise ValueError(f"batch features {sparse.names} do not match the config's "
                         f"{list(config.sparse_names)}")
    lengths = sparse.lengths()
    weights = config.id_weight_std * _signed_units(sparse.values,
                                                   _seed_salt(seed, _WEIGHT_SALT))
    per_bag = np.bincount(np.repeat(np.arange(lengths.size), lengths.ravel()),
                          weights=weights, minlength=lengths.size).reshape(lengths.shape)
    per_bag[config.n_categorical:] /= np.maximum(lengths[config.n_categorical:], 1)
    dense_weights = config.dense_weight_std * _signed_units(
        np.arange(config.n_dense, dtype=np.uint64), _seed_salt(seed, _DENSE_SALT))
    if rows == 0:
        return np.zeros(0)
    _, centre = _dense_typical_values(config.n_dense)
    return config.bias + per_bag.sum(axis=0) + (batch.dense - centre) @ dense_weights


def planted_probabilities(batch: Batch, config: SyntheticConfig, seed: int) -> np.ndarray:
    """The planted model's click probability for every sample of `batch` (float64, (B,))."""
    return 1.0 / (1.0 + np.exp(-planted_logits(batch, config, seed)))


@dataclass
class SyntheticReader:
    """Batches of synthetic rows first_row .. first_row+rows-1 (see the module docstring).
    `config` is a SyntheticConfig or a preset name ("criteo-like")."""

    config: SyntheticConfig | str = CRITEO_LIKE
    rows: int = 100_000
    batch_size: int = 4096
    _: dataclasses.KW_ONLY
    seed: int = 0
    first_row: int = 0
    rank: int = 0
    world_size: int = 1
    drop_last: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.config, str):
            if self.config not in PRESETS:
                raise ValueError(f"config preset must be one of {sorted(PRESETS)}, got "
                                 f"{self.config!r}")
            self.config = PRESETS[self.config]
        if not isinstance(self.config, SyntheticConfig):
            raise TypeError(f"config must be a SyntheticConfig or preset name, got "
                            f"{type(self.config).__name__}")
        check_sharding(self.batch_size, self.rank, self.world_size)
        for name in ("rows", "first_row", "seed"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")

    def count_rows(self) -> int:
        return self.rows

    def blocks(self) -> Iterator[_Block]:
        """This rank's generated blocks, trimmed to the requested rows."""
        stop = self.first_row + self.rows
        for block in range(self.first_row // BLOCK_ROWS, -(-stop // BLOCK_ROWS)):
            if block % self.world_size != self.rank:
                continue
            generated = _generate_block(self.config, self.seed, block)
            low = max(self.first_row - block * BLOCK_ROWS, 0)
            high = min(stop - block * BLOCK_ROWS, BLOCK_ROWS)
            if (low, high) != (0, BLOCK_ROWS):
                batch = generated.batch
                sliced = batch.slice_rows(low, high)
                tokens = _slice_tokens(batch, generated.tokens, low, high)
                generated = _Block(sliced, tokens, generated.counts[low:high])
            yield generated

    def __iter__(self) -> Iterator[Batch]:
        return rebatch((block.batch for block in self.blocks()), self.batch_size,
                       self.drop_last)


def _slice_tokens(batch: Batch, tokens: np.ndarray, low: int, high: int) -> np.ndarray:
    """The tokens of rows low..high-1, in the feature-major order of batch.slice_rows."""
    rows = batch.batch_size
    offsets = batch.sparse.offsets
    return np.concatenate([tokens[offsets[f * rows + low]: offsets[f * rows + high]]
                           for f in range(batch.sparse.num_features)])


def planted_auc(config: SyntheticConfig = CRITEO_LIKE, rows: int = 50_000, *, seed: int = 0,
                first_row: int = 0) -> float:
    """AUC of the planted model against the sampled labels of rows first_row.. (e.g. the
    held-out rows after a training prefix): the best AUC a learned model can expect."""
    from hybridrec.metrics import auc

    labels, scores = [], []
    for batch in SyntheticReader(config, rows, BLOCK_ROWS, seed=seed, first_row=first_row):
        labels.append(batch.labels[:, 0])
        scores.append(planted_probabilities(batch, config, seed))
    return float(auc(np.concatenate(labels), np.concatenate(scores)))


@njit(cache=True, nogil=True)
def _write_decimal(out, pos, value):
    digits = 1
    rest = value // 10
    while rest > 0:
        digits += 1
        rest //= 10
    for i in range(digits - 1, -1, -1):
        out[pos + i] = 48 + value % 10
        value //= 10
    return pos + digits


@njit(cache=True, nogil=True)
def _format_tsv(labels, counts, tokens, offsets, out):
    """Writes rows as label<TAB>counts...<TAB>8-hex tokens (multi-hot joined by ',')."""
    rows = labels.shape[0]
    fields = (offsets.shape[0] - 1) // rows
    pos = 0
    for b in range(rows):
        out[pos] = 48 + labels[b]
        pos += 1
        for j in range(counts.shape[1]):
            out[pos] = 9
            pos = _write_decimal(out, pos + 1, counts[b, j])
        for f in range(fields):
            out[pos] = 9
            pos += 1
            for k in range(offsets[f * rows + b], offsets[f * rows + b + 1]):
                if k > offsets[f * rows + b]:
                    out[pos] = 44
                    pos += 1
                token = np.int64(tokens[k])
                for i in range(8):
                    nibble = (token >> (28 - 4 * i)) & 15
                    out[pos + i] = 48 + nibble if nibble < 10 else 87 + nibble
                pos += 8
        out[pos] = 10
        pos += 1
    return pos


def write_synthetic(path: str | Path, rows: int, seed: int = 0,
                    config: SyntheticConfig | str = CRITEO_LIKE, first_row: int = 0) -> TabularSchema:
    """Writes `rows` synthetic rows (rows first_row.. of the generator) to `path` as a headerless
    TSV in Criteo's layout (label, counts I1.., 8-hex tokens C1.., multi-hot M1.. joined by ','),
    block by block. With the Criteo-like preset the file is a valid Criteo file. Returns the
    schema that reads it back (with `DelimitedTextReader`) into the batches `SyntheticReader`
    yields."""
    path = Path(path)
    if path.suffix.lower() in (".parquet", ".pq"):
        raise ValueError(f"write_synthetic writes TSV; got the Parquet path {str(path)!r}")
    with open(path, "wb") as handle:
        for text in synthetic_tsv(rows, seed, config, first_row):
            handle.write(text)
    return SyntheticReader(config, rows, BLOCK_ROWS, seed=seed).config.schema()


def synthetic_tsv(rows: int, seed: int = 0, config: SyntheticConfig | str = CRITEO_LIKE,
                  first_row: int = 0) -> Iterator[bytes]:
    """The lines `write_synthetic` writes, as bytes of whole lines, a generator block at a time."""
    reader = SyntheticReader(config, rows, BLOCK_ROWS, seed=seed, first_row=first_row)
    for block in reader.blocks():
        batch = block.batch
        if not len(batch):
            continue
        width = 2 + 21 * reader.config.n_dense + reader.config.n_sparse
        out = np.empty(len(batch) * width + 9 * len(block.tokens), dtype=np.uint8)
        used = _format_tsv(batch.labels[:, 0].astype(np.int64), block.counts,
                           block.tokens, batch.sparse.offsets, out)
        yield out[:used].tobytes()


def criteo_like(**overrides) -> SyntheticConfig:
    """The Criteo-like preset (26 categorical, 13 dense fields) with some fields changed."""
    return dataclasses.replace(CRITEO_LIKE, **overrides)
