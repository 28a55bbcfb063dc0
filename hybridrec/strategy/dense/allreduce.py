"""AllReduce dense sync: with several trainers the dense model runs in
`torch.nn.parallel.DistributedDataParallel`, whose backward averages the gradients over the
trainers before each local optimizer step, so every replica stays identical (Persia Alg. 2);
with one trainer it is the plain model and its optimizer. `strategy.dense_codec` puts the
gradients on the wire as bf16 or as top-k with error feedback (a DDP communication hook,
hybridrec.comm.compression), and the bytes sent are reported."""
from __future__ import annotations

import torch

from hybridrec.comm.compression import dense_comm_hook
from hybridrec.strategy.dense import DenseSync, dense_optimizer, model_device


class AllReduceDense(DenseSync):
    lockstep = True

    def __init__(self, model: torch.nn.Module, cfg, world, services=None):
        self.model = self.module = model
        self.hook = None
        if world.grouped:
            device = model_device(model)
            self.module = torch.nn.parallel.DistributedDataParallel(
                model, device_ids=[device.index] if device.type == "cuda" else None, gradient_as_bucket_view=True)
            # strategy.dense_codec: the gradients' wire format (bf16, or top-k with error feedback)
            self.hook = dense_comm_hook(cfg.strategy.dense_codec, cfg.strategy.topk_ratio)
            if self.hook is not None:
                self.hook.register(self.module)
        self.optimizer = dense_optimizer(cfg, model.parameters())

    def accumulating(self):
        """DDP's `no_sync`: the AllReduce waits for the backward of the batch's last part."""
        return self.module.no_sync() if self.module is not self.model else super().accumulating()

    def facts(self, world) -> dict:
        """With a dense codec: the gradient bytes every trainer put on the wire, and float32's."""
        if self.hook is None:
            return {}
        every = world.gather((self.hook.state.bytes_sent, self.hook.state.raw_bytes))
        return {"dense_codec": self.hook.name, "dense_gradient_bytes": sum(sent for sent, _ in every),
                "dense_gradient_bytes_float32": sum(raw for _, raw in every)}

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
