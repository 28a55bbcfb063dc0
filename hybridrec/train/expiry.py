"""When the loop sweeps the tables with `embedding.<...>.expire_after` (EmbeddingStore.expire):
between steps, every 1/64 of the tightest bound (every step for bounds under 64 steps), so a row
is dropped at most that much later than its bound, and a sweep, which reads every live row's
metadata once, costs a small share of the steps it covers. Counts what was dropped."""
from __future__ import annotations

import time


class ExpirySchedule:
    """`due(step)` says when to `sweep` the placement's tables; `expired` counts the rows dropped."""

    SHARE = 64

    def __init__(self, tables, placement) -> None:
        bounds = [c.expire_after for c in tables.all_tables().values() if c.expire_after is not None]
        steps = [b["steps"] for b in bounds if "steps" in b]
        seconds = [b["seconds"] for b in bounds if "seconds" in b]
        self.placement = placement
        self.every_steps = max(1, min(steps) // self.SHARE) if steps else None
        self.every_seconds = min(seconds) / self.SHARE if seconds else None
        self._last_time = time.monotonic()
        self.expired = 0

    @property
    def active(self) -> bool:
        return self.every_steps is not None or self.every_seconds is not None

    def due(self, step: int, agree=None) -> bool:
        """Whether the loop sweeps after step `step`. `agree(flag)` makes trainers that step
        together decide alike (the seconds rule reads each trainer's clock: the leader's counts)."""
        if not self.active:
            return False
        due = self.every_steps is not None and step % self.every_steps == 0
        if self.every_seconds is not None:
            late = time.monotonic() - self._last_time >= self.every_seconds
            due = due or (agree(late) if agree is not None else late)
        return due

    def sweep(self, step: int) -> None:
        """Drop the rows unseen for longer than their bound (nothing in flight: the loop drained)."""
        self._last_time = time.monotonic()
        self.expired += self.placement.expire(step, time.time())
