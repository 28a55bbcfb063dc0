"""A group PS of Hierarchical Training (HT §3): a process that holds its part of a group's ONE
dense copy and runs the layers the operator placement put on it for every trainer of the group.

A launcher starts it as a server role (`hybridrec group-ps CONFIG --group G --index J ...`,
hybridrec.parallel.roles), like the PS servers and embedding workers, before any trainer; the job
config gives it the dense optimizer, the wire codec and its bounds, `--ps` the PS servers that
hold the centre copy. It has no units until its group's first trainer sends them. Operations,
over the job's authenticated transport:

  setup     the leader's operator placement (meta `plan`) and the starting values of the units'
            parameters (arrays): the group PS cuts the job's dense model as every trainer does
            and runs the units placed on it (`plan_builder`); a second setup (a trainer group
            started again) replaces them.

  forward   a trainer sends a unit's inputs (packed by the wire codec's forward half); the unit
            runs on them and the output goes back the same way. With `train: true` the autograd
            graph is kept under (caller, unit, call) until its backward arrives.
  backward  the gradient of that output arrives (the codec's backward half); autograd runs the
            kept graph, the unit's optimizer applies the parameter gradients at once, and the
            gradients of the inputs that need one go back.
  finish    the elastic averaging thread stops and syncs once more (the copy's last updates reach
            the centre); `stats` reports updates, the dense staleness and the bytes moved.

Trainers are served by concurrent handler threads and update the copy without locks between
them (Hogwild): a forward reads the parameters through aliases that autograd does not version,
so an update landing between a call's forward and its backward is used, not refused. Only each
unit's optimizer step is serialised (its state tensors are not made for concurrent steps). The
dense staleness of a backward is the number of updates of its unit since its forward.

A background thread pulls this process's parameters toward the centre by elastic averaging
(hybridrec.hierarchical.elastic_averaging) every `period` updates; a part of a split FC layer
syncs with its slice of the unsplit parameter (`slices`). The process stops on SIGTERM (its
launcher's teardown, or the kernel's when the launcher dies) or a `shutdown` request.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

import torch
from torch import nn

from hybridrec.comm.transport import Message, Operation, Server, Service, check_addresses
from hybridrec.ps.client import PSClient
from hybridrec.models.dense_optimizer import optimizer_of
from hybridrec.hierarchical.elastic_averaging import ElasticSync
from hybridrec.comm.compression import WIRE_CODECS
from hybridrec.hierarchical.net_transformation import placed_devices, plan_units, split_model, split_slices, unit_module
from hybridrec.hierarchical.remote_wire import GradientSender, pack_tensors, unpack_tensors, wire_codec

READY = "hybridrec-group-ps listening on "
MAX_PENDING = 64  # graphs kept per caller awaiting their backward; older ones are dropped and counted
MAX_ROW_VALUES = 1 << 16  # values of one sample in one input of a unit


@dataclass
class Unit:
    """One remote unit: `module` runs here; its parameter `p` is `prefix.p` in the whole model."""

    name: str
    prefix: str
    module: nn.Module
    optimizer: torch.optim.Optimizer | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    updates: int = 0


@dataclass
class _Pending:
    output: torch.Tensor
    inputs: list[torch.Tensor | None]
    aliases: dict[str, torch.Tensor]
    version: int


class GroupPS(Service):
    """The units of one group PS behind a transport Server (see the module docstring). Given
    `units`, it runs them from the start; given `builder` instead (a group PS a launcher started),
    it runs the units its group's first trainer's `setup` request describes: `builder(meta,
    arrays)` gives (units, slices)."""

    def __init__(self, units: Sequence[Unit], optimizer: Mapping[str, Any], *, wire: str = "none",
                 topk_ratio: float = 0.01, centre: Sequence[str] = (), alpha: float = 0.1, period: int = 4,
                 slices: dict | None = None, host: str = "127.0.0.1", port: int = 0, threads: int = 2,
                 timeout: float = 10.0, retries: int = 2, callers: int = 64, max_rows: int = 1 << 16,
                 builder: Callable[[dict, dict], tuple[list[Unit], dict]] | None = None):
        self.optimizer_settings, self.alpha, self.builder = dict(optimizer), alpha, builder
        self.forward_codec, self._make_backward = wire_codec(wire, topk_ratio)
        self.codecs = WIRE_CODECS[wire]  # (forward, backward): what requests may use
        self.callers, self.max_rows = callers, max_rows
        self.senders: dict[int, GradientSender] = {}  # caller -> the encoder of the input gradients it gets back
        self.pending: dict[tuple[int, str, int], _Pending] = OrderedDict()
        self._pending_lock = threading.Lock()
        self._count_lock = threading.Lock()
        self.counters = dict.fromkeys(("forwards", "backwards", "updates", "dropped_graphs", "bytes_received",
                                       "bytes_sent", "staleness_sum", "staleness_max"), 0)
        self.period, self.synced_at = period, 0
        self.centre = None
        if centre:
            self.centre = PSClient(check_addresses(list(centre), "centre"), timeout=timeout, retries=retries)
        self.units: dict[str, Unit] = {}
        self.params: dict[str, torch.Tensor] = {}
        self.sync: ElasticSync | None = None
        self._serving = False
        self._install(units, slices)
        self.transport = Server({
            "ping": Operation(self._ping),
            "setup": Operation(self._setup, arrays=None),
            "forward": Operation(self._forward, arrays=None),
            "backward": Operation(self._backward, arrays=None),
            "finish": Operation(self._finish),
            "stats": Operation(self._stats),
            "shutdown": Operation(self._shutdown),
        }, host=host, port=port, threads=threads)

    def _install(self, units: Sequence[Unit], slices: dict | None) -> None:
        """Run `units` from now on, each with its own optimizer, kept near the centre by an
        elastic averaging thread of their own."""
        for unit in units:
            unit.module.train()
            params = list(unit.module.parameters())
            unit.optimizer = optimizer_of(self.optimizer_settings, params) if params else None
        with self._pending_lock:
            self.pending.clear()
        self.senders.clear()
        self.units = {unit.name: unit for unit in units}
        self.params = {f"{unit.prefix}.{name}": p for unit in units for name, p in unit.module.named_parameters()}
        self.synced_at = self.counters["updates"]
        self.sync = None
        if self.centre is not None and units:
            self.sync = ElasticSync(self.params, self.centre, self.alpha, self._due, slices=slices)
            if self._serving:
                self.sync.start()

    def start(self) -> int:
        port = super().start()
        self._serving = True
        if self.sync is not None:
            self.sync.start()
        return port

    def _stop_sync(self) -> None:
        if self.sync is not None:
            try:
                self.sync.stop(timeout=10.0)
            except RuntimeError:
                pass  # reported through `finish` and `stats` already

    def _release(self) -> None:
        self._stop_sync()
        if self.centre is not None:
            self.centre.close()

    def _due(self) -> bool:
        updates = self.counters["updates"]
        if updates - self.synced_at < self.period:
            return False
        self.synced_at = updates
        return True

    def _count(self, **amounts: int) -> None:
        with self._count_lock:
            for name, amount in amounts.items():
                self.counters[name] += amount

    # ------------------------------------------------------------------ operations
    def _setup(self, request: Message) -> Message:
        """The units this group PS runs from now on, as its group's first trainer describes them
        (a trainer group started again after a failure sends them again: they replace the old)."""
        if self.builder is None:
            raise ValueError("setup: this group PS runs the units it was started with")
        units, slices = self.builder(request.meta, request.arrays)
        self._stop_sync()
        self._install(units, slices)
        return Message("setup", meta={"units": sorted(self.units)})

    def _unit(self, meta: dict) -> Unit:
        if not self.units:
            raise ValueError("this group PS has no units yet: its group's first trainer sends them (setup) "
                             "before any trainer calls it")
        unit = self.units.get(meta.get("unit"))
        if unit is None:
            raise ValueError(f"meta unit {meta.get('unit')!r:.80} is not one of this group PS's units "
                             f"{sorted(self.units)}")
        return unit

    def _key(self, meta: dict) -> tuple[int, str, int]:
        """(caller, unit, call): a caller numbers its calls of each unit."""
        caller, call = meta.get("caller"), meta.get("call")
        for name, value, most in (("caller", caller, self.callers - 1), ("call", call, (1 << 62))):
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= most:
                raise ValueError(f"meta {name} must be an int in [0, {most}] (the group's trainers, their calls), "
                                 f"got {value!r:.40}")
        return caller, meta["unit"], call

    def _fits_input(self, shape: list) -> str | None:
        """Why a unit's input of `shape` is refused before it is decoded (None: it fits)."""
        rows = shape[0] if shape else 1
        if not isinstance(rows, int) or rows > self.max_rows:
            return f"has more rows than the job's batches ({self.max_rows})"
        if math.prod(shape[1:]) > MAX_ROW_VALUES:
            return f"has more than {MAX_ROW_VALUES} values a row"
        return None

    def _ping(self, request: Message) -> Message:
        return Message("ping", meta={"pid": os.getpid(), "units": sorted(self.units)})

    def _forward(self, request: Message) -> Message:
        unit, key = self._unit(request.meta), self._key(request.meta)
        inputs, nbytes = unpack_tensors(request.arrays, request.meta.get("inputs"), "in", {self.codecs[0]},
                                        self._fits_input)
        train = request.meta.get("train") is True
        wants = request.meta.get("grads", [False] * len(inputs))
        if not isinstance(wants, list) or len(wants) != len(inputs):
            raise ValueError(f"meta grads must be a list of {len(inputs)} booleans, got {wants!r:.80}")
        self._count(bytes_received=nbytes)
        leaves = [None if x is None else x.requires_grad_(wants[i] is True and train) for i, x in enumerate(inputs)]
        aliases = {name: p.data.requires_grad_(train) for name, p in unit.module.named_parameters()}
        try:
            with torch.set_grad_enabled(train):
                output = torch.func.functional_call(unit.module, aliases, tuple(leaves))
        except RuntimeError as error:  # inputs whose shapes do not fit the unit: the request's fault
            raise ValueError(f"unit {unit.name}: the inputs do not fit it: {' '.join(str(error).split())}") from None
        if not isinstance(output, torch.Tensor):
            raise TypeError(f"unit {unit.name} returned {type(output).__name__}; remote units return one tensor")
        self._count(forwards=1)
        if train:
            with self._pending_lock:
                self.pending[key] = _Pending(output, leaves, aliases, unit.updates)
                mine = [k for k in self.pending if k[0] == key[0]]
                for old in mine[:-MAX_PENDING]:
                    del self.pending[old]
                    self._count(dropped_graphs=1)
        arrays, meta = pack_tensors(lambda i, t: self.forward_codec.encode(t, "activations"), [output.detach()], "out")
        self._count(bytes_sent=meta["bytes"])
        return Message("forward", arrays, {"output": meta})

    def _backward(self, request: Message) -> Message:
        unit, key = self._unit(request.meta), self._key(request.meta)
        with self._pending_lock:
            kept = self.pending.get(key)
        output = None if kept is None else list(kept.output.shape)
        grads_in, nbytes = unpack_tensors(  # sized by the kept output, checked before decoding
            request.arrays, request.meta.get("grad"), "grad", {self.codecs[1]},
            lambda shape: None if shape == output else f"is not the output's shape {output}")
        with self._pending_lock:
            kept = self.pending.pop(key, None)
        if kept is None:
            raise ValueError(f"backward of call {key[2]} of unit {key[1]} by caller {key[0]}: no forward of it is "
                             f"kept here (never sent, already answered, or dropped after {MAX_PENDING} newer ones)")
        grad = grads_in[0] if len(grads_in) == 1 else None
        if grad is None or tuple(grad.shape) != tuple(kept.output.shape):
            raise ValueError(f"unit {unit.name}: backward takes one gradient of the output's shape "
                             f"{list(kept.output.shape)}, got "
                             f"{[None if g is None else list(g.shape) for g in grads_in]}")
        self._count(bytes_received=nbytes)
        needing = [x for x in kept.inputs if x is not None and x.requires_grad]
        grads = torch.autograd.grad(kept.output, needing + list(kept.aliases.values()), grad, allow_unused=True)
        found = iter(grads[:len(needing)])
        back = [next(found) if x is not None and x.requires_grad else None for x in kept.inputs]
        with unit.lock:
            staleness = unit.updates - kept.version
            for param, g in zip(unit.module.parameters(), grads[len(needing):]):
                param.grad = g
            if unit.optimizer is not None:
                unit.optimizer.step()
                unit.optimizer.zero_grad(set_to_none=True)
            unit.updates += 1
        self._count(updates=1, backwards=1, staleness_sum=staleness)
        with self._count_lock:
            self.counters["staleness_max"] = max(self.counters["staleness_max"], staleness)
        if self.sync is not None:
            self.sync.poke()
        sender = self.senders.setdefault(key[0], GradientSender(self._make_backward))
        arrays, meta = pack_tensors(lambda i, g: sender.encode((unit.name, i), g),
                                    [None if g is None else g.detach() for g in back], "in")
        self._count(bytes_sent=meta["bytes"])
        return Message("backward", arrays, {"grads": meta, "staleness": staleness})

    def _finish(self, request: Message) -> Message:
        if self.sync is not None:
            self.sync.stop()
            self.sync.sync_once()
        return Message("finish", meta=self._counts())

    def _counts(self) -> dict:
        sync = {"elastic_syncs": self.sync.syncs, "elastic_sync_bytes": self.sync.bytes} if self.sync else {}
        return {**self.counters, **sync, "pending": len(self.pending)}

    def _stats(self, request: Message) -> Message:
        return Message("stats", meta=self._counts())

    def _shutdown(self, request: Message) -> Message:
        self.transport.request_stop()
        return Message("shutdown", meta={"pid": os.getpid()})


# ------------------------------------------------------------------------------------ the process
SETUP_FAULTS = (ValueError, TypeError, KeyError, IndexError, AttributeError)  # a plan that does not fit the model


def plan_builder(make_model: Callable[[], nn.Module], index: int) -> Callable[[dict, dict], tuple[list[Unit], dict]]:
    """What a launcher-started group PS does with its `setup` request: meta `plan` (the leader's
    plan: `modules`, `splits`, `devices`) cuts the job's dense model (`make_model()`) as every
    trainer cuts it, this group PS (`index` among its group's) takes the units placed on it, and
    the request's arrays give the values of their parameters (named as in the whole split model)."""

    def build(meta: dict, arrays: dict) -> tuple[list[Unit], dict]:
        plan = meta.get("plan")
        if not isinstance(plan, dict) or not {"modules", "splits", "devices"} <= set(plan):
            raise ValueError("setup takes meta plan: {modules, splits, devices} (the leader's operator placement)")
        try:
            split = split_model(make_model(), plan["splits"])
            units = plan_units(split, placed_devices(plan["modules"], plan["splits"], plan["devices"]))
            mine = [Unit(u.name, u.prefix, unit_module(split, u)) for u in units if u.device == index]
            slices = split_slices(split, plan["splits"])
        except SETUP_FAULTS as error:
            raise ValueError(f"setup: the plan does not fit this job's dense model ({error!r:.200})") from None
        params = {f"{u.prefix}.{name}": p for u in mine for name, p in u.module.named_parameters()}
        if set(arrays) != set(params):
            raise ValueError(f"setup takes the values of this group PS's parameters {sorted(params)}, got "
                             f"{sorted(arrays)[:20]}")
        with torch.no_grad():
            for name, param in params.items():
                value = arrays[name]
                if tuple(value.shape) != tuple(param.shape) or value.dtype != np.float32:
                    raise ValueError(f"setup: {name} takes float32 of shape {list(param.shape)}, got "
                                     f"{value.dtype} of shape {list(value.shape)}")
                param.copy_(torch.from_numpy(np.asarray(value)))
        return mine, {name: where for name, where in slices.items() if name in params}

    return build


def setup_request(plan: dict, units: Sequence[Unit]) -> tuple[dict[str, np.ndarray], dict]:
    """The arrays and meta of the `setup` request that gives a group PS `units` (modules at the
    values it starts from) under `plan` (`plan_builder` reads it)."""
    arrays = {f"{u.prefix}.{name}": p.detach().cpu().numpy().astype(np.float32, copy=True)
              for u in units for name, p in u.module.named_parameters()}
    return arrays, {"plan": {key: plan[key] for key in ("modules", "splits", "devices")}}


def main(argv: list[str] | None = None, prog: str = "python -m hybridrec.hierarchical.group_ps") -> int:
    """A group PS as a launcher starts it (`hybridrec group-ps`, hybridrec.parallel.roles): empty
    until its group's first trainer sends the units (`setup`), with every setting from the job
    config."""
    from hybridrec.config import load_config
    from hybridrec.job.tables import job_dense_model, job_tables
    from hybridrec.ps.server import run_until_stopped

    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    parser.add_argument("config", help="the job's YAML config")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    parser.add_argument("--group", type=int, required=True, help="the group this group PS serves")
    parser.add_argument("--index", type=int, required=True, help="which of its group's strategy.ht.group_ps it is")
    parser.add_argument("--trainers-per-group", type=int, required=True, help="the trainers that call it")
    parser.add_argument("--ps", required=True, help="the PS servers holding the centre copy (comma-separated)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.set)
        centre = check_addresses([a for a in args.ps.split(",") if a], "--ps")
        tables = job_tables(cfg)
    except ValueError as error:  # ConfigError too
        parser.error(str(error))
    ht, strategy = cfg.strategy.ht, cfg.strategy
    for flag, value, most in (("--index", args.index, ht.group_ps - 1), ("--group", args.group, 1 << 20),
                              ("--trainers-per-group", args.trainers_per_group, 1 << 20)):
        if not 0 <= value <= most or (flag == "--trainers-per-group" and value < 1):
            parser.error(f"{flag} {value} is out of range (strategy.ht.group_ps is {ht.group_ps})")
    torch.set_num_threads(1)
    t = args.trainers_per_group
    server = GroupPS((), cfg.train.dense_optimizer.model_dump(), wire=ht.wire_codec, topk_ratio=strategy.topk_ratio,
                     centre=centre, alpha=ht.alpha, period=ht.period, host=args.host, port=args.port,
                     threads=max(2, t), timeout=strategy.request_timeout, retries=strategy.retries, callers=t,
                     max_rows=max(cfg.data.batch_size, cfg.data.eval_batch_size or 0),
                     builder=plan_builder(lambda: job_dense_model(cfg, tables), args.index))
    server.start()
    run_until_stopped(server, on_ready=lambda: print(f"{READY}{server.address} pid {os.getpid()} group {args.group} "
                                                     f"index {args.index}", flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
