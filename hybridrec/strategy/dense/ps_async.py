"""Asynchronous dense sync through the PS (the baseline Persia beats): the dense parameters
live on the PS servers; each step pulls their current values and pushes its own gradients,
which the PS applies with the dense optimizer as they arrive. No AllReduce and no barrier
between trainers, so they do not run in lockstep. The times of the pulls and pushes are recorded, with
the PS shards' versions each pull read and each push made (`dense_staleness_cross` in
final_metrics.json, dense_trace.npz for the staleness lab)."""
from __future__ import annotations

import numpy as np
import torch

from hybridrec.persia.staleness import DENSE_TRACE_FILE, StalenessTelemetry, Timeline
from hybridrec.strategy.dense import DenseSync


class ParameterServerDense(DenseSync):
    lockstep = False

    def __init__(self, model: torch.nn.Module, cfg, world, services):
        self.model = self.module = model
        self.world = world
        self.ps = ps = services.ps_endpoints("dense ps_async").client()  # of its own, for the training thread
        self.params = dict(model.named_parameters())
        self.timeline = Timeline()  # when each pull and push was sent and answered
        self.telemetry = StalenessTelemetry(cfg.train.output_dir, "dense_staleness_cross", DENSE_TRACE_FILE)
        self.telemetry.add(self.timeline)
        opt = cfg.train.dense_optimizer
        initial = {name: p.detach().cpu().numpy().copy() for name, p in self.params.items()}
        # every trainer offers its initial values; the PS keeps the first it gets per parameter
        self._assign(ps.dense_init(initial, {"name": opt.name, "lr": opt.lr, "weight_decay": opt.weight_decay}))

    def _assign(self, values: dict) -> None:
        with torch.no_grad():
            for name, value in values.items():
                self.params[name].copy_(torch.from_numpy(np.asarray(value)))

    def begin_step(self) -> None:
        sent = Timeline.now()
        values, versions = self.ps.dense_pull_versions(list(self.params))
        self.timeline.lookups.append((sent, Timeline.now()))
        self.timeline.lookup_versions.append(versions)
        self._assign(values)
        for p in self.params.values():
            p.grad = None

    def finish_step(self) -> None:
        grads = {name: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().cpu().numpy()
                 for name, p in self.params.items()}
        sent = Timeline.now()
        versions = self.ps.dense_push(grads)
        self.timeline.updates.append((sent, Timeline.now()))
        self.timeline.update_versions.append(versions)

    def finish_training(self) -> None:
        """The model becomes the PS's final values, once every trainer's last push is applied: a
        trainer's own copy is what its last pull read (without its last push, nor the pushes of
        trainers that ran on), and the trainers' copies differ, while every trainer scores its
        share of the test rows and the leader saves its copy."""
        self.world.barrier()
        self._assign(self.ps.dense_pull(list(self.params)))

    def facts(self, world) -> dict:
        """The steps of every trainer each step's pulled copy may have missed (persia.staleness)."""
        return self.telemetry.facts(world)

    def state(self) -> dict:
        return {"model": self.model.state_dict()}  # the optimizer state is the PS's (its checkpoint)

    def load(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])

    def close(self) -> None:
        self.ps.close()


DENSE = ParameterServerDense
