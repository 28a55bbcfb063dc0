"""A training step's forward and backward passes, and the logits of a batch, as every strategy
runs them: the placement makes the dense model's embedding inputs, the dense sync gives the module
to call (DDP, DES's substituted model, HT's remote units) and says how gradients accumulate over
the parts of a cut batch."""
from __future__ import annotations

import contextlib

import numpy as np
import torch


def logits_of(module, inputs, batch, device: torch.device) -> torch.Tensor:
    inputs = inputs.to(device)
    dense = torch.from_numpy(batch.dense).to(device) if batch.dense.shape[1] else None
    return module(inputs.deep, inputs.wide, dense)


def dense_precision(precision: str, device: torch.device):
    """The context the dense forward runs in: torch autocast to bfloat16 for `bf16`, else nothing."""
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def batch_loss(loss_fn, logits: torch.Tensor, labels: np.ndarray, device) -> torch.Tensor:
    """The loss of a batch; an empty one (a lockstep trainer whose stream had nothing, an empty
    micro-batch) has loss 0 with zero gradients, not the NaN a mean over no rows would be."""
    if not len(labels):
        return logits.sum() * 0.0
    return loss_fn(logits, torch.from_numpy(labels).to(device))


def forward_backward(placement, dense, ready, loss_fn, device, precision: str = "fp32"):
    """(inputs, logits, loss) of a step's forward and backward passes. The placement's
    `micro_batches(looked, batch)` (PICASSO's D-interleaving) may cut the batch into parts: one
    pass per part, each part's loss weighted by its share of the rows and the dense gradients
    accumulated unsynchronised (the dense sync's `accumulating()`) until the last part, so the
    step's gradients are the whole batch's; the placement updates its embeddings once, in the push."""
    batch = ready.batch
    parts = placement.micro_batches(ready.looked, batch)
    if len(parts) == 1:
        inputs = placement.inputs(parts[0][0], batch, requires_grad=True)
        with dense_precision(precision, device):
            logits = logits_of(dense.module, inputs, batch, device).float()
        loss = batch_loss(loss_fn, logits, batch.labels, device)
        loss.backward()
        return inputs, logits, loss
    outputs, total = [], 0.0
    for index, (looked, part) in enumerate(parts):
        last = index + 1 == len(parts)
        with contextlib.nullcontext() if last else dense.accumulating():
            inputs = placement.inputs(looked, part, requires_grad=True)
            with dense_precision(precision, device):
                logits = logits_of(dense.module, inputs, part, device).float()
            loss = batch_loss(loss_fn, logits, part.labels, device)
            (loss * (part.batch_size / max(batch.batch_size, 1))).backward()
        outputs.append(logits.detach())
        total = total + loss.detach() * part.batch_size
    return inputs, torch.cat(outputs), total / max(batch.batch_size, 1)
