"""A real job's recorded staleness as an emulation's schedule: `RecordedSchedule.from_job(dir)`
reads the times a distributed job's trainers recorded (staleness_trace.npz, and for ps_async
dense_trace.npz: hybridrec.persia.staleness) and answers the emulator's questions from them:

* the workers of a step in the order their lookups of that step were served;
* `embedding_plan()`: per PS store of the job (a table on one server), the order in which it
  applied the trainers' embedding updates, and per lookup how many of them it had applied when
  it served the lookup. The stores number their updates and the job records the numbers
  (`columns`, `lookup_versions`, `update_versions` of the embedding trace), so the replay applies
  each store's share of each update in that store's order and makes each read on exactly what
  each store held (hybridrec.lab.replayed_embeddings). A trace without them falls back on times:
* a read sees, of each worker's updates, those applied before it was served (an update counts as
  applied half-way between its sending and its acknowledgement, a lookup as served half-way
  between its sending and its answer), within what the bound requires and what was computed;
* extra updates land in the order they landed in the job;
* (async) `dense_plan()`: per PS shard of the job, the order in which the shard applied the
  trainers' dense pushes, and per step the number of them its pull read from each shard. The
  shards number their pushes, and a job records the numbers (`lookup_versions`,
  `update_versions`), so the plan is the servers' own; a trace without them gives one shard whose
  pushes land, and whose pulls read, at their midpoints in time.

A job is replayed from `timeline()`: every read and every update in the order they happened (and
under async every step at its dense pull and every dense push when it landed), so a trainer's read
that ran ahead of another trainer's read of an earlier step (up to tau + 1 rounds ahead) is made
ahead of it too. Where the job saw something the emulator cannot replay (a read that saw fewer
updates than an earlier read had already applied: the stores cannot un-apply), the read sees
more, and `departures` counts the updates by which reads differ from the job's.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hybridrec.errors import UserError
from hybridrec.lab.schedule import Schedule
from hybridrec.persia.staleness import DENSE_TRACE_FILE, TRACE_FILE, TRACE_KINDS


def load_trace(path: Path) -> list[dict[str, np.ndarray]]:
    """Per trainer, its {"lookups", "updates"} times from a trace file (and "lookup_versions",
    "update_versions" where it holds them)."""
    try:
        with np.load(path) as data:
            trainers = int(data["trainers"])
            return [{kind: data[f"{kind}_{r}"] for kind in (*TRACE_KINDS, "columns") if kind in ("lookups", "updates")
                     or f"{kind}_{r}" in data.files} for r in range(trainers)]
    except (OSError, KeyError, ValueError) as exc:
        raise UserError(f"{path}: not a staleness trace ({type(exc).__name__}: {exc})") from None


@dataclass
class DensePlan:
    """An async job's dense side as its PS shards saw it: `order[k]`, the (worker, step) of every
    push in the order shard k applied them; `reads[worker, step]`, per shard how many of its pushes
    the step's pull read; `source`: "versions" (the shards' numbers) or "times" (midpoints)."""

    shards: int
    order: list[list[tuple[int, int]]]
    reads: dict[tuple[int, int], tuple[int, ...]]
    source: str


def _orders(trainers: list[dict], columns: int) -> tuple[list[list[tuple[int, int]]], list[int]] | None:
    """Per column (a server's store), the (worker, step) of every update in the order the store
    numbered them, and the number before its first; None where the numbers do not count each
    update of a column once, one after another (another client updated the store too, an update
    went unnumbered or was split in two: then the order is not known)."""
    order, first = [], []
    for k in range(columns):
        pushes = sorted((int(t["update_versions"][i, k]), w, i) for w, t in enumerate(trainers)
                        for i in range(len(t["update_versions"])) if t["update_versions"][i, k] != -1)
        numbers = [v for v, _, _ in pushes]
        if numbers and (numbers[0] < 0 or numbers != list(range(numbers[0], numbers[0] + len(numbers)))):
            return None
        first.append(numbers[0] - 1 if numbers else 0)  # a store restored from a checkpoint counts on
        order.append([(w, i) for _, w, i in pushes])
    return order, first


def _read_counts(trainer: dict, i: int, order: list, first: list[int]) -> list[int]:
    """Per column, how many of its updates lookup i of `trainer` read (-1: it did not read it)."""
    return [-1 if v < 0 else int(np.clip(v - first[k], 0, len(order[k])))
            for k, v in enumerate(trainer["lookup_versions"][i].tolist())]


def _versions_plan(dense: list[dict]) -> DensePlan | None:
    """The plan from the shards' version numbers; None where the trace lacks them or they do not
    number every push of a shard once, one after another (then times decide)."""
    if not dense or not all("lookup_versions" in t and "update_versions" in t for t in dense):
        return None
    columns = {t[kind].shape[1] for t in dense for kind in ("lookup_versions", "update_versions") if len(t[kind])}
    if len(columns) != 1:
        return None
    shards = columns.pop()
    known = _orders(dense, shards)
    if known is None:
        return None
    order, first = known
    reads = {(w, i): tuple(max(c, 0) for c in _read_counts(t, i, order, first))
             for w, t in enumerate(dense) for i in range(min(len(t["lookup_versions"]), len(t["updates"])))}
    return DensePlan(shards, order, reads, "versions")


@dataclass
class EmbeddingPlan:
    """A job's embedding side as its PS stores saw it: `columns[k]`, the (table, shard) of store
    k; `order[k]`, the (worker, step) of every update in the order store k applied them;
    `reads[worker, step]`, {k: how many of store k's updates the lookup read} over the stores it
    read; `read_order`, every recorded lookup in an order in which each store's counts never
    fall (`_read_order`), and `inversions`, the lookups that order had to put before one whose
    counts they exceed on some store (0 when the job allows such an order)."""

    columns: list[tuple[str, int]]
    order: list[list[tuple[int, int]]]
    reads: dict[tuple[int, int], dict[int, int]]
    read_order: list[tuple[int, int]]
    inversions: int


def embedding_plan(embedding: list[dict]) -> EmbeddingPlan | None:
    """The plan from the PS stores' numbers in an embedding trace; None where it has none, or
    they do not give each store's order (then midpoints in time decide)."""
    if not embedding or not all("columns" in t and "lookup_versions" in t and "update_versions" in t
                                for t in embedding):
        return None
    names = list(dict.fromkeys(str(name) for t in embedding for name in t["columns"]))
    aligned = []
    for t in embedding:
        where = [names.index(str(name)) for name in t["columns"]]
        wide = dict(t)
        for kind in ("lookup_versions", "update_versions"):
            wide[kind] = np.full((len(t[kind]), len(names)), -1, np.int64)
            wide[kind][:, where] = t[kind][:, :len(where)]
        aligned.append(wide)
    known = _orders(aligned, len(names))
    if known is None:
        return None
    order, first = known
    reads = {(w, i): {k: c for k, c in enumerate(_read_counts(t, i, order, first)) if c >= 0}
             for w, t in enumerate(aligned) for i in range(min(len(t["lookup_versions"]), len(t["updates"])))}
    served = {(w, i): float(t["lookups"][i].mean()) for w, t in enumerate(aligned) for i in range(len(t["lookups"]))}
    read_order, inversions = _read_order(reads, served)
    columns = [(name.rpartition("@")[0], int(name.rpartition("@")[2])) for name in names]
    return EmbeddingPlan(columns, order, reads, read_order, inversions)


def _read_order(reads: dict[tuple[int, int], dict[int, int]],
                served: dict[tuple[int, int], float]) -> tuple[list[tuple[int, int]], int]:
    """The lookups in an order in which each store's counts never fall: a topological order of
    "read fewer of some store's updates" (one gate per store between each count and the next, so
    that the edges grow with the lookups, not with their pairs), the earliest served first among
    the lookups free to go. Where the job allows no such order (a lookup read store a before
    some update and store b after another, and a second lookup the other way round: two servers
    answer one lookup at different instants), the earliest served of the lookups left goes,
    counted in the inversions."""
    after: dict = {key: [] for key in reads}
    waiting: dict = dict.fromkeys(reads, 0)
    by_column: dict[int, dict[int, list]] = {}
    for key, counts in reads.items():
        for k, c in counts.items():
            by_column.setdefault(k, {}).setdefault(c, []).append(key)
    for k, by_count in by_column.items():
        counts = sorted(by_count)
        for lower, higher in zip(counts, counts[1:]):
            gate = ("gate", k, higher)  # passed once every lookup of the lower count went
            after[gate] = list(by_count[higher])
            waiting[gate] = len(by_count[lower])
            for a in by_count[lower]:
                after[a].append(gate)
            for b in by_count[higher]:
                waiting[b] += 1
    free = [(served.get(key, np.inf) if key in reads else -np.inf, key) for key, n in waiting.items() if n == 0]
    heapq.heapify(free)
    left = set(reads)
    order, inversions = [], 0
    while left:
        if free:
            _, key = heapq.heappop(free)
            if key in reads and key not in left:
                continue
        else:  # every lookup left waits for another: the earliest served goes
            key = min(left, key=lambda k: (served.get(k, np.inf), k))
            inversions += 1
        if key in reads:
            left.discard(key)
            order.append(key)
        for b in after[key]:
            waiting[b] -= 1
            if waiting[b] == 0 and (b not in reads or b in left):
                heapq.heappush(free, (served.get(b, np.inf) if b in reads else -np.inf, b))
    return order, inversions


def _times_plan(dense: list[dict]) -> DensePlan:
    """One shard: pushes land, and pulls read, half-way between their sending and their answer."""
    pushes = sorted((t, w, i) for w, trainer in enumerate(dense) for i, t in enumerate(_mid(trainer["updates"])))
    landed = np.array([t for t, _, _ in pushes])
    reads = {(w, i): (int(np.searchsorted(landed, t)),) for w, trainer in enumerate(dense)
             for i, t in enumerate(_mid(trainer["lookups"]))}
    return DensePlan(1, [[(w, i) for _, w, i in pushes]], reads, "times")


def _mid(times: np.ndarray) -> np.ndarray:
    return times.mean(axis=1) if len(times) else np.empty(0)


class RecordedSchedule(Schedule):
    def __init__(self, embedding: list[dict], dense: list[dict] | None = None, seed: int = 0, source: str = ""):
        super().__init__(seed)
        self.source = source
        self.read_time = [_mid(t["lookups"]) for t in embedding]
        self.apply_time = [_mid(t["updates"]) for t in embedding]
        self.pull_time = None if dense is None else [_mid(t["lookups"][:len(t["updates"])]) for t in dense]
        self.push_time = None if dense is None else [_mid(t["updates"]) for t in dense]
        self.dense = None if dense is None else _versions_plan(dense) or _times_plan(dense)
        self.embedding = embedding_plan(embedding)
        self.departures = 0
        self.reads = 0

    @classmethod
    def from_job(cls, output_dir, seed: int = 0) -> "RecordedSchedule":
        directory = Path(output_dir)
        if not (directory / TRACE_FILE).is_file():
            raise UserError(f"{directory}: no {TRACE_FILE}; a job records it when its consistency runs the threaded "
                            f"pipeline (placement ps)")
        dense = load_trace(directory / DENSE_TRACE_FILE) if (directory / DENSE_TRACE_FILE).is_file() else None
        return cls(load_trace(directory / TRACE_FILE), dense, seed, str(directory))

    @property
    def workers(self) -> int:
        return len(self.read_time)

    def describe(self) -> dict:
        return {"kind": "recorded", "source": self.source, "reads": self.reads, "departures": self.departures,
                "embedding_plan": "versions" if self.embedding else "times",
                **({"embedding_stores": len(self.embedding.columns), "read_inversions": self.embedding.inversions}
                   if self.embedding else {}),
                **({"dense_plan": self.dense.source, "dense_shards": self.dense.shards} if self.dense else {})}

    def embedding_plan(self) -> EmbeddingPlan | None:
        """The job's embedding updates in each PS store's order, and what each lookup read of
        each store (from the stores' numbers; None: a trace without them, replayed by times)."""
        return self.embedding

    def dense_plan(self) -> DensePlan | None:
        """async: the order of the job's dense pushes on each shard and what each pull read."""
        return self.dense

    def _when(self, worker: int, step: int) -> float:
        times = self.read_time[worker]
        return times[step] if step < len(times) else np.inf  # a step the job did not take: after all

    def order(self, workers, round_index: int = 0) -> list[int]:
        workers = list(workers)
        return sorted(workers, key=lambda w: (self._when(w, round_index), w))

    def seen(self, worker: int, step: int, workers: int) -> np.ndarray:
        """Per worker, how many of its updates had landed when the job served `worker`'s read of
        `step` (counted as one read of the replay)."""
        when = self._when(worker, step)
        self.reads += 1
        return np.array([np.searchsorted(self.apply_time[w], when) if w < self.workers else 0
                         for w in range(workers)], np.int64)

    def visible(self, required: np.ndarray, available: np.ndarray, worker: int = -1, step: int = -1) -> np.ndarray:
        required = np.minimum(np.asarray(required, np.int64), available)
        if worker < 0:
            return required
        return np.clip(self.seen(worker, step, len(required)), required, available)

    def timeline(self) -> list[tuple[str, int, int]]:
        """Every recorded read and update as ("read", worker, step) and ("apply", worker, i-th
        update of that worker), and for ps_async each step's dense pull as ("step", worker, step)
        and its dense push as ("push", worker, step), in the order they happened (at equal times
        updates first)."""
        events = [(t, 0, "apply", w, i) for w, times in enumerate(self.apply_time) for i, t in enumerate(times)]
        events += [(t, 1, "read", w, i) for w, times in enumerate(self.read_time) for i, t in enumerate(times)]
        for kind, rank, times in (("step", 2, self.pull_time), ("push", 3, self.push_time)):
            events += [(t, rank, kind, w, i) for w, steps in enumerate(times or []) for i, t in enumerate(steps)]
        return [(kind, w, i) for _, _, kind, w, i in sorted(events)]

    def note_applied(self, targets: np.ndarray, applied: np.ndarray) -> None:
        """The emulator applied `applied` where the job's read saw `targets`."""
        self.departures += int(np.maximum(applied - targets, 0).sum())

    def apply_order(self, counts: np.ndarray, start: np.ndarray | None = None) -> np.ndarray:
        if start is None:
            return super().apply_order(counts)
        events = [(self.apply_time[w][i] if i < len(self.apply_time[w]) else np.inf, w)
                  for w in range(len(counts)) for i in range(int(start[w]), int(start[w] + counts[w]))]
        return np.array([w for _, w in sorted(events)], np.int64)
