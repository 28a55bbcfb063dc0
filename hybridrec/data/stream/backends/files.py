"""Stream backend `files`: a directory (or a glob) into which complete data files keep arriving,
such as hourly partitions `dt=2026112513/part-0.parquet`, read in the order of their names.

Files are any format the readers parse (Criteo or Avazu TSV/CSV, schema CSV/TSV, Parquet by its
suffix). Names are paths relative to the root (the directory, or the part of the glob before its
first wildcard); any path component starting with `.` or `_` is not a data file (`_SUCCESS`,
`_temporary/`, `.part-0.tmp`). A file counts as complete by one of two conventions
(`complete`):
  * `marker` (default): its directory holds a `_SUCCESS` file (`marker` names it), written after
    the directory's last file, as Hadoop, Spark and Hive write partitions;
  * `rename`: every listed file is complete, because writers create it under a hidden name and
    rename it into place when done (an atomic rename within one file system).
Files must arrive in name order, as time partitions do: a file that appears after a file sorting
after it was read is reported once and not read (the position is one file and row, not a set).

Shares: trainer r of W reads the files whose name hashes (BLAKE2b, 8 bytes) to r modulo W, a
stable assignment whatever order the files arrive in; with `whole_stream` every trainer reads
every file. Position: `{"file": name, "row": next data row}` (`row` null once the file is done).
Sample ids are mix64(name hash + data row), the same for a record whatever trainer reads it.
"""
from __future__ import annotations

import glob
import hashlib
import os
import time
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from hybridrec.data.batch import Batch
from hybridrec.data.stream.source import BadRecord, StreamSource, log
from hybridrec.data.tabular import BadRow, tabular_reader
from hybridrec.errors import UserError
from hybridrec.mixing import mix64_array

_WILDCARDS = "*?["


class FilesOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    path: str = Field(description="directory (every file under it) or glob of the arriving files")
    complete: Literal["marker", "rename"] = Field("marker", description="when a file counts as complete: marker = "
                                                  "its directory holds the marker file; rename = as soon as listed")
    marker: str = Field("_SUCCESS", min_length=1, description="the marker file's name (complete: marker)")


def name_key(name: str) -> int:
    """The stable 64-bit hash of a file's relative name (share assignment, sample ids)."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


def file_sample_ids(name: str, rows: np.ndarray) -> np.ndarray:
    """The sample ids of data rows `rows` of file `name` (relative to the stream's root)."""
    out = np.empty(len(rows), np.uint64)
    mix64_array(np.asarray(rows, np.uint64) + np.uint64(name_key(name)), out)
    return out


def _hidden(relative: str) -> bool:
    return any(part.startswith((".", "_")) for part in Path(relative).parts)


class FilesSource(StreamSource):
    """A trainer's share of the files arriving under `path` (see the module docstring)."""

    name = "files"
    Options = FilesOptions

    def __init__(self, options, common, context) -> None:
        super().__init__(options, common, context)
        path = options.path
        if any(c in path for c in _WILDCARDS):
            head = path[:min(path.index(c) for c in _WILDCARDS if c in path)]
            self.root = Path(head if head.endswith(os.sep) else os.path.dirname(head) or ".")
            self.pattern = path
        else:
            self.root = Path(path)
            self.pattern = None
            if self.root.exists() and not self.root.is_dir():
                raise UserError(f"data.stream.path: {path!r} is a file; give the directory the files arrive in "
                                f"(or a glob such as {path!r}*)")
        self._listed: set[str] = set()
        self._pending: list[str] = []  # complete files of this share after the position, in name order
        self._last_listing = 0.0
        self._file: str | None = None  # the file being read
        self._after: str | None = None  # files up to this name are read
        self._batches = None  # the reader's batch iterator of the file being read
        self._held: Batch | None = None  # the next batch of that file, read ahead to end the span before it
        self._bad_rows: list[tuple[int, BadRecord]] = []
        self._first_line = 1

    # ------------------------------------------------------------------ listing
    def _list(self) -> list[str]:
        """Relative names of the complete data files of this trainer's share, sorted."""
        if self.pattern is not None:
            found = [Path(p) for p in glob.glob(self.pattern, recursive=True)]
        else:
            found = [Path(d, f) for d, _, files in os.walk(self.root) for f in files] if self.root.is_dir() else []
        names = []
        for path in found:
            relative = os.path.relpath(path, self.root)
            if _hidden(relative) or not path.is_file():
                continue
            if self.options.complete == "marker" and not (path.parent / self.options.marker).exists():
                continue
            if not self.context.whole_stream and self.context.trainers > 1 \
                    and name_key(relative) % self.context.trainers != self.context.rank:
                continue
            names.append(relative)
        return sorted(names)

    def _refresh(self) -> None:
        names = self._list()
        self._last_listing = time.monotonic()
        fresh = [n for n in names if n not in self._listed]
        first_listing = not self._listed
        self._listed.update(fresh)
        late = [] if first_listing else [n for n in fresh if self._after is not None and n <= self._after
                                         and n != self._file]
        for name in late:
            log.warning("stream: %s arrived after %s was read (files are read in name order); it is not read",
                        self.root / name, self.root / self._after)
        self._pending = [n for n in names if self._after is None or n > self._after]

    # ------------------------------------------------------------------ reading
    def _restart(self, position: dict | None) -> None:
        self._close_file()
        self._after = None
        if position is None:
            self._refresh()
            return
        name, row = position["file"], position["row"]
        self._after = name
        self._refresh()
        if row is not None:  # that file is read from `row` on
            self._open(name, int(row))

    def _open(self, name: str, row: int) -> None:
        self._file, self._after = name, name
        self._held = None
        self._bad_rows = []
        self._first_line = 2 if self.context.schema.header and not self._is_parquet(name) else 1
        path = self.root / name
        try:
            reader = tabular_reader(path, self.context.schema, self.context.batch_size, row_range=(row, None),
                                    on_bad_row=self._bad_row)
            self._batches = iter(reader)
        except (UserError, OSError) as exc:
            self._batches = None
            self._bad_rows.append((row, BadRecord(str(path), f"the file cannot be read: {exc}")))

    @staticmethod
    def _is_parquet(name: str) -> bool:
        return name.lower().endswith((".parquet", ".pq"))

    def _bad_row(self, bad: BadRow) -> None:
        self._bad_rows.append((bad.line - self._first_line,
                               BadRecord(f"{bad.path}:{bad.line}", f"column {bad.column}: {bad.reason}", bad.value)))

    def _next_batch(self) -> Batch | None:
        if self._batches is None:
            return None
        try:
            return next(self._batches, None)
        except (UserError, OSError) as exc:  # a file that breaks mid-way: the rest of it is one bad record
            self._batches = None
            self._bad_rows.append((np.iinfo(np.int64).max, BadRecord(str(self.root / self._file),
                                                                       f"the file cannot be read on: {exc}")))
            return None

    def _read(self, timeout: float):
        deadline = time.monotonic() + timeout
        while self._file is None:
            if not self._pending and time.monotonic() - self._last_listing >= min(timeout, 1.0) / 4:
                self._refresh()
            if self._pending:
                self._open(self._pending.pop(0), 0)
                break
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            time.sleep(min(left, max(timeout / 4, 0.01)))
        name = self._file
        batch = self._held if self._held is not None else self._next_batch()
        following = self._next_batch() if batch is not None else None
        self._held = following
        end_row = None if following is None else int(following.sample_ids[0])
        cut = np.iinfo(np.int64).max if end_row is None else end_row
        bad = [record for row, record in self._bad_rows if row < cut]
        self._bad_rows = [(row, record) for row, record in self._bad_rows if row >= cut]
        if end_row is None:
            self._close_file()
        end = {"file": name, "row": end_row}
        if batch is not None:
            batch.sample_ids = file_sample_ids(name, batch.sample_ids)
        return batch, end, bad

    def _close_file(self) -> None:
        self._file, self._batches, self._held = None, None, None

    def lag(self) -> dict:
        return {"lag_files": len(self._pending) + (self._file is not None)}

    def close(self) -> None:
        super().close()
        self._close_file()
