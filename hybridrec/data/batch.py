"""The one batch type every package speaks: jagged uint64 ID features plus dense, labels, ids.

`JaggedFeatures` is feature-major like TorchRec's KeyedJaggedTensor: with B samples and
F = len(names), the IDs of feature f for sample b are
`values[offsets[f*B+b] : offsets[f*B+b+1]]`. `Batch` adds dense float32 features (B, n_dense),
float32 labels (B, n_tasks) and uint64 sample ids (B,). Arrays stay numpy (torch handles
uint64 poorly); `Batch.to_torch()` gives the dense side as tensors.

Row slicing, concatenation and `rebatch` (cut any stream of batches into batches of an exact
size) are here because every reader needs them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

import numpy as np


def check_array(name: str, array: object, dtype: type, ndim: int) -> None:
    """Raises TypeError/ValueError naming `name` unless `array` is a numpy array (a subclass such as
    np.memmap included) of `dtype` with `ndim` dimensions."""
    if not isinstance(array, np.ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray of {np.dtype(dtype).name}, "
                        f"got {type(array).__name__}")
    if array.dtype != dtype:
        raise TypeError(f"{name} must have dtype {np.dtype(dtype).name}, got {array.dtype}")
    if array.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-dimensional, got shape {array.shape}")


@dataclass
class JaggedFeatures:
    """Feature-major jagged uint64 IDs of F named features for B samples."""

    names: list[str]
    values: np.ndarray  # uint64[total IDs]
    offsets: np.ndarray  # int64[F*B + 1]

    @property
    def num_features(self) -> int:
        return len(self.names)

    @property
    def batch_size(self) -> int:
        """B, derived from len(offsets) == F*B + 1 (0 when there are no features)."""
        if not self.names:
            return 0
        return (len(self.offsets) - 1) // len(self.names)

    def validate(self, batch_size: int | None = None) -> "JaggedFeatures":
        """Raises TypeError/ValueError naming the broken invariant; returns self."""
        if not isinstance(self.names, list) or not all(isinstance(n, str) for n in self.names):
            raise TypeError(f"names must be a list of str, got {self.names!r}")
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"names must be unique, got {self.names!r}")
        check_array("values", self.values, np.uint64, 1)
        check_array("offsets", self.offsets, np.int64, 1)
        n_features = len(self.names)
        if len(self.offsets) == 0 or self.offsets[0] != 0:
            raise ValueError(f"offsets must start with 0, got {self.offsets[:1]!r}")
        if n_features == 0:
            if len(self.offsets) != 1 or len(self.values) != 0:
                raise ValueError("with no features, offsets must be [0] and values empty")
            return self
        if (len(self.offsets) - 1) % n_features != 0:
            raise ValueError(f"len(offsets) - 1 = {len(self.offsets) - 1} is not a multiple "
                             f"of the {n_features} features")
        if batch_size is not None and self.batch_size != batch_size:
            raise ValueError(f"offsets describe {self.batch_size} samples per feature, "
                             f"expected batch size {batch_size}")
        steps = np.diff(self.offsets)
        if steps.size and steps.min() < 0:
            position = int(np.argmax(steps < 0))
            raise ValueError(f"offsets must be non-decreasing, offsets[{position + 1}] = "
                             f"{self.offsets[position + 1]} < offsets[{position}] = "
                             f"{self.offsets[position]}")
        if self.offsets[-1] != len(self.values):
            raise ValueError(f"offsets[-1] = {self.offsets[-1]} must equal "
                             f"len(values) = {len(self.values)}")
        return self

    def _index(self, name: str) -> int:
        try:
            return self.names.index(name)
        except ValueError:
            raise KeyError(f"feature {name!r} is not in this batch; features are "
                           f"{self.names!r}") from None

    def feature(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """(values, offsets) of one feature, offsets rebased to 0 (length B+1)."""
        f = self._index(name)
        b = self.batch_size
        offsets = self.offsets[f * b: (f + 1) * b + 1]
        return self.values[offsets[0]: offsets[-1]], offsets - offsets[0]

    def lengths(self) -> np.ndarray:
        """int64[F, B]: how many IDs each sample has in each feature."""
        return np.diff(self.offsets).reshape(self.num_features, self.batch_size)

    def slice_rows(self, start: int, stop: int) -> "JaggedFeatures":
        """Samples start..stop-1 of every feature (one numpy call per feature)."""
        b = self.batch_size
        if not 0 <= start <= stop <= b:
            raise ValueError(f"row range [{start}, {stop}) is outside the batch of {b} rows")
        rows = stop - start
        # per feature, its offsets over the rows (F, rows+1), rebased to start at 0
        starts = np.arange(self.num_features, dtype=np.int64)[:, None] * b
        window = self.offsets[starts + np.arange(start, stop + 1)]
        window -= window[:, :1]
        feature_base = np.concatenate([[0], np.cumsum(window[:, -1])])
        offsets = np.empty(self.num_features * rows + 1, dtype=np.int64)
        offsets[:-1] = (window[:, :-1] + feature_base[:-1, None]).ravel()
        offsets[-1] = feature_base[-1]
        values = np.concatenate(
            [self.values[self.offsets[f * b + start]: self.offsets[f * b + stop]]
             for f in range(self.num_features)] or [np.empty(0, np.uint64)])
        return JaggedFeatures(list(self.names), values, offsets)

    def take_rows(self, rows: np.ndarray) -> "JaggedFeatures":
        """The samples at positions `rows` (any order, repeats allowed), in that order; one
        vectorised gather per array."""
        b, f = self.batch_size, self.num_features
        starts = self.offsets[:-1].reshape(f, b)[:, rows]
        lengths = self.lengths()[:, rows].ravel()
        offsets = np.zeros(lengths.size + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        # the k-th value of segment s is at starts[s] + k, and lands at offsets[s] + k
        shift = np.repeat(starts.ravel() - offsets[:-1], lengths)
        values = self.values[np.arange(offsets[-1], dtype=np.int64) + shift]
        return JaggedFeatures(list(self.names), values, offsets)

    @staticmethod
    def concat(parts: Sequence["JaggedFeatures"]) -> "JaggedFeatures":
        """Stacks the samples of several JaggedFeatures with the same names."""
        if not parts:
            raise ValueError("concat needs at least one JaggedFeatures, got none")
        names = parts[0].names
        for part in parts[1:]:
            if part.names != names:
                raise ValueError(f"cannot concatenate features {part.names!r} onto {names!r}")
        lengths = np.concatenate([part.lengths() for part in parts], axis=1)
        offsets = np.zeros(lengths.size + 1, dtype=np.int64)
        np.cumsum(lengths.ravel(), out=offsets[1:])
        pieces = []
        for f in range(len(names)):
            for part in parts:
                b = part.batch_size
                pieces.append(part.values[part.offsets[f * b]: part.offsets[(f + 1) * b]])
        values = np.concatenate(pieces) if pieces else np.empty(0, np.uint64)
        return JaggedFeatures(list(names), values, offsets)


@dataclass
class Batch:
    """B samples: jagged sparse IDs, dense float32 (B, n_dense), labels float32 (B, n_tasks),
    sample ids uint64 (B,)."""

    sparse: JaggedFeatures
    dense: np.ndarray
    labels: np.ndarray
    sample_ids: np.ndarray

    @property
    def batch_size(self) -> int:
        return len(self.sample_ids)

    def __len__(self) -> int:
        return self.batch_size

    def feature(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        return self.sparse.feature(name)

    def validate(self) -> "Batch":
        """Raises TypeError/ValueError naming the broken invariant; returns self."""
        check_array("sample_ids", self.sample_ids, np.uint64, 1)
        b = len(self.sample_ids)
        check_array("dense", self.dense, np.float32, 2)
        check_array("labels", self.labels, np.float32, 2)
        if self.dense.shape[0] != b:
            raise ValueError(f"dense has {self.dense.shape[0]} rows, expected B = {b} "
                             f"(len(sample_ids))")
        if self.labels.shape[0] != b:
            raise ValueError(f"labels has {self.labels.shape[0]} rows, expected B = {b} "
                             f"(len(sample_ids))")
        if self.sparse.num_features and self.sparse.batch_size != b:
            raise ValueError(f"sparse offsets describe {self.sparse.batch_size} samples, "
                             f"expected B = {b} (len(sample_ids))")
        self.sparse.validate()
        return self

    def slice_rows(self, start: int, stop: int) -> "Batch":
        return Batch(self.sparse.slice_rows(start, stop), self.dense[start:stop],
                     self.labels[start:stop], self.sample_ids[start:stop])

    def take_rows(self, rows: np.ndarray) -> "Batch":
        """The samples at positions `rows` (an int array; any order, repeats allowed)."""
        rows = np.asarray(rows, dtype=np.int64)
        return Batch(self.sparse.take_rows(rows), self.dense[rows], self.labels[rows],
                     self.sample_ids[rows])

    @staticmethod
    def concat(parts: Sequence["Batch"]) -> "Batch":
        if len(parts) == 1:
            return parts[0]
        return Batch(JaggedFeatures.concat([p.sparse for p in parts]),
                     np.concatenate([p.dense for p in parts]),
                     np.concatenate([p.labels for p in parts]),
                     np.concatenate([p.sample_ids for p in parts]))

    def to_torch(self):
        """(dense, labels) as torch float32 tensors sharing memory with the arrays."""
        import torch

        return (torch.from_numpy(np.ascontiguousarray(self.dense)),
                torch.from_numpy(np.ascontiguousarray(self.labels)))


def rebatch(batches: Iterable[Batch], batch_size: int, drop_last: bool = False) -> Iterator[Batch]:
    """Cuts a stream of batches of any sizes into batches of exactly `batch_size` rows
    (the last one smaller unless `drop_last`). Holds at most one output batch of rows."""
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    pending: list[Batch] = []
    pending_rows = 0
    for batch in batches:
        start = 0
        while start < len(batch):
            take = min(batch_size - pending_rows, len(batch) - start)
            if start == 0 and take == len(batch):
                pending.append(batch)
            else:
                pending.append(batch.slice_rows(start, start + take))
            pending_rows += take
            start += take
            if pending_rows == batch_size:
                yield Batch.concat(pending)
                pending, pending_rows = [], 0
    if pending_rows and not drop_last:
        yield Batch.concat(pending)
