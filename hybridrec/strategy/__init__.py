"""A job's training strategy: one implementation per axis of the strategy matrix (hybridrec.axes),
chosen by the config's resolved `strategy` section and put together for the training loop.

    placement    where embeddings live          hybridrec.strategy.placement.<value>
    consistency  how stale a lookup may be      hybridrec.strategy.consistency.<value>
    dense        how dense parameters sync      hybridrec.strategy.dense.<value>
    codecs       what the wire carries          hybridrec.comm.codec (used by remote placements)

The loop never asks which paper it runs: it opens the consistency's stream over the placement,
trains on the inputs the placement makes, and lets the dense sync wrap the model.
"""
from __future__ import annotations

from dataclasses import dataclass

from hybridrec.strategy.consistency import make_consistency
from hybridrec.strategy.dense import make_dense
from hybridrec.strategy.placement import make_placement
from hybridrec.strategy.world import World


@dataclass
class Strategy:
    axes: dict
    world: World
    placement: object
    consistency: object
    cfg: object

    def dense(self, model):
        """The dense sync of this strategy around `model` (made after the embeddings were restored:
        ps_async takes the dense parameters from the PS servers)."""
        return make_dense(self.axes["dense"], model, self.cfg, self.world, self.placement)

    def close(self) -> None:
        self.consistency.close()
        self.placement.close()


def build_strategy(cfg, tables, world: World, endpoints: dict | None = None) -> Strategy:
    """The strategy the config resolves to, for this trainer of `world`; `endpoints` holds the
    addresses of remote services ({"ps": [...], "embedding_workers": [...]})."""
    axes = cfg.strategy.resolved
    placement = make_placement(axes["placement"], cfg, tables, world, endpoints or {})
    return Strategy(axes, world, placement, make_consistency(axes["consistency"], cfg), cfg)
