"""Writing records into a Redis stream (`hybridrec data stream`): one entry per line of a data
file, or of synthetic Criteo-format rows with a planted model, at a rate or as fast as Redis takes
them. For users feeding a stream and for the tests and benchmarks that need one."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

from hybridrec.data.stream.backends.redis import connect
from hybridrec.errors import UserError


@dataclass
class Produced:
    """What a producer wrote: how many entries, and their IDs when asked to keep them."""

    count: int = 0
    first_id: str | None = None
    last_id: str | None = None
    ids: list[bytes] = field(default_factory=list)
    seconds: float = 0.0


def file_lines(path: str | Path, skip_header: bool = False) -> Iterator[bytes]:
    """The non-blank lines of a text file, without their line ends."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"--from: file {str(path)!r} does not exist")
    with open(path, "rb") as handle:
        if skip_header:
            handle.readline()
        for line in handle:
            line = line.rstrip(b"\r\n")
            if line:
                yield line


def synthetic_lines(rows: int, seed: int = 0, first_row: int = 0, **overrides) -> Iterator[bytes]:
    """`rows` synthetic Criteo-format lines (the planted model of `hybridrec data synth`), rows
    first_row.. of the generator."""
    from hybridrec.data.synthetic import criteo_like, synthetic_tsv

    for text in synthetic_tsv(rows, seed, criteo_like(**overrides), first_row):
        yield from text.rstrip(b"\n").split(b"\n")


def parse_rate(text: str | float | None) -> float | None:
    """Records per second from '5000', '5000/s' or a number; None for no limit."""
    if text is None:
        return None
    value = str(text).strip().removesuffix("/s")
    try:
        rate = float(value)
    except ValueError:
        raise UserError(f"--rate: expected records per second such as 5000/s, got {text!r}") from None
    if not rate > 0:
        raise UserError(f"--rate: must be > 0 records per second, got {text!r}")
    return rate


def produce(url: str, lines: Iterable[bytes], rate: float | None = None, *, field_name: str = "line",
            chunk: int = 1000, keep_ids: bool = False, password_env: str | None = None,
            maxlen: int | None = None) -> Produced:
    """XADD every line of `lines` to the stream of `url` as an entry {field_name: line}, `chunk`
    entries per round trip, at most `rate` per second. `maxlen` trims the stream to about that
    many entries (XADD MAXLEN ~)."""
    client, stream = connect(url, password_env)
    produced = Produced()
    started = time.monotonic()
    try:
        pipe = client.pipeline(transaction=False)
        pending = 0
        for line in lines:
            pipe.xadd(stream, {field_name: line}, maxlen=maxlen, approximate=maxlen is not None)
            pending += 1
            if pending == chunk:
                _flush(pipe, produced, keep_ids)
                pending = 0
                if rate is not None:
                    ahead = produced.count / rate - (time.monotonic() - started)
                    if ahead > 0:
                        time.sleep(ahead)
        if pending:
            _flush(pipe, produced, keep_ids)
    finally:
        client.close()
    produced.seconds = time.monotonic() - started
    return produced


def _flush(pipe, produced: Produced, keep_ids: bool) -> None:
    ids = pipe.execute()
    if not ids:
        return
    if produced.first_id is None:
        produced.first_id = ids[0].decode()
    produced.last_id = ids[-1].decode()
    produced.count += len(ids)
    if keep_ids:
        produced.ids.extend(ids)
