"""The dense model's embedding inputs for one batch: deep [B, F, D] and wide [B, F] tensors, as
every placement hands them to the training loop.

A remote placement's rows arrive as numpy parts: pooled parts ("deep" [B, F*D], "wide" [B, F])
become the inputs as they are; unique rows (one part per table, the lossless wire mode) are
pooled here with the batch's `BatchLayout`. The arrays that came off the wire become autograd
leaves, and `gradients()` hands back their gradients, by part name, for the update. A local
placement's inputs come out of its fused lookup, whose backward applies the update itself, so
there is nothing to hand back. All of this runs in the training thread, which keeps torch out of
the consistency pipeline's threads.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hybridrec.embedding.layout import BatchLayout


@dataclass
class Pulled:
    """Rows of one batch from a remote placement, decoded. `layout` "pooled": parts "deep"
    [B, F*D] and "wide" [B, F] (as present); "unique": one part per table, the rows of its unique
    keys in `batch_layout` order (`batch_layout` is set when this process already made it)."""

    layout: str
    parts: dict[str, np.ndarray]
    batch_size: int
    num_features: int
    batch_layout: BatchLayout | None = None
    handle: Any = None  # what the placement's connection needs to update this batch later
    versions: dict | None = None  # {table: [per PS shard, the updates its store held when read]}, where known


class EmbeddingInputs:
    def __init__(self, deep: torch.Tensor | None, wide: torch.Tensor | None,
                 leaves: dict[str, torch.Tensor] | None = None):
        self.deep, self.wide = deep, wide
        self.leaves = leaves or {}

    @classmethod
    def from_pulled(cls, pulled: Pulled, layout_of, deep_dim: int, requires_grad: bool) -> "EmbeddingInputs":
        """Inputs from pulled rows; `layout_of()` gives the batch's layout when the rows are unique
        and the pull did not carry it."""
        leaves = {name: torch.from_numpy(np.array(part, dtype=np.float32)).requires_grad_(requires_grad)
                  for name, part in pulled.parts.items()}
        shape = (pulled.batch_size, pulled.num_features)
        if pulled.layout == "unique":
            layout = pulled.batch_layout if pulled.batch_layout is not None else layout_of()
            deep, wide = layout.assemble(leaves, deep_dim)
        elif pulled.layout == "pooled":
            deep, wide = leaves.get("deep"), leaves.get("wide")
            deep = None if deep is None else deep.view(*shape, -1)
            wide = None if wide is None else wide.view(shape)
        else:
            raise ValueError(f"pulled layout {pulled.layout!r} is neither 'unique' nor 'pooled'")
        return cls(deep, wide, leaves)

    def to(self, device: torch.device) -> "EmbeddingInputs":
        """The same inputs on the dense model's device (the leaves stay where they are)."""
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return EmbeddingInputs(move(self.deep), move(self.wide), self.leaves)

    def gradients(self) -> dict[str, np.ndarray]:
        """Each leaf's gradient (zeros where the loss did not reach it); empty for local inputs."""
        return {name: (leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)).numpy()
                for name, leaf in self.leaves.items()}
