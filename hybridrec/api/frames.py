"""pandas DataFrames as a job's data: checked against the config's schema and staged as Parquet
files, which the job then reads as it reads any Parquet file (`data.tabular.ParquetReader`), so a
DataFrame and a file of the same rows train and score alike, in this process or in the trainer
processes of a distributed job.

Categorical columns may hold strings or integers (both hashed as their text; an integer column
with gaps, which pandas stores as floats, is hashed as the integers it holds); NaN or None is
missing: no ID for a categorical, 0.0 for a dense column, as an empty cell in a CSV file. A row
whose label is missing is a bad row (skipped and counted) in training and evaluation; prediction
needs no label column.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from hybridrec.data import TabularSchema
from hybridrec.errors import UserError


def _pandas():
    try:
        import pandas
        import pyarrow  # noqa: F401  (the Parquet files are written and read with it)
    except ImportError as exc:
        raise UserError(f"DataFrames as data need pandas and pyarrow ({exc}): pip install 'hybridrec[pandas]'") from None
    return pandas


def is_frame(value) -> bool:
    """Whether `value` is a pandas DataFrame (without importing pandas when it is not loaded)."""
    import sys

    pandas = sys.modules.get("pandas")
    return pandas is not None and isinstance(value, pandas.DataFrame)


def schema_columns(schema: TabularSchema, labels: bool = True) -> list[str]:
    """The columns of the schema a DataFrame must hold (the labels only when `labels`)."""
    return list((schema.labels if labels else ()) + schema.dense + schema.categorical + schema.multi_categorical)


def _categorical(column, name: str, where: str):
    """A categorical column as Arrow reads it for hashing: integers stay integers (floats that are
    all whole numbers become integers, so 3.0 hashes as 3), text stays text, mixed objects become
    text; missing values stay missing."""
    pandas = _pandas()
    if pandas.api.types.is_float_dtype(column):
        present = column.dropna()
        if not np.all(np.isfinite(present)) or not np.all(present == np.round(present)):
            raise UserError(f"{where}: categorical column {name!r} holds numbers that are not whole "
                            f"(e.g. {present[present != np.round(present)].iloc[0]!r}); categorical values are IDs: "
                            f"strings or integers")
        return column.astype("Int64")
    if pandas.api.types.is_object_dtype(column):
        return column.map(lambda v: v if v is None or (isinstance(v, float) and np.isnan(v)) else str(v))
    return column


def stage(frame, schema: TabularSchema, path: Path, where: str, labels: bool = True) -> Path:
    """Write the schema's columns of `frame` as the Parquet file `path`; UserError naming `where`
    (e.g. `fit(train=...)`) and the column when the frame does not fit the schema. Without
    `labels` (prediction), label columns the frame lacks are written as 0."""
    pandas = _pandas()
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not isinstance(frame, pandas.DataFrame):
        raise UserError(f"{where}: expected a pandas DataFrame, got {type(frame).__name__}")
    if schema.hour_columns:
        raise UserError(f"{where}: data.schema.hour_columns {list(schema.hour_columns)} are read from delimited "
                        f"text only; give the hour of day and day of week as categorical columns of the DataFrame")
    missing = [c for c in schema_columns(schema, labels) if c not in frame.columns]
    if missing:
        raise UserError(f"{where}: the DataFrame has no columns {missing} that data.schema names; it has "
                        f"{[str(c) for c in frame.columns]}")
    if not len(frame):
        raise UserError(f"{where}: the DataFrame has no rows")
    columns = {}
    for name in schema.labels:
        columns[name] = frame[name] if name in frame.columns else np.zeros(len(frame), np.float32)
    for name in schema.dense:
        if not pandas.api.types.is_numeric_dtype(frame[name]) or pandas.api.types.is_bool_dtype(frame[name]):
            raise UserError(f"{where}: dense column {name!r} has dtype {frame[name].dtype}; dense features are "
                            f"numbers (NaN for missing)")
        columns[name] = frame[name]
    for name in schema.categorical:
        columns[name] = _categorical(frame[name], name, where)
    for name in schema.multi_categorical:
        columns[name] = frame[name]  # lists of IDs, or text split on multi_separator
    table = pandas.DataFrame({name: values.reset_index(drop=True) if isinstance(values, pandas.Series) else values
                              for name, values in columns.items()})
    try:
        arrow = pa.Table.from_pandas(table, preserve_index=False)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise UserError(f"{where}: the DataFrame's columns cannot be read as data.schema says: {exc}") from None
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(arrow, path)
    return path
