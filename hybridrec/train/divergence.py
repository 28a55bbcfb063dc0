"""Divergence: a training loss that is NaN or infinite stops the run with one line naming the
step, the loss and the optimizer settings to look at, before its gradients reach any parameter
(they would be refused anyway, with a traceback, or spread NaN through the model)."""
from __future__ import annotations

from typing import Callable

import torch

from hybridrec.errors import UserError


class DivergedError(UserError):
    """The training loss is not finite: the optimizer settings (or the data) make it diverge."""


def diverged_message(cfg, step: int, loss: float) -> str:
    """What to say when the loss of `step` is `loss` (not finite)."""
    dense = cfg.train.dense_optimizer
    embedding = cfg.embedding.default.optimizer
    return (f"training diverged at step {step}: the loss is {loss}; lower the learning rates, "
            f"train.dense_optimizer ({dense.name}, lr {dense.lr:g}, weight_decay {dense.weight_decay:g}) "
            f"and embedding.default.optimizer ({embedding.name}, lr {embedding.lr:g}) or the tables' own, "
            f"or look for extreme values in the data (train.precision {cfg.train.precision})")


def checked_loss(loss_fn: Callable, cfg, step: Callable[[], int]) -> Callable:
    """`loss_fn` that raises DivergedError when a loss is NaN or infinite; `step()` is the step
    it belongs to."""
    def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        value = loss_fn(logits, labels)
        if not bool(torch.isfinite(value.detach()).all()):
            raise DivergedError(diverged_message(cfg, step(), float(value.detach().float().mean())))
        return value

    return loss
