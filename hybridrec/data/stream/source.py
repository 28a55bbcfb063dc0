"""The interface every stream backend implements, and the bookkeeping they share.

A stream source yields `Batch`es without end: it waits for records to arrive and stops only when
told (`stop()`, a signal), or once `idle_timeout` seconds passed with nothing new. Each trainer
reads its own share (its files, or its entries through a Redis consumer group); with
`whole_stream` every trainer reads every record in the same batches (DES's trainers each compute a
part of every sample).

**Positions.** A backend cuts what it reads into *spans*: a batch together with the bad records
before it, or bad records alone. Each span ends at a backend-specific position (files: the next
row of a file; Redis: the last entry ID delivered to this trainer). The training loop reports each
batch it has trained (`trained(batch)`); `position()` is the end of the longest run of spans,
from the start, whose batches are all trained. That record (small, JSON-able) is what a checkpoint
stores; `start(position)` continues after it, and `commit(position)` tells the backend a durable
checkpoint covers it (Redis acknowledges those entries then, and only then). So after a crash the
records after the checkpoint's position are read again, and none before it: every record is
trained once with respect to the restored model.

**Bad records** (a line the format's parser rejects, an entry without data) never stop the stream.
Each is counted once the position passes it, logged then with its place (file and line, or entry
ID), and acknowledged with the span it belongs to; the count is part of the position, so a resumed
run neither loses nor repeats it.

**Lockstep trainers.** With `empty_when_dry`, a trainer whose share has nothing ready within
`poll_interval` seconds yields an empty batch (zero rows), so trainers that step together keep
stepping while another's share runs dry: the dry trainer contributes no rows and a zero gradient,
the others train what they hold. The stream of a trainer ends after `idle_timeout` seconds without
data; in lockstep the job then ends for every trainer, and whatever another trainer still held is
after its recorded position, so it is read again by the next run, not lost.

A backend is one module in `hybridrec/data/stream/backends/` named after it, holding one
`StreamSource` subclass whose `Options` (a pydantic model) are its configuration keys; `open_source`
finds it by name. A Kafka backend would be `backends/kafka.py` and nothing else.
"""
from __future__ import annotations

import abc
import collections
import dataclasses
import logging
import threading
import time
from typing import Any, ClassVar, Iterator

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from hybridrec.data.batch import Batch, JaggedFeatures
from hybridrec.data.tabular import TabularSchema

log = logging.getLogger("hybridrec.data.stream")

MAX_REPORTED_BAD_RECORDS = 20  # bad records logged one by one; past this only counted (and summarised)


class CommonOptions(BaseModel):
    """Keys every backend takes (besides `backend`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    idle_timeout: float | None = Field(None, gt=0, description="seconds without a new record after which the "
                                                             "stream ends (and training with it); null: never")
    poll_interval: float = Field(0.5, gt=0, le=60, description="seconds between looks for new data when there is "
                                                             "none; lockstep trainers step with an empty batch after "
                                                             "this long without one")
    record_sample_ids: bool = Field(False, description="each checkpoint writes the sample ids its trainer trained "
                                                       "since the one before to <output_dir>/sample_ids/ (audits, "
                                                       "tests)")


@dataclasses.dataclass(frozen=True)
class StreamContext:
    """What a source needs to know of the job: how records parse, batch size, which trainer reads."""

    schema: TabularSchema
    batch_size: int
    rank: int = 0
    trainers: int = 1
    whole_stream: bool = False  # every trainer reads every record, in the same batches (DES)
    empty_when_dry: bool = False  # lockstep trainers: an empty batch after poll_interval without data
    strict: bool = False  # data.strict: the first bad record is an error
    job: str = "hybridrec"  # names the job's consumer group where the backend has one


@dataclasses.dataclass(frozen=True)
class BadRecord:
    """A record the stream skipped: where it is (file:line, or an entry ID) and why."""

    where: str
    reason: str
    value: str = ""

    def __str__(self) -> str:
        return f"{self.where}: {self.reason}" + (f" (value {self.value!r})" if self.value else "")


@dataclasses.dataclass
class _Span:
    batch_id: int | None  # id() of the batch in flight, None for a span of bad records only
    end: dict
    bad: list
    records: int
    done: bool = False


def empty_batch(schema: TabularSchema) -> Batch:
    """A batch of zero rows with the schema's features (what a dry lockstep trainer steps with)."""
    names = schema.sparse_feature_names
    return Batch(JaggedFeatures(list(names), np.empty(0, np.uint64), np.zeros(1, np.int64)),
                 np.zeros((0, len(schema.dense)), np.float32), np.zeros((0, len(schema.labels)), np.float32),
                 np.empty(0, np.uint64))


class StreamSource(abc.ABC):
    """One trainer's reader of a stream (see the module docstring). Subclasses implement `_read`
    and may override `prepare`, `_restart`, `commit`, `lag` and `close`."""

    name: ClassVar[str]
    Options: ClassVar[type[BaseModel]]

    def __init__(self, options: BaseModel, common: CommonOptions, context: StreamContext) -> None:
        self.options = options
        self.common = common
        self.context = context
        self._lock = threading.Lock()
        self._spans: collections.deque[_Span] = collections.deque()
        self._position: dict | None = None
        self._records = 0  # records trained, through the position
        self._bad = 0  # bad records passed, through the position
        self._trained_ids: list[np.ndarray] = []
        self._stop = threading.Event()
        self._last_trained_at: float | None = None
        self.empty_steps = 0
        self.bad_examples: list[str] = []  # the first bad records passed in this process, as logged

    # ------------------------------------------------------------------ the job's side
    def prepare(self, fresh: bool) -> None:
        """Set-up done once per job by its leader before any trainer reads (Redis: the consumer
        group). `fresh`: the run starts over, forgetting what an earlier run of the job read."""

    def step_when_dry(self, on: bool) -> None:
        """Lockstep trainers: yield an empty batch after poll_interval without data (see the
        module docstring)."""
        self.context = dataclasses.replace(self.context, empty_when_dry=bool(on))

    def start(self, state: dict | None) -> None:
        """Continue after `state` (a `state()` record of this trainer, as a checkpoint stored it),
        or from the beginning of the stream with None."""
        self._position = None if state is None else state.get("position")
        self._records = 0 if state is None else int(state.get("records", 0))
        self._bad = 0 if state is None else int(state.get("bad_records", 0))
        self._restart(self._position)

    def __iter__(self) -> Iterator[Batch]:
        """This trainer's batches, waiting for data; ends on `stop()` or after idle_timeout."""
        idle = 0.0  # seconds spent looking for data in vain since the last record (not waiting for the consumer)
        while not self._stop.is_set():
            looked = time.monotonic()
            got = self._read(self.common.poll_interval)
            if got is None:
                idle += time.monotonic() - looked
                if self.common.idle_timeout is not None and idle >= self.common.idle_timeout:
                    return
                if self.context.empty_when_dry:
                    self.empty_steps += 1
                    yield self._emit(empty_batch(self.context.schema), self._span_end(), [])
                continue
            idle = 0.0
            batch, end, bad = got
            item = self._emit(batch, end, bad)
            if item is not None:
                yield item

    def trained(self, batch: Batch) -> None:
        """The loop applied `batch`'s update; the position moves past it once every batch before
        it is trained too."""
        with self._lock:
            for span in self._spans:
                if span.batch_id == id(batch) and not span.done:
                    span.done = True
                    break
            if self.common.record_sample_ids and len(batch):
                self._trained_ids.append(batch.sample_ids.copy())
            self._advance()
            self._last_trained_at = time.time()

    def state(self) -> dict:
        """This trainer's place in the stream, as a checkpoint stores it: the backend's position
        and the counts of records trained and bad records skipped through it."""
        with self._lock:
            return {"backend": self.name, "position": self._position, "records": self._records,
                    "bad_records": self._bad}

    def take_trained_ids(self) -> np.ndarray:
        """Sample ids trained since the last call (with record_sample_ids), in training order."""
        with self._lock:
            ids, self._trained_ids = self._trained_ids, []
        return np.concatenate(ids) if ids else np.empty(0, np.uint64)

    def commit(self, state: dict) -> None:
        """A durable checkpoint holds `state` (this trainer's): what it covers will never be read
        again. Redis acknowledges the entries then."""

    def stop(self) -> None:
        """End the iteration at the next look for data (from any thread, e.g. a signal handler)."""
        self._stop.set()

    def close(self) -> None:
        self.stop()

    def lag(self) -> dict:
        """How far this trainer is behind the head of its share: `lag_records` (entries) or
        `lag_files`, and `lag_seconds` behind the newest record's time where the backend knows it."""
        return {}

    # ------------------------------------------------------------------ backends implement
    @abc.abstractmethod
    def _restart(self, position: dict | None) -> None:
        """Position the reader right after `position` (None: the start of the stream)."""

    @abc.abstractmethod
    def _read(self, timeout: float) -> tuple[Batch | None, dict, list[BadRecord]] | None:
        """The next span, waiting at most about `timeout` seconds: (batch or None for bad records
        alone, the position at its end, its bad records), or None when nothing arrived."""

    def _span_end(self) -> dict | None:
        """The position at the end of everything read so far (an empty batch's span ends there)."""
        with self._lock:
            return self._spans[-1].end if self._spans else self._position

    # ------------------------------------------------------------------ bookkeeping
    def _emit(self, batch: Batch | None, end: dict | None, bad: list[BadRecord]) -> Batch | None:
        if bad and self.context.strict:
            from hybridrec.errors import UserError

            raise UserError(f"bad record at {bad[0]} (data.strict is true: the first bad record stops the run; set "
                            f"it false to skip and count bad records)")
        with self._lock:
            span = _Span(None if batch is None else id(batch), end, list(bad), 0 if batch is None else len(batch),
                         done=batch is None)
            self._spans.append(span)
            self._advance()
        return batch

    def _advance(self) -> None:
        """Move the position over the spans at the front that are done (lock held)."""
        while self._spans and self._spans[0].done:
            span = self._spans.popleft()
            if span.end is not None:
                self._position = span.end
            self._records += span.records
            for record in span.bad:
                self._bad += 1
                if len(self.bad_examples) < MAX_REPORTED_BAD_RECORDS:
                    self.bad_examples.append(str(record))
                    log.warning("stream: skipping bad record at %s%s", record,
                                "; further bad records are counted, not listed"
                                if len(self.bad_examples) == MAX_REPORTED_BAD_RECORDS else "")

    @property
    def records(self) -> int:
        return self._records

    @property
    def bad_records(self) -> int:
        return self._bad

    def facts(self) -> dict[str, Any]:
        """Counts for metrics: records trained and bad records through the position, empty steps."""
        return {"stream_records": self._records, "stream_bad_records": self._bad, "stream_empty_steps": self.empty_steps}
