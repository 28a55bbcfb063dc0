"""The collectives of PICASSO's sharded tables and what a step costs in operations.

`Collectives` runs AllToAll and AllReduce on a gloo process group of the tables' own (so that the
DDP AllReduce on the default group and these never wait on each other's order) and counts the
bytes each trainer sends to the others, by purpose ("train" or "eval"), once, by the sender.
`OpCounts` counts the operations a step issues on the embedding path (PICASSO Table V).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch
import torch.distributed as dist


@dataclasses.dataclass
class OpCounts:
    """Operations a step issues on the embedding path (PICASSO Table V): native kernel calls
    (numba kernels and numpy array operations), collectives, torch operations."""

    native: int = 0
    collectives: int = 0
    torch: int = 0

    def add(self, other: "OpCounts") -> None:
        self.native += other.native
        self.collectives += other.collectives
        self.torch += other.torch

    def as_dict(self, steps: int = 1) -> dict:
        steps = max(steps, 1)
        out = {k: getattr(self, k) / steps for k in ("native", "collectives", "torch")}
        out["total"] = sum(out.values())
        return out


class Collectives:
    """The placement's collectives on its own gloo process group (so that the DDP AllReduce on
    the default group and these never wait on each other's order), with the bytes each trainer
    sends to the others counted by purpose ("train" or "eval")."""

    def __init__(self, world):
        self.size, self.rank = world.size, world.rank
        self.group = dist.new_group(backend="gloo") if world.grouped and world.size > 1 else None
        self.bytes = {"train": 0, "eval": 0}

    def alltoall(self, send: np.ndarray, send_splits, recv_splits, ops: OpCounts, purpose: str,
                 async_op: bool = False):
        """(received array, work or None): rows send_splits[w] of `send` (laid out rank after
        rank) go to rank w; rows from rank w arrive as recv_splits[w] rows, rank after rank."""
        if self.size == 1:
            return send, None
        send = np.ascontiguousarray(send)
        recv_splits = [int(n) for n in recv_splits]
        send_splits = [int(n) for n in send_splits]
        recv = np.empty((sum(recv_splits),) + send.shape[1:], send.dtype)
        as_torch = (lambda a: torch.from_numpy(a.view(np.int64))) if send.dtype == np.uint64 else torch.from_numpy
        work = dist.all_to_all_single(as_torch(recv), as_torch(send), recv_splits, send_splits, group=self.group,
                                      async_op=async_op)
        ops.collectives += 1
        row_bytes = send.itemsize * int(np.prod(send.shape[1:], dtype=np.int64))
        self.bytes[purpose] += (sum(send_splits) - send_splits[self.rank]) * row_bytes
        return recv, work

    def allreduce(self, array: np.ndarray, ops: OpCounts, purpose: str) -> None:
        """Sum `array` over the trainers, in place (a ring moves 2 (W-1)/W of it per trainer)."""
        if self.size == 1 or array.size == 0:
            return
        dist.all_reduce(torch.from_numpy(array), group=self.group)
        ops.collectives += 1
        self.bytes[purpose] += int(2 * (self.size - 1) * array.nbytes // self.size)

    def barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)
