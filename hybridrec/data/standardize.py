"""Standardising a tabular file's dense columns: the mean and standard deviation of each column
over the training rows, which the schema then carries (`data.schema.dense_mean` and
`dense_std`) so that every reader of the job scales alike: training, evaluation, `predict`,
and the bundles `serve` loads (they store the schema). An empty cell reads as the column's
mean, 0 once scaled.

The statistics come from the first `MAX_ROWS` training rows (after `dense_transform`, empty
cells left out); a column without any value gets mean 0 and standard deviation 1, a constant
column standard deviation 1 (it is only shifted).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from hybridrec.data.tabular import TabularSchema, tabular_reader

MAX_ROWS = 100_000


@dataclasses.dataclass(frozen=True)
class DenseStatistics:
    mean: tuple[float, ...]
    std: tuple[float, ...]
    rows: int  # training rows they were taken over
    missing: tuple[float, ...]  # share of empty cells per column

    def applied(self, schema: TabularSchema) -> TabularSchema:
        """`schema` with these statistics, so its readers scale the dense columns."""
        return dataclasses.replace(schema, dense_mean=self.mean, dense_std=self.std)


def dense_statistics(paths, schema: TabularSchema, row_range: tuple[int, int | None],
                     max_rows: int = MAX_ROWS) -> DenseStatistics:
    """Mean and standard deviation of each dense column over the first `max_rows` data rows of
    `row_range` in `paths` (the training rows), empty cells left out."""
    n = len(schema.dense)
    total, squares, counts, rows = np.zeros(n), np.zeros(n), np.zeros(n), 0
    # bad rows are the training reader's to report, once
    reader = tabular_reader(paths, schema, 8192, row_range=row_range, raw_dense=True, on_bad_row=lambda row: None)
    for batch in reader:
        dense = batch.dense[:max_rows - rows].astype(np.float64)
        present = ~np.isnan(dense)
        total += np.where(present, dense, 0.0).sum(axis=0)
        squares += np.where(present, dense * dense, 0.0).sum(axis=0)
        counts += present.sum(axis=0)
        rows += len(dense)
        if rows >= max_rows:
            break
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(counts > 0, total / counts, 0.0)
        variance = np.where(counts > 1, (squares - counts * mean * mean) / np.maximum(counts - 1, 1), 0.0)
    std = np.sqrt(np.maximum(variance, 0.0))
    std = np.where(std > 1e-12 * np.maximum(np.abs(mean), 1.0), std, 1.0)
    missing = 1.0 - counts / rows if rows else np.ones(n)
    return DenseStatistics(tuple(float(v) for v in mean), tuple(float(v) for v in std), rows,
                           tuple(float(v) for v in missing))
