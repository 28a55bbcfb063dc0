"""The net transformation of Hierarchical Training (HT §3.2): the operator placement's plan
(hybridrec.hierarchical.operator_placement) executed. The layers it puts on a group PS run there;
the trainer's copy of the model keeps the glue and calls them over the wire.

1. `split_model`: every nn.Linear the plan splits becomes a SplitLinear (hybridrec.models.
   fc_split) with the same weights; its parts are placed one per group PS, the join stays on the
   trainer. The centre keeps the unsplit parameter; each part syncs with its slice of it
   (`split_slices`).
2. `plan_units`: the placed modules become units, one remote call each. Inside an nn.Sequential,
   consecutive children placed on the same group PS, with the parameter-free leaves between and
   after them (ReLU, Dropout), form one unit, so an MLP's Linear-ReLU-Linear chain is one round
   trip instead of one per layer. Every other placed module is a unit of its own.
3. `remote_model`: a copy of the model whose units are `RemoteUnit`s: a forward sends the inputs
   (wire codec's forward half), gets the output back, and autograd's backward sends the output's
   gradient and gets the inputs' gradients back (the codec's backward half). The group PS
   applies the parameter gradients itself (hybridrec.hierarchical.group_ps).

Glue the plan puts on a group PS (an activation between two of its layers that is not a
Sequential child) runs on the trainer here: the executed plan may move more bytes than the plan
counts, never fewer parameters off the group PSs.
"""
from __future__ import annotations

import copy
import itertools
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import nn

from hybridrec.comm.transport import Client
from hybridrec.hierarchical.fc_split import SplitLinear
from hybridrec.hierarchical.remote_wire import GradientSender, pack_tensors, unpack_tensors, wire_codec


@dataclass(frozen=True)
class UnitPlan:
    """A unit: `paths` (children of one Sequential, or one module) run as one module on group PS
    `device`; its parameters are named `prefix.<name in the unit's module>` in the whole model."""

    name: str
    prefix: str
    device: int
    paths: tuple[str, ...]


def _get(model: nn.Module, path: str) -> nn.Module:
    return model.get_submodule(path) if path else model


def _set(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(_get(model, parent), name, module)


def split_model(model: nn.Module, splits: list[dict]) -> nn.Module:
    """A copy of `model` with each split of the plan (`{"module", "how", "parts"}`) made a
    SplitLinear computing the same function."""
    out = copy.deepcopy(model)
    for split in splits:
        linear = _get(out, split["module"])
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"plan split {split['module']}: not an nn.Linear in this model "
                             f"({type(linear).__name__})")
        parts = SplitLinear(linear.in_features, linear.out_features, split["parts"], split["how"],
                            bias=linear.bias is not None).to(linear.weight.dtype).load_from(linear)
        _set(out, split["module"], parts)
    return out


def split_slices(split: nn.Module, splits: list[dict]) -> dict[str, tuple[str, int, int, int]]:
    """For each parameter of a split part in a model `split_model` made: (the unsplit
    parameter's name, the dimension cut, start, stop), so that the part syncs with its slice of
    the unsplit parameter in the centre (hybridrec.hierarchical.elastic_averaging)."""
    out = {}
    for entry in splits:
        layer, path = _get(split, entry["module"]), entry["module"]
        start = 0
        for j, size in enumerate(layer.sizes):
            stop = start + size
            if layer.how == "vertical":  # output columns: rows of the weight, a slice of the bias
                out[f"{path}.parts.{j}.weight"] = (f"{path}.weight", 0, start, stop)
                if layer.has_bias:
                    out[f"{path}.parts.{j}.bias"] = (f"{path}.bias", 0, start, stop)
            else:  # input rows: columns of the weight; part 0 holds the whole bias
                out[f"{path}.parts.{j}.weight"] = (f"{path}.weight", 1, start, stop)
                if layer.has_bias and j == 0:
                    out[f"{path}.parts.0.bias"] = (f"{path}.bias", 0, 0, layer.out_features)
            start = stop
    return out


def placed_devices(modules: dict[str, list[str]], splits: list[dict], devices: list[str]) -> dict[str, int]:
    """Module path (split parts as `<linear>.parts.<j>`) -> group PS index, from the plan's
    `modules` (module -> its device, or its parts' devices in order)."""
    split = {entry["module"] for entry in splits}
    out = {}
    for module, names in modules.items():
        for j, name in enumerate(names):
            index = devices.index(name) - 1
            if index < 0:
                raise ValueError(f"plan: module {module} is placed on the trainer; with group PSs every "
                                 "parameter-owning module runs on one")
            out[f"{module}.parts.{j}" if module in split else module] = index
    return out


def _is_free_leaf(module: nn.Module) -> bool:
    return next(module.children(), None) is None and next(module.parameters(), None) is None


def plan_units(model: nn.Module, placed: dict[str, int]) -> list[UnitPlan]:
    """The units of a (split) model whose placed modules are `placed` (path -> group PS)."""
    units, covered = [], set()
    for parent_path, parent in model.named_modules():
        if not isinstance(parent, nn.Sequential):
            continue
        run: list[str] = []
        device = None

        def flush():
            if any(f"{parent_path}.{c}".lstrip(".") in placed for c in run):
                paths = tuple(f"{parent_path}.{c}".lstrip(".") for c in run)
                if len(paths) == 1:
                    units.append(UnitPlan(paths[0], paths[0], device, paths))
                else:
                    units.append(UnitPlan(f"{parent_path}[{run[0]}:{run[-1]}]", parent_path, device, paths))
                covered.update(paths)
            run.clear()

        for name, child in parent.named_children():
            path = f"{parent_path}.{name}".lstrip(".")
            if path in placed:
                if run and placed[path] != device:
                    flush()
                device = placed[path]
                run.append(name)
            elif run and _is_free_leaf(child):
                run.append(name)
            else:
                flush()
        flush()
    for path, device in placed.items():
        if path not in covered:
            units.append(UnitPlan(path, path, device, (path,)))
    return units


def unit_module(model: nn.Module, unit: UnitPlan) -> nn.Module:
    """The module a unit runs (children of one Sequential joined into a Sequential that keeps
    their names, so parameter names stay `prefix.<child>.<param>`)."""
    if len(unit.paths) == 1 and unit.prefix == unit.paths[0]:
        return _get(model, unit.paths[0])
    return nn.Sequential(OrderedDict((path.rpartition(".")[2], _get(model, path)) for path in unit.paths))


class RemoteLink:
    """One trainer's line to one unit on its group PS: the transport client, the codecs, the
    call ids, and the bytes both ways."""

    def __init__(self, client: Client, unit: str, caller: int, codec: str = "none", topk_ratio: float = 0.01):
        self.client, self.unit, self.caller = client, unit, caller
        self.forward_codec, make = wire_codec(codec, topk_ratio)
        self.sender = GradientSender(make)
        self.calls = itertools.count()
        self.bytes_sent = self.bytes_received = 0

    def forward(self, inputs: list[torch.Tensor | None], train: bool) -> tuple[torch.Tensor, int]:
        call = next(self.calls)
        arrays, meta = pack_tensors(lambda i, t: self.forward_codec.encode(t, "activations"),
                                    [None if x is None else x.detach() for x in inputs], "in")
        grads = [x is not None and x.requires_grad for x in inputs]
        reply = self.client.request("forward", arrays, {"unit": self.unit, "caller": self.caller, "call": call,
                                                        "train": train, "grads": grads, "inputs": meta},
                                    idempotent=True)  # a repeated forward replaces its kept graph
        (output,), received = unpack_tensors(reply.arrays, reply.meta.get("output"), "out")
        self.bytes_sent += meta["bytes"]
        self.bytes_received += received
        return output, call

    def backward(self, call: int, grad: torch.Tensor) -> list[torch.Tensor | None]:
        arrays, meta = pack_tensors(lambda i, g: self.sender.encode("output", g), [grad.detach()], "grad")
        reply = self.client.request("backward", arrays, {"unit": self.unit, "caller": self.caller, "call": call,
                                                         "grad": meta})
        grads, received = unpack_tensors(reply.arrays, reply.meta.get("grads"), "in")
        self.bytes_sent += meta["bytes"]
        self.bytes_received += received
        return grads


class _RemoteCall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, link: RemoteLink, anchor: torch.Tensor, *inputs):
        output, ctx.call = link.forward(list(inputs), train=True)
        ctx.link = link
        return output.to(next(x for x in inputs if x is not None).dtype)

    @staticmethod
    def backward(ctx, grad):
        return (None, None, *ctx.link.backward(ctx.call, grad.contiguous()))


class RemoteUnit(nn.Module):
    """Stands in the trainer's model for a unit that runs on a group PS. Its output needs a
    gradient even when no input does (a bottom MLP fed by the dense features): the unit's
    parameters learn from it. A tensor that needs a gradient (the anchor, not a parameter: the
    trainer holds none) makes autograd call the backward."""

    def __init__(self, link: RemoteLink):
        super().__init__()
        self.link = link
        self.anchor = torch.zeros((), requires_grad=True)

    def forward(self, *inputs):
        if torch.is_grad_enabled():
            # autograd marks which inputs need gradients; the Function sees them detached
            return _RemoteCall.apply(self.link, self.anchor, *inputs)
        output, _ = self.link.forward(list(inputs), train=False)
        return output

    def extra_repr(self) -> str:
        return f"unit={self.link.unit}, at={self.link.client.address}"


def remote_model(model: nn.Module, units: list[UnitPlan], links: dict[str, RemoteLink]) -> nn.Module:
    """A copy of `model` in which every unit is a RemoteUnit on `links[unit.name]`; ValueError
    when a parameter would be left on the trainer."""
    out = copy.deepcopy(model)
    for unit in units:
        if len(unit.paths) == 1 and unit.prefix == unit.paths[0]:
            _set(out, unit.paths[0], RemoteUnit(links[unit.name]))
            continue
        parent = _get(out, unit.prefix)
        names = [path.rpartition(".")[2] for path in unit.paths]
        children = OrderedDict()
        for name, child in parent.named_children():
            if name == names[0]:
                children[f"remote_{names[0]}_{names[-1]}"] = RemoteUnit(links[unit.name])
            elif name not in names:
                children[name] = child
        _set(out, unit.prefix, nn.Sequential(children))
    left = [name for name, _ in out.named_parameters()]
    if left:
        raise ValueError(f"the plan leaves parameters on the trainer ({', '.join(left[:4])}); with group PSs every "
                         "parameter-owning module runs on one")
    return out
