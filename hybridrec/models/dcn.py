"""DCN-v2 (Wang et al., 2021): a cross network of full-rank matrices plus a deep MLP.

Input x0 = [flattened deep embeddings, dense features] (size d = F*D + n_dense).
Cross layer l: x_{l+1} = x0 * (W_l x_l + b_l) + x_l, with W_l a full d x d matrix, so
L layers model feature crosses up to degree L + 1.

* `structure="stacked"`: representation = MLP(cross(x0)).
* `structure="parallel"`: representation = [cross(x0), MLP(x0)].

The representation goes to a `TaskHead` (one logit per task).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from hybridrec.models.base import CTRModel, flatten_inputs
from hybridrec.models.checks import check_choice, check_int
from hybridrec.models.mlp import MLP
from hybridrec.models.multitask import TaskHead

DCN_STRUCTURES = ("stacked", "parallel")


class CrossNetwork(nn.Module):
    """`num_layers` full-rank cross layers: [B, in_dim] -> [B, in_dim]; identity with 0 layers."""

    def __init__(self, in_dim: int, num_layers: int):
        super().__init__()
        in_dim = check_int("in_dim", in_dim, minimum=1)
        num_layers = check_int("cross_layers", num_layers, minimum=0)
        self.layers = nn.ModuleList(nn.Linear(in_dim, in_dim) for _ in range(num_layers))

    def forward(self, x0: Tensor) -> Tensor:
        x = x0
        for layer in self.layers:
            x = x0 * layer(x) + x
        return x


class DCN(CTRModel):
    """DCN-v2 with full-rank cross layers, stacked on or parallel to a deep MLP.

    Hyper-parameters: `cross_layers`, `structure` ("stacked" or "parallel"), `hidden`
    (MLP layer sizes; may be empty for a cross-only model), `dropout`, and the `TaskHead`
    options (`multitask`, `tower_hidden`, `num_experts`, `expert_hidden`).
    """

    def __init__(
        self, num_sparse: int, embedding_dim: int, num_dense: int, num_tasks: int = 1, *,
        cross_layers: int = 3,
        structure: str = "parallel",
        hidden: Sequence[int] = (256, 128),
        dropout: float = 0.0,
        **head_options,
    ):
        super().__init__(num_sparse, embedding_dim, num_dense, num_tasks)
        self.structure = check_choice("structure", structure, DCN_STRUCTURES)
        in_dim = self.num_sparse * self.embedding_dim + self.num_dense
        self.cross = CrossNetwork(in_dim, cross_layers)
        self.mlp = MLP(in_dim, hidden, dropout)
        head_in = self.mlp.out_dim if self.structure == "stacked" else in_dim + self.mlp.out_dim
        self.head = TaskHead(head_in, self.num_tasks, dropout=dropout, **head_options)

    def forward(self, deep: Tensor, wide: Tensor | None, dense: Tensor | None) -> Tensor:
        dense = self.check_inputs(deep, wide, dense)
        x0 = flatten_inputs(deep, dense)
        if self.structure == "stacked":
            representation = self.mlp(self.cross(x0))
        else:
            representation = torch.cat([self.cross(x0), self.mlp(x0)], dim=1)
        return self.head(representation)
