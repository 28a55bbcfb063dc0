"""The consistency axis: how stale the embedding rows a step trains on may be.

Each value is a class built with (cfg, tables, world, services: the placement's typed services,
hybridrec.strategy.services) with `tau` (how many of this trainer's updates may still be in
flight when a batch is looked up) and `open(placement, batches, skip, limit, prefetch, lockstep)`
(lockstep: the trainers take every step together, the dense sync's property), which
gives the training loop its stream of ready batches (hybridrec.embedding.stream): the threaded
pipeline when the placement offers lookups off the training thread, the inline stream otherwise.
`make_consistency` builds the value named by `strategy.consistency` from the module
hybridrec.axes names for it.
"""
from __future__ import annotations

import importlib

from hybridrec.axes import AXES
from hybridrec.strategy.consistency.inline import InlineStream
from hybridrec.persia.pipeline import EmbeddingPipeline
from hybridrec.persia.staleness import StalenessTelemetry


class Consistency:
    tau = 0
    synchronous = False  # every lookup sees every trainer's earlier updates (sync), not only its own

    def __init__(self, cfg, tables, world, services):
        self.cfg, self.tables, self.world, self.services = cfg, tables, world, services
        self.telemetry = StalenessTelemetry(cfg.train.output_dir)  # the threaded pipelines' timelines

    def open(self, placement, batches, skip: int = 0, limit: int | None = None, prefetch: int = 0,
             lockstep: bool = False):
        if self.services.background_lookups:
            # synchronous lockstep trainers meet at a barrier after each update, before the next lookup
            across = self.world.barrier if self.synchronous and lockstep and self.world.size > 1 else None
            pipeline = EmbeddingPipeline(batches, placement.connect, self.tau, skip=skip, limit=limit, across=across)
            self.telemetry.add(pipeline.timeline)
            return pipeline
        if self.tau:
            raise ValueError(f"tau={self.tau} needs a placement that looks up off the training thread")
        return InlineStream(batches, placement.connect, skip=skip, limit=limit, prefetch=prefetch)

    def facts(self, world) -> dict:
        """Figures of the whole job for final_metrics.json (every trainer calls this together):
        with threaded pipelines, the staleness of every trainer's lookups (persia.staleness). Without
        them (the same on every trainer of a job) there is nothing to gather, and no collective runs."""
        return self.telemetry.facts(world) if self.services.background_lookups else {}

    def close(self) -> None:
        """Release what the consistency holds across epochs (HET's caches and connections)."""


def make_consistency(name: str, cfg, tables, world, services) -> Consistency:
    module = importlib.import_module(f"hybridrec.strategy.{AXES['consistency'][name].module}")
    return module.CONSISTENCY(cfg, tables, world, services)
