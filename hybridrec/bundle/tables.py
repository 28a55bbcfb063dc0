"""A bundle's tables as the predictor reads them: keys with their stored rows, a hash index over
the keys (the predictor's lookup, `kernels.pool_side`, probes it), and the merge of a delta into a
new table.

A table is never changed in place: `apply(delta)` builds the next version's table beside the one
being served, so a request in flight reads one version or the other, never half of each.
"""
from __future__ import annotations

import numpy as np

from hybridrec.bundle import kernels as BK
from hybridrec.bundle.format import BundleError, TablePart
from hybridrec.bundle.precision import dequantize


class ServingTable:
    def __init__(self, part: TablePart):
        self.name, self.dim, self.side, self.pooling = part.name, part.dim, part.side, part.pooling
        self.precision = part.precision
        self.keys = np.ascontiguousarray(part.keys, dtype=np.uint64)
        self.arrays = {name: np.ascontiguousarray(array) for name, array in part.arrays.items()}
        expected = {"fp32": {"weights"}, "fp16": {"weights"}, "int8": {"codes", "scale", "bias"}}.get(self.precision)
        if expected is None or set(self.arrays) != expected:
            raise BundleError(f"bundle: table {self.name!r} has arrays {sorted(self.arrays)} for precision "
                              f"{self.precision!r}")
        for name, array in self.arrays.items():
            if len(array) != len(self.keys):
                raise BundleError(f"bundle: table {self.name!r} has {len(self.keys)} keys but {len(array)} {name} rows")
        if self.precision == "int8":  # the kernel reads the scale and bias as float32
            self._scale = self.arrays["scale"].view(np.float16).astype(np.float32)
            self._bias = self.arrays["bias"].view(np.float16).astype(np.float32)
        self.slots = np.full(BK.index_slots(len(self.keys)), -1, np.int32)
        twice = BK.build_index(self.keys, self.slots)
        if twice >= 0:
            raise BundleError(f"bundle: table {self.name!r} holds key {int(self.keys[twice])} twice")

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def nbytes(self) -> int:
        return int(self.keys.nbytes + sum(a.nbytes for a in self.arrays.values()))

    def dequantizing(self) -> tuple[np.ndarray, np.ndarray]:
        """(scale, bias) float32 per row of an int8 table; empty arrays for other precisions."""
        if self.precision == "int8":
            return self._scale, self._bias
        return np.empty(0, np.float32), np.empty(0, np.float32)

    def weights(self) -> np.ndarray:
        """Every row as float32, in key order of `keys`."""
        return dequantize(self.arrays, self.precision)

    def apply(self, delta: TablePart) -> "ServingTable":
        """The table of the next version: this one without the delta's deleted and changed keys,
        then the delta's rows."""
        if delta.precision != self.precision or delta.dim != self.dim:
            raise BundleError(f"bundle: a delta of table {self.name!r} is {delta.precision} dim {delta.dim}; the "
                              f"table is {self.precision} dim {self.dim}")
        leaving = np.concatenate([delta.keys, delta.deleted]).astype(np.uint64, copy=False)
        found = np.empty(len(leaving), np.int64)
        BK.find_rows(leaving, self.keys, self.slots, found)
        keep = np.ones(len(self.keys), bool)
        keep[found[found >= 0]] = False
        merged = {name: np.concatenate([array[keep], delta.arrays[name]]) for name, array in self.arrays.items()}
        return ServingTable(TablePart(self.name, self.dim, self.side, self.pooling, self.precision,
                                      np.concatenate([self.keys[keep], delta.keys]), merged))
