"""The consistency axis: how stale the embedding rows a step trains on may be.

Each value is a class with `tau` (how many of this trainer's updates may still be in flight when a
batch is looked up) and `open(placement, batches, skip, limit, prefetch)`, which gives the
training loop its stream of ready batches: the threaded pipeline when the placement can look up
off the training thread, the inline stream otherwise. `make_consistency` builds the value named
by `strategy.consistency` from the module hybridrec.axes names for it.
"""
from __future__ import annotations

import importlib

from hybridrec.axes import AXES
from hybridrec.strategy.consistency.inline import InlineStream
from hybridrec.persia.pipeline import EmbeddingPipeline
from hybridrec.persia.staleness import StalenessTelemetry


class Consistency:
    tau = 0
    telemetry: StalenessTelemetry | None = None  # the threaded pipelines' timelines (make_consistency sets it)

    def open(self, placement, batches, skip: int = 0, limit: int | None = None, prefetch: int = 0):
        if placement.background_lookups:
            pipeline = EmbeddingPipeline(batches, placement.connect, self.tau, skip=skip, limit=limit)
            if self.telemetry is not None:
                self.telemetry.add(pipeline.timeline)
            return pipeline
        if self.tau:
            raise ValueError(f"tau={self.tau} needs a placement that looks up off the training thread")
        return InlineStream(batches, placement.connect, skip=skip, limit=limit, prefetch=prefetch)

    def facts(self, world) -> dict:
        """Figures of the whole job for final_metrics.json (every trainer calls this together):
        with threaded pipelines, the staleness of every trainer's lookups (persia.staleness)."""
        return self.telemetry.facts(world) if self.telemetry is not None else {}

    def close(self) -> None:
        """Release what the consistency holds across epochs (HET's caches and connections)."""


def make_consistency(name: str, cfg) -> Consistency:
    module = importlib.import_module(f"hybridrec.strategy.{AXES['consistency'][name].module}")
    consistency = module.CONSISTENCY(cfg)
    consistency.telemetry = StalenessTelemetry(cfg.train.output_dir)
    return consistency
