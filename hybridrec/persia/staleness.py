"""What the staleness of a real job's lookups was: each trainer's timeline of lookups and
acknowledged updates, and the job's view of them once every trainer's is gathered.

A trainer's `Timeline` holds, in step order, the wall-clock time each training lookup was sent and
answered and each update was sent and acknowledged (the embedding pipeline records them; the
trainers of one job share the host's clock, emulated hosts included). Gathered (`StalenessTelemetry.facts`,
a collective), they say for every lookup of trainer r at its step i how many steps of every
trainer r' it missed: the steps before i whose update r' had not had acknowledged when the lookup
was sent (an update acknowledged after that may still have been applied in time: this count is
the most the lookup can have missed, and the pipeline's own bound applies to r' = r). The job's
`staleness_cross` in final_metrics.json is the histogram of each lookup's largest such count, and
the leader writes every time to `staleness_trace.npz` in the output directory, from which the
staleness lab replays the job (hybridrec.lab.trace). ps_async's dense pulls and pushes are
recorded the same way in `dense_trace.npz`, with the PS shards' version numbers each pull read
and each push made: the order in which every shard applied the pushes, and which of them each
step computed on, as the servers saw them rather than as the clock suggests. The embedding
lookups and updates carry such numbers too, one per PS store (a table on one shard, the trace's
`columns`, "<table>@<shard>"): how many updates the store had applied when it served the lookup,
and each update's place in the store's order.
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from hybridrec.metrics import StalenessHistogram

TRACE_FILE = "staleness_trace.npz"  # the embedding lookups' times
DENSE_TRACE_FILE = "dense_trace.npz"  # ps_async: the dense pulls' and pushes' times and versions
TRACE_KINDS = ("lookups", "updates", "lookup_versions", "update_versions")  # a trace's arrays per trainer


class Timeline:
    """One trainer's lookups and updates: (sent, answered) wall-clock seconds, in step order; and
    where the server numbers its state, per lookup and update the version it answered
    (`lookup_versions`, `update_versions`): ps_async's dense pulls and pushes one per shard, the
    embedding lookups and updates one per column of `columns` (`note_versions`; -1: that lookup
    or update did not reach the store)."""

    def __init__(self) -> None:
        self.lookups: list[tuple[float, float]] = []
        self.updates: list[tuple[float, float]] = []
        self.lookup_versions: list[list[int]] = []
        self.update_versions: list[list[int]] = []
        self.columns: list[str] = []  # the embedding stores numbered, "<table>@<shard>"
        self._column: dict[str, int] = {}

    @staticmethod
    def now() -> float:
        return time.time()

    def note_versions(self, kind: str, versions: dict | None) -> None:
        """One more row of `kind` ("lookup_versions" or "update_versions") from a lookup's or an
        update's numbers ({table: [per shard]}, None or {} where the answer had none): a column
        per store, added as stores appear."""
        row: list[int] = []
        for table, numbers in (versions or {}).items():
            for shard, number in enumerate(numbers):
                name = f"{table}@{shard}"
                if name not in self._column:
                    self._column[name] = len(self.columns)
                    self.columns.append(name)
                column = self._column[name]
                row.extend([-1] * (column + 1 - len(row)))
                row[column] = int(number)
        getattr(self, kind).append(row)

    def arrays(self) -> dict[str, np.ndarray]:
        out = {"lookups": np.array(self.lookups, np.float64).reshape(-1, 2),
               "updates": np.array(self.updates, np.float64).reshape(-1, 2)}
        if any(self.lookup_versions) or any(self.update_versions):
            width = max(len(row) for row in self.lookup_versions + self.update_versions)
            for kind in ("lookup_versions", "update_versions"):
                rows = getattr(self, kind)
                out[kind] = np.array([row + [-1] * (width - len(row)) for row in rows], np.int64).reshape(len(rows),
                                                                                                          width)
            if self.columns:
                out["columns"] = np.array(self.columns)
        return out


def _on_columns(part: dict[str, np.ndarray], columns: list[str]) -> dict[str, np.ndarray]:
    """`part`'s version rows over `columns` (a superset of its own, -1 where it has none)."""
    where = [columns.index(str(name)) for name in part["columns"]]
    for kind in ("lookup_versions", "update_versions"):
        wide = np.full((len(part[kind]), len(columns)), -1, np.int64)
        wide[:, where] = part[kind][:, :len(where)]
        part[kind] = wide
    return part


def joined(timelines: list[Timeline]) -> dict[str, np.ndarray]:
    """One trainer's timelines of several epochs, one after another, each epoch's lookups cut to
    the batches it trained (as many as its updates): a batch looked up at an epoch's end and then
    skipped, because another trainer had none, was not trained and is no step. Embedding versions
    are put over the columns of every epoch."""
    parts = [t.arrays() for t in timelines]
    for part in parts:
        for lookups in ("lookups", "lookup_versions"):
            if lookups in part:
                part[lookups] = part[lookups][:len(part["updates"])]
    columns = list(dict.fromkeys(str(name) for p in parts for name in p.get("columns", [])))
    if columns and all("columns" in p for p in parts):
        parts = [_on_columns(p, columns) for p in parts]
    names = [name for name in TRACE_KINDS if parts and all(name in p for p in parts)]
    out = {name: np.concatenate([p[name] for p in parts]) if parts else np.empty((0, 2)) for name in
           names or ("lookups", "updates")}
    if columns and "lookup_versions" in out:
        out["columns"] = np.array(columns)
    return out


def missed_steps(trainers: list[dict[str, np.ndarray]]) -> list[np.ndarray]:
    """Per trainer, [lookups, trainers]: the steps of each trainer a lookup may have missed (those
    before the lookup's step whose update was not acknowledged when it was sent)."""
    acked = [np.sort(t["updates"][:, 1]) for t in trainers]
    out = []
    for t in trainers:
        sent = t["lookups"][:, 0]
        step = np.arange(len(sent))
        seen = np.stack([np.searchsorted(a, sent, side="left") for a in acked], axis=1) if acked else np.zeros((len(sent), 0))
        out.append(np.maximum(step[:, None] - seen, 0))
    return out


class StalenessTelemetry:
    """The timelines of one trainer's streams; `facts(world)` gathers every trainer's. `name`:
    the fact's name and `trace_file` the file's (the dense pulls and pushes of ps_async are
    recorded the same way, as `dense_staleness_cross` in DENSE_TRACE_FILE)."""

    def __init__(self, output_dir: str | Path, name: str = "staleness_cross", trace_file: str = TRACE_FILE):
        self.output_dir = Path(output_dir)
        self.name, self.trace_file = name, trace_file
        self.timelines: list[Timeline] = []

    def add(self, timeline: Timeline) -> None:
        self.timelines.append(timeline)

    def facts(self, world) -> dict:
        """{name: histogram of each lookup's most missed steps of one trainer}; the leader writes
        every trainer's times to the trace file. Every trainer calls this together."""
        every = world.gather(joined(self.timelines))
        if not any(len(t["lookups"]) for t in every):
            return {}
        histogram = StalenessHistogram()
        for missed in missed_steps(every):
            histogram.add(missed.max(axis=1) if missed.size else np.zeros(len(missed), np.int64))
        if world.leader:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            arrays = {f"{kind}_{rank}": t[kind] for rank, t in enumerate(every) for kind in (*TRACE_KINDS, "columns")
                      if kind in t}
            np.savez(self.output_dir / self.trace_file, trainers=np.array(len(every)), **arrays)
        return {self.name: histogram.as_dict()}
