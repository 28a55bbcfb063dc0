"""A group's group PSs seen from its trainers (HT with strategy.ht.group_ps = p >= 1): the plan,
the processes, and the trainer's model whose placed layers run on them.

Every trainer takes the leader's plan (hybridrec.hierarchical.operator_placement; saved with the
run) and splits its model, which starts at the centre's values, as the plan says. Each group's
first trainer starts the group's p group PS processes (hybridrec.hierarchical.group_ps) on its
host, each with its units; the group's trainers then train `module`, the model whose units are
remote calls to them (hybridrec.hierarchical.net_transformation). Each group PS syncs its
parameters with the centre by elastic averaging (a split part with its slice of the unsplit
parameter). At the end each group PS syncs once more and stops; the centre is the job's result.

A group's trainers and its group PSs run on one host (the first trainer's): group PSs on hosts
of their own are not placed by the launchers yet.
"""
from __future__ import annotations

import secrets
import socket
import subprocess
import tempfile
from pathlib import Path

import torch

from hybridrec.comm.transport import Client
from hybridrec.config import ConfigError
from hybridrec.hierarchical.group_ps import Unit, start_group_ps, write_spec
from hybridrec.hierarchical.net_transformation import (RemoteLink, placed_devices, plan_units, remote_model,
                                                         split_model, split_slices, unit_module)
from hybridrec.hierarchical.operator_placement import PlanError, plan_for_config, save_plan

SHUTDOWN_SECONDS = 15.0


def leader_plan(cfg, world) -> dict:
    """The leader's plan of the job's dense model (saved with the run), on every trainer; a
    PlanError on every trainer when the plan cannot meet a device's memory."""
    plan, error = None, None
    if world.leader:
        try:
            plan = plan_for_config(cfg).to_json()
            save_plan(plan, cfg.train.output_dir)
        except PlanError as failure:
            error = str(failure)
    plan, error = world.broadcast((plan, error))
    if error is not None:
        raise PlanError(error)
    return plan


class GroupServers:
    """Built by every trainer of the job (collectives inside); `module` is what the trainer runs."""

    def __init__(self, model: torch.nn.Module, cfg, world, group: int, member: int, trainers_per_group: int,
                 centre_addresses: list[str]):
        ht, strategy = cfg.strategy.ht, cfg.strategy
        self.world, self.member, self.cfg, self.trainers_per_group = world, member, cfg, trainers_per_group
        self.processes: list[subprocess.Popen] = []
        self.clients: list[Client] = []
        self.counts: list[dict] = []
        hosts = world.gather(socket.gethostname())
        spread = [g for g in range(world.size // trainers_per_group)
                  if len(set(hosts[g * trainers_per_group:(g + 1) * trainers_per_group])) > 1]
        if spread:
            raise ConfigError(f"strategy.ht.group_ps {ht.group_ps}: a group's group PSs run on its first trainer's "
                              f"host, but the trainers of group(s) {spread} run on several hosts; place each group "
                              "on one host")
        plan = leader_plan(cfg, world)
        self.plan, self.codec = plan, ht.wire_codec
        self.split = split_model(model, plan["splits"])
        units = plan_units(self.split, placed_devices(plan["modules"], plan["splits"], plan["devices"]))
        slices = split_slices(self.split, plan["splits"])
        addresses = self._start(units, slices, centre_addresses) if member == 0 else None
        addresses = world.gather(addresses)[group * trainers_per_group]
        self.clients = [Client(address, timeout=strategy.request_timeout, retries=strategy.retries)
                        for address in addresses]
        self.links = {unit.name: RemoteLink(self.clients[unit.device], unit.name, member, ht.wire_codec,
                                            strategy.topk_ratio) for unit in units}
        self.module = remote_model(self.split, units, self.links)

    def _start(self, units, slices: dict, centre_addresses: list[str]) -> list[str]:
        """Start the group's group PSs (the first trainer only); their addresses."""
        ht, strategy = self.cfg.strategy.ht, self.cfg.strategy
        optimizer = self.cfg.train.dense_optimizer.model_dump()
        addresses = []
        with tempfile.TemporaryDirectory(prefix="hybridrec-group-ps-") as scratch:
            for j in range(ht.group_ps):
                placed = [Unit(u.name, u.prefix, unit_module(self.split, u)) for u in units if u.device == j]
                mine = {f"{u.prefix}.{name}" for u in placed for name, _ in u.module.named_parameters()}
                spec = write_spec(Path(scratch) / f"ps{j}-{secrets.token_hex(4)}.pt", placed, optimizer,
                                  wire=ht.wire_codec, topk_ratio=strategy.topk_ratio, centre=centre_addresses,
                                  alpha=ht.alpha, period=ht.period, threads=self.trainers_threads(),
                                  slices={k: v for k, v in slices.items() if k in mine},
                                  timeout=strategy.request_timeout, retries=strategy.retries,
                                  callers=self.trainers_per_group,
                                  max_rows=max(self.cfg.data.batch_size, self.cfg.data.eval_batch_size or 0))
                process, address = start_group_ps(spec)
                self.processes.append(process)
                addresses.append(address)
        return addresses

    def trainers_threads(self) -> int:
        """Handler threads of a group PS: one per trainer of its group (Hogwild between them)."""
        return max(2, self.trainers_per_group)

    def finish(self) -> None:
        """The group PSs' last elastic sync (the first trainer asks; every trainer then waits)."""
        self.world.barrier()  # no trainer calls a group PS from here on
        if self.member == 0:
            self.counts = [client.request("finish", timeout=120.0).meta for client in self.clients]
        self.world.barrier()

    def facts(self) -> dict:
        """This trainer's wire bytes, and (first trainer) its group PSs' counters."""
        return {"wire_bytes": sum(link.bytes_sent + link.bytes_received for link in self.links.values()),
                "group_ps": self.counts}

    def close(self) -> None:
        for client in self.clients:
            if self.member == 0:
                try:
                    client.request("shutdown", timeout=5.0, retries=0)
                except (TimeoutError, RuntimeError, OSError):
                    pass  # killed below
            client.close()
        for process in self.processes:
            try:
                process.wait(SHUTDOWN_SECONDS)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5)
            if process.stdout is not None:
                process.stdout.close()
