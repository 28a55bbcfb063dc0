"""Synchronous consistency: a batch is looked up only after every earlier update was applied
(staleness 0): this trainer's, and when the trainers step together, every other trainer's too (they
meet at a barrier once their updates of a step are acknowledged: hybridrec.persia.pipeline)."""
from __future__ import annotations

from hybridrec.strategy.consistency import Consistency


class Sync(Consistency):
    tau = 0
    synchronous = True


CONSISTENCY = Sync
