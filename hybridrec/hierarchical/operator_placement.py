"""Operator placement for Hierarchical Training (HT §3.2.1, the tagging system): which of the
dense model's operators run on a group's trainers and which on its group PSs, planned from a
cost model of each device (CPU FLOP/s, network bytes/s, memory bytes).

This module only plans. It runs the model once on a sample batch to measure it, then:

1. Measures: forward hooks keep the stack of modules being run and a TorchDispatchMode sees
   every aten op. Each parameter-owning module (the outermost module that owns parameters
   directly, e.g. nn.Linear) and each leaf module (ReLU, Dropout) is one operator; each aten op
   run outside them (cat, bmm, mul in a model's own forward) is one glue operator. Per operator:
   forward FLOPs (torch's FLOP formulas for matmul-like ops, one per output value otherwise),
   parameter bytes, the bytes of its outputs, and the tensors it hands to other operators (the
   edges, with whether a gradient comes back along them).
2. Rule-based tagging: parameter-owning operators (and so their gradients and optimizer state)
   go on group PSs, glue on the trainers. Chains of parameter-owning operators joined by glue
   that reads only from the chain (an MLP's Linear-ReLU-Linear) form connected components; each
   component is one unit on one group PS, assigned largest first to the PS holding the fewest
   weight bytes. An nn.Linear too big for one group PS's memory is split (hybridrec.models.
   fc_split) over k group PSs, vertically or horizontally, whichever sends fewer bytes, with the
   join on the trainer.
3. Greedy refinement: the bottleneck device is the one with the most seconds per round (CPU
   time or network time, whichever is larger); the planner tries moving each operator and each
   component off it to every other device and takes the move that lowers the devices' loads
   sorted from the largest (the bottleneck first) the most, until no move helps or
   `refine_seconds` pass. Parameter-owning operators move only between group PSs: on a trainer
   they would become one replica per trainer, which groups exist to avoid. A device over its
   memory limit counts before any time, so refinement first moves operators off it; a plan that
   still cannot fit is refused with a one-line `PlanError` naming the module and the device.

A round is one batch on each of the group's t trainers: a trainer runs its operators once, a
group PS runs its operators (and applies their optimizer updates) t times. Every tensor between
two devices goes through the trainer that runs the batch (trainers drive the loop; a group PS
returns its outputs to the caller), forward and, when it carries a gradient, backward; a device
sends and receives at the same time (full duplex), so its network time is the larger of the two
over its bandwidth. A wire codec (strategy.ht.wire_codec: bf16, int8 activations with bf16
gradients, or top-k gradients; hybridrec.hierarchical.remote_wire) scales those bytes exactly
(top-k by its ratio); its CPU cost is not modelled (the paper
leaves that to future work too). Backward costs twice the forward FLOPs of a parameter-owning
operator and once those of glue.

This module only plans; the plan is printed (`hybridrec plan CONFIG`) and saved with a run.
hybridrec.hierarchical.net_transformation executes it: a group PS's layers run in its process,
with activations forward and gradients back over the wire.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from hybridrec.comm.compression import INT8_BLOCK, WIRE_CODECS as WIRE_CODEC_HALVES
from hybridrec.errors import UserError

TRAINER = "trainer"
INPUT, LOSS = "(input)", "(loss)"
OPTIMIZER_STATES = {"sgd": 0, "adagrad": 1, "adam": 2}  # float tensors per parameter besides weight and grad
OPTIMIZER_FLOPS_PER_VALUE = {"sgd": 2, "adagrad": 5, "adam": 10}
PLAN_FILE = "plan.json"
WIRE_CODECS = tuple(WIRE_CODEC_HALVES)


def wire_bytes(edge: "Edge", codec: str, topk_ratio: float = 0.01) -> tuple[float, float]:
    """(forward, backward) bytes of an edge's tensors under a wire codec of
    hybridrec.hierarchical.remote_wire: bf16 halves both; int8 sends a byte a value plus one
    float32 scale per INT8_BLOCK values forward (Int8Codec(block_size=INT8_BLOCK)) and bf16
    gradients back; topk sends float32 forward and topk_ratio of the gradients back as an int32
    index and a float32 value each."""
    if codec == "none":
        return float(edge.nbytes), float(edge.nbytes)
    if codec == "bf16":
        return edge.nbytes / 2, edge.nbytes / 2
    if codec == "topk":
        return float(edge.nbytes), edge.nbytes * topk_ratio * 2
    return edge.nbytes / 4 + 4 * edge.blocks, edge.nbytes / 2


class PlanError(UserError):
    """A plan that cannot meet a device's memory limit; the message names the module and device."""


# ------------------------------------------------------------------------------------ the measured graph
@dataclass
class Operator:
    name: str  # module path (parameter-owning or leaf), or "<module path>:<aten op>#k" for glue
    kind: str  # "params" | "glue" | "pinned" (the batch's input and the loss, on the trainer)
    flops: float = 0.0  # forward FLOPs of one batch
    param_bytes: int = 0
    output_bytes: int = 0  # bytes of the floating-point tensors it makes for one batch
    module: str = ""  # the nn.Linear this operator is a part of, for split parts
    split: bool = False  # a part of a split FC: a unit of its own


@dataclass(frozen=True)
class Edge:
    src: int
    dst: int
    nbytes: int  # as float32
    grad: bool  # a gradient of the same size comes back
    blocks: int = 0  # blocks of INT8_BLOCK values of its tensors: one int8 scale each


@dataclass
class OpGraph:
    ops: list[Operator]
    edges: list[Edge]
    batch_size: int

    def index(self, name: str) -> int:
        return next(i for i, op in enumerate(self.ops) if op.name == name)


def _is_operator_module(module: nn.Module) -> bool:
    return next(module.children(), None) is None or next(module.parameters(recurse=False), None) is not None


class _Trace(TorchDispatchMode):
    """Builds an OpGraph from the aten ops of one forward pass (see the module docstring)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.ops: list[Operator] = [Operator(INPUT, "pinned"), Operator(LOSS, "pinned")]
        self.edges: dict[tuple[int, int], list] = {}
        self.stack: list[tuple[str, nn.Module]] = []
        self.module_op: dict[str, int] = {}
        self.glue_count: dict[str, int] = {}
        self.producer: dict[int, int] = {}
        self.grad: dict[int, bool] = {}
        self.seen: set[tuple[int, int]] = set()
        self.alive: list = []  # keeps traced tensors alive so that their ids stay unique
        self.constants = {id(t) for t in list(model.parameters()) + list(model.buffers())}

    def source(self, tensor: torch.Tensor, needs_grad: bool) -> None:
        self.producer[id(tensor)] = 0
        self.grad[id(tensor)] = needs_grad
        self.alive.append(tensor)

    def _owner(self, func) -> int:
        for name, module in self.stack:  # the outermost operator module on the stack owns the op
            if _is_operator_module(module):
                if name not in self.module_op:
                    owns = sum(p.numel() * p.element_size() for p in module.parameters())
                    self.module_op[name] = len(self.ops)
                    self.ops.append(Operator(name, "params" if owns else "glue", param_bytes=owns))
                return self.module_op[name]
        where = self.stack[-1][0] if self.stack else ""
        base = f"{where or 'model'}:{func.overloadpacket.__name__}"
        self.glue_count[base] = self.glue_count.get(base, 0) + 1
        self.ops.append(Operator(f"{base}#{self.glue_count[base]}", "glue"))
        return len(self.ops) - 1

    def _edge(self, src: int, dst: int, tensor: torch.Tensor) -> None:
        edge = self.edges.setdefault((src, dst), [0, False, 0])
        edge[0] += tensor.numel() * tensor.element_size()
        edge[1] |= self.grad.get(id(tensor), False)
        edge[2] += -(-tensor.numel() // INT8_BLOCK)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        op = self._owner(func)
        needs_grad = self.ops[op].kind == "params"
        for tensor in tree_flatten((args, kwargs))[0]:
            if not isinstance(tensor, torch.Tensor) or id(tensor) in self.constants:
                continue
            src = self.producer.get(id(tensor))
            needs_grad |= self.grad.get(id(tensor), False)
            if src is not None and src != op and (id(tensor), op) not in self.seen:
                self.seen.add((id(tensor), op))
                self._edge(src, op, tensor)
        aliases = any(r.alias_info is not None for r in func._schema.returns)
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        packet = func.overloadpacket
        if packet in flop_registry:
            self.ops[op].flops += flop_registry[packet](*args, **kwargs, out_val=out)
        elif not aliases:
            self.ops[op].flops += sum(t.numel() for t in outputs if t.is_floating_point())
        for tensor in outputs:
            self.producer[id(tensor)] = op
            self.grad[id(tensor)] = needs_grad and tensor.is_floating_point()
            self.alive.append(tensor)
            if not aliases and tensor.is_floating_point():
                self.ops[op].output_bytes += tensor.numel() * tensor.element_size()
        return out


def trace_model(model: nn.Module, inputs: tuple, grad_inputs: tuple[bool, ...]) -> OpGraph:
    """The operators of `model` and the tensors between them, from one forward pass on `inputs`
    (positional; None allowed); `grad_inputs[i]` says whether input i gets a gradient back."""
    trace = _Trace(model)

    def enter(name: str, module: nn.Module) -> None:
        trace.stack.append((name, module))

    def leave(*_) -> None:
        trace.stack.pop()

    handles = []
    for name, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(lambda m, a, name=name: enter(name, m)))
        handles.append(module.register_forward_hook(leave))
    was_training = model.training
    model.eval()
    try:
        for tensor, needs_grad in zip(inputs, grad_inputs):
            if tensor is not None:
                trace.source(tensor, needs_grad)
        with torch.no_grad(), trace:
            out = model(*inputs)
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor) and id(tensor) in trace.producer:
                trace._edge(trace.producer[id(tensor)], 1, tensor)
    finally:
        model.train(was_training)
        for handle in handles:
            handle.remove()
    edges = [Edge(src, dst, nbytes, grad, blocks) for (src, dst), (nbytes, grad, blocks) in trace.edges.items()]
    batch = next((t.shape[0] for t in inputs if t is not None), 0)
    return OpGraph(trace.ops, edges, int(batch))


# ------------------------------------------------------------------------------------ the cost model
@dataclass(frozen=True)
class Device:
    name: str
    flops: float  # FLOP/s
    network: float  # bytes/s each way
    memory: float  # bytes


@dataclass(frozen=True)
class CostModel:
    """The devices of one group: devices[0] is (each of) the `trainers` trainers, devices[1:] the
    group PSs; `optimizer` names the dense optimizer (its state per parameter)."""

    devices: tuple[Device, ...]
    trainers: int = 1
    optimizer: str = "adam"
    wire_codec: str = "none"  # activations and gradients between devices (hybridrec.hierarchical.remote_wire)
    topk_ratio: float = 0.01  # wire codec topk: share of the gradients' entries sent

    def __post_init__(self):
        if not self.devices or self.devices[0].name != TRAINER:
            raise ValueError(f"devices must start with the trainer, got {[d.name for d in self.devices]}")
        if self.wire_codec not in WIRE_CODECS:
            raise ValueError(f"wire_codec must be one of {list(WIRE_CODECS)}, got {self.wire_codec!r}")
        if self.optimizer not in OPTIMIZER_STATES:
            raise ValueError(f"optimizer must be one of {sorted(OPTIMIZER_STATES)}, got {self.optimizer!r}")
        if self.trainers < 1:
            raise ValueError(f"trainers must be >= 1, got {self.trainers}")
        for d in self.devices:
            if not (d.flops > 0 and d.network > 0 and d.memory > 0):
                raise ValueError(f"device {d.name}: flops, network and memory must be > 0, got {d}")


@dataclass
class Costs:
    cpu_s: list[float]
    net_s: list[float]
    memory: list[float]
    overflow: float  # bytes over the memory limits, all devices together

    @property
    def loads(self) -> list[float]:
        return [max(c, n) for c, n in zip(self.cpu_s, self.net_s)]

    @property
    def bottleneck_s(self) -> float:
        return max(self.loads)

    def key(self) -> tuple:
        """What refinement minimises: memory overflow first, then the loads from the largest."""
        return (self.overflow, *sorted(self.loads, reverse=True))


def _better(a: tuple, b: tuple, tolerance: float = 1e-9) -> bool:
    """a < b lexicographically, entries within a relative `tolerance` counting as equal."""
    for x, y in zip(a, b):
        if x < y - tolerance * max(abs(y), 1e-30):
            return True
        if x > y + tolerance * max(abs(y), 1e-30):
            return False
    return False


class _Evaluator:
    """Costs of an assignment (operator -> device index) of `graph` on `cost`."""

    def __init__(self, graph: OpGraph, cost: CostModel):
        self.graph, self.cost = graph, cost
        states = OPTIMIZER_STATES[cost.optimizer]
        update = OPTIMIZER_FLOPS_PER_VALUE[cost.optimizer]
        self.work = [op.flops * (3 if op.kind == "params" else 2) + update * op.param_bytes / 4 for op in graph.ops]
        self.state = [op.param_bytes * (2 + states) for op in graph.ops]
        self.rounds = [1] + [cost.trainers] * (len(cost.devices) - 1)  # batches a device runs per round
        self.wire = [wire_bytes(edge, cost.wire_codec, cost.topk_ratio) for edge in graph.edges]

    def op_memory(self, i: int, device: int) -> float:
        return self.state[i] + self.rounds[device] * self.graph.ops[i].output_bytes

    def __call__(self, assign: list[int]) -> Costs:
        n = len(self.cost.devices)
        work, sent, received, memory = [0.0] * n, [0.0] * n, [0.0] * n, [0.0] * n
        for i, d in enumerate(assign):
            work[d] += self.rounds[d] * self.work[i]
            memory[d] += self.op_memory(i, d)
        for edge, (forward, backward) in zip(self.graph.edges, self.wire):
            a, b = assign[edge.src], assign[edge.dst]
            if a == b:
                continue
            for src, dst, nbytes in ((a, b, forward), (b, a, backward)) if edge.grad else ((a, b, forward),):
                sent[src] += self.rounds[src] * nbytes
                received[dst] += self.rounds[dst] * nbytes
                if src and dst:  # group PS to group PS goes through the trainer
                    received[0] += nbytes
                    sent[0] += nbytes
        devices = self.cost.devices
        return Costs([w / d.flops for w, d in zip(work, devices)],
                     [max(s, r) / d.network for s, r, d in zip(sent, received, devices)],
                     memory, sum(max(0.0, m - d.memory) for m, d in zip(memory, devices)))


# ------------------------------------------------------------------------------------ rule-based tagging
def _producers(graph: OpGraph) -> list[set[int]]:
    producers: list[set[int]] = [set() for _ in graph.ops]
    for edge in graph.edges:
        producers[edge.dst].add(edge.src)
    return producers


def components(graph: OpGraph) -> list[int]:
    """Component id of each operator (-1: glue outside every component, and the pinned ones):
    parameter-owning operators fed by a component's operator join it, glue whose inputs all come
    from one component joins it, a split FC's parts are components of their own."""
    parent = list(range(len(graph.ops)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    member = [False] * len(graph.ops)
    producers = _producers(graph)
    for i, op in enumerate(graph.ops):  # execution order: producers come first
        if op.kind == "params":
            member[i] = True
            if not op.split:
                for p in producers[i]:
                    if member[p] and not graph.ops[p].split:
                        parent[find(p)] = find(i)
        elif op.kind == "glue" and producers[i] and all(member[p] and not graph.ops[p].split for p in producers[i]):
            roots = {find(p) for p in producers[i]}
            if len(roots) == 1:
                member[i] = True
                parent[i] = roots.pop()
    roots = {}
    return [roots.setdefault(find(i), len(roots)) if member[i] else -1 for i in range(len(graph.ops))]


def cheaper_split(graph: OpGraph, i: int, parts: int) -> str:
    """"vertical" when sending the whole input to every part and the columns back costs fewer
    bytes than sending each part its rows and every partial sum back, else "horizontal"."""
    in_bytes = sum(e.nbytes for e in graph.edges if e.dst == i)
    out_bytes = graph.ops[i].output_bytes
    return "vertical" if parts * in_bytes + out_bytes <= in_bytes + parts * out_bytes else "horizontal"


def split_operator(graph: OpGraph, i: int, parts: int, how: str | None = None) -> OpGraph:
    """`graph` with operator i (an nn.Linear) as `parts` split parts plus a join on the trainer
    (hybridrec.hierarchical.fc_split): vertical parts each read the whole input and return their
    columns; horizontal parts read their rows of the input and return partial sums. `how` None:
    whichever sends fewer bytes."""
    op = graph.ops[i]
    how = how or cheaper_split(graph, i, parts)
    new_ops = list(graph.ops[:i])
    first = len(new_ops)
    for j in range(parts):
        new_ops.append(Operator(f"{op.name}[{j + 1}/{parts}]", "params", op.flops / parts, op.param_bytes // parts,
                                op.output_bytes // parts if how == "vertical" else op.output_bytes, op.name, True))
    join = len(new_ops)
    summed = op.output_bytes // 4 * (parts - 1) if how == "horizontal" else 0
    new_ops.append(Operator(f"{op.name}:join", "glue", float(summed), 0, op.output_bytes, op.name))
    new_ops += graph.ops[i + 1:]
    shift = parts  # operators after i move by parts + 1 - 1

    def moved(k: int) -> int:
        return k if k < i else k + shift

    edges = []
    for e in graph.edges:
        if e.dst == i:
            for j in range(parts):
                nbytes = e.nbytes if how == "vertical" else e.nbytes // parts
                edges.append(Edge(moved(e.src), first + j, nbytes, e.grad, e.blocks))
        elif e.src == i:
            edges.append(Edge(join, moved(e.dst), e.nbytes, e.grad, e.blocks))
        else:
            edges.append(Edge(moved(e.src), moved(e.dst), e.nbytes, e.grad, e.blocks))
    for j in range(parts):
        blocks = -(-new_ops[first + j].output_bytes // 4 // INT8_BLOCK)
        edges.append(Edge(first + j, join, new_ops[first + j].output_bytes, True, blocks))
    return OpGraph(new_ops, edges, graph.batch_size)


def _fits(evaluator: _Evaluator, i: int, device: int) -> bool:
    return evaluator.op_memory(i, device) <= evaluator.cost.devices[device].memory


def _mb(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f} MB"


def _refuse_big(evaluator: _Evaluator, i: int, device: int) -> PlanError:
    op, d = evaluator.graph.ops[i], evaluator.cost.devices[device]
    return PlanError(f"plan: module {op.module or op.name} needs {_mb(evaluator.op_memory(i, device))} (weights, "
                     f"gradients, optimizer state and activations) but device {d.name} has {_mb(d.memory)}; raise "
                     f"strategy.ht.plan memory or strategy.ht.group_ps")


def split_oversized(graph: OpGraph, cost: CostModel, linears: set[str]) -> tuple[OpGraph, list[dict]]:
    """Split every nn.Linear (names in `linears`) too big for the largest group PS into the fewest
    parts (at most one per group PS) that fit; PlanError when even that does not fit."""
    splits = []
    num_ps = len(cost.devices) - 1
    if not num_ps:
        return graph, splits
    largest = max(range(1, num_ps + 1), key=lambda d: cost.devices[d].memory)
    evaluator = _Evaluator(graph, cost)
    i = 0
    while i < len(graph.ops):
        op = graph.ops[i]
        if op.kind == "params" and not op.split and not _fits(evaluator, i, largest):
            if op.name not in linears or num_ps < 2:
                raise _refuse_big(evaluator, i, largest)
            for parts in range(2, num_ps + 1):
                candidate = split_operator(graph, i, parts)
                if _fits(_Evaluator(candidate, cost), i, largest):
                    break
            else:
                raise _refuse_big(_Evaluator(candidate, cost), i, largest)
            splits.append({"module": op.name, "how": cheaper_split(graph, i, parts), "parts": parts})
            graph = candidate
            evaluator = _Evaluator(graph, cost)
            i += parts + 1
            continue
        i += 1
    return graph, splits


def rule_based(graph: OpGraph, cost: CostModel) -> list[int]:
    """The rule-based assignment: glue on the trainer, each component on one group PS, the
    components largest first to the PS holding the fewest weight bytes (among those where it
    fits); with no group PS everything stays on the trainers."""
    assign = [0] * len(graph.ops)
    num_ps = len(cost.devices) - 1
    if num_ps == 0:
        return assign
    evaluator = _Evaluator(graph, cost)
    comp = components(graph)
    members: dict[int, list[int]] = {}
    for i, c in enumerate(comp):
        if c >= 0:
            members.setdefault(c, []).append(i)
    weights = [0.0] * (num_ps + 1)
    used = [0.0] * (num_ps + 1)
    units = sorted(members.values(), key=lambda ops: -sum(graph.ops[i].param_bytes for i in ops))
    for unit in units:
        need = {d: sum(evaluator.op_memory(i, d) for i in unit) for d in range(1, num_ps + 1)}
        order = sorted(range(1, num_ps + 1), key=lambda d: (weights[d], d))
        fitting = [d for d in order if used[d] + need[d] <= cost.devices[d].memory]
        if not fitting and len(unit) > 1:  # too big as one unit: its operators go one by one
            units += [[i] for i in unit]
            continue
        target = fitting[0] if fitting else order[0]
        for i in unit:
            assign[i] = target
        weights[target] += sum(graph.ops[i].param_bytes for i in unit)
        used[target] += need[target]
    return assign


# ------------------------------------------------------------------------------------ greedy refinement
def refine(graph: OpGraph, cost: CostModel, assign: list[int], seconds: float = 5.0) -> tuple[list[int], int]:
    """Greedy refinement of `assign`: move an operator or a component off the bottleneck device
    while that lowers the cost key (memory overflow, then loads from the largest); returns the
    assignment and the number of moves. The key never gets worse."""
    evaluator = _Evaluator(graph, cost)
    comp = components(graph)
    num_devices = len(cost.devices)
    assign = list(assign)
    current = evaluator(assign)
    moves = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if current.overflow > 0:
            bottleneck = max(range(num_devices), key=lambda d: current.memory[d] - cost.devices[d].memory)
        else:
            bottleneck = max(range(num_devices), key=lambda d: current.loads[d])
        here = [i for i, d in enumerate(assign) if d == bottleneck and graph.ops[i].kind != "pinned"]
        candidates = [[i] for i in here]
        groups: dict[int, list[int]] = {}
        for i in here:
            if comp[i] >= 0:
                groups.setdefault(comp[i], []).append(i)
        candidates += [ops for ops in groups.values() if len(ops) > 1]
        best, best_key = None, current.key()
        for ops in candidates:
            lowest = 1 if any(graph.ops[i].kind == "params" for i in ops) else 0
            for target in range(lowest, num_devices):
                if target == bottleneck:
                    continue
                trial = list(assign)
                for i in ops:
                    trial[i] = target
                key = evaluator(trial).key()
                if _better(key, best_key):
                    best, best_key = trial, key
            if time.monotonic() >= deadline:
                break
        if best is None:
            break
        assign, current = best, evaluator(best)
        moves += 1
    return assign, moves


# ------------------------------------------------------------------------------------ the plan
@dataclass
class Plan:
    """Where each operator runs and what each device does per round."""

    devices: list[str]
    trainers: int
    batch_size: int
    placement: dict[str, str]  # operator -> device
    modules: dict[str, list[str]]  # parameter-owning module -> its device(s) (several when split)
    devices_stats: dict[str, dict]
    bottleneck: dict
    rule_based_bottleneck_s: float
    moves: int
    refine_seconds: float
    splits: list[dict] = field(default_factory=list)
    wire_codec: str = "none"

    def to_json(self) -> dict:
        return asdict(self)

    def format(self) -> str:
        lines = [f"operator placement for one group: {self.trainers} trainer(s) x batch {self.batch_size}, "
                 f"group PSs {', '.join(self.devices[1:]) or 'none (the dense copy stays on the trainers)'}, "
                 f"wire codec {self.wire_codec}"]
        lines.append("parameter-owning modules:")
        width = max((len(m) for m in self.modules), default=0)
        lines += [f"  {module:<{width}}  -> {', '.join(devices)}" for module, devices in self.modules.items()]
        glue = {}
        for op, device in self.placement.items():
            if op not in self.modules and not op.startswith("(") and "[" not in op:
                glue.setdefault(device, []).append(op)
        for device, ops in glue.items():
            shown = ", ".join(ops[:8]) + (f", ... ({len(ops)} in all)" if len(ops) > 8 else "")
            lines.append(f"glue on {device}: {shown}")
        for split in self.splits:
            lines.append(f"split: {split['module']} {split['how']}ly into {split['parts']} parts (too big for one "
                         f"group PS)")
        lines.append(f"{'device':<10} {'cpu s/round':>12} {'net s/round':>12} {'cpu util':>9} {'net util':>9} "
                     f"{'memory':>12} {'mem util':>9}")
        for device, s in self.devices_stats.items():
            lines.append(f"{device:<10} {s['cpu_s']:>12.3g} {s['net_s']:>12.3g} {s['cpu_util']:>9.2f} "
                         f"{s['net_util']:>9.2f} {_mb(s['memory_bytes']):>12} {s['memory_util']:>9.2f}")
        b = self.bottleneck
        lines.append(f"bottleneck: {b['device']} ({b['resource']}), {b['seconds']:.3g} s per round "
                     f"(rule-based: {self.rule_based_bottleneck_s:.3g} s; {self.moves} refinement move(s) in "
                     f"{self.refine_seconds:.2f} s)")
        return "\n".join(lines)


def plan_graph(graph: OpGraph, cost: CostModel, refine_seconds: float = 5.0, linears: set[str] = frozenset()) -> Plan:
    """Rule-based tagging then greedy refinement of `graph` on `cost`; PlanError when it cannot
    meet a device's memory limit."""
    graph, splits = split_oversized(graph, cost, set(linears))
    start = rule_based(graph, cost)
    evaluator = _Evaluator(graph, cost)
    rule_costs = evaluator(start)
    began = time.monotonic()
    assign, moves = refine(graph, cost, start, refine_seconds)
    spent = time.monotonic() - began
    costs = evaluator(assign)
    names = [d.name for d in cost.devices]
    if costs.overflow > 0:
        device = max(range(len(names)), key=lambda d: costs.memory[d] - cost.devices[d].memory)
        biggest = max((i for i, d in enumerate(assign) if d == device), key=lambda i: evaluator.op_memory(i, device))
        op = graph.ops[biggest]
        raise PlanError(f"plan: device {names[device]} needs {_mb(costs.memory[device])} but has "
                        f"{_mb(cost.devices[device].memory)}; its largest module is {op.module or op.name} "
                        f"({_mb(evaluator.op_memory(biggest, device))}); raise strategy.ht.plan memory or "
                        f"strategy.ht.group_ps")
    bottleneck_s = costs.bottleneck_s
    stats = {}
    for d, name in enumerate(names):
        stats[name] = {"cpu_s": costs.cpu_s[d], "net_s": costs.net_s[d], "memory_bytes": costs.memory[d],
                       "cpu_util": costs.cpu_s[d] / bottleneck_s if bottleneck_s else 0.0,
                       "net_util": costs.net_s[d] / bottleneck_s if bottleneck_s else 0.0,
                       "memory_util": costs.memory[d] / cost.devices[d].memory}
    worst = max(range(len(names)), key=lambda d: costs.loads[d])
    bottleneck = {"device": names[worst], "resource": "cpu" if costs.cpu_s[worst] >= costs.net_s[worst] else "network",
                  "seconds": bottleneck_s}
    placement = {op.name: names[d] for op, d in zip(graph.ops, assign)}
    modules: dict[str, list[str]] = {}
    for op, d in zip(graph.ops, assign):
        if op.kind == "params":
            modules.setdefault(op.module or op.name, []).append(names[d])
    return Plan(names, cost.trainers, graph.batch_size, placement, modules, stats, bottleneck,
                rule_costs.bottleneck_s, moves, spent, splits, cost.wire_codec)


def placed_modules(graph: OpGraph) -> list[str]:
    """Names of the parameter-owning operators of a graph (split parts by their nn.Linear)."""
    return sorted({op.module or op.name for op in graph.ops if op.kind == "params"})


# ------------------------------------------------------------------------------------ from a job config
def sample_inputs(model: nn.Module, batch_size: int, seed: int = 0) -> tuple[tuple, tuple[bool, ...]]:
    """A random batch of the inputs a CTR model takes (deep, wide, dense) and which of them get
    gradients back (the embeddings do; the dense features do not)."""
    g = torch.Generator().manual_seed(seed)
    deep = torch.randn(batch_size, model.num_sparse, model.embedding_dim, generator=g) if model.needs_deep else None
    wide = torch.randn(batch_size, model.num_sparse, generator=g) if model.needs_wide else None
    dense = torch.randn(batch_size, model.num_dense, generator=g) if model.num_dense else None
    return (deep, wide, dense), (True, True, False)


def cost_model(cfg, group_ps: int | None = None) -> CostModel:
    """The devices of one group as the job's strategy.ht section describes them (`group_ps`, if
    given, instead of strategy.ht.group_ps)."""
    ht = cfg.strategy.ht
    plan = ht.plan
    group_ps = ht.group_ps if group_ps is None else group_ps
    if isinstance(group_ps, bool) or not isinstance(group_ps, int) or not 0 <= group_ps <= 64:
        raise UserError(f"group_ps must be an int in 0..64, got {group_ps!r}")
    trainer = Device(TRAINER, plan.trainer_gflops * 1e9, plan.network_gbit * 1e9 / 8, plan.trainer_memory_gb * 2**30)
    group_ps = [Device(f"ps{j}", plan.group_ps_gflops * 1e9, plan.network_gbit * 1e9 / 8,
                       plan.group_ps_memory_gb * 2**30) for j in range(group_ps)]
    trainers = max(1, cfg.strategy.roles.trainers // ht.groups)
    return CostModel((trainer, *group_ps), trainers, cfg.train.dense_optimizer.name, ht.wire_codec,
                     cfg.strategy.topk_ratio)


def plan_model(model: nn.Module, cost: CostModel, batch_size: int, refine_seconds: float = 5.0) -> Plan:
    """The plan of a CTR model's dense part for one batch of `batch_size` samples."""
    inputs, grads = sample_inputs(model, batch_size)
    graph = trace_model(model, inputs, grads)
    linears = {name for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    return plan_graph(graph, cost, refine_seconds, linears)


def plan_for_config(cfg, group_ps: int | None = None) -> Plan:
    """The plan of the job's dense model on the devices of strategy.ht.plan, with
    strategy.ht.group_ps group PSs or `group_ps` if given."""
    from hybridrec.job.tables import job_dense_model, job_tables

    model = job_dense_model(cfg, job_tables(cfg))
    return plan_model(model, cost_model(cfg, group_ps), cfg.data.batch_size, cfg.strategy.ht.plan.refine_seconds)


def write_plan(cfg, directory: str | Path, group_ps: int | None = None) -> Path:
    """Plan the job's dense model (see `plan_for_config`) and save it as `directory`/plan.json
    (returns the path); PlanError (a UserError) when the plan cannot meet a device's memory limit."""
    return save_plan(plan_for_config(cfg, group_ps).to_json(), directory)


def save_plan(plan: dict, directory: str | Path) -> Path:
    """Write a plan's JSON form as `directory`/plan.json; returns the path."""
    path = Path(directory) / PLAN_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(plan, indent=1) + "\n")
    return path
