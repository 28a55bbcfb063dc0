"""Wide & Deep (Cheng et al., 2016): a linear part on IDs plus an MLP on the embeddings.

logits = first-order term (wide IDs + dense features)
       + task head(MLP([flattened deep embeddings, dense features]))

The wide part is the first-order ID weights (`needs_wide`); hand-made cross-product
features can be fed as extra sparse features. `DeepFM` extends this class by adding the
FM pairwise term, which is the only difference between the two models.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from hybridrec.models.base import CTRModel, flatten_inputs
from hybridrec.models.fm import PairwiseInteraction
from hybridrec.models.lr import FirstOrderTerm
from hybridrec.models.mlp import MLP
from hybridrec.models.multitask import TaskHead


class WideAndDeep(CTRModel):
    """Linear (wide) part + MLP (deep) part summed into one logit per task.

    Hyper-parameters: `hidden` (MLP layer sizes), `dropout`, and the `TaskHead` options
    (`multitask`, `tower_hidden`, `num_experts`, `expert_hidden`).
    """

    needs_wide = True
    adds_pairwise_interaction = False

    def __init__(
        self, num_sparse: int, embedding_dim: int, num_dense: int, num_tasks: int = 1, *,
        hidden: Sequence[int] = (256, 128),
        dropout: float = 0.0,
        **head_options,
    ):
        super().__init__(num_sparse, embedding_dim, num_dense, num_tasks)
        self.linear = FirstOrderTerm(self.num_sparse, self.num_dense, self.num_tasks)
        self.interaction = (
            PairwiseInteraction(self.embedding_dim, self.num_tasks) if self.adds_pairwise_interaction else None
        )
        self.mlp = MLP(self.num_sparse * self.embedding_dim + self.num_dense, hidden, dropout)
        self.head = TaskHead(self.mlp.out_dim, self.num_tasks, dropout=dropout, **head_options)

    def forward(self, deep: Tensor, wide: Tensor, dense: Tensor | None) -> Tensor:
        dense = self.check_inputs(deep, wide, dense)
        logits = self.linear(wide, dense) + self.head(self.mlp(flatten_inputs(deep, dense)))
        if self.interaction is not None:
            logits = logits + self.interaction(deep)
        return logits
