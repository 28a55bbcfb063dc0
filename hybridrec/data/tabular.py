"""Reading tabular files (delimited text or Parquet) described by a schema into `Batch`es.

`TabularSchema` is plain data (a YAML config can hold it as a dict): which columns are labels
(one per task), dense floats, single-ID categoricals, multi-ID categoricals (multi-hot, split
on a separator) and Avazu-style YYMMDDHH hours (two features: hour of day, day of week).
Columns the schema does not name are skipped.

`DelimitedTextReader` streams in constant memory: it reads byte chunks into one numpy buffer
and parses the complete records with the numba kernel of `kernels.py` (no per-row Python).
Quoted fields follow RFC 4180 (`schema.quote`, default `"`; null reads quotes as ordinary
bytes): a field in quotes may hold the delimiter, newlines and doubled quotes, and its value is
the text between the quotes. `ParquetReader` streams record batches
with pyarrow. Both shard by rank: data row r belongs to rank `(r // block_rows) % world_size`,
so the ranks' rows are disjoint and together cover the file; each rank yields batches of
exactly `batch_size` rows (the last one smaller unless `drop_last`). `sample_ids` are the
global data-row indices (0-based across all files, header lines not counted). A data row is
a record (a line, or several where a quoted field holds newlines), good or bad, so
`row_range=(start, stop)` keeps the same records whatever they hold; rows outside it are
neither parsed nor reported. Bad rows are reported by the line they start on.

Bad rows (wrong column count, non-numeric dense value, bad label, a number that is infinite or
beyond float32's range, which would train as inf) are dropped, counted in
`reader.bad_rows` (every pass) and the first few logged with file and line (the first pass
only, so each bad line is reported once); `strict=True` raises a `UserError` naming file,
line, column and value at the first one. Files that do not fit the reader or the schema are
`UserError`s too.
"""
from __future__ import annotations

import abc
import csv
import dataclasses
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from hybridrec.data import kernels
from hybridrec.data.batch import Batch, JaggedFeatures, rebatch
from hybridrec.errors import UserError

log = logging.getLogger(__name__)

DENSE_TRANSFORMS = ("none", "log1p")
PARQUET_SUFFIXES = (".parquet", ".pq")
PARQUET_MAGIC = b"PAR1"  # the first (and last) four bytes of every Parquet file
MAX_RECORD_BYTES = 64 << 20  # a record longer than this behind an open quote is an unclosed quote


def _as_name_tuple(name: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise TypeError(f"{name} must be a list of column names, got {value!r}")
    for item in value:
        if not isinstance(item, str):
            raise TypeError(f"{name} must hold str column names, got {item!r}")
        if not item:
            raise ValueError(f"{name} must hold non-empty column names, got {item!r}")
    return tuple(value)


def _single_char(name: str, value: Any) -> str:
    if not isinstance(value, str) or len(value) != 1 or value in "\r\n" or ord(value) > 127:
        raise ValueError(f"{name} must be one ASCII character other than a newline, "
                         f"got {value!r}")
    return value


@dataclass(frozen=True)
class TabularSchema:
    """Which columns of a table feed which part of a `Batch` (see the module docstring)."""

    labels: tuple[str, ...]
    dense: tuple[str, ...] = ()
    categorical: tuple[str, ...] = ()
    multi_categorical: tuple[str, ...] = ()
    hour_columns: tuple[str, ...] = ()
    multi_separator: str = "|"
    delimiter: str = ","
    header: bool = True
    column_names: tuple[str, ...] = ()
    dense_transform: str = "none"
    binary_labels: bool = True
    event_time: str | None = None  # a column of Unix seconds when the record happened (streams' lag)
    quote: str | None = '"'  # RFC 4180 quoting of fields; None: quotes are ordinary bytes
    # dense columns scaled to mean 0 and standard deviation 1 by the statistics of the training
    # rows (after dense_transform); training fills in dense_mean and dense_std, the readers
    # apply them, and an empty dense cell reads as the column's mean (0 once scaled)
    standardize: bool = True
    dense_mean: tuple[float, ...] = ()
    dense_std: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        for name in ("labels", "dense", "categorical", "multi_categorical", "hour_columns",
                     "column_names"):
            object.__setattr__(self, name, _as_name_tuple(name, getattr(self, name)))
        if not self.labels:
            raise ValueError("labels must name at least one column (one per task), got []")
        used = self.labels + self.dense + self.categorical + self.multi_categorical \
            + self.hour_columns
        repeated = sorted({c for c in used if used.count(c) > 1})
        if repeated:
            raise ValueError(f"columns {repeated} are used more than once in the schema")
        _single_char("delimiter", self.delimiter)
        _single_char("multi_separator", self.multi_separator)
        if self.multi_separator == self.delimiter:
            raise ValueError(f"multi_separator must differ from delimiter, both are "
                             f"{self.delimiter!r}")
        if self.quote is not None:
            _single_char("quote", self.quote)
            if self.quote in (self.delimiter, self.multi_separator):
                raise ValueError(f"quote must differ from delimiter and multi_separator, got {self.quote!r} "
                                 f"(null reads quotes as ordinary characters)")
        if self.dense_transform not in DENSE_TRANSFORMS:
            raise ValueError(f"dense_transform must be one of {DENSE_TRANSFORMS}, got "
                             f"{self.dense_transform!r}")
        for name in ("header", "binary_labels"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not self.header and not self.column_names:
            raise ValueError("header is false, so column_names must name the file's columns "
                             "in order (got none)")
        if self.event_time is not None and (not isinstance(self.event_time, str) or not self.event_time):
            raise ValueError(f"event_time must name a column, got {self.event_time!r}")
        if self.event_time is not None and self.column_names and self.event_time not in self.column_names:
            raise ValueError(f"event_time column {self.event_time!r} is not in column_names "
                             f"{list(self.column_names)}")
        self._check_statistics()
        if self.column_names:
            missing = [c for c in used if c not in self.column_names]
            if missing:
                raise ValueError(f"columns {missing} are not in column_names "
                                 f"{list(self.column_names)}")

    def _check_statistics(self) -> None:
        if not isinstance(self.standardize, bool):
            raise TypeError(f"standardize must be a bool, got {self.standardize!r}")
        for name in ("dense_mean", "dense_std"):
            value = getattr(self, name)
            if isinstance(value, str) or not isinstance(value, (list, tuple)):
                raise TypeError(f"{name} must be a list of numbers, got {value!r}")
            if any(isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v) for v in value):
                raise ValueError(f"{name} must hold finite numbers, got {list(value)!r}")
            object.__setattr__(self, name, tuple(float(v) for v in value))
            if value and len(value) != len(self.dense):
                raise ValueError(f"{name} holds {len(value)} numbers for {len(self.dense)} dense columns "
                                 f"{list(self.dense)}; training fills it in (leave it out)")
        if bool(self.dense_mean) != bool(self.dense_std):
            raise ValueError("dense_mean and dense_std go together (training fills both in); give both or neither")
        if any(v <= 0 for v in self.dense_std):
            raise ValueError(f"dense_std must hold numbers > 0, got {list(self.dense_std)!r}")

    @property
    def scaled(self) -> bool:
        """Whether the readers scale the dense columns (the statistics are known)."""
        return bool(self.dense_mean)

    def dense_fill(self) -> np.ndarray:
        """What an empty dense cell reads as, per dense column (float64, after dense_transform):
        the column's training mean when the columns are scaled, else 0."""
        return np.array(self.dense_mean if self.scaled else [0.0] * len(self.dense), dtype=np.float64)

    def scale_dense(self, dense: np.ndarray) -> np.ndarray:
        """`dense` [rows, n_dense] float32 scaled in place by the statistics (unchanged without them)."""
        if self.scaled and len(dense):
            dense -= np.asarray(self.dense_mean, dtype=np.float32)
            dense *= np.float32(1.0) / np.asarray(self.dense_std, dtype=np.float32)
        return dense

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TabularSchema":
        """Builds a schema from plain data (e.g. a YAML mapping); unknown keys are errors."""
        if not isinstance(data, dict):
            raise TypeError(f"a tabular schema must be a mapping, got {type(data).__name__}")
        allowed = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(data) - set(allowed))
        if unknown:
            raise ValueError(f"unknown tabular schema keys {unknown}; allowed: {allowed}")
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v
                for k, v in dataclasses.asdict(self).items()}

    @property
    def quote_byte(self) -> int:
        """The quote as the kernels take it (`kernels.NO_QUOTE` without quoting)."""
        return kernels.NO_QUOTE if self.quote is None else ord(self.quote)

    def split_header(self, line: str) -> list[str]:
        """The column names of a header line (its fields, quoted ones unquoted)."""
        if self.quote is None:
            return line.split(self.delimiter)
        return next(csv.reader([line], delimiter=self.delimiter, quotechar=self.quote, strict=False))

    @property
    def sparse_feature_names(self) -> list[str]:
        """Names of the Batch's sparse features, in order."""
        names = list(self.categorical) + list(self.multi_categorical)
        for column in self.hour_columns:
            names += [f"{column}:hour_of_day", f"{column}:day_of_week"]
        return names

    def column_layout(self, column_names: Sequence[str], where: str) -> tuple[np.ndarray,
                                                                                np.ndarray]:
        """(kinds int8, slots int32) per column for `kernels.parse_delimited_lines`."""
        index = {name: i for i, name in enumerate(column_names)}
        missing = [c for c in self.labels + self.dense + self.categorical
                   + self.multi_categorical + self.hour_columns if c not in index]
        if missing:
            raise UserError(f"{where}: columns {missing} named by the schema are not among "
                            f"the file's columns {list(column_names)}")
        kinds = np.full(len(column_names), kernels.KIND_SKIP, dtype=np.int8)
        slots = np.zeros(len(column_names), dtype=np.int32)
        dense_kind = kernels.KIND_DENSE_LOG1P if self.dense_transform == "log1p" \
            else kernels.KIND_DENSE
        n_single = len(self.categorical)
        n_multi = len(self.multi_categorical)
        groups = [(self.labels, kernels.KIND_LABEL, 0, 1),
                  (self.dense, dense_kind, 0, 1),
                  (self.categorical, kernels.KIND_CATEGORICAL, 0, 1),
                  (self.multi_categorical, kernels.KIND_MULTI_CATEGORICAL, n_single, 1),
                  (self.hour_columns, kernels.KIND_HOUR_YYMMDDHH, n_single + n_multi, 2)]
        for columns, kind, first_slot, slot_width in groups:
            for position, name in enumerate(columns):
                kinds[index[name]] = kind
                slots[index[name]] = first_slot + position * slot_width
        return kinds, slots


def check_row_range(row_range) -> tuple[int, int | None]:
    """(start, stop) of data rows a reader keeps; stop None = to the end."""
    if not isinstance(row_range, tuple) or len(row_range) != 2:
        raise TypeError(f"row_range must be a (start, stop) tuple, got {row_range!r}")
    start, stop = row_range
    if not isinstance(start, int) or isinstance(start, bool) or start < 0:
        raise ValueError(f"row_range start must be an int >= 0, got {start!r}")
    if stop is not None and (not isinstance(stop, int) or isinstance(stop, bool) or stop < start):
        raise ValueError(f"row_range stop must be None or an int >= start ({start}), got {stop!r}")
    return start, stop


def check_sharding(batch_size: int, rank: int, world_size: int) -> None:
    """Validates the arguments every reader shares."""
    for name, value in (("batch_size", batch_size), ("rank", rank), ("world_size", world_size)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
            raise TypeError(f"{name} must be an int, got {value!r}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")


def _as_paths(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> list[Path]:
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    resolved = [Path(p) for p in paths]
    if not resolved:
        raise ValueError("paths must name at least one file, got none")
    for path in resolved:
        if path.is_dir():
            raise UserError(f"data file {str(path)!r} is a directory; name the data files in it")
        if not path.is_file():
            raise FileNotFoundError(f"data file {str(path)!r} does not exist")
    return resolved


@dataclass(frozen=True)
class BadRow:
    """One rejected row: where it is and why."""

    path: str
    line: int
    column: str
    value: str
    reason: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: column {self.column}: {self.reason} (value {self.value!r})"


@dataclass
class BadRows:
    """How many rows a reader dropped, with the first `max_examples` of them."""

    count: int = 0
    examples: list[BadRow] = field(default_factory=list)
    max_examples: int = 5

    def record(self, found: int, describe, strict: bool, warn: bool = True) -> None:
        """Counts `found` bad rows; `describe(i)` builds the BadRow of the i-th one and is
        called only for those that are raised (strict) or kept as examples (and logged when
        `warn`)."""
        if found and strict:
            raise UserError(f"bad row at {describe(0)} (data.strict is true: the first bad row "
                            f"stops the run; set it false to skip and count bad rows)")
        for i in range(min(found, self.max_examples - len(self.examples))):
            self.examples.append(describe(i))
            if warn:
                log.warning("skipping bad row at %s", self.examples[-1])
        self.count += found


class _ShardedReader(abc.ABC):
    """What the text and Parquet readers share: arguments, sharding, rebatching. A reader
    subclass says how its file format turns into blocks of rows (`_blocks`)."""

    def __init__(self, paths, schema: TabularSchema, batch_size: int, *, rank: int = 0,
                 world_size: int = 1, block_rows: int | None = None, strict: bool = False,
                 drop_last: bool = False, max_reported_bad_rows: int = 5,
                 row_range: tuple[int, int | None] = (0, None), on_bad_row=None,
                 raw_dense: bool = False) -> None:
        if not isinstance(schema, TabularSchema):
            raise TypeError(f"schema must be a TabularSchema, got {type(schema).__name__}")
        check_sharding(batch_size, rank, world_size)
        block_rows = batch_size if block_rows is None else block_rows
        if not isinstance(block_rows, int) or block_rows < 1:
            raise ValueError(f"block_rows must be an int >= 1, got {block_rows!r}")
        self.row_range = check_row_range(row_range)
        self.paths = _as_paths(paths)
        self.schema = schema
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.block_rows = block_rows
        self.strict = strict
        self.drop_last = drop_last
        self.max_reported_bad_rows = max_reported_bad_rows
        self.on_bad_row = on_bad_row
        self.raw_dense = raw_dense  # dense values unscaled and empty cells NaN (what statistics are taken of)
        self.bad_rows = BadRows(max_examples=max_reported_bad_rows)
        self.rows_read = 0  # this rank's rows in row_range seen in the latest pass, good or bad
        self.passes = 0

    def __iter__(self) -> Iterator[Batch]:
        self.bad_rows = BadRows(max_examples=self.max_reported_bad_rows)
        self.rows_read = 0
        self.passes += 1
        return rebatch(self._blocks(), self.batch_size, self.drop_last)

    def _record(self, found: int, describe) -> None:
        """Counts bad rows every pass and warns about them in the first pass only; with
        `on_bad_row`, every bad row is handed to it instead of being logged (its caller reports
        them, e.g. a stream that reports each bad record once it is past it)."""
        if self.on_bad_row is not None and not self.strict:
            for i in range(found):
                self.on_bad_row(describe(i))
            self.bad_rows.record(found, describe, self.strict, warn=False)
            return
        self.bad_rows.record(found, describe, self.strict, warn=self.passes == 1)

    @property
    def _row_stop(self) -> int:
        return self.row_range[1] if self.row_range[1] is not None else np.iinfo(np.int64).max

    @abc.abstractmethod
    def _blocks(self) -> Iterator[Batch]:
        """This rank's rows as Batches of any size (rebatched by `__iter__`)."""


class DelimitedTextReader(_ShardedReader):
    """Streams CSV/TSV files described by a `TabularSchema` (see the module docstring)."""

    def __init__(self, paths, schema: TabularSchema, batch_size: int, *,
                 chunk_bytes: int = 8 << 20, **kwargs) -> None:
        super().__init__(paths, schema, batch_size, **kwargs)
        for path in self.paths:
            with open(path, "rb") as handle:
                if handle.read(4) == PARQUET_MAGIC:
                    raise UserError(f"{path}: this is a Parquet file, and {type(self).__name__} "
                                    f"reads delimited text; give it a .parquet suffix with data.format "
                                    f"tabular (the reader is chosen by the suffix)")
        if not isinstance(chunk_bytes, int) or chunk_bytes < 64:
            raise ValueError(f"chunk_bytes must be an int >= 64, got {chunk_bytes!r}")
        self.chunk_bytes = chunk_bytes
        self.bytes_read = 0

    def __iter__(self) -> Iterator[Batch]:
        self.bytes_read = 0
        return super().__iter__()

    def count_rows(self) -> int:
        """Data rows in all files (lines, less headers), counted chunk by chunk."""
        total = 0
        for path in self.paths:
            with open(path, "rb") as handle:
                if self.schema.header:
                    handle.readline()
                for buffer, n, _ in self._complete_lines(handle, path):
                    total += kernels.count_records(buffer, n, ord(self.schema.delimiter), self.schema.quote_byte)
        return total

    def _column_names(self, handle, path: Path) -> tuple[list[str], int]:
        """The file's column names and how many header lines were consumed."""
        if not self.schema.header:
            return list(self.schema.column_names), 0
        line = handle.readline()
        self.bytes_read += len(line)
        text = line.decode("utf-8", errors="replace").rstrip("\r\n")
        if not text:
            raise UserError(f"{path}:1: expected a header line (data.schema.header is true), the "
                            f"file is empty")
        return self.schema.split_header(text), 1

    def _complete_lines(self, handle, path: Path) -> Iterator[tuple[np.ndarray, int, int]]:
        """Yields (buffer, n, newlines): buffer[:n] is whole records, each ending in a newline
        (outside quotes); `newlines` counts them when buffer[:n] holds no quote byte, else it is
        -1 (see `kernels.scan_records`). The buffer is reused, so it is only valid until the next
        step. Memory stays at
        chunk_bytes unless one record is longer; one longer than MAX_RECORD_BYTES that holds a
        quote is an unclosed quote, an error naming its line."""
        delimiter, quote = ord(self.schema.delimiter), self.schema.quote_byte
        buffer = np.empty(self.chunk_bytes + 1, dtype=np.uint8)
        carry = 0
        while True:
            got = handle.readinto(memoryview(buffer)[carry:len(buffer) - 1])
            self.bytes_read += got
            filled = carry + got
            if got == 0:
                if carry:
                    buffer[carry] = 10  # the last line had no newline
                    yield buffer, carry + 1, -1
                return
            end, newlines, _ = kernels.scan_records(buffer, filled, delimiter, quote)
            end -= 1
            if end < 0:
                if filled > MAX_RECORD_BYTES and kernels.count_newlines_and_quotes(buffer, filled, quote)[1]:
                    raise UserError(_unclosed_quote(path, handle.tell() - filled, self.schema.quote))
                if filled == len(buffer) - 1:  # one record longer than the buffer: grow it
                    grown = np.empty(2 * len(buffer), dtype=np.uint8)
                    grown[:filled] = buffer[:filled]
                    buffer = grown
                carry = filled
                continue
            yield buffer, end + 1, newlines
            carry = filled - end - 1
            buffer[:carry] = buffer[end + 1:filled].copy()

    def _blocks(self) -> Iterator[Batch]:
        schema = self.schema
        first_row = 0
        start, stop = self.row_range[0], self._row_stop
        for path in self.paths:
            if first_row >= stop:
                return
            with open(path, "rb") as handle:
                columns, first_line = self._column_names(handle, path)
                kinds, slots = schema.column_layout(columns, str(path))
                first_line += 1
                for buffer, n, newlines in self._complete_lines(handle, path):
                    if first_row >= stop:
                        return
                    batch, bad, records, lines = parse_line_buffer(
                        schema, kinds, slots, buffer, n, first_row, (start, stop), self.block_rows, self.rank,
                        self.world_size, newlines, self.raw_dense)
                    self.rows_read += (0 if batch is None else len(batch)) + len(bad)
                    if len(bad):
                        self._record_bad_rows(path, columns, buffer, bad, first_line)
                    if batch is not None:
                        yield batch
                    first_row += records
                    first_line += lines

    def _record_bad_rows(self, path: Path, columns: list[str], buffer: np.ndarray,
                         bad: np.ndarray, first_line: int) -> None:
        self._record(len(bad), lambda i: describe_bad_line(str(path), columns, buffer, bad[i], first_line))


def parse_line_buffer(schema: TabularSchema, kinds: np.ndarray, slots: np.ndarray, buffer: np.ndarray, n: int,
                      first_row: int, row_range: tuple[int, int], block_rows: int = 1, rank: int = 0,
                      world_size: int = 1, newlines: int = -1,
                      raw_dense: bool = False) -> tuple[Batch | None, np.ndarray, int, int]:
    """(batch or None, bad, records, lines) of the complete records buffer[:n]: record i is data
    row first_row + i (its sample id); rows outside row_range or another rank's blocks are skipped;
    `bad` holds the kernel's (record index, column, code, value start, value end, line index) per
    rejected row (see `describe_bad_line`); `lines` counts the newlines of buffer[:n], more than
    `records` where quoted fields hold some. `kinds`, `slots` come from `schema.column_layout`.
    `newlines` >= 0: the caller's count of buffer[:n]'s newlines, which hold no quote byte
    (`kernels.scan_records`); then nothing is counted or copied again.
    Dense values are scaled as the schema says (`TabularSchema.scale_dense`); `raw_dense` leaves
    them unscaled with empty cells NaN."""
    names = schema.sparse_feature_names
    quotes = 0
    if newlines < 0:
        newlines, quotes = kernels.count_newlines_and_quotes(buffer, n, schema.quote_byte)
    if quotes or not buffer.flags.writeable:
        buffer = buffer[:n].copy()  # the kernel unescapes quoted values in place: the caller's text stays
    (labels, dense, id_starts, id_counts, ids, rows, bad, records, lines) = kernels.parse_delimited_lines(
        buffer, n, ord(schema.delimiter), ord(schema.multi_separator), schema.quote_byte if quotes else None,
        kinds, slots, len(schema.labels), len(schema.dense), len(names), schema.binary_labels, first_row, block_rows,
        rank, world_size, row_range[0], row_range[1], newlines,
        np.full(len(schema.dense), np.nan) if raw_dense else schema.dense_fill())
    if not len(rows):
        return None, bad, records, lines
    if not raw_dense:
        schema.scale_dense(dense)
    values, offsets = kernels.row_major_to_feature_major(id_starts, id_counts, ids)
    batch = Batch(JaggedFeatures(list(names), values, offsets), dense, labels, rows.astype(np.uint64))
    return batch, bad, records, lines


def describe_bad_line(where: str, columns: Sequence[str], buffer: np.ndarray, bad: np.ndarray,
                      first_line: int) -> BadRow:
    """The BadRow of one of `parse_line_buffer`'s rejected rows; `first_line` is the number that
    line index 0 of the buffer has in `where`."""
    _, column, code, start, end, line = (int(x) for x in bad)
    value = bytes(buffer[start:end]).decode("utf-8", errors="replace")
    if code == kernels.ERROR_COLUMN_COUNT:
        where_column = "*"
        reason = f"expected {len(columns)} columns, found {column}"
    else:
        where_column = f"{column + 1} ({columns[column]})"
        reason = kernels.ERROR_REASONS[code]
    return BadRow(where, first_line + line, where_column, value, reason)


class ParquetReader(_ShardedReader):
    """Streams Parquet files described by a `TabularSchema` through pyarrow's iter_batches.

    Categorical columns of any type are cast to strings and hashed like the text reader
    hashes them; multi-ID columns may be list columns or strings split on multi_separator.
    Rows with a null or (for binary labels) non-0/1 label, or a label or dense value that is NaN,
    infinite or beyond float32, are bad rows."""

    def __init__(self, paths, schema: TabularSchema, batch_size: int, **kwargs) -> None:
        super().__init__(paths, schema, batch_size, **kwargs)
        if schema.hour_columns:
            raise UserError(f"data.schema.hour_columns {list(schema.hour_columns)} are read from "
                            f"delimited text only, not from Parquet files")
        for path in self.paths:
            _open_parquet(path)

    def count_rows(self) -> int:
        import pyarrow.parquet as pq

        return sum(_open_parquet(path).metadata.num_rows for path in self.paths)

    def _blocks(self) -> Iterator[Batch]:
        schema = self.schema
        wanted = list(schema.labels + schema.dense + schema.categorical
                      + schema.multi_categorical)
        first_row = 0
        start, stop = self.row_range[0], self._row_stop
        for path in self.paths:
            if first_row >= stop:
                return
            file_first_row = first_row
            parquet = _open_parquet(path)
            missing = [c for c in wanted if c not in parquet.schema_arrow.names]
            if missing:
                raise UserError(f"{path}: columns {missing} named by the schema are not "
                                f"among the file's columns {parquet.schema_arrow.names}")
            for record_batch in parquet.iter_batches(batch_size=self.block_rows,
                                                     columns=wanted):
                if first_row >= stop:
                    return
                rows = first_row + np.arange(record_batch.num_rows, dtype=np.int64)
                first_row += record_batch.num_rows
                mine = ((rows // self.block_rows) % self.world_size == self.rank) \
                    & (rows >= start) & (rows < stop)
                if not mine.any():
                    continue
                self.rows_read += int(mine.sum())
                batch = self._to_batch(record_batch.filter(mine), rows[mine], path,
                                       file_first_row)
                if len(batch):
                    yield batch

    def _record_parquet_bad(self, bad: np.ndarray, problems: list, rows: np.ndarray, path: Path,
                            file_first_row: int) -> None:
        """Count (and report, in file order) the rows where `bad` is true, each by the first of
        `problems` [(mask, what(r) -> (column, value), error code)] it has."""
        found = np.flatnonzero(bad)

        def describe(i: int) -> BadRow:
            r = found[i]
            mask, what, code = next(problem for problem in problems if problem[0][r])
            column, value = what(r)
            return BadRow(f"{path} (row)", int(rows[r]) - file_first_row + 1, column, value,
                          kernels.ERROR_REASONS[code])

        self._record(len(found), describe)

    def _to_batch(self, table, rows: np.ndarray, path: Path, file_first_row: int) -> Batch:
        import pyarrow as pa
        import pyarrow.compute as pc

        schema = self.schema
        labels = np.stack([pc.cast(table.column(c), pa.float32()).to_numpy(
            zero_copy_only=False) for c in schema.labels], axis=1).astype(np.float32)
        not_labels = np.isnan(labels).any(axis=1)
        if schema.binary_labels:
            not_labels |= ~np.isin(labels, (0.0, 1.0)).all(axis=1)

        def label_text(r: int) -> tuple[str, str]:
            return "label", str(labels[r].tolist())

        problems = [(not_labels, label_text, kernels.ERROR_BAD_LABEL),
                    (~np.isfinite(labels).all(axis=1), label_text, kernels.ERROR_OUT_OF_RANGE)]
        dense = np.zeros((table.num_rows, len(schema.dense)), dtype=np.float32)
        log1p = schema.dense_transform == "log1p"
        fill = np.full(len(schema.dense), np.nan) if self.raw_dense else schema.dense_fill()
        for j, column in enumerate(schema.dense):
            cast = pc.cast(table.column(column), pa.float64())
            empty = cast.is_null().to_numpy(zero_copy_only=False)
            values = pc.fill_null(cast, 0.0).to_numpy(zero_copy_only=False)
            # NaN, infinite, or (stored as float32) past its range: a bad row, as in the text reader
            wrong = np.isnan(values) | np.isinf(values) if log1p else ~(np.abs(values) <= kernels.FLOAT32_MAX)
            problems.append((wrong, lambda r, v=values, c=column: (c, repr(float(v[r]))), kernels.ERROR_OUT_OF_RANGE))
            with np.errstate(invalid="ignore", over="ignore"):
                dense[:, j] = np.where(empty, fill[j], np.log1p(np.maximum(values, 0.0)) if log1p else values)
        if not self.raw_dense:
            schema.scale_dense(dense)
        bad = np.logical_or.reduce([mask for mask, _, _ in problems])
        self._record_parquet_bad(bad, problems, rows, path, file_first_row)
        lengths, pieces = [], []
        for slot, column in enumerate(schema.categorical + schema.multi_categorical):
            data = table.column(column)
            if slot < len(schema.categorical):
                keys, present = _hash_strings(data, slot)
                lengths.append(present.astype(np.int64))
                pieces.append(keys[present])
            else:
                if not pa.types.is_list(data.type) and not pa.types.is_large_list(data.type):
                    data = pc.split_pattern(pc.cast(data, pa.string()), schema.multi_separator)
                list_offsets = data.offsets.to_numpy()
                keys, present = _hash_strings(data.flatten(), slot)
                kept_before = np.concatenate([[0], np.cumsum(present)])
                lengths.append(kept_before[list_offsets[1:] - list_offsets[0]]
                               - kept_before[list_offsets[:-1] - list_offsets[0]])
                pieces.append(keys[present])
        keep = ~bad
        names = schema.sparse_feature_names
        if names:
            length_matrix = np.stack(lengths)
            offsets = np.zeros(length_matrix.size + 1, dtype=np.int64)
            np.cumsum(length_matrix.ravel(), out=offsets[1:])
            sparse = JaggedFeatures(list(names), np.concatenate(pieces), offsets)
        else:  # no sparse feature to take rows of: keep the good rows of the rest
            sparse = JaggedFeatures([], np.empty(0, np.uint64), np.zeros(1, np.int64))
            return Batch(sparse, dense[keep], labels[keep], rows[keep].astype(np.uint64))
        batch = Batch(sparse, dense, labels, rows.astype(np.uint64))
        return batch if keep.all() else batch.take_rows(np.flatnonzero(keep))


def _unclosed_quote(path: Path, offset: int, quote: str) -> str:
    """The error of a quote opened at or after byte `offset` of `path` that no record closes."""
    line = 1
    with open(path, "rb") as handle:
        while offset > 0:
            part = handle.read(min(offset, 8 << 20))
            line += part.count(b"\n")
            offset -= len(part)
    return (f"{path}:{line}: a field opened with {quote!r} on this line or soon after is not closed within "
            f"{MAX_RECORD_BYTES >> 20} MiB (RFC 4180: a quote inside a quoted field is written twice; set "
            f"data.schema.quote: null if quotes in this file are ordinary characters)")


def _open_parquet(path: Path):
    """pyarrow's ParquetFile of `path`; a file that is not Parquet is a UserError."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as exc:
        raise UserError(f"{path}: not a Parquet file ({exc}); files ending in "
                        f"{' or '.join(PARQUET_SUFFIXES)} are read as Parquet, others as delimited "
                        f"text") from None


def _hash_strings(array, field_index: int) -> tuple[np.ndarray, np.ndarray]:
    """Keys and presence of an Arrow array of any type, hashed as its string form."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if pa.types.is_dictionary(array.type):
        array = array.dictionary_decode()
    strings = pc.cast(array, pa.large_string())
    _, offsets_buffer, data_buffer = strings.buffers()
    offsets = np.frombuffer(offsets_buffer, dtype=np.int64)[
        strings.offset: strings.offset + len(strings) + 1]
    data = np.frombuffer(data_buffer, dtype=np.uint8) if data_buffer is not None \
        else np.empty(0, np.uint8)
    valid = strings.is_valid().to_numpy(zero_copy_only=False)
    return kernels.hash_string_column(data, offsets, valid, field_index)


def tabular_reader(paths, schema: TabularSchema | dict, batch_size: int, **kwargs):
    """A Parquet reader for .parquet/.pq files, else a delimited-text reader."""
    if isinstance(schema, dict):
        schema = TabularSchema.from_dict(schema)
    first = Path(paths if isinstance(paths, (str, os.PathLike)) else list(paths)[0])
    if first.suffix.lower() in PARQUET_SUFFIXES:
        return ParquetReader(paths, schema, batch_size, **kwargs)
    return DelimitedTextReader(paths, schema, batch_size, **kwargs)
