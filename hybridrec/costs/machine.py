"""How many of a shared machine's cores other work took while a job ran: the machine's busy CPU
time (/proc/stat) less the job's own (this process's and its reaped children's, getrusage), over
the job's wall time. On emulated hosts every process of every agent shares the same cores, so the
cost model (hybridrec.costs.model) predicts such a job with the cores left to it.

The job's processes must be children this process reaps (`hybridrec launch`'s roles are);
where they are not (a Ray cluster's workers belong to its raylets), their CPU counts as the
background's, and `background_cores` is None when told so.
"""
from __future__ import annotations

import os
import resource
import time


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


class MachineUse:
    """`with MachineUse() as use: <run the job>`; then `use.figures()`: the wall seconds, the
    job's CPU seconds and the cores the rest of the machine took meanwhile (`background_cores`)."""

    def __init__(self, counts_job: bool = True):
        self.counts_job = counts_job

    def __enter__(self) -> "MachineUse":
        self.start = (time.monotonic(), machine_busy_seconds(), own_cpu_seconds())
        return self

    def __exit__(self, *exc) -> None:
        self.end = (time.monotonic(), machine_busy_seconds(), own_cpu_seconds())

    def figures(self) -> dict:
        wall = self.end[0] - self.start[0]
        job = self.end[2] - self.start[2]
        busy = None if self.start[1] is None or self.end[1] is None else self.end[1] - self.start[1]
        background = (max(busy - job, 0.0) / wall if busy is not None and wall > 0 and self.counts_job else None)
        return {"wall_s": wall, "job_cpu_s": job, "background_cores": background}
