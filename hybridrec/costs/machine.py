"""How many of a shared machine's cores other work took while a job ran: the machine's busy CPU
time (/proc/stat) less the job's own, over the wall time. On emulated hosts every process of every
agent shares the same cores, so the cost model (hybridrec.costs.model) predicts such a job with the
cores left to it.

Over the job's whole life (`background_cores`) the job's own CPU is this process's and its reaped
children's (getrusage). While the job trains (`training_background_cores`, the figure the cost
model's prediction of the training steps needs) it comes from samples taken every `sample_every`
seconds on a thread: the machine's busy time and the CPU of this process and of every live
descendant (/proc/<pid>/stat) beside the reaped ones; the samples inside the job's training window
(its trainers' first step to their last, `training_window` of its final metrics) give the figure.
A job's start-up (imports, kernel loading, connecting) and end (evaluation, checkpoint) leave the
cores to other work, so the whole-life figure overstates what other work took while it trained.

The job's processes must be descendants of this process (`hybridrec launch`'s roles are);
where they are not (a Ray cluster's workers belong to its raylets), their CPU counts as the
background's, and both figures are None when told so.
"""
from __future__ import annotations

import os
import resource
import threading
import time

# /proc/<pid>/stat after the command's closing parenthesis: ppid, utime, stime, cutime, cstime
_PPID, _UTIME, _STIME, _CUTIME, _CSTIME = 1, 11, 12, 13, 14


def machine_busy_seconds() -> float | None:
    """CPU seconds every core of the machine has spent busy since boot (None off Linux)."""
    try:
        with open("/proc/stat") as stat:
            fields = stat.readline().split()
    except OSError:
        return None
    # user nice system idle iowait irq softirq steal ...: all but idle and iowait are busy
    ticks = [int(v) for v in fields[1:9]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    """CPU seconds of this process and of the children it has reaped."""
    return sum(u.ru_utime + u.ru_stime for u in (resource.getrusage(resource.RUSAGE_SELF),
                                                  resource.getrusage(resource.RUSAGE_CHILDREN)))


def descendants_cpu_seconds(root: int | None = None) -> float:
    """CPU seconds of every live descendant of process `root` (default: this one), each with the
    children it has reaped; 0 off Linux."""
    root = os.getpid() if root is None else root
    parents, cpu = {}, {}
    try:
        pids = [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):  # ended meanwhile
            continue
        parents[pid] = int(fields[_PPID])
        cpu[pid] = sum(int(fields[i]) for i in (_UTIME, _STIME, _CUTIME, _CSTIME))
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    ticks, todo = 0, list(children.get(root, ()))
    while todo:
        pid = todo.pop()
        ticks += cpu[pid]
        todo.extend(children.get(pid, ()))
    return ticks / os.sysconf("SC_CLK_TCK")


class MachineUse:
    """`with MachineUse() as use: <run the job>`; then `use.figures()`: the wall seconds, the
    job's CPU seconds and the cores the rest of the machine took meanwhile (`background_cores`);
    with `sample_every`, `use.figures(window)` also gives `training_background_cores` over the
    wall-clock (epoch seconds) `window`."""

    def __init__(self, counts_job: bool = True, sample_every: float | None = None):
        self.counts_job = counts_job
        self.sample_every = sample_every
        self.samples: list[tuple[float, float | None, float]] = []  # (epoch seconds, machine busy, job CPU)
        self._stop = threading.Event()
        self._sampler: threading.Thread | None = None

    def _sample(self) -> None:
        self.samples.append((time.time(), machine_busy_seconds(), own_cpu_seconds() + descendants_cpu_seconds()))

    def _sample_until_stopped(self) -> None:
        while not self._stop.wait(self.sample_every):
            self._sample()

    def __enter__(self) -> "MachineUse":
        self.start = (time.monotonic(), machine_busy_seconds(), own_cpu_seconds())
        if self.sample_every and self.counts_job:
            self._sample()
            self._sampler = threading.Thread(target=self._sample_until_stopped, name="machine-use", daemon=True)
            self._sampler.start()
        return self

    def __exit__(self, *exc) -> None:
        self.end = (time.monotonic(), machine_busy_seconds(), own_cpu_seconds())
        if self._sampler is not None:
            self._stop.set()
            self._sampler.join()
            self._sample()

    def background_between(self, start: float, end: float) -> float | None:
        """The cores other work took between the first sample at or after `start` and the last one
        at or before `end` (epoch seconds); None without two such samples."""
        inside = [s for s in self.samples if start <= s[0] <= end and s[1] is not None]
        if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
            return None
        (t0, busy0, job0), (t1, busy1, job1) = inside[0], inside[-1]
        return max((busy1 - busy0) - (job1 - job0), 0.0) / (t1 - t0)

    def figures(self, window: list | tuple | None = None) -> dict:
        wall = self.end[0] - self.start[0]
        job = self.end[2] - self.start[2]
        busy = None if self.start[1] is None or self.end[1] is None else self.end[1] - self.start[1]
        background = (max(busy - job, 0.0) / wall if busy is not None and wall > 0 and self.counts_job else None)
        out = {"wall_s": wall, "job_cpu_s": job, "background_cores": background}
        if self.sample_every:
            out["training_background_cores"] = (self.background_between(*window) if window and self.counts_job
                                                else None)
        return out
