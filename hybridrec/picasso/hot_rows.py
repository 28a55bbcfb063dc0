"""PICASSO's hot storage (§III-D): the hottest rows of a pack's tables copied to every trainer,
the same on every trainer, with the index the packed lookup kernel probes to read a hot key
from the copy instead of sending it to its owner. Which rows are hot is HybridHash's choice
(hybridrec.picasso.hybrid_hash); the sharded tables start with an empty set per pack.
"""
from __future__ import annotations

import numpy as np

from hybridrec.embedding import kernels as K
from hybridrec.embedding.table_arrays import TableArrays
from hybridrec.picasso import packing as P


class HotTable:
    """Store-shaped arrays of one table's hot rows, for `TableArrays` (only rows and meta are read)."""

    def __init__(self, rows: np.ndarray, meta: np.ndarray):
        self.rows, self.meta = rows, meta
        self.index = np.full(1, -1, np.int32)
        self.parts = np.zeros((1, K.PARTS_WIDTH), np.int64)
        self.sketch = np.zeros((2, 1), np.uint16)
        self.scalars = np.zeros(K.SCALARS_WIDTH, np.int64)
        self.lru_log = np.zeros(1, np.int32)


class HotSet:
    """The hot rows of one pack, the same on every trainer: per pack table t, `rows[t]` [n_t,
    row width] (weights and optimizer state, as the owner's store holds them) and `meta[t]` (the
    key and the access count), with the index of (pack table, key) -> hot row the lookup kernel
    probes. The hot rows of all tables are numbered from `base[t]` in the gradient buffer."""

    def __init__(self, pack: "Pack", rows: list[np.ndarray], meta: list[np.ndarray]):
        self.counts = np.array([len(r) for r in rows], np.int64)
        self.base = np.concatenate([[0], np.cumsum(self.counts)[:-1]]).astype(np.int64)
        self.total = int(self.counts.sum())
        self.rows, self.meta = rows, meta
        tables = []
        for t, store in enumerate(pack.stores):
            width = store.config.row_width
            r = rows[t] if len(rows[t]) else np.zeros((1, width), np.float32)
            m = meta[t] if len(meta[t]) else np.zeros((1, K.META_WIDTH), np.int32)
            tables.append(HotTable(np.ascontiguousarray(r, np.float32), np.ascontiguousarray(m, np.int32)))
        self._tables = tables
        self.arrays = TableArrays(tables)
        size = 1
        while size < 2 * self.total:
            size *= 2
        keys = np.concatenate([m.view(np.uint64)[:, 0] for m in meta]) if self.total else np.empty(0, np.uint64)
        which = np.repeat(np.arange(len(rows), dtype=np.int64), self.counts)
        local = np.concatenate([np.arange(n, dtype=np.int64) for n in self.counts]) if self.total else \
            np.empty(0, np.int64)
        self.index_keys = np.zeros(size if self.total else 0, np.uint64)
        self.index_tables = np.zeros(size if self.total else 0, np.int64)
        self.index_rows = np.full(size if self.total else 0, -1, np.int64)
        if self.total:
            P.build_hot_index(np.ascontiguousarray(keys), which, local, self.index_keys, self.index_tables,
                              self.index_rows)

    def table_rows(self, t: int) -> np.ndarray:
        """Table t's hot rows as the kernels update them (a view)."""
        return self._tables[t].rows[:self.counts[t]]

    def table_meta(self, t: int) -> np.ndarray:
        return self._tables[t].meta[:self.counts[t]]

    @classmethod
    def empty(cls, pack: "Pack") -> "HotSet":
        return cls(pack, [np.empty((0, s.config.row_width), np.float32) for s in pack.stores],
                   [np.empty((0, K.META_WIDTH), np.int32) for _ in pack.stores])
