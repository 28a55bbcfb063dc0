"""One dense copy shared by the trainer processes of a Hierarchical Training group (Hogwild).

The group's leader writes the model's parameters into one flat float32 file under /dev/shm;
every member maps it and points its parameters at views of it, so an optimizer step of any
member changes the one copy in place, without locks (the form of PyTorch's Hogwild example,
across processes torchrun started rather than forked). Beside it each member owns a write
counter in a shared int64 array: the writes the others made between a step's forward (its
read) and its optimizer step (its write) are that step's dense staleness, at most t - 1 per
step with t one-step-at-a-time members. The files are unlinked once every member has mapped
them, so nothing is left behind however the job ends.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

SHM_DIRECTORY = Path("/dev/shm")


def _mapped(path: Path, numel: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_file(str(path), shared=True, size=numel, dtype=dtype)


def _create(path: Path, numel: int, dtype: torch.dtype) -> torch.Tensor:
    with open(path, "xb") as file:  # "x": a name clash is an error, never another job's copy
        os.ftruncate(file.fileno(), numel * torch.empty(0, dtype=dtype).element_size())
    return _mapped(path, numel, dtype)


class SharedCopy:
    """A group's dense copy: `attach` the model's parameters to it, `read_mark()` before the
    forward, `write_mark(mark)` just before the optimizer step (returns that step's staleness).

    `prefix`: the file names' job- and group-unique prefix; `member` / `members`: this
    process's index in the group and the group's size; `create`: this process makes the files
    (the others map them after it did; the caller orders that with a barrier)."""

    def __init__(self, model: torch.nn.Module, prefix: str, member: int, members: int, create: bool):
        self.params = [p for p in model.parameters()]
        self.numel = sum(p.numel() for p in self.params)
        self.paths = (SHM_DIRECTORY / f"{prefix}.params", SHM_DIRECTORY / f"{prefix}.writes")
        self.member, self.members = member, members
        if create:
            self.flat = _create(self.paths[0], self.numel, torch.float32)
            self.writes = _create(self.paths[1], members, torch.int64)
            offset = 0
            with torch.no_grad():
                for p in self.params:
                    self.flat[offset:offset + p.numel()].copy_(p.detach().reshape(-1))
                    offset += p.numel()
            self.writes.zero_()
        else:
            self.flat = _mapped(self.paths[0], self.numel, torch.float32)
            self.writes = _mapped(self.paths[1], members, torch.int64)

    def attach(self) -> None:
        """Point every parameter at its view of the shared copy (its values are the copy's)."""
        offset = 0
        for p in self.params:
            p.data = self.flat[offset:offset + p.numel()].view(p.shape)
            offset += p.numel()

    def unlink(self) -> None:
        """Remove the files; the mappings stay valid until every member exits."""
        for path in self.paths:
            path.unlink(missing_ok=True)

    def read_mark(self) -> int:
        return int(self.writes.sum())

    def write_mark(self, mark: int) -> int:
        """This step's staleness (the group's writes since `mark`, this member's own none of
        them), and this member's write counted."""
        staleness = int(self.writes.sum()) - mark
        self.writes[self.member] += 1
        return staleness

    @property
    def total_writes(self) -> int:
        return int(self.writes.sum())
