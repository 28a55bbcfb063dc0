"""The dense-sync axis: how each trainer's dense parameters stay in step with the others'.

A value is a `DenseSync` built with (model, cfg, world, services: the placement's typed
services, hybridrec.strategy.services) that offers `model` (what the
loop evaluates, saves and hands to `on_step`: the model itself, or DES's substituted one),
`module` (what the loop calls forward on), `accumulating()` (the context in which a backward adds
to the gradients without synchronising them: DDP's `no_sync`, for all but the last part of a cut
batch), `lockstep` (whether the trainers take every step together, so the
loop may run collectives such as a mid-run evaluation), `begin_step()` / `finish_step()` around
forward and backward, `finish_training()` once every trainer is out of its training loop (a
collective: the model becomes the one to evaluate and save), `facts(world)` for the result file
(a collective), `state()` / `load(state)` for checkpoints (`state()` is called on every trainer,
so a sync may gather its parts there; the leader's is written), and `close()`. `make_dense` builds the value named by `strategy.dense` from the module
hybridrec.axes names for it.
"""
from __future__ import annotations

import contextlib
import importlib

import torch

from hybridrec.axes import AXES
from hybridrec.models.dense_optimizer import optimizer_of


class DenseSync:
    """What every dense sync offers beyond its steps; the defaults suit a sync whose model needs
    nothing at the end and reports nothing."""

    lockstep = True
    model: torch.nn.Module
    module: torch.nn.Module

    def accumulating(self):
        """A backward inside this adds to the gradients, synchronising nothing (no sync here does)."""
        return contextlib.nullcontext()

    def finish_training(self) -> None:
        pass

    def facts(self, world) -> dict:
        return {}

    def close(self) -> None:
        pass


def dense_optimizer(cfg, params) -> torch.optim.Optimizer:
    """The torch optimizer of the dense model's parameters, as train.dense_optimizer says."""
    return optimizer_of(cfg.train.dense_optimizer.model_dump(), params)


def model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters(), torch.empty(0)).device


def make_dense(name: str, model: torch.nn.Module, cfg, world, services):
    module = importlib.import_module(f"hybridrec.strategy.{AXES['dense'][name].module}")
    return module.DENSE(model, cfg, world, services)
