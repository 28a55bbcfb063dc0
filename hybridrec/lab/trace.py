"""A real job's recorded staleness as an emulation's schedule: `RecordedSchedule.from_job(dir)`
reads the times a distributed job's trainers recorded (staleness_trace.npz, and for ps_async
dense_trace.npz: hybridrec.persia.staleness) and answers the emulator's questions from them:

* the workers of a step in the order their lookups of that step were served;
* a read sees, of each worker's updates, those applied before it was served (an update counts as
  applied half-way between its sending and its acknowledgement, a lookup as served half-way
  between its sending and its answer), within what the bound requires and what was computed;
* extra updates land in the order they landed in the job;
* (async) a step's dense copy holds the pushes acknowledged before its pull was sent.

A job is replayed from `timeline()`: every read and every update in the order they happened (and
under async every step at its dense pull), so a trainer's read that ran ahead of another trainer's
read of an earlier step (up to tau + 1 rounds ahead) is made ahead of it too. Where the job saw something the
emulator cannot replay (a read that saw fewer updates than an earlier read had already applied:
the stores cannot un-apply), the read sees more, and `departures` counts the updates by which
reads differ from the job's.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from hybridrec.errors import UserError
from hybridrec.lab.schedule import Schedule
from hybridrec.persia.staleness import DENSE_TRACE_FILE, TRACE_FILE


def load_trace(path: Path) -> list[dict[str, np.ndarray]]:
    """Per trainer, its {"lookups", "updates"} times from a trace file."""
    try:
        with np.load(path) as data:
            trainers = int(data["trainers"])
            return [{kind: data[f"{kind}_{r}"] for kind in ("lookups", "updates")} for r in range(trainers)]
    except (OSError, KeyError, ValueError) as exc:
        raise UserError(f"{path}: not a staleness trace ({type(exc).__name__}: {exc})") from None


def _mid(times: np.ndarray) -> np.ndarray:
    return times.mean(axis=1) if len(times) else np.empty(0)


class RecordedSchedule(Schedule):
    def __init__(self, embedding: list[dict], dense: list[dict] | None = None, seed: int = 0, source: str = ""):
        super().__init__(seed)
        self.source = source
        self.read_time = [_mid(t["lookups"]) for t in embedding]
        self.apply_time = [_mid(t["updates"]) for t in embedding]
        self.pull_sent = None if dense is None else [t["lookups"][:, 0] for t in dense]
        self.push_acked = None if dense is None else np.sort(np.concatenate([t["updates"][:, 1] for t in dense]))
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
        return {"kind": "recorded", "source": self.source, "reads": self.reads, "departures": self.departures}

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
        update of that worker), and for ps_async each step's dense pull as ("step", worker, step),
        in the order they happened (at equal times updates first)."""
        events = [(t, 0, "apply", w, i) for w, times in enumerate(self.apply_time) for i, t in enumerate(times)]
        events += [(t, 1, "read", w, i) for w, times in enumerate(self.read_time) for i, t in enumerate(times)]
        for w, times in enumerate(self.pull_sent or []):
            events += [(t, 2, "step", w, i) for i, t in enumerate(times)]
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

    def dense_version(self, required: int, available: int, worker: int, step: int) -> int:
        if self.pull_sent is None or worker >= len(self.pull_sent) or step >= len(self.pull_sent[worker]):
            return required
        seen = int(np.searchsorted(self.push_acked, self.pull_sent[worker][step]))
        return int(np.clip(seen, required, available))
