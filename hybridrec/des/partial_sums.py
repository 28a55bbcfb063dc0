"""The one collective of a DES step: every trainer's partial results of the substituted first
layers summed by an AllReduce in the forward pass (`SumOverTrainers`), with nothing sent in
backward, and the bytes a ring AllReduce puts on the wire (`ring_bytes`)."""
from __future__ import annotations

import torch
import torch.distributed as dist


def ring_bytes(payload: int, elsize: int, rank: int, size: int) -> tuple[int, int]:
    """(sent, received) bytes of trainer `rank` in a ring AllReduce of `payload` bytes among `size`
    trainers: reduce-scatter then all-gather, each N-1 steps of one chunk (chunks of whole elements)."""
    if size == 1:
        return 0, 0
    elements = payload // elsize
    chunk = [(elements // size + (i < elements % size)) * elsize for i in range(size)]
    sent = 2 * payload - chunk[(rank + 1) % size] - chunk[(rank + 2) % size]
    received = 2 * payload - chunk[rank % size] - chunk[(rank + 1) % size]
    return sent, received


class SumOverTrainers(torch.autograd.Function):
    """Forward: every trainer's partial results summed (one AllReduce). Backward: the gradient as
    it is (no communication): every trainer computes the same loss from the same sum."""

    @staticmethod
    def forward(ctx, partial):
        summed = partial.contiguous().clone()
        dist.all_reduce(summed)
        return summed

    @staticmethod
    def backward(ctx, grad):
        return grad
