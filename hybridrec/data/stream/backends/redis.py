"""Stream backend `redis`: Redis Streams read through one consumer group per job, each trainer
one consumer (`pip install 'hybridrec[stream]'` for the client).

`url` is `redis://[user:password@]HOST:PORT/STREAM` (`?db=N` for another database; the password
may come from the environment variable named by `password_env` instead). An entry is either one
line in the job's data format (a single field, `line` by default: what `hybridrec data stream`
writes) or a map of the schema's columns to their values (columns it does not name are missing
values; fields the schema does not use are ignored).

Exactly once: an entry is acknowledged (XACK) only once a durable checkpoint covers it
(`commit`), never on delivery. A trainer's consumer name is stable (`trainer-<rank>`), so after a
crash the restarted trainer reads its own pending entries again first: those with an ID up to the
checkpoint's position (the last entry ID it had trained) are acknowledged and skipped, the rest
are trained, then new entries follow. A fresh run (no checkpoint) of a job whose group exists
recreates the group, so it reads the stream from `start` again.

With `whole_stream` (DES: every trainer reads every entry) each trainer has a group of its own,
`<group>:trainer-<rank>`, and batches hold exactly `data.batch_size` entries, so every trainer
cuts the stream into the same batches; entries past the last full batch wait for more.

Sample ids are the entry IDs, `(ms << 22) | seq`. `lag_seconds` is now minus the event time of
the newest trained record where the schema names an `event_time` column (kept in the position as
`event_time`), else minus the time its entry entered the stream (the entry ID's milliseconds).
"""
from __future__ import annotations

import os
import time
import urllib.parse
from collections import deque
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

from hybridrec.data.stream.source import BadRecord, StreamSource
from hybridrec.data.tabular import describe_bad_line, parse_line_buffer
from hybridrec.errors import UserError

SEQ_BITS = 22  # an entry ID ms-seq is the sample id (ms << SEQ_BITS) | seq


class RedisOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    url: str = Field(description="redis://[user:password@]HOST:PORT/STREAM")
    group: str | None = Field(None, min_length=1, description="the job's consumer group (default: "
                                                             "hybridrec:<train.output_dir>)")
    start: Literal["earliest", "latest"] = Field("earliest", description="where a new group starts: the first "
                                                 "entry of the stream, or entries added after it is made")
    line_field: str = Field("line", min_length=1, description="the field of an entry that holds one data line")
    max_wait: float = Field(0.05, ge=0, le=60, description="seconds a batch that is not full waits for more entries")
    password_env: str | None = Field(None, description="environment variable holding the password")
    timeout: float = Field(30.0, gt=0, description="seconds a Redis command may take before it is an error")

    @field_validator("url")
    @classmethod
    def _url(cls, value):
        parse_url(value)
        return value


def parse_url(url: str) -> dict:
    """{host, port, db, stream, username, password} of a redis:// stream URL; ValueError saying
    what is wrong."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "redis":
        raise ValueError(f"a stream URL is redis://HOST:PORT/STREAM, got {url!r}")
    stream = urllib.parse.unquote(parts.path.lstrip("/"))
    if not stream:
        raise ValueError(f"the URL names no stream: redis://HOST:PORT/STREAM, got {url!r}")
    try:
        port = parts.port or 6379
    except ValueError:
        raise ValueError(f"the URL's port is not a number: {url!r}") from None
    query = urllib.parse.parse_qs(parts.query)
    db = query.get("db", ["0"])[0]
    if not db.isdigit():
        raise ValueError(f"db must be a number, got {db!r} in {url!r}")
    return {"host": parts.hostname or "127.0.0.1", "port": port, "db": int(db), "stream": stream,
            "username": urllib.parse.unquote(parts.username) if parts.username else None,
            "password": urllib.parse.unquote(parts.password) if parts.password else None}


def connect(url: str, password_env: str | None = None, timeout: float = 30.0):
    """A redis client of a stream URL whose XREADGROUP / XRANGE replies stay raw nested lists
    (the client would otherwise build a dict per entry in Python), and the stream's key."""
    try:
        import redis
    except ImportError:
        raise UserError("data.stream.backend redis needs the Redis client: pip install 'hybridrec[stream]'") from None
    try:
        where = parse_url(url)
    except ValueError as exc:
        raise UserError(f"stream URL: {exc}") from None
    password = where["password"]
    if password_env:
        if password_env not in os.environ:
            raise UserError(f"data.stream.password_env: the environment variable {password_env!r} is not set")
        password = os.environ[password_env]
    client = redis.Redis(host=where["host"], port=where["port"], db=where["db"], username=where["username"],
                         password=password, socket_timeout=timeout, socket_connect_timeout=timeout)
    for command in ("XREADGROUP", "XREAD", "XRANGE"):
        client.set_response_callback(command, lambda response, **options: response)
    try:
        client.ping()
    except redis.exceptions.RedisError as exc:  # unreachable, refused, wrong password: the user's to fix
        client.close()
        raise UserError(f"stream URL {url}: cannot use Redis at {where['host']}:{where['port']} "
                        f"({type(exc).__name__}: {exc})") from None
    return client, where["stream"]


def entry_key(entry_id: bytes | str) -> tuple[int, int]:
    """(ms, seq) of an entry ID, its order."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


def entry_sample_ids(entry_ids: list) -> np.ndarray:
    """The sample ids of entry IDs: (ms << 22) | seq."""
    if not entry_ids:
        return np.empty(0, np.uint64)
    parts = np.array(b" ".join(entry_ids).replace(b"-", b" ").split(), dtype=np.uint64).reshape(-1, 2)
    return (parts[:, 0] << np.uint64(SEQ_BITS)) | parts[:, 1]


class RedisSource(StreamSource):
    """A trainer's consumer of the job's group (see the module docstring)."""

    name = "redis"
    Options = RedisOptions

    def __init__(self, options, common, context) -> None:
        super().__init__(options, common, context)
        self.client, self.stream = connect(options.url, options.password_env, options.timeout)
        group = options.group or context.job
        self.consumer = f"trainer-{context.rank}"
        self.group = f"{group}:{self.consumer}" if context.whole_stream else group
        self._groups = ([f"{group}:trainer-{r}" for r in range(context.trainers)] if context.whole_stream
                        else [group])
        schema = context.schema
        self._line_columns = list(schema.column_names)
        used = schema.labels + schema.dense + schema.categorical + schema.multi_categorical + schema.hour_columns
        self._field_columns = [c for c in (schema.column_names or used) if c in used]
        self._field_bytes = [c.encode() for c in self._field_columns]
        self._line_layout = schema.column_layout(self._line_columns, options.url) if self._line_columns else None
        self._field_layout = schema.column_layout(self._field_columns, options.url)
        self._line_field = options.line_field.encode()
        event = schema.event_time  # where a record says when it happened: lag_seconds behind it
        self._event_field = None if event is None else event.encode()
        self._event_column = (self._line_columns.index(event) if event is not None and event in self._line_columns
                              else None)
        self._cursor: bytes | None = None  # reading this consumer's pending entries after this ID; None: new ones
        self._covered: tuple[int, int] | None = None  # the checkpoint's last entry ID
        self._delivered: deque = deque()  # (last key, [ids]) of the spans read, oldest first, until acknowledged
        self._last_key: tuple[int, int] | None = None
        self._carry: list = []  # entries read past a full batch (whole_stream), or read while stopping

    # ------------------------------------------------------------------ the group
    def prepare(self, fresh: bool) -> None:
        """Make the job's group(s); a fresh run starts them over from `start`."""
        import redis

        first = "0" if self.options.start == "earliest" else "$"
        for group in self._groups:
            try:
                self.client.xgroup_create(self.stream, group, id=first, mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise
                if fresh:
                    self.client.xgroup_destroy(self.stream, group)
                    self.client.xgroup_create(self.stream, group, id=first, mkstream=True)

    def _restart(self, position: dict | None) -> None:
        if position is not None and (position.get("stream"), position.get("group")) != (self.stream, self.group):
            raise UserError(f"resume: the checkpoint read stream {position.get('stream')!r} with consumer group "
                            f"{position.get('group')!r}; data.stream now names stream {self.stream!r}, group "
                            f"{self.group!r}. Resume with the settings of that run, or start over (--overwrite)")
        self._covered = None if position is None else entry_key(position["last_id"])
        self._last_key = self._covered
        self._cursor = b"0"  # this consumer's pending entries first
        self._delivered.clear()
        self._carry = []

    # ------------------------------------------------------------------ reading
    def _xreadgroup(self, entry_id: bytes, count: int, block_ms: int | None):
        args = ["XREADGROUP", "GROUP", self.group, self.consumer, "COUNT", count]
        if block_ms is not None:
            args += ["BLOCK", max(1, block_ms)]
        reply = self.client.execute_command(*args, "STREAMS", self.stream, entry_id)
        if not reply:
            return []
        # RESP3 answers a map {stream: entries}, RESP2 a list [[stream, entries]]
        return next(iter(reply.values())) if isinstance(reply, dict) else reply[0][1]

    def _read(self, timeout: float):
        size = self.context.batch_size
        deadline = time.monotonic() + timeout
        entries, bad_ids = self._carry, []
        self._carry = []
        first_at = time.monotonic() if entries else None
        while len(entries) < size:
            if self._cursor is not None:  # pending entries of this consumer, delivered before a crash
                got = self._xreadgroup(self._cursor, size - len(entries), None)
                if not got:
                    self._cursor = None
                    continue
                self._cursor = got[-1][0]
                got = self._skip_covered(got)
            else:
                now = time.monotonic()
                wait_until = deadline if first_at is None or self.context.whole_stream else \
                    min(deadline, first_at + self.options.max_wait)
                if now >= wait_until:
                    break
                got = self._xreadgroup(b">", size - len(entries), int((wait_until - now) * 1000))
                if not got:
                    if self._stop.is_set():
                        break
                    continue
            if got and first_at is None:
                first_at = time.monotonic()
            entries.extend(got)
        if self.context.whole_stream and len(entries) < size:
            self._carry = entries  # only full batches, so that every trainer cuts the same ones
            return None
        if not entries:
            return None
        return self._span(entries)

    def _skip_covered(self, entries: list) -> list:
        """Pending entries up to the checkpoint's position were trained in the restored model:
        acknowledge them and keep the rest."""
        if self._covered is None:
            return entries
        covered = [e[0] for e in entries if entry_key(e[0]) <= self._covered]
        if covered:
            self.client.xack(self.stream, self.group, *covered)
        return entries[len(covered):]

    def _span(self, entries: list):
        """(batch, position after it, bad records) of some entries, in ID order."""
        ids = [e[0] for e in entries]
        lines, bad = [], []
        kept_ids = []
        field = self._line_field
        for entry_id, fields in entries:
            if fields is None:  # the entry was deleted (XDEL, XTRIM) while it was pending
                bad.append(BadRecord(f"{self.stream} entry {entry_id.decode()}", "the entry was deleted before it "
                                                                                   "was trained"))
            elif len(fields) == 2 and fields[0] == field:
                lines.append((0, fields[1]))
                kept_ids.append(entry_id)
            else:
                lines.append((1, self._field_line(fields)))
                kept_ids.append(entry_id)
        batches = []
        for kind in (0, 1):
            chosen = [i for i, (k, _) in enumerate(lines) if k == kind]
            if chosen:
                batch, more_bad = self._parse(kind, [lines[i][1] for i in chosen], [kept_ids[i] for i in chosen])
                bad += more_bad
                if batch is not None:
                    batches.append(batch)
        last = ids[-1]
        key = entry_key(last)
        self._delivered.append((key, ids))
        self._last_key = key
        from hybridrec.data.batch import Batch

        batch = None
        if batches:
            batch = batches[0] if len(batches) == 1 else Batch.concat(batches)
            if len(batches) > 1:  # lines and field maps mixed: back to entry order
                batch = batch.take_rows(np.argsort(batch.sample_ids, kind="stable"))
        position = {"stream": self.stream, "group": self.group, "consumer": self.consumer,
                    "last_id": last.decode()}
        event_time = self._event_time(entries)
        if event_time is not None:
            position["event_time"] = event_time
        return batch, position, bad

    def _event_time(self, entries: list) -> float | None:
        """The schema's event_time (Unix seconds) of the newest entry that has a readable one."""
        if self._event_field is None:
            return None
        for _, fields in reversed(entries):
            if fields is None:
                continue
            try:
                if len(fields) == 2 and fields[0] == self._line_field:
                    if self._event_column is None:
                        return None
                    return float(fields[1].split(self.context.schema.delimiter.encode())[self._event_column])
                values = dict(zip(fields[0::2], fields[1::2]))
                if self._event_field in values:
                    return float(values[self._event_field])
            except (ValueError, IndexError):
                continue
        return None

    def _field_line(self, fields: list) -> bytes:
        """One line of the schema's columns (in _field_columns order) from an entry's field map."""
        values = dict(zip(fields[0::2], fields[1::2]))
        delimiter = self.context.schema.delimiter.encode()
        return delimiter.join(values.get(c, b"") for c in self._field_bytes)

    def _parse(self, kind: int, lines: list, ids: list):
        """(batch or None, bad records) of entries that are lines (kind 0) or field maps (kind 1)."""
        bad = []
        layout = self._line_layout if kind == 0 else self._field_layout
        if layout is None:
            return None, [BadRecord(f"{self.stream} entry {i.decode()}", "a line entry needs the file's columns in "
                                    "data.schema.column_names (a stream has no header line)") for i in ids]
        if any(b"\n" in line for line in lines):
            keep = [i for i, line in enumerate(lines) if b"\n" not in line]
            bad += [BadRecord(f"{self.stream} entry {ids[i].decode()}", "the entry holds more than one line")
                    for i in range(len(lines)) if b"\n" in lines[i]]
            lines, ids = [lines[i] for i in keep], [ids[i] for i in keep]
            if not lines:
                return None, bad
        data = b"\n".join(lines) + b"\n"
        buffer = np.frombuffer(data, dtype=np.uint8)
        kinds, slots = layout
        columns = self._line_columns if kind == 0 else self._field_columns
        batch, rejected, _, _ = parse_line_buffer(self.context.schema, kinds, slots, buffer, len(buffer), 0,
                                               (0, len(lines)))
        seen = np.zeros(len(lines), bool)
        for row in rejected:
            described = describe_bad_line("", columns, buffer, row, 0)
            seen[int(row[0])] = True
            bad.append(BadRecord(f"{self.stream} entry {ids[int(row[0])].decode()}",
                                 f"column {described.column}: {described.reason}", described.value))
        sample_ids = entry_sample_ids(ids)
        if batch is not None:
            rows = batch.sample_ids.astype(np.int64)
            seen[rows] = True
            batch.sample_ids = sample_ids[rows]
        for i in np.flatnonzero(~seen):  # blank lines: the parser skips them without a word
            bad.append(BadRecord(f"{self.stream} entry {ids[i].decode()}", "the entry is empty"))
        return batch, bad

    # ------------------------------------------------------------------ acknowledging
    def commit(self, state: dict) -> None:
        position = state.get("position")
        if position is None:
            return
        upto = entry_key(position["last_id"])
        ids = []
        while self._delivered and self._delivered[0][0] <= upto:
            ids += self._delivered.popleft()[1]
        for start in range(0, len(ids), 10_000):
            self.client.xack(self.stream, self.group, *ids[start:start + 10_000])

    def lag(self) -> dict:
        lag = {}
        try:
            for info in self.client.xinfo_groups(self.stream):
                if info["name"].decode() == self.group:
                    lag["lag_records"] = info.get("lag")
        except Exception:  # lag is informative: a failed look-up leaves it out
            pass
        with self._lock:
            position = self._position
        if position is not None:  # behind the newest trained record's event time, else its entry's time
            since = position.get("event_time", entry_key(position["last_id"])[0] / 1000.0)
            lag["lag_seconds"] = max(0.0, time.time() - since)
        return lag

    def close(self) -> None:
        super().close()
        self.client.close()
