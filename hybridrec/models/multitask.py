"""Output heads mapping a model's shared representation [B, H] to logits [B, num_tasks].

* `"shared_bottom"`: one tower (MLP of `tower_hidden` + a linear output) per task on the
  shared representation. With the default `tower_hidden=()` each tower is one linear
  layer, which for a single task is the usual final logit layer.
* `"mmoe"` (Ma et al., KDD 2018): `num_experts` expert MLPs on the representation; each
  task mixes the experts' outputs with its own softmax gate, then runs its own tower.

Towers and experts are `GroupedMLP`s, so all tasks (or experts) run in one einsum per layer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from hybridrec.models.checks import check_choice, check_dropout, check_int, check_layer_sizes
from hybridrec.models.mlp import GroupedLinear, GroupedMLP

MULTITASK_KINDS = ("shared_bottom", "mmoe")


class TaskHead(nn.Module):
    """[B, in_dim] -> logits [B, num_tasks] through per-task towers (and MMoE experts)."""

    def __init__(
        self,
        in_dim: int,
        num_tasks: int,
        *,
        multitask: str = "shared_bottom",
        tower_hidden: Sequence[int] = (),
        num_experts: int = 4,
        expert_hidden: Sequence[int] = (64,),
        dropout: float = 0.0,
    ):
        super().__init__()
        self.num_tasks = check_int("num_tasks", num_tasks, minimum=1)
        self.multitask = check_choice("multitask", multitask, MULTITASK_KINDS)
        self.num_experts = check_int("num_experts", num_experts, minimum=1)
        expert_hidden = check_layer_sizes("expert_hidden", expert_hidden, allow_empty=False)
        dropout = check_dropout("dropout", dropout)
        self.experts: GroupedMLP | None = None
        self.gates: nn.Linear | None = None
        if self.multitask == "mmoe":
            self.experts = GroupedMLP(num_experts, in_dim, expert_hidden, dropout, name="expert_hidden")
            self.gates = nn.Linear(in_dim, num_tasks * num_experts)
            in_dim = self.experts.out_dim
        self.towers = GroupedMLP(num_tasks, in_dim, tower_hidden, dropout, name="tower_hidden")
        self.output = GroupedLinear(num_tasks, self.towers.out_dim, 1)

    def forward(self, representation: Tensor) -> Tensor:
        x = representation
        if self.experts is not None:
            x = torch.bmm(self.gate_weights(x), self.experts(x))  # [B, T, E] @ [B, E, H] -> [B, T, H]
        return self.output(self.towers(x)).squeeze(-1)

    def gate_weights(self, representation: Tensor) -> Tensor:
        """MMoE only: each task's softmax weights over the experts, [B, num_tasks, num_experts]."""
        if self.gates is None:
            raise ValueError(f"gate_weights needs multitask='mmoe'; this head has multitask={self.multitask!r}")
        return self.gates(representation).view(-1, self.num_tasks, self.num_experts).softmax(dim=-1)
