"""Scores raw rows with one bundle version: the feature pipeline parses them, each feature's
keys are read from its table (an ID the table does not hold reads as zeros, as training's
evaluation lookup reads it, and is counted), pooled by the table's pooling, and the dense model
turns the pooled embeddings and dense features into one probability per task.

`Predictor` is immutable once built; a server holds one per version and swaps the reference, so a
call that started on a version finishes on it.
"""
from __future__ import annotations

import threading

import numpy as np
import torch

from numba.typed import List

from hybridrec.bundle import kernels as BK
from hybridrec.bundle.chain import Version
from hybridrec.bundle.format import BundleError
from hybridrec.bundle.model import build
from hybridrec.data.batch import Batch
from hybridrec.embedding.table import POOLING_MODES


class SideLookup:
    """The tables of one side (deep or wide) as one native call: every feature's keys looked up in
    its table and pooled by the table's pooling into [B, F, dim]."""

    def __init__(self, name: str, features, mapping: dict, tables: dict):
        self.name = name
        names = list(dict.fromkeys(mapping[f] for f in features))
        self.tables = [tables[n] for n in names]
        self.dim = self.tables[0].dim
        precisions = {t.precision for t in self.tables}
        if len(precisions) != 1 or {t.dim for t in self.tables} != {self.dim}:
            raise BundleError(f"bundle: the {name} tables mix dims or precisions ({sorted(precisions)})")
        self.precision = BK.PRECISION_CODES[precisions.pop()]
        self.feature_table = np.array([names.index(mapping[f]) for f in features], np.int64)
        self.modes = np.array([POOLING_MODES[tables[mapping[f]].pooling] for f in features], np.int64)
        lists = {"keys": List(), "slots": List(), "weights": List(), "scales": List(), "biases": List()}
        for table in self.tables:
            lists["keys"].append(table.keys)
            lists["slots"].append(table.slots)
            lists["weights"].append(table.arrays["codes" if self.precision == 2 else "weights"])
            scale, bias = table.dequantizing()
            lists["scales"].append(scale)
            lists["biases"].append(bias)
        self.lists = lists

    def pool(self, batch: Batch) -> tuple[np.ndarray, int]:
        size = batch.batch_size
        out = np.empty((size, len(self.feature_table), self.dim), np.float32)
        l = self.lists
        missing = BK.pool_side(batch.sparse.values, batch.sparse.offsets, size, self.feature_table, self.modes,
                               l["keys"], l["slots"], l["weights"], l["scales"], l["biases"], self.precision, out)
        return out, int(missing)


class Predictor:
    def __init__(self, version: Version):
        self.version = version
        manifest = version.manifest
        self.model = build(manifest["model"], version.dense_state)
        features = version.features
        self.features = features
        self.task_names = list(features.labels)
        self.sides = [SideLookup(side, features.sparse_names, mapping, version.tables)
                      for side, mapping in (("deep", features.deep_map), ("wide", features.wide_map)) if mapping]
        self._missing = 0
        self._lookups = 0
        self._count_lock = threading.Lock()

    @property
    def number(self) -> int:
        return self.version.number

    @property
    def score_columns(self) -> list[str]:
        """`score`, or `score_<task>` for each task of a multi-task model."""
        return ["score"] if len(self.task_names) == 1 else [f"score_{t}" for t in self.task_names]

    def counts(self) -> tuple[int, int]:
        """(IDs looked up, IDs the tables did not hold) since this predictor was built."""
        return self._lookups, self._missing

    def pooled(self, batch: Batch) -> dict[str, np.ndarray]:
        """{side: pooled embeddings}: deep [B, F, D], wide [B, F, 1]."""
        out, missing = {}, 0
        for side in self.sides:
            out[side.name], absent = side.pool(batch)
            missing += absent
        self.count_lookups(len(batch.sparse.values) * len(self.sides), missing)
        return out

    def count_lookups(self, looked: int, missing: int) -> None:
        """Add a batch's IDs looked up and IDs the tables did not hold to the counts."""
        with self._count_lock:
            self._missing += missing
            self._lookups += looked

    @torch.inference_mode()
    def score_batch(self, batch: Batch) -> np.ndarray:
        """float32 [B, tasks] probabilities of a batch's rows."""
        pooled = self.pooled(batch)
        deep = pooled.get("deep")
        wide = pooled.get("wide")
        dense = torch.from_numpy(batch.dense) if batch.dense.shape[1] else None
        logits = self.model(None if deep is None else torch.from_numpy(deep),
                            None if wide is None else torch.from_numpy(wide[:, :, 0]), dense)
        return torch.sigmoid(logits.float()).reshape(batch.batch_size, -1).numpy()
