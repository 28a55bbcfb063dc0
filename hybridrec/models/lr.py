"""Logistic regression, and the first-order (linear) term that FM, Wide&Deep and DeepFM reuse.

The first-order term of sample b for task t is

    sum_f wide[b, f] * w[f, t] + sum_j dense[b, j] * u[j, t] + bias[t]

`wide[b, f]` is the learned dim-1 embedding of feature f's ID, so with one task and
w = 1 this is exactly LR on one-hot IDs. `w` starts at 1 and stays learnable so that
several tasks can weigh the same first-order embeddings differently; `u` and the bias
start at 0.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from hybridrec.models.base import CTRModel
from hybridrec.models.checks import check_int


class FirstOrderTerm(nn.Module):
    """wide [B, F] and dense [B, n_dense] -> per-task linear logits [B, num_tasks]."""

    def __init__(self, num_sparse: int, num_dense: int, num_tasks: int):
        super().__init__()
        num_sparse = check_int("num_sparse", num_sparse, minimum=1)
        num_dense = check_int("num_dense", num_dense, minimum=0)
        num_tasks = check_int("num_tasks", num_tasks, minimum=1)
        weight = torch.zeros(num_sparse + num_dense, num_tasks)
        weight[:num_sparse] = 1.0
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(torch.zeros(num_tasks))

    def forward(self, wide: Tensor, dense: Tensor) -> Tensor:
        return torch.addmm(self.bias, torch.cat([wide, dense], dim=1), self.weight)


class LogisticRegression(CTRModel):
    """LR on first-order ID weights plus a linear term on the dense features."""

    needs_deep = False
    needs_wide = True

    def __init__(self, num_sparse: int, embedding_dim: int, num_dense: int, num_tasks: int = 1):
        super().__init__(num_sparse, embedding_dim, num_dense, num_tasks)
        self.linear = FirstOrderTerm(self.num_sparse, self.num_dense, self.num_tasks)

    def forward(self, deep: Tensor | None, wide: Tensor | None, dense: Tensor | None) -> Tensor:
        dense = self.check_inputs(deep, wide, dense)
        return self.linear(wide, dense)
