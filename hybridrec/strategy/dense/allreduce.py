"""AllReduce dense sync: with several trainers the dense model runs in
`torch.nn.parallel.DistributedDataParallel`, whose backward averages the gradients over the
trainers before each local optimizer step, so every replica stays identical (Persia Alg. 2);
with one trainer it is the plain model and its optimizer."""
from __future__ import annotations

import torch

from hybridrec.strategy.dense import DenseSync, dense_optimizer, model_device


class AllReduceDense(DenseSync):
    lockstep = True

    def __init__(self, model: torch.nn.Module, cfg, world, placement=None):
        self.model = self.module = model
        if world.grouped:
            device = model_device(model)
            self.module = torch.nn.parallel.DistributedDataParallel(
                model, device_ids=[device.index] if device.type == "cuda" else None, gradient_as_bucket_view=True)
        self.optimizer = dense_optimizer(cfg, model.parameters())

    def begin_step(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def finish_step(self) -> None:
        self.optimizer.step()

    def state(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])


DENSE = AllReduceDense
