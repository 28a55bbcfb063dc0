"""A group's group PSs seen from its trainers (HT with strategy.ht.group_ps = p >= 1): the plan,
the units, and the trainer's model whose placed layers run on them.

The launcher starts every group PS (hybridrec.hierarchical.group_ps) as a server role, before the
trainers, and gives the trainers their addresses (group-major); no trainer starts a server.
Every trainer takes the leader's plan (hybridrec.hierarchical.operator_placement; saved with the
run) and splits its model, which starts at the centre's values, as the plan says. Each group's
first trainer sends each of its group's p group PSs the units placed on it (`setup`: the plan
and the units' starting values); the group's trainers then train `module`, the model whose units
are remote calls to them (hybridrec.hierarchical.net_transformation). Each group PS syncs its
parameters with the centre by elastic averaging (a split part with its slice of the unsplit
parameter). At the end each group PS syncs once more; the centre is the job's result.
"""
from __future__ import annotations

import torch

from hybridrec.comm.transport import Client
from hybridrec.config import ConfigError
from hybridrec.hierarchical.group_ps import Unit, setup_request
from hybridrec.hierarchical.net_transformation import (RemoteLink, placed_devices, plan_units, remote_model,
                                                         split_model, unit_module)
from hybridrec.hierarchical.operator_placement import PlanError, plan_for_config, save_plan

SETUP_SECONDS = 120.0  # a group PS builds the job's dense model before it answers its setup


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
    """Built by every trainer of the job (collectives inside); `module` is what the trainer runs.
    `addresses`: every group PS of the job, group-major (p per group)."""

    def __init__(self, model: torch.nn.Module, cfg, world, group: int, member: int, trainers_per_group: int,
                 addresses: list[str]):
        ht, strategy = cfg.strategy.ht, cfg.strategy
        self.world, self.member, self.cfg, self.trainers_per_group = world, member, cfg, trainers_per_group
        self.counts: list[dict] = []
        groups = world.size // trainers_per_group
        if len(addresses) != groups * ht.group_ps:
            raise ConfigError(f"strategy.ht.group_ps {ht.group_ps}: {groups} group(s) need {groups * ht.group_ps} "
                              f"group PS addresses (--group-ps), got {len(addresses)}; start the job with "
                              "`hybridrec launch`, which starts them")
        plan = leader_plan(cfg, world)
        self.plan, self.codec = plan, ht.wire_codec
        self.split = split_model(model, plan["splits"])
        units = plan_units(self.split, placed_devices(plan["modules"], plan["splits"], plan["devices"]))
        mine = addresses[group * ht.group_ps:(group + 1) * ht.group_ps]
        self.clients = [Client(address, timeout=strategy.request_timeout, retries=strategy.retries)
                        for address in mine]
        failure = None
        if member == 0:  # the group's first trainer gives each of its group PSs its units
            try:
                for j, client in enumerate(self.clients):
                    arrays, meta = setup_request(plan, [Unit(u.name, u.prefix, unit_module(self.split, u))
                                                        for u in units if u.device == j])
                    client.request("setup", arrays, meta, timeout=SETUP_SECONDS, idempotent=True)
            except (TimeoutError, RuntimeError, OSError) as error:
                failure = f"group {group}'s group PS {mine[j]} did not take its units: {error}"
        failures = [f for f in world.gather(failure) if f]  # no trainer calls a group PS before it has its units
        if failures:
            self.close()
            raise RuntimeError(failures[0])
        self.links = {unit.name: RemoteLink(self.clients[unit.device], unit.name, member, ht.wire_codec,
                                            strategy.topk_ratio) for unit in units}
        self.module = remote_model(self.split, units, self.links)

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
        """Close the connections; the group PSs are the launcher's, which stops them with the job."""
        for client in self.clients:
            client.close()
