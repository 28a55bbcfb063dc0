"""The trainers of a job as the training loop sees them: this process's rank, how many there
are, and the few collectives the loop needs (all have a batch?, gather, broadcast, barrier).

With one trainer (a local run, or torchrun with one process and no process group) every
collective is answered in process, so the same loop runs with and without torch.distributed.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    in_process: bool = False  # answer every collective in process, even inside a process group

    @staticmethod
    def current() -> "World":
        """The process group this process joined, or a world of one."""
        if dist.is_available() and dist.is_initialized():
            return World(dist.get_rank(), dist.get_world_size())
        return World()

    def alone(self) -> "World":
        """This trainer as a world of one, even inside a process group: collectives answered in process."""
        return World(0, 1, in_process=True)

    @property
    def grouped(self) -> bool:
        return not self.in_process and dist.is_available() and dist.is_initialized()

    @property
    def leader(self) -> bool:
        """Rank 0 writes metrics, checkpoints and the final result."""
        return self.rank == 0

    def all_have(self, flag: bool) -> bool:
        """Whether every trainer has `flag` (e.g. another batch this epoch)."""
        if not self.grouped:
            return flag
        have = torch.tensor([1 if flag else 0], dtype=torch.int32)
        dist.all_reduce(have, op=dist.ReduceOp.MIN)
        return bool(have.item())

    def all_have_any_rows(self, flag: bool, rows: bool) -> tuple[bool, bool]:
        """(every trainer has `flag`, some trainer has `rows`) in one collective: whether all have
        a batch, and whether any of those batches holds rows (lockstep trainers on a stream step
        with empty batches while their share is dry, and not at all while every share is)."""
        if not self.grouped:
            return flag, rows
        both = torch.tensor([1 if flag else 0, 0 if rows else 1], dtype=torch.int32)
        dist.all_reduce(both, op=dist.ReduceOp.MIN)
        return bool(both[0].item()), not bool(both[1].item())

    def gather(self, value) -> list:
        """`value` of every trainer, in rank order, on every trainer."""
        if not self.grouped:
            return [value]
        out = [None] * self.size
        dist.all_gather_object(out, value)
        return out

    def broadcast(self, value):
        """Rank 0's `value` on every trainer."""
        if not self.grouped:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.grouped:
            dist.barrier()
