"""The contract every CTR model's dense part follows (see docs/architecture.md).

Models never see IDs. They receive already-pooled embeddings and return logits:

    forward(deep: Tensor[B, F, D] | None, wide: Tensor[B, F] | None,
            dense: Tensor[B, n_dense] | None) -> Tensor[B, n_tasks]

`needs_deep` / `needs_wide` tell the caller which embeddings to look up: `deep` holds
one D-dim vector per sparse feature, `wide` one first-order scalar per sparse feature.
An input the model does not need may be passed as None; `dense` may be None when
`num_dense == 0`.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from hybridrec.models.checks import check_int


class CTRModel(nn.Module):
    """Base class: stores the input sizes, validates them and the tensors given to forward."""

    needs_deep: bool = True
    needs_wide: bool = False

    def __init__(self, num_sparse: int, embedding_dim: int, num_dense: int, num_tasks: int = 1):
        super().__init__()
        self.num_sparse = check_int("num_sparse", num_sparse, minimum=1)
        self.embedding_dim = check_int("embedding_dim", embedding_dim, minimum=1)
        self.num_dense = check_int("num_dense", num_dense, minimum=0)
        self.num_tasks = check_int("num_tasks", num_tasks, minimum=1)

    def check_inputs(self, deep: Tensor | None, wide: Tensor | None, dense: Tensor | None) -> Tensor:
        """Validate the forward inputs and return `dense` as a [B, num_dense] tensor."""
        batch_size = None
        expected = {
            "deep": (deep, (self.num_sparse, self.embedding_dim), self.needs_deep),
            "wide": (wide, (self.num_sparse,), self.needs_wide),
            "dense": (dense, (self.num_dense,), self.num_dense > 0),
        }
        for name, (tensor, tail, required) in expected.items():
            if tensor is None:
                if required:
                    raise ValueError(f"{type(self).__name__} needs `{name}` (shape [B, {_dims(tail)}]); got None")
                continue
            if not isinstance(tensor, Tensor) or not tensor.is_floating_point():
                raise TypeError(f"`{name}` must be a floating-point torch.Tensor; got {_describe(tensor)}")
            if tuple(tensor.shape[1:]) != tail or (batch_size is not None and tensor.shape[0] != batch_size):
                shown = f"[{batch_size if batch_size is not None else 'B'}, {_dims(tail)}]"
                raise ValueError(f"`{name}` must have shape {shown}; got {list(tensor.shape)}")
            batch_size = tensor.shape[0]
        if dense is None:
            reference = deep if deep is not None else wide
            dense = reference.new_zeros(reference.shape[0], 0)
        return dense

    def extra_repr(self) -> str:
        return (
            f"num_sparse={self.num_sparse}, embedding_dim={self.embedding_dim}, "
            f"num_dense={self.num_dense}, num_tasks={self.num_tasks}"
        )


def _dims(tail: tuple[int, ...]) -> str:
    return ", ".join(str(size) for size in tail)


def _describe(value: object) -> str:
    if isinstance(value, Tensor):
        return f"a tensor of dtype {value.dtype}"
    return f"{type(value).__name__}"


def flatten_inputs(deep: Tensor, dense: Tensor) -> Tensor:
    """[B, F, D] embeddings and [B, n_dense] dense features -> one [B, F*D + n_dense] row each."""
    return torch.cat([deep.flatten(1), dense], dim=1)
