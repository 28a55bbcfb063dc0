"""FC splits (Hierarchical Training §4.1): a split layer computes what the unsplit one does,
outputs and gradients, both ways, with uneven parts, and for a co-partitioned pair."""
import pytest
import torch
from torch import nn

from hybridrec.hierarchical.fc_split import (CoPartitionedPair, SplitLinear, co_partition, part_sizes, should_co_partition,
                                       split_linear)


def _grads(module: nn.Module, x: torch.Tensor, upstream: torch.Tensor):
    x = x.clone().requires_grad_(True)
    out = module(x)
    out.backward(upstream)
    return out.detach(), x.grad


@pytest.mark.parametrize("how", ["vertical", "horizontal"])
@pytest.mark.parametrize("parts", [1, 3, [2, 5, 4]])
@pytest.mark.parametrize("bias", [True, False])
def test_split_layer_matches_the_unsplit_layer(how, parts, bias):
    torch.manual_seed(0)
    linear = nn.Linear(11, 11, bias=bias).double()
    split = split_linear(linear, parts, how)
    assert isinstance(split, SplitLinear) and len(split.parts) == (parts if isinstance(parts, int) else len(parts))
    x, upstream = torch.randn(7, 11, dtype=torch.float64), torch.randn(7, 11, dtype=torch.float64)
    out, x_grad = _grads(linear, x, upstream)
    split_out, split_x_grad = _grads(split, x, upstream)
    torch.testing.assert_close(split_out, out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(split_x_grad, x_grad, rtol=1e-12, atol=1e-12)
    # the parts' weight gradients are the unsplit gradient's pieces
    dim = 0 if how == "vertical" else 1
    torch.testing.assert_close(torch.cat([p.weight.grad for p in split.parts], dim=dim), linear.weight.grad)
    if bias:
        bias_grad = (torch.cat([p.bias.grad for p in split.parts]) if how == "vertical" else split.parts[0].bias.grad)
        torch.testing.assert_close(bias_grad, linear.bias.grad)
        assert how == "vertical" or all(p.bias is None for p in split.parts[1:])
    joined = split.join()
    torch.testing.assert_close(joined.weight, linear.weight, rtol=0, atol=0)


def test_uneven_sizes_and_a_non_square_layer():
    torch.manual_seed(1)
    linear = nn.Linear(13, 5)
    assert part_sizes(13, 4) == [4, 3, 3, 3]
    for how, parts in (("vertical", 2), ("horizontal", 4)):
        split = split_linear(linear, parts, how)
        x = torch.randn(3, 2, 13)  # any leading dimensions
        torch.testing.assert_close(split(x), linear(x), rtol=1e-5, atol=1e-6)
    assert split_linear(linear, 2, "vertical").sizes == [3, 2]


def test_co_partitioned_pair_matches_two_layers_without_a_join():
    torch.manual_seed(2)
    first, second = nn.Linear(6, 20).double(), nn.Linear(20, 3).double()
    assert should_co_partition(first, second) and not should_co_partition(second, first)
    reference = nn.Sequential(first, nn.ReLU(), second)
    pair = co_partition(first, second, [7, 7, 6], nn.ReLU())
    assert isinstance(pair, CoPartitionedPair) and len(pair.shards) == 3
    x, upstream = torch.randn(9, 6, dtype=torch.float64), torch.randn(9, 3, dtype=torch.float64)
    out, x_grad = _grads(reference, x, upstream)
    pair_out, pair_x_grad = _grads(pair, x, upstream)
    torch.testing.assert_close(pair_out, out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(pair_x_grad, x_grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.cat([s[0].weight.grad for s in pair.shards]), first.weight.grad)
    torch.testing.assert_close(torch.cat([s[2].weight.grad for s in pair.shards], dim=1), second.weight.grad)
    torch.testing.assert_close(pair.shards[0][2].bias.grad, second.bias.grad)
    joined_first, _, joined_second = pair.join()
    torch.testing.assert_close(joined_first.weight, first.weight, rtol=0, atol=0)
    torch.testing.assert_close(joined_second.bias, second.bias, rtol=0, atol=0)


def test_bad_splits_are_refused_with_the_parameter():
    linear = nn.Linear(4, 3)
    with pytest.raises(ValueError, match="parts is 4, more than the out_features"):
        split_linear(linear, 4, "vertical")
    with pytest.raises(ValueError, match=r"sum to 5, but the in_features to split is 4"):
        split_linear(linear, [2, 3], "horizontal")
    with pytest.raises(ValueError, match="how must be one of"):
        split_linear(linear, 2, "diagonal")
    with pytest.raises(ValueError, match="must equal second.in_features"):
        co_partition(nn.Linear(4, 5), nn.Linear(6, 2), 2)
