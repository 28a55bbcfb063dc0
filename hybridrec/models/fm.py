"""Factorization machine (Rendle, 2010) and its second-order term, reused by DeepFM.

The second-order term sums the dot products of every pair of feature embeddings,
sum_{f<g} <v_f, v_g>, in O(F*D) rather than O(F^2*D) with the identity

    sum_{f<g} v_f * v_g = 0.5 * ((sum_f v_f)^2 - sum_f v_f^2)     (per dimension).

The per-dimension result [B, D] is mapped to the tasks by a [D, num_tasks] weight that
starts at 1, so one task starts as the textbook FM (sum over D) and several tasks can
weigh the dimensions differently.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from hybridrec.models.base import CTRModel
from hybridrec.models.checks import check_int
from hybridrec.models.lr import FirstOrderTerm


class PairwiseInteraction(nn.Module):
    """deep [B, F, D] -> sum over feature pairs of their dot products, per task: [B, num_tasks]."""

    def __init__(self, embedding_dim: int, num_tasks: int):
        super().__init__()
        embedding_dim = check_int("embedding_dim", embedding_dim, minimum=1)
        num_tasks = check_int("num_tasks", num_tasks, minimum=1)
        self.weight = nn.Parameter(torch.ones(embedding_dim, num_tasks))

    def forward(self, deep: Tensor) -> Tensor:
        square_of_sum = deep.sum(dim=1).square()
        sum_of_squares = deep.square().sum(dim=1)
        return (0.5 * (square_of_sum - sum_of_squares)) @ self.weight


class FactorizationMachine(CTRModel):
    """First-order term (IDs and dense features) + pairwise interactions of the ID embeddings."""

    needs_wide = True

    def __init__(self, num_sparse: int, embedding_dim: int, num_dense: int, num_tasks: int = 1):
        super().__init__(num_sparse, embedding_dim, num_dense, num_tasks)
        self.linear = FirstOrderTerm(self.num_sparse, self.num_dense, self.num_tasks)
        self.interaction = PairwiseInteraction(self.embedding_dim, self.num_tasks)

    def forward(self, deep: Tensor, wide: Tensor, dense: Tensor | None) -> Tensor:
        dense = self.check_inputs(deep, wide, dense)
        return self.linear(wide, dense) + self.interaction(deep)
