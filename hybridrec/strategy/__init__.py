"""A job's training strategy: one implementation per axis of the strategy matrix (hybridrec.axes),
chosen by the config's resolved `strategy` section and put together for the training loop.

    placement    where embeddings live          hybridrec.strategy.placement.<value>
    consistency  how stale a lookup may be      hybridrec.strategy.consistency.<value>
    dense        how dense parameters sync      hybridrec.strategy.dense.<value>
    codecs       what the wire carries          hybridrec.comm.codec (used by remote placements)

The axes meet through the placement's typed services (hybridrec.strategy.services): the
consistency and the dense sync are built with them and ask for what they require, never for a
placement's attributes. The loop never asks which paper it runs: it opens the consistency's
stream over the placement, trains on the inputs the placement makes, and lets the dense sync
wrap the model. What the loop
needs to know of the strategy as a whole is asked here: `readers` (the trainers as the rows are
dealt to them), `lockstep` and `all_have` (whether the trainers step together), `facts()`.
"""
from __future__ import annotations

from dataclasses import dataclass

from hybridrec.axes import AXES, Axis
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
    dense: object | None = None  # the dense sync, made by `make_dense` once the embeddings are restored

    def make_dense(self, model):
        """The dense sync of this strategy around `model` (made after the embeddings were restored:
        ps_async takes the dense parameters from the PS servers)."""
        self.dense = make_dense(self.axes["dense"], model, self.cfg, self.world, self.placement.services)
        return self.dense

    @property
    def readers(self) -> World:
        """The trainers as the rows are dealt to them: each reads its share of the training rows and
        scores its share of the held-out ones (`world`), or, when the placement's trainers each
        compute a part of every sample (`whole_batches`: DES's field_sharded), every trainer reads
        and scores every row, all together (a world of one)."""
        return self.world.alone() if self.placement.services.whole_batches else self.world

    @property
    def lockstep(self) -> bool:
        """Whether the trainers take every step together, so collectives (a mid-run evaluation or
        checkpoint) may run between steps; HT's groups and the async dense sync do not."""
        return self.dense.lockstep

    def all_have(self, flag: bool, rows: bool) -> tuple[bool, bool]:
        """(every trainer has `flag`: another batch, some trainer's batch has `rows`): asked of all
        in one collective when they step together, where one trainer out of data ends the epoch
        for all and trainers on a stream step with empty batches while their share is dry, but not
        at all while every share is; else this trainer's own (flag, True)."""
        return self.world.all_have_any_rows(flag, rows) if self.lockstep else (flag, True)

    def facts(self) -> dict:
        """The axes' figures of the whole job for final_metrics.json (a collective)."""
        return {**self.placement.facts(), **self.dense.facts(self.world), **self.consistency.facts(self.world)}

    def close(self) -> None:
        if self.dense is not None:
            self.dense.close()
        self.consistency.close()
        self.placement.close()


def build_strategy(cfg, tables, world: World, endpoints: dict | None = None) -> Strategy:
    """The strategy the config resolves to, for this trainer of `world`; `endpoints` holds the
    addresses of remote services ({"ps": [...], "embedding_workers": [...]})."""
    axes = cfg.strategy.resolved
    placement = make_placement(axes["placement"], cfg, tables, world, endpoints or {})
    declared, offered = AXES[Axis.PLACEMENT][axes["placement"]].offers, placement.services.offered()
    if offered != declared:
        placement.close()
        raise RuntimeError(f"placement {axes['placement']} offers {sorted(offered)} but hybridrec.axes declares "
                           f"{sorted(declared)}: a bug in hybridrec")
    try:
        consistency = make_consistency(axes["consistency"], cfg, tables, world, placement.services)
    except BaseException:
        placement.close()
        raise
    return Strategy(axes, world, placement, consistency, cfg)
