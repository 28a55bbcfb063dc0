"""The feature pipeline a bundle carries: how raw rows, in the training data's own format,
become the keys and dense inputs the model was trained on.

It is the training reader's pipeline, not a copy of it: the schema (which column is a label, a
dense value, a categorical, a multi-ID list or an Avazu hour), the dense transform (log1p), the
delimiter and the columns in order are stored, and rows are parsed by the same numba kernel as
training (`data.tabular.parse_line_buffer`), which hashes each categorical string per field
(`data.kernels.token_key`, named by `HASHING`). Scoring differs from training in one way only:
labels are not read, so a row may leave its label empty or have no label column at all.

JSON rows ({column: value}) are written as lines in the schema's column order and parsed the same
way, so a row scores the same whether it came as JSON or as a line of the file.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from hybridrec.data import kernels as DK
from hybridrec.data.batch import Batch
from hybridrec.data.tabular import TabularSchema, describe_bad_line, parse_line_buffer
from hybridrec.errors import UserError

HASHING = "hybridrec-token-key-1"  # data.kernels.token_key: a field-salted 64-bit hash of the value's bytes
_NO_LIMIT = 1 << 62


class RowError(UserError):
    """A row that cannot be scored; the message names the row, the column and the reason."""


@dataclasses.dataclass(frozen=True)
class Layout:
    """How the lines of one source are parsed: its columns and the kernel's kinds and slots."""

    columns: tuple[str, ...]
    kinds: np.ndarray
    slots: np.ndarray


@dataclasses.dataclass(frozen=True)
class FeatureSpec:
    format: str  # the training data's format: criteo, avazu, tabular or synthetic (its TSV)
    schema: TabularSchema
    columns: tuple[str, ...]  # the training file's columns in order: the format of `lines`
    sparse_names: tuple[str, ...]
    num_dense: int
    labels: tuple[str, ...]
    deep_map: dict  # feature -> deep table
    wide_map: dict  # feature -> wide (first-order) table
    hashing: str = HASHING

    def to_dict(self) -> dict:
        return {"format": self.format, "schema": self.schema.to_dict(), "columns": list(self.columns),
                "sparse_names": list(self.sparse_names), "num_dense": self.num_dense, "labels": list(self.labels),
                "deep_map": dict(self.deep_map), "wide_map": dict(self.wide_map), "hashing": self.hashing}

    @classmethod
    def from_dict(cls, data: dict) -> "FeatureSpec":
        if data.get("hashing") != HASHING:
            raise UserError(f"bundle: the features were hashed with {data.get('hashing')!r}; this hybridrec hashes "
                            f"with {HASHING!r}")
        return cls(data["format"], TabularSchema.from_dict(data["schema"]), tuple(data["columns"]),
                   tuple(data["sparse_names"]), int(data["num_dense"]), tuple(data["labels"]),
                   dict(data["deep_map"]), dict(data["wide_map"]))

    # ------------------------------------------------------------------ lines
    @property
    def feature_columns(self) -> tuple[str, ...]:
        """The columns a row's features come from (every schema column but the labels)."""
        s = self.schema
        return s.dense + s.categorical + s.multi_categorical + s.hour_columns

    def layout(self, columns, where: str) -> Layout:
        """The layout of lines with these `columns`: the label columns may be missing (they are
        never read); a feature column missing is a UserError naming it."""
        columns = tuple(columns)
        absent_labels = [c for c in self.schema.labels if c not in columns]
        kinds, slots = self.schema.column_layout(list(columns) + absent_labels, where)
        kinds = kinds[:len(columns)].copy()
        kinds[kinds == DK.KIND_LABEL] = DK.KIND_SKIP
        return Layout(columns, kinds, np.ascontiguousarray(slots[:len(columns)]))

    def layout_for_fields(self, fields: int, where: str) -> Layout:
        """The layout of headerless lines of `fields` columns: the training file's columns, or
        those columns without the labels."""
        without = tuple(c for c in self.columns if c not in self.schema.labels)
        for columns in (self.columns, without):
            if fields == len(columns):
                return self.layout(columns, where)
        raise RowError(f"{where}: a line has {fields} columns; lines of this model have {len(self.columns)} "
                       f"({', '.join(self.columns)}) or {len(without)} without the label")

    def parse(self, layout: Layout, buffer: np.ndarray, n: int,
              first_row: int) -> tuple[Batch | None, np.ndarray, int, int]:
        """(batch of the good rows or None, the kernel's bad rows, records read, lines read) of
        buffer[:n], complete records; record i is row first_row + i (its sample id)."""
        return parse_line_buffer(self.schema, layout.kinds, layout.slots, buffer, n, first_row, (0, _NO_LIMIT))

    def parse_request_lines(self, text: bytes, count: int, where: str, layout: Layout | None = None) -> Batch:
        """The batch of `count` lines joined by newlines (a request's); RowError naming the
        first bad or empty line."""
        if layout is None:
            first = text.split(b"\n", 1)[0].decode("utf-8", errors="replace")
            layout = self.layout_for_fields(len(self.schema.split_header(first)), where)
        buffer = np.frombuffer(text + b"\n", np.uint8)
        batch, bad, _, _ = self.parse(layout, buffer, len(buffer), 0)
        if len(bad):
            found = describe_bad_line(where, layout.columns, buffer, bad[0], 1)
            raise RowError(f"{where} line {found.line}: column {found.column}: {found.reason} (value {found.value!r})")
        got = 0 if batch is None else len(batch)
        if got != count:
            empty = sorted(set(range(count)) - set(() if batch is None else batch.sample_ids.tolist()))
            raise RowError(f"{where} line {empty[0] + 1}: the line is empty")
        return batch

    @classmethod
    def of_job(cls, cfg) -> "FeatureSpec":
        """The pipeline of a job config: its data's schema and its tables' feature maps."""
        from hybridrec.job.sources import file_schema
        from hybridrec.job.tables import job_tables

        schema, tables = file_schema(cfg.data), job_tables(cfg)
        return cls(cfg.data.format, schema, _file_columns(cfg.data, schema), tuple(tables.sparse_names),
                   tables.num_dense, tuple(tables.label_names), dict(tables.deep_map), dict(tables.wide_map))

    # ------------------------------------------------------------------ JSON rows
    def rows_to_text(self, rows: list) -> bytes:
        """JSON rows as lines of the feature columns (see `feature_layout`); RowError naming the
        first row and column that cannot be a value of that column."""
        columns = self.feature_columns
        allowed = set(columns) | set(self.schema.labels)
        delimiter = self.schema.delimiter
        multi = set(self.schema.multi_categorical)
        dense = set(self.schema.dense)
        lines = []
        for number, row in enumerate(rows, 1):
            if not isinstance(row, dict):
                raise RowError(f"rows[{number - 1}]: a row is an object of column: value, got {type(row).__name__}")
            unknown = [c for c in row if c not in allowed]
            if unknown:
                raise RowError(f"rows[{number - 1}]: unknown column {unknown[0]!r}; this model reads "
                               f"{', '.join(columns)}")
            values = []
            for column in columns:
                value = row.get(column)
                if value is None:
                    values.append("")
                    continue
                if column in multi and isinstance(value, list):
                    parts = [_token(number, column, v, delimiter) for v in value]
                    text = self.schema.multi_separator.join(parts)
                elif column in dense:
                    text = _number(number, column, value)
                else:
                    text = _token(number, column, value, delimiter)
                values.append(text)
            lines.append(delimiter.join(values))
        return "\n".join(lines).encode()

    def feature_layout(self) -> Layout:
        return self.layout(self.feature_columns, "rows")


def _token(number: int, column: str, value, delimiter: str) -> str:
    """A categorical value as the text a data file would hold."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise RowError(f"rows[{number - 1}]: column {column!r} takes a string or an integer, got "
                       f"{type(value).__name__}")
    text = str(value)
    if delimiter in text or "\n" in text or "\r" in text:
        raise RowError(f"rows[{number - 1}]: column {column!r}: the value holds the delimiter {delimiter!r} or a "
                       f"line break")
    return text


def _number(number: int, column: str, value) -> str:
    """A dense value as the text a data file would hold."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise RowError(f"rows[{number - 1}]: column {column!r} takes a number, got {type(value).__name__}")
    if isinstance(value, str):
        try:
            value = float(value) if value.strip() else None
        except ValueError:
            raise RowError(f"rows[{number - 1}]: column {column!r} takes a number, got {value!r}") from None
        if value is None:
            return ""
    if isinstance(value, float) and not math.isfinite(value):
        raise RowError(f"rows[{number - 1}]: column {column!r} takes a finite number, got {value!r}")
    return repr(value) if isinstance(value, float) else str(value)


def _file_columns(data, schema: TabularSchema) -> tuple[str, ...]:
    """The columns of the training files in order: the schema's column_names, else the header of
    the first training file, else (no file at hand) the labels and then the feature columns."""
    if schema.column_names:
        return tuple(schema.column_names)
    paths = [data.path] if isinstance(data.path, str) else list(data.path or [])
    if paths and schema.header and not str(paths[0]).lower().endswith((".parquet", ".pq")):
        try:
            with open(paths[0], "rb") as handle:
                header = handle.readline().decode("utf-8", errors="replace").rstrip("\r\n")
            if header:
                return tuple(schema.split_header(header))
        except OSError:
            pass
    return schema.labels + schema.dense + schema.categorical + schema.multi_categorical + schema.hour_columns
