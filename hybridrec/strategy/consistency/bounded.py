"""Bounded staleness (Persia's hybrid algorithm): at most `strategy.tau` of this trainer's
updates may be in flight when a batch is looked up, so lookups run ahead of the dense step."""
from __future__ import annotations

from hybridrec.strategy.consistency import Consistency


class Bounded(Consistency):
    def __init__(self, cfg, tables, world, services):
        super().__init__(cfg, tables, world, services)
        self.tau = cfg.strategy.tau


CONSISTENCY = Bounded
