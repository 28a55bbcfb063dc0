"""The dense-sync axis: how each trainer's dense parameters stay in step with the others'.

A value is a class built with (model, cfg, world, placement) that offers `module` (what the
loop calls forward on), `lockstep` (whether the trainers take every step together, so the loop
may run collectives such as a mid-run evaluation), `begin_step()` / `finish_step()` around
forward and backward, and `state()` / `load(state)` for checkpoints. `make_dense` builds the
value named by `strategy.dense` from the module hybridrec.axes names for it.
"""
from __future__ import annotations

import importlib

import torch

from hybridrec.axes import AXES


def dense_optimizer(cfg, params) -> torch.optim.Optimizer:
    """The torch optimizer of the dense model's parameters, as train.dense_optimizer says."""
    d = cfg.train.dense_optimizer
    cls = {"adam": torch.optim.Adam, "adagrad": torch.optim.Adagrad, "sgd": torch.optim.SGD}[d.name]
    return cls(params, lr=d.lr, weight_decay=d.weight_decay)


def model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters(), torch.empty(0)).device


def make_dense(name: str, model: torch.nn.Module, cfg, world, placement):
    module = importlib.import_module(f"hybridrec.strategy.{AXES['dense'][name].module}")
    return module.DENSE(model, cfg, world, placement)
