"""A group PS of Hierarchical Training (HT §3): a process that holds its part of a group's ONE
dense copy and runs the layers the operator placement put on it for every trainer of the group.

The group's leader trainer starts it (`start_group_ps`) with a spec file: the units it runs
(modules of the dense model, each with the prefix of its parameters' names in the whole model),
the dense optimizer, the wire codec, and the addresses of the PS servers that hold the centre
copy. Operations, over the job's authenticated transport:

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
syncs with its slice of the unsplit parameter (`slices`). The process exits when its parent
trainer does.
"""
from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from hybridrec.comm.transport import Message, Operation, Server, Service, check_addresses
from hybridrec.ps.client import PSClient
from hybridrec.ps.server import listening_address, run_until_stopped
from hybridrec.models.dense_optimizer import optimizer_of
from hybridrec.hierarchical.elastic_averaging import ElasticSync
from hybridrec.comm.compression import WIRE_CODECS
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
    """The units of one group PS behind a transport Server (see the module docstring)."""

    def __init__(self, units: Sequence[Unit], optimizer: Mapping[str, Any], *, wire: str = "none",
                 topk_ratio: float = 0.01, centre: Sequence[str] = (), alpha: float = 0.1, period: int = 4,
                 slices: dict | None = None, host: str = "127.0.0.1", port: int = 0, threads: int = 2,
                 timeout: float = 10.0, retries: int = 2, callers: int = 64, max_rows: int = 1 << 16):
        self.units = {unit.name: unit for unit in units}
        for unit in units:
            unit.module.train()
            params = list(unit.module.parameters())
            unit.optimizer = optimizer_of(optimizer, params) if params else None
        self.forward_codec, self._make_backward = wire_codec(wire, topk_ratio)
        self.codecs = WIRE_CODECS[wire]  # (forward, backward): what requests may use
        self.callers, self.max_rows = callers, max_rows
        self.senders: dict[int, GradientSender] = {}  # caller -> the encoder of the input gradients it gets back
        self.pending: dict[tuple[int, str, int], _Pending] = OrderedDict()
        self._pending_lock = threading.Lock()
        self._count_lock = threading.Lock()
        self.counters = dict.fromkeys(("forwards", "backwards", "updates", "dropped_graphs", "bytes_received",
                                       "bytes_sent", "staleness_sum", "staleness_max"), 0)
        self.params = {f"{unit.prefix}.{name}": p for unit in units for name, p in unit.module.named_parameters()}
        self.period, self.synced_at = period, 0
        self.centre = None
        if centre:
            self.centre = PSClient(check_addresses(list(centre), "centre"), timeout=timeout, retries=retries)
        self.sync = None
        if self.centre is not None:
            self.sync = ElasticSync(self.params, self.centre, alpha, self._due, slices=slices)
        self.transport = Server({
            "ping": Operation(self._ping),
            "forward": Operation(self._forward, arrays=None),
            "backward": Operation(self._backward, arrays=None),
            "finish": Operation(self._finish),
            "stats": Operation(self._stats),
            "shutdown": Operation(self._shutdown),
        }, host=host, port=port, threads=threads)

    def start(self) -> int:
        port = super().start()
        if self.sync is not None:
            self.sync.start()
        return port

    def _release(self) -> None:
        if self.sync is not None:
            try:
                self.sync.stop(timeout=10.0)
            except RuntimeError:
                pass  # reported through `finish` and `stats` already
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
    def _unit(self, meta: dict) -> Unit:
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
def write_spec(path: str | Path, units: Sequence[Unit], optimizer: Mapping[str, Any], **settings: Any) -> Path:
    """The file `start_group_ps` hands its process: the units (modules with their weights) and
    the settings of `GroupPS`. Written by the leader trainer for its own child only."""
    path = Path(path)
    torch.save({"units": [(u.name, u.prefix, u.module) for u in units], "optimizer": dict(optimizer),
                "settings": settings}, path)
    return path


def _exit_with_parent(server: GroupPS, parent: int) -> None:
    while not server.wait(0.5):
        if os.getppid() != parent:
            server.transport.request_stop()
            return


def start_group_ps(spec: str | Path, *, host: str = "127.0.0.1", env: Mapping[str, str] | None = None,
                   startup_timeout: float = 120.0) -> tuple[subprocess.Popen, str]:
    """Start a group PS process from a spec file (`write_spec`); (process, address) once it
    listens. The caller owns the process; it also exits by itself when the caller dies."""
    process = subprocess.Popen([sys.executable, "-m", "hybridrec.hierarchical.group_ps", "--spec", str(spec),
                                "--host", host, "--parent", str(os.getpid())], stdout=subprocess.PIPE, text=True,
                               env=None if env is None else dict(env))
    return process, listening_address(process, READY, f"group PS from {spec}", startup_timeout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybridrec.hierarchical.group_ps",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--spec", required=True, help="the spec file the leader trainer wrote (write_spec)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--parent", type=int, default=None, help="exit when this process is no longer the parent")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    spec = torch.load(args.spec, weights_only=False)  # our own leader's file, never a user's
    units = [Unit(name, prefix, module) for name, prefix, module in spec["units"]]
    settings = dict(spec["settings"])
    server = GroupPS(units, spec["optimizer"], host=args.host, port=args.port,
                     threads=settings.pop("threads", 2), **settings)
    server.start()
    if args.parent is not None:
        threading.Thread(target=_exit_with_parent, args=(server, args.parent), daemon=True).start()
    run_until_stopped(server, on_ready=lambda: print(f"{READY}{server.address} pid {os.getpid()}", flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
