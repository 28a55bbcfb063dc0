"""The EASGD dense sync (Hierarchical Training's baseline, the ShadowSync system): every trainer
trains its own dense replica without waiting, and a background thread pulls it toward the
centre copy on the PS servers by elastic averaging. It is the `groups` sync with one trainer per
group (hybridrec.strategy.dense.groups)."""
from __future__ import annotations

from hybridrec.strategy.dense.groups import GroupsDense


class ElasticAveragingDense(GroupsDense):
    def __init__(self, model, cfg, world, services):
        super().__init__(model, cfg, world, services, trainers_per_group=1)


DENSE = ElasticAveragingDense
