"""Synthetic benchmark inputs: Zipf-distributed uint64 IDs and Criteo-like dense features.

Every ID feature is one-hot. A key is drawn as a Zipf(exponent) rank and spread over the
whole uint64 space by a bijective 64-bit mixer salted per field, so hot keys are not small
integers and fields do not share keys. Peers that need a dense index range get the same keys
pre-mapped to [0, n_distinct) per field (a perfect dictionary, which favours them).
All batches are generated up front so that generation is never timed.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

import numpy as np

from hybridrec.mixing import mix64_array

from hybridrec.benchmarks.timing import TimingPlan, number_above, positive_int, timing_plan_from_args

_GOLDEN_GAMMA = np.uint64(0x9E3779B97F4A7C15)


def mix64(values: np.ndarray, salt: int | np.ndarray) -> np.ndarray:
    """Bijective uint64 -> uint64 mixer (SplitMix64 finalizer after adding a salted offset).

    Each step (add a constant, xor-shift, multiply by an odd constant, all mod 2**64) is
    invertible, so distinct inputs give distinct outputs for a fixed salt. `salt` is an int
    in [0, 2**64) or a uint64 array broadcastable against `values` (one salt per field).
    """
    if isinstance(salt, (int, np.integer)) and not 0 <= int(salt) < 2**64:
        raise ValueError(f"salt must be in [0, 2**64), got {salt}")
    salts = np.asarray(salt, dtype=np.uint64)
    with np.errstate(over="ignore"):  # wrapping mod 2**64 is the point
        offset = np.ascontiguousarray(np.asarray(values, dtype=np.uint64) + salts * _GOLDEN_GAMMA)
    mixed = np.empty_like(offset)
    mix64_array(offset.reshape(-1), mixed.reshape(-1))
    return mixed


@dataclass(frozen=True)
class WorkloadShape:
    """Size of the sparse part of a benchmark: `fields` one-hot ID features of width `dim`
    per sample, `batch_size` samples per batch, Zipf(`zipf_exponent`) keys, tables of
    `capacity` rows."""

    batch_size: int
    fields: int
    dim: int
    capacity: int
    zipf_exponent: float = 1.2
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("batch_size", "fields", "dim", "capacity"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value}")
        if not self.zipf_exponent > 1.0:
            raise ValueError(f"zipf_exponent must be > 1.0, got {self.zipf_exponent}")

    @property
    def feature_names(self) -> list[str]:
        return [f"f{field}" for field in range(self.fields)]

    @property
    def lookups_per_batch(self) -> int:
        return self.batch_size * self.fields


_zipf_exponent = number_above(1.0)  # numpy's Zipf sampler needs an exponent > 1


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the workload options shared by the embedding and end-to-end benchmarks."""
    parser.add_argument("--batch-size", type=positive_int, default=4096,
                        help="samples per batch (default 4096)")
    parser.add_argument("--fields", type=positive_int, default=26,
                        help="one-hot ID features per sample, one table each (default 26)")
    parser.add_argument("--dim", type=positive_int, default=16,
                        help="embedding width (default 16)")
    parser.add_argument("--capacity", type=positive_int, default=1_000_000,
                        help="rows per table for every system (default 1000000)")
    parser.add_argument("--zipf", type=_zipf_exponent, default=1.2, dest="zipf_exponent",
                        help="Zipf exponent of the key ranks, > 1 (default 1.2)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")


def parse_benchmark_arguments(parser: argparse.ArgumentParser, argv: list[str] | None,
                              ) -> tuple[argparse.Namespace, WorkloadShape, TimingPlan]:
    """Parses a benchmark's command line into (args, workload shape, timing plan)."""
    args = parser.parse_args(argv)
    return args, workload_shape_from_args(args), timing_plan_from_args(args)


def workload_shape_from_args(args: argparse.Namespace) -> WorkloadShape:
    return WorkloadShape(batch_size=args.batch_size, fields=args.fields, dim=args.dim,
                         capacity=args.capacity, zipf_exponent=args.zipf_exponent,
                         seed=args.seed)


@dataclass(frozen=True)
class SparseBatch:
    """One batch of one-hot IDs, field-major: `keys[f, b]` is sample b's key in field f;
    `dense_ids[f, b]` is the same key as an index in [0, capacity) for the peers."""

    keys: np.ndarray  # uint64 [fields, batch_size]
    dense_ids: np.ndarray  # int64 [fields, batch_size]


def zipf_keys(rng: np.random.Generator, shape: WorkloadShape, n_batches: int) -> np.ndarray:
    """uint64 keys [n_batches, fields, batch_size]: Zipf ranks mixed with a per-field salt."""
    ranks = rng.zipf(shape.zipf_exponent, size=(n_batches, shape.fields, shape.batch_size))
    field_salts = np.arange(1, shape.fields + 1, dtype=np.uint64)[None, :, None]
    return mix64(ranks.astype(np.uint64), salt=field_salts)


def dense_ids_per_field(keys: np.ndarray, capacity: int) -> np.ndarray:
    """Maps each field's distinct keys to 0..n_distinct-1 (over all batches at once).

    Raises if a field has more distinct keys than `capacity`, since the peers' tables could
    then not hold every key without collisions.
    """
    n_batches, n_fields, batch_size = keys.shape
    dense = np.empty(keys.shape, dtype=np.int64)
    for field in range(n_fields):  # one vectorised np.unique per field, not per ID
        distinct, inverse = np.unique(keys[:, field, :], return_inverse=True)
        if len(distinct) > capacity:
            raise ValueError(
                f"capacity={capacity} is smaller than the {len(distinct)} distinct keys of "
                f"field {field} in this workload; raise capacity or use fewer batches")
        dense[:, field, :] = inverse.reshape(n_batches, batch_size)
    return dense


def make_sparse_batches(shape: WorkloadShape, n_batches: int) -> list[SparseBatch]:
    """`n_batches` independent batches of one-hot Zipf keys, with the peers' dense ids."""
    if n_batches < 1:
        raise ValueError(f"n_batches must be >= 1, got {n_batches}")
    rng = np.random.default_rng(shape.seed)
    keys = zipf_keys(rng, shape, n_batches)
    dense = dense_ids_per_field(keys, shape.capacity)
    return [SparseBatch(keys=keys[i], dense_ids=dense[i]) for i in range(n_batches)]


@dataclass(frozen=True)
class DenseBatch:
    """Criteo-like continuous features and click labels for one batch."""

    dense: np.ndarray  # float32 [batch_size, n_dense], log1p of heavy-tailed counts
    labels: np.ndarray  # float32 [batch_size, 1], 0/1


def make_dense_batches(batch_size: int, n_dense: int, n_batches: int, *, seed: int = 0,
                       click_rate: float = 0.25) -> list[DenseBatch]:
    """Dense features as log1p of log-normal counts (Criteo's usual preprocessing) and
    Bernoulli(click_rate) labels; for throughput only, not for judging model quality."""
    if batch_size < 1 or n_dense < 1 or n_batches < 1:
        raise ValueError(
            f"batch_size, n_dense and n_batches must be >= 1, got {batch_size}, {n_dense}, "
            f"{n_batches}")
    if not 0.0 < click_rate < 1.0:
        raise ValueError(f"click_rate must be in (0, 1), got {click_rate}")
    rng = np.random.default_rng(seed + 1)
    counts = rng.lognormal(mean=1.0, sigma=1.5, size=(n_batches, batch_size, n_dense))
    dense = np.log1p(np.floor(counts)).astype(np.float32)
    labels = (rng.random((n_batches, batch_size, 1)) < click_rate).astype(np.float32)
    return [DenseBatch(dense=dense[i], labels=labels[i]) for i in range(n_batches)]
