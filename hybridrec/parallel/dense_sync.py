"""How an NN worker's dense parameters stay in step with the other NN workers'.

`AllReduceDense` (sync and hybrid disciplines): the dense model in
`torch.nn.parallel.DistributedDataParallel`, whose backward AllReduces (averages) the gradients
over the workers, then a local optimizer step: every replica stays identical (Persia Alg. 2).
`ParameterServerDense` (async discipline, the baseline Persia beats): the dense parameters live
on the PS; each step pulls the current values, and pushes its own gradients, which the PS
applies with the dense optimizer as they arrive — no AllReduce, no barrier between workers.
"""
from __future__ import annotations

import numpy as np
import torch

from hybridrec.config import JobConfig
from hybridrec.ps.client import PSClient
from hybridrec.train.loop import dense_optimizer


class AllReduceDense:
    def __init__(self, model: torch.nn.Module, cfg: JobConfig):
        self.model = model
        device_ids = [model_device(model).index] if model_device(model).type == "cuda" else None
        self.module = torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids, gradient_as_bucket_view=True)
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


class ParameterServerDense:
    def __init__(self, model: torch.nn.Module, cfg: JobConfig, ps: PSClient):
        self.model = self.module = model
        self.ps = ps
        self.params = dict(model.named_parameters())
        opt = cfg.train.dense_optimizer
        initial = {name: p.detach().cpu().numpy().copy() for name, p in self.params.items()}
        # every worker offers its initial values; the PS keeps the first it gets per parameter
        self._assign(ps.dense_init(initial, {"name": opt.name, "lr": opt.lr, "weight_decay": opt.weight_decay}))

    def _assign(self, values: dict) -> None:
        with torch.no_grad():
            for name, value in values.items():
                self.params[name].copy_(torch.from_numpy(np.asarray(value)))

    def begin_step(self) -> None:
        self._assign(self.ps.dense_pull(list(self.params)))
        for p in self.params.values():
            p.grad = None

    def finish_step(self) -> None:
        grads = {name: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().cpu().numpy()
                 for name, p in self.params.items()}
        self.ps.dense_push(grads)

    def state(self) -> dict:
        return {"model": self.model.state_dict()}  # the optimizer state is the PS's (its checkpoint)

    def load(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])


def model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters(), torch.empty(0)).device


def make_dense(discipline: str, model: torch.nn.Module, cfg: JobConfig, ps: PSClient):
    """The dense synchronisation of `discipline` ('sync' | 'hybrid' | 'async')."""
    if discipline == "async":
        return ParameterServerDense(model, cfg, ps)
    return AllReduceDense(model, cfg)
