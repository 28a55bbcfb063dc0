"""A real job's recorded staleness as an emulation's schedule: `RecordedSchedule.from_job(dir)`
reads the times a distributed job's trainers recorded (staleness_trace.npz, and for ps_async
dense_trace.npz: hybridrec.persia.staleness) and answers the emulator's questions from them:

* the workers of a step in the order their lookups of that step were served;
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
            return [{kind: data[f"{kind}_{r}"] for kind in TRACE_KINDS if kind in ("lookups", "updates") or
                     f"{kind}_{r}" in data.files} for r in range(trainers)]
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


def _versions_plan(dense: list[dict]) -> DensePlan | None:
    """The plan from the shards' version numbers; None where the trace lacks them or they do not
    number every push of a shard once, one after another (then times decide)."""
    if not dense or not all("lookup_versions" in t and "update_versions" in t for t in dense):
        return None
    columns = {t[kind].shape[1] for t in dense for kind in ("lookup_versions", "update_versions") if len(t[kind])}
    if len(columns) != 1:
        return None
    shards = columns.pop()
    order, first = [], []
    for k in range(shards):
        pushes = sorted((int(t["update_versions"][i, k]), w, i) for w, t in enumerate(dense)
                        for i in range(len(t["update_versions"])) if t["update_versions"][i, k] >= 0)
        numbers = [v for v, _, _ in pushes]
        if numbers and numbers != list(range(numbers[0], numbers[0] + len(numbers))):
            return None  # another client pushed too, or a push is missing: not this job's order alone
        first.append(numbers[0] - 1 if numbers else 0)  # a store restored from a checkpoint counts on
        order.append([(w, i) for _, w, i in pushes])
    reads = {(w, i): tuple(int(np.clip(t["lookup_versions"][i, k] - first[k], 0, len(order[k])))
                           for k in range(shards))
             for w, t in enumerate(dense) for i in range(min(len(t["lookup_versions"]), len(t["updates"])))}
    return DensePlan(shards, order, reads, "versions")


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
                **({"dense_plan": self.dense.source, "dense_shards": self.dense.shards} if self.dense else {})}

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
