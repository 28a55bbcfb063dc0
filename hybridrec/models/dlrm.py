"""DLRM (Naumov et al., 2019): dot-product interactions between embeddings and dense features.

1. A bottom MLP maps the dense features [B, n_dense] to one D-dim vector (its last layer
   size must equal `embedding_dim`).
2. That vector and the F feature embeddings form F + 1 vectors; the dot product of every
   distinct pair (upper triangle, no self-interactions) gives (F + 1) * F / 2 numbers.
3. These are concatenated with the bottom output (size D + (F + 1) * F / 2, see
   `interaction_dim`) and go through the top MLP and a `TaskHead` (one logit per task).

With `num_dense == 0` there is no bottom MLP: only the F embeddings interact and the
interaction output has F * (F - 1) / 2 entries.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from hybridrec.models.base import CTRModel
from hybridrec.models.checks import check_layer_sizes
from hybridrec.models.mlp import MLP
from hybridrec.models.multitask import TaskHead


class DLRM(CTRModel):
    """Bottom MLP on dense features, pairwise dot interaction, top MLP.

    Hyper-parameters: `bottom_mlp` (layer sizes, last = embedding_dim; default None means
    (64, embedding_dim)), `top_mlp` (layer sizes before the task head), `dropout`, and the
    `TaskHead` options (`multitask`, `tower_hidden`, `num_experts`, `expert_hidden`).
    """

    def __init__(
        self, num_sparse: int, embedding_dim: int, num_dense: int, num_tasks: int = 1, *,
        bottom_mlp: Sequence[int] | None = None,
        top_mlp: Sequence[int] = (256, 128),
        dropout: float = 0.0,
        **head_options,
    ):
        super().__init__(num_sparse, embedding_dim, num_dense, num_tasks)
        if bottom_mlp is None:
            bottom_mlp = (64, self.embedding_dim)
        bottom_sizes = check_layer_sizes("bottom_mlp", bottom_mlp, allow_empty=False)
        if bottom_sizes[-1] != self.embedding_dim:
            raise ValueError(
                f"bottom_mlp must end with embedding_dim={self.embedding_dim} so its output can "
                f"interact with the embeddings; got bottom_mlp={list(bottom_sizes)}"
            )
        num_vectors = self.num_sparse + (1 if self.num_dense > 0 else 0)
        if num_vectors < 2:
            raise ValueError(
                f"DLRM needs at least two vectors to interact; got num_sparse={self.num_sparse} "
                f"and num_dense={self.num_dense} (use num_sparse >= 2 or num_dense >= 1)"
            )
        self.bottom = MLP(self.num_dense, bottom_sizes, dropout, name="bottom_mlp") if self.num_dense > 0 else None
        rows, cols = torch.triu_indices(num_vectors, num_vectors, offset=1)
        self.register_buffer("pair_rows", rows, persistent=False)
        self.register_buffer("pair_cols", cols, persistent=False)
        bottom_dim = self.embedding_dim if self.bottom is not None else 0
        self.interaction_dim = bottom_dim + num_vectors * (num_vectors - 1) // 2
        self.top = MLP(self.interaction_dim, top_mlp, dropout, name="top_mlp")
        self.head = TaskHead(self.top.out_dim, self.num_tasks, dropout=dropout, **head_options)

    def interact(self, deep: Tensor, dense: Tensor) -> Tensor:
        """[B, F, D] embeddings and [B, n_dense] dense features -> [B, interaction_dim]."""
        if self.bottom is None:
            vectors, kept = deep, []
        else:
            bottom_out = self.bottom(dense)
            vectors, kept = torch.cat([bottom_out.unsqueeze(1), deep], dim=1), [bottom_out]
        dots = torch.bmm(vectors, vectors.transpose(1, 2))  # [B, V, V]
        return torch.cat([*kept, dots[:, self.pair_rows, self.pair_cols]], dim=1)

    def forward(self, deep: Tensor, wide: Tensor | None, dense: Tensor | None) -> Tensor:
        dense = self.check_inputs(deep, wide, dense)
        return self.head(self.top(self.interact(deep, dense)))
