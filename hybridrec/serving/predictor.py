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

from hybridrec.bundle.chain import Version
from hybridrec.bundle.model import build
from hybridrec.data.batch import Batch
from hybridrec.embedding import kernels as EK
from hybridrec.embedding.table import POOLING_MODES


class Predictor:
    def __init__(self, version: Version):
        self.version = version
        manifest = version.manifest
        self.model = build(manifest["model"], version.dense_state)
        features = version.features
        self.features = features
        self.task_names = list(features.labels)
        self.sides = []  # (side, dim, [(feature column, table)])
        for side, mapping in (("deep", features.deep_map), ("wide", features.wide_map)):
            if mapping:
                columns = [(f, version.tables[mapping[name]]) for f, name in enumerate(features.sparse_names)]
                self.sides.append((side, columns[0][1].dim, columns))
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
        sparse = batch.sparse
        size = batch.batch_size
        offsets = sparse.offsets
        out, missing, looked = {}, 0, 0
        for side, dim, columns in self.sides:
            pooled = np.empty((size, len(columns), dim), np.float32)
            for f, table in columns:
                lo, hi = offsets[f * size], offsets[(f + 1) * size]
                rows, absent = table.rows(sparse.values[lo:hi])
                missing += absent
                looked += hi - lo
                EK.gather_pool(rows, np.arange(hi - lo, dtype=np.int64), offsets[f * size:(f + 1) * size + 1] - lo,
                               POOLING_MODES[table.pooling], pooled, f)
            out[side] = pooled
        with self._count_lock:
            self._missing += missing
            self._lookups += looked
        return out

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
