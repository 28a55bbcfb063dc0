"""Synchronous consistency: a batch is looked up only after every earlier update of this
trainer was applied (staleness 0)."""
from __future__ import annotations

from hybridrec.strategy.consistency import Consistency


class Sync(Consistency):
    tau = 0


CONSISTENCY = Sync
