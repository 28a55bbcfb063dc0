"""Multi-layer perceptrons: one plain MLP and a grouped one that runs G MLPs at once.

Both are stacks of (linear -> ReLU -> dropout) layers; the caller adds its own output
layer. `GroupedMLP` keeps G independent weight sets in one tensor per layer and applies
them with a single einsum, so per-task towers and MMoE experts cost one kernel per layer
instead of a Python loop over tasks or experts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from hybridrec.models.checks import check_dropout, check_int, check_layer_sizes


class _LayerStack(nn.Module):
    """(linear -> ReLU -> dropout) per entry of `sizes`; `make_linear(in, out)` builds each linear."""

    def __init__(
        self,
        in_dim: int,
        sizes: Sequence[int],
        dropout: float,
        name: str,
        make_linear: Callable[[int, int], nn.Module],
    ):
        super().__init__()
        in_dim = check_int("in_dim", in_dim, minimum=1)
        sizes = check_layer_sizes(name, sizes)
        dropout = check_dropout("dropout", dropout)
        layers: list[nn.Module] = []
        for out_dim in sizes:
            layers.append(make_linear(in_dim, out_dim))
            layers.append(nn.ReLU())
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
            in_dim = out_dim
        self.layers = nn.Sequential(*layers)
        self.out_dim = in_dim

    def forward(self, x: Tensor) -> Tensor:
        return self.layers(x)


class MLP(_LayerStack):
    """`len(sizes)` ReLU layers mapping [B, in_dim] -> [B, out_dim]; identity when sizes is empty."""

    def __init__(self, in_dim: int, sizes: Sequence[int], dropout: float = 0.0, *, name: str = "hidden"):
        super().__init__(in_dim, sizes, dropout, name, nn.Linear)


class GroupedLinear(nn.Module):
    """G independent linear maps: [B, in] (shared input) or [B, G, in] -> [B, G, out].

    Initialised like `nn.Linear` (uniform in +-1/sqrt(in)) for each group.
    """

    def __init__(self, groups: int, in_dim: int, out_dim: int):
        super().__init__()
        self.groups = check_int("groups", groups, minimum=1)
        bound = 1.0 / math.sqrt(check_int("in_dim", in_dim, minimum=1))
        self.weight = nn.Parameter(torch.empty(groups, in_dim, out_dim).uniform_(-bound, bound))
        self.bias = nn.Parameter(torch.empty(groups, out_dim).uniform_(-bound, bound))

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() == 2:
            return torch.einsum("bi,gio->bgo", x, self.weight) + self.bias
        return torch.einsum("bgi,gio->bgo", x, self.weight) + self.bias

    def extra_repr(self) -> str:
        groups, in_dim, out_dim = self.weight.shape
        return f"groups={groups}, in_dim={in_dim}, out_dim={out_dim}"


class GroupedMLP(_LayerStack):
    """G MLPs with the same layer sizes: [B, in] (shared) or [B, G, in] -> [B, G, out_dim].

    With no layers the input passes through unchanged (a following `GroupedLinear`
    accepts both shapes).
    """

    def __init__(
        self, groups: int, in_dim: int, sizes: Sequence[int], dropout: float = 0.0, *, name: str = "hidden"
    ):
        groups = check_int("groups", groups, minimum=1)
        super().__init__(in_dim, sizes, dropout, name, lambda i, o: GroupedLinear(groups, i, o))
        self.groups = groups
