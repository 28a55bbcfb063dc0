"""FC splits (Hierarchical Training §4.1): one fully connected layer held as k parts, each a
separate module that a group PS could own, with the results joined exactly.

* Vertical split (by output columns): part i holds rows [o_i, o_{i+1}) of the weight (and of
  the bias) and sees the whole input; the layer's output is the parts' outputs concatenated.
* Horizontal split (by input rows): part i holds columns [h_i, h_{i+1}) of the weight and sees
  that slice of the input; the layer's output is the sum of the parts' partial products (the
  bias lives on part 0 only).
* Co-partitioning of two consecutive FCs (first vertical, second horizontal with the same cut):
  shard i runs first_i -> elementwise activation -> second_i, so the activation between the two
  layers never has to be joined; only the partial sums of the second layer are added.

`split_linear(linear, parts, how)` builds a `SplitLinear` from an existing nn.Linear (weights
copied, so it computes the same function) and `SplitLinear.join()` gives the nn.Linear back.
Which device runs which part is the operator placement's business
(hybridrec.hierarchical.operator_placement); these modules only compute.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from hybridrec.models.checks import check_choice, check_int

SPLITS = ("vertical", "horizontal")


def part_sizes(total: int, parts: int | Sequence[int], what: str = "dimension") -> list[int]:
    """`parts` as a list of sizes summing to `total`: an int k cuts `total` into k near-equal
    pieces (the first `total % k` one larger); a sequence is checked and returned."""
    if isinstance(parts, Sequence):
        sizes = [check_int(f"parts[{i}]", size, minimum=1) for i, size in enumerate(parts)]
        if sum(sizes) != total:
            raise ValueError(f"parts {list(sizes)} sum to {sum(sizes)}, but the {what} to split is {total}")
        return sizes
    k = check_int("parts", parts, minimum=1)
    if k > total:
        raise ValueError(f"parts is {k}, more than the {what} to split ({total}); allowed: 1..{total}")
    return [total // k + (1 if i < total % k else 0) for i in range(k)]


class SplitLinear(nn.Module):
    """An nn.Linear [in_features -> out_features] held as k part layers (`self.parts`).

    `how="vertical"`: part i is nn.Linear(in_features, out_sizes[i]); outputs concatenated.
    `how="horizontal"`: part i is nn.Linear(in_sizes[i], out_features); the input is cut along
    its last dimension and the partial products summed; only part 0 has a bias.
    """

    def __init__(self, in_features: int, out_features: int, parts: int | Sequence[int], how: str,
                 bias: bool = True):
        super().__init__()
        self.how = check_choice("how", how, SPLITS)
        self.in_features = check_int("in_features", in_features, minimum=1)
        self.out_features = check_int("out_features", out_features, minimum=1)
        if self.how == "vertical":
            self.sizes = part_sizes(self.out_features, parts, "out_features")
            layers = [nn.Linear(self.in_features, size, bias=bias) for size in self.sizes]
        else:
            self.sizes = part_sizes(self.in_features, parts, "in_features")
            layers = [nn.Linear(size, self.out_features, bias=bias and i == 0) for i, size in enumerate(self.sizes)]
        self.has_bias = bool(bias)
        self.parts = nn.ModuleList(layers)

    def forward(self, x: Tensor) -> Tensor:
        if self.how == "vertical":
            return torch.cat([part(x) for part in self.parts], dim=-1)
        pieces = torch.split(x, self.sizes, dim=-1)
        out = self.parts[0](pieces[0])
        for part, piece in zip(self.parts[1:], pieces[1:]):
            out = out + part(piece)
        return out

    @torch.no_grad()
    def load_from(self, linear: nn.Linear) -> "SplitLinear":
        """Copy `linear`'s weight (and bias) into the parts; returns self."""
        if (linear.in_features, linear.out_features) != (self.in_features, self.out_features):
            raise ValueError(f"linear is {linear.in_features} -> {linear.out_features}, this split layer "
                             f"{self.in_features} -> {self.out_features}")
        if (linear.bias is not None) != self.has_bias:
            raise ValueError(f"linear has bias={linear.bias is not None}, this split layer bias={self.has_bias}")
        dim = 0 if self.how == "vertical" else 1
        for part, weight in zip(self.parts, torch.split(linear.weight, self.sizes, dim=dim)):
            part.weight.copy_(weight)
        if self.has_bias:
            if self.how == "vertical":
                for part, bias in zip(self.parts, torch.split(linear.bias, self.sizes)):
                    part.bias.copy_(bias)
            else:
                self.parts[0].bias.copy_(linear.bias)
        return self

    def join(self) -> nn.Linear:
        """The nn.Linear this split layer computes (weights copied)."""
        return join_parts(self.parts, self.how)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, how={self.how}, sizes={self.sizes}"


@torch.no_grad()
def join_parts(parts: Sequence[nn.Linear], how: str) -> nn.Linear:
    """One nn.Linear from the part layers of a vertical split (weights stacked by output row,
    biases concatenated) or a horizontal one (weights side by side, part 0's bias)."""
    how = check_choice("how", how, SPLITS)
    dim = 0 if how == "vertical" else 1
    weight = torch.cat([part.weight for part in parts], dim=dim)
    has_bias = parts[0].bias is not None
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=has_bias, device=weight.device, dtype=weight.dtype)
    linear.weight.copy_(weight)
    if has_bias:
        linear.bias.copy_(torch.cat([part.bias for part in parts]) if how == "vertical" else parts[0].bias)
    return linear


def split_linear(linear: nn.Linear, parts: int | Sequence[int], how: str) -> SplitLinear:
    """A `SplitLinear` computing exactly what `linear` computes, its weight cut into `parts`
    (a count or the list of sizes) vertically (by output columns) or horizontally (by input rows)."""
    if not isinstance(linear, nn.Linear):
        raise TypeError(f"linear must be an nn.Linear, got {type(linear).__name__}")
    weight = linear.weight
    split = SplitLinear(linear.in_features, linear.out_features, parts, how, bias=linear.bias is not None)
    return split.to(device=weight.device, dtype=weight.dtype).load_from(linear)


class CoPartitionedPair(nn.Module):
    """Two consecutive FCs `second(activation(first(x)))` co-partitioned into k shards: shard i
    is Sequential(first's output columns i, activation, second's input rows i) and the output is
    the sum of the shards' partial products (second's bias on shard 0). The activation must be
    elementwise (ReLU, Sigmoid, Identity, ...), so that it commutes with cutting the columns."""

    def __init__(self, first: nn.Linear, second: nn.Linear, parts: int | Sequence[int],
                 activation: nn.Module | None = None):
        super().__init__()
        if not isinstance(first, nn.Linear) or not isinstance(second, nn.Linear):
            raise TypeError(f"first and second must be nn.Linear, got {type(first).__name__} and "
                            f"{type(second).__name__}")
        if first.out_features != second.in_features:
            raise ValueError(f"first.out_features ({first.out_features}) must equal second.in_features "
                             f"({second.in_features}) for the two layers to be consecutive")
        activation = nn.Identity() if activation is None else activation
        columns = split_linear(first, parts, "vertical")
        rows = split_linear(second, columns.sizes, "horizontal")
        self.sizes = columns.sizes
        self.shards = nn.ModuleList(nn.Sequential(a, activation, b) for a, b in zip(columns.parts, rows.parts))

    def forward(self, x: Tensor) -> Tensor:
        out = self.shards[0](x)
        for shard in self.shards[1:]:
            out = out + shard(x)
        return out

    def join(self) -> tuple[nn.Linear, nn.Module, nn.Linear]:
        """(first, activation, second) as whole layers again (weights copied)."""
        return (join_parts([shard[0] for shard in self.shards], "vertical"), self.shards[0][1],
                join_parts([shard[2] for shard in self.shards], "horizontal"))


def co_partition(first: nn.Linear, second: nn.Linear, parts: int | Sequence[int],
                 activation: nn.Module | None = None) -> CoPartitionedPair:
    """`second(activation(first(x)))` as k shards with no join between the two layers (§4.1)."""
    return CoPartitionedPair(first, second, parts, activation)


def should_co_partition(first: nn.Linear, second: nn.Linear) -> bool:
    """The paper's rule: co-partition when the first layer widens (out > in) and the second
    narrows (in > out); then the wide activation between them never crosses the wire."""
    return first.out_features > first.in_features and second.in_features > second.out_features
