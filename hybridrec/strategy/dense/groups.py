"""Hierarchical Training's dense sync (`groups`): the trainers form strategy.ht.groups groups of
equal size; each group trains ONE dense copy, shared by its trainer processes without locks
(Hogwild, dense staleness at most t - 1 writes per step with t trainers), and the group's
leader pulls that copy toward a centre copy on the PS servers by elastic averaging in a
background thread (ShadowSync), so no step waits for another group. With one trainer per group
this is the EASGD baseline (hybridrec.strategy.dense.easgd).

With strategy.ht.group_ps = p >= 1 the group's copy lives on its p group PS processes instead
(server roles the launcher starts, hybridrec.parallel.roles), which run the layers the operator
placement puts on them for all the group's trainers and do the elastic averaging themselves
(hybridrec.hierarchical.group_servers); the trainers keep the glue and no parameter.

The job's result is the centre: when every trainer is out of its training loop, each group's
copy syncs once more and every trainer takes the centre's values, which are evaluated and saved.
Each trainer keeps its own optimizer state over the shared parameters, as the Hogwild example
does; a checkpoint holds the leader's.
"""
from __future__ import annotations

import secrets
import socket

import numpy as np
import torch

from hybridrec.config import ConfigError
from hybridrec.strategy.dense import DenseSync, dense_optimizer
from hybridrec.hierarchical.elastic_averaging import CENTRE_OPTIMIZER, ElasticSync
from hybridrec.hierarchical.group_servers import GroupServers
from hybridrec.hierarchical.shared_copy import SharedCopy
from hybridrec.hierarchical.operator_placement import write_plan


def group_shape(world_size: int, groups: int) -> int:
    """Trainers per group; ValueError when the trainers do not divide evenly."""
    if world_size % groups:
        raise ValueError(f"strategy.ht.groups {groups}: {world_size} trainers do not divide into {groups} groups of "
                         f"equal size; allowed: a divisor of the trainer count")
    return world_size // groups


class GroupsDense(DenseSync):
    lockstep = False

    def __init__(self, model: torch.nn.Module, cfg, world, services, trainers_per_group: int | None = None):
        ht = cfg.strategy.ht
        servers = services.ps_endpoints("dense groups")  # the PS servers hold the centre
        self.model = self.module = model
        self.params = dict(model.named_parameters())
        self.trainers_per_group = t = trainers_per_group or group_shape(world.size, ht.groups)
        self.groups = world.size // t
        self.group, self.member = divmod(world.rank, t)
        self.world, self.period = world, ht.period
        self.centre_client = servers.client()
        initial = {name: p.detach().cpu().numpy().copy() for name, p in self.params.items()}
        self._assign(self.centre_client.dense_init(initial, CENTRE_OPTIMIZER))  # every copy starts at the centre
        self.steps, self.synced_at, self.mark = 0, 0, 0
        self.staleness: list[int] = []
        self.shared = self.sync = self.optimizer = self.servers = None
        if ht.group_ps:  # the copy lives on the group's group PSs, which sync it themselves
            self.servers = GroupServers(model, cfg, world, self.group, self.member, t, list(servers.group_ps))
            self.module = self.servers.module
            return
        if world.leader:  # the operator placement of one group, saved with the run (`hybridrec plan` prints it)
            write_plan(cfg, cfg.train.output_dir)
        self.shared = self._share(world) if t > 1 else None
        self.optimizer = dense_optimizer(cfg, model.parameters())
        if self.member == 0:  # the group's leader keeps its copy near the centre
            self.sync = ElasticSync(self.params, servers.client(), ht.alpha, self._due).start()

    def _share(self, world) -> SharedCopy:
        """The group's copy in shared memory, made by its leader, mapped by every member."""
        hosts = world.gather(socket.gethostname())
        mine = hosts[self.group * self.trainers_per_group:(self.group + 1) * self.trainers_per_group]
        if len(set(mine)) > 1:
            raise ConfigError(f"strategy.ht.group_ps 0 keeps a group's copy in shared memory, but group {self.group}'s "
                              f"trainers run on {sorted(set(mine))}; place each group on one host")
        prefix = f"hybridrec-ht-{world.broadcast(secrets.token_hex(8))}-g{self.group}"
        leader = self.member == 0
        shared = SharedCopy(self.model, prefix, self.member, self.trainers_per_group, create=True) if leader else None
        world.barrier()
        if not leader:
            shared = SharedCopy(self.model, prefix, self.member, self.trainers_per_group, create=False)
        world.barrier()
        if leader:
            shared.unlink()  # every member has it mapped
        shared.attach()
        return shared

    def _assign(self, values: dict) -> None:
        with torch.no_grad():
            for name, value in values.items():
                self.params[name].copy_(torch.from_numpy(np.asarray(value)))

    def _writes(self) -> int:
        return self.shared.total_writes if self.shared is not None else self.steps

    def _due(self) -> bool:
        writes = self._writes()
        if writes - self.synced_at < self.period:
            return False
        self.synced_at = writes
        return True

    def begin_step(self) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        if self.shared is not None:
            self.mark = self.shared.read_mark()

    def finish_step(self) -> None:
        if self.shared is not None:
            self.staleness.append(self.shared.write_mark(self.mark))
        if self.optimizer is not None:
            self.optimizer.step()
        self.steps += 1
        if self.sync is not None:
            self.sync.poke()

    def finish_training(self) -> None:
        if self.servers is not None:
            self.servers.finish()  # each group PS's last sync
        else:
            self.world.barrier()  # no trainer writes a copy from here on
            if self.sync is not None:
                self.sync.stop()
                self.sync.sync_once()  # the copy's last steps reach the centre
            self.world.barrier()
        self._assign(self.centre_client.dense_pull(list(self.params)))

    def facts(self, world) -> dict:
        if self.servers is not None:
            return self._group_ps_facts(world)
        mine = {"staleness": [max(self.staleness, default=0), sum(self.staleness), len(self.staleness)],
                "syncs": self.sync.syncs if self.sync else 0, "bytes": self.sync.bytes if self.sync else 0}
        every = world.gather(mine)
        steps = sum(f["staleness"][2] for f in every)
        return {"dense_replicas": self.groups, "trainers_per_group": self.trainers_per_group,
                "max_dense_staleness": max(f["staleness"][0] for f in every),
                "mean_dense_staleness": sum(f["staleness"][1] for f in every) / steps if steps else 0.0,
                "elastic_syncs": sum(f["syncs"] for f in every),
                "elastic_sync_bytes": sum(f["bytes"] for f in every)}

    def _group_ps_facts(self, world) -> dict:
        """The group PSs' counters (updates, staleness, elastic syncs) and the trainers' wire bytes."""
        every = world.gather({**self.servers.facts(), "steps": self.steps})
        counts = [c for f in every for c in f["group_ps"]]
        backwards = sum(c["backwards"] for c in counts)
        steps = sum(f["steps"] for f in every)
        wire = sum(f["wire_bytes"] for f in every)
        return {"dense_replicas": self.groups, "trainers_per_group": self.trainers_per_group,
                "group_ps": len(counts) // self.groups, "wire_codec": self.servers.codec,
                "max_dense_staleness": max((c["staleness_max"] for c in counts), default=0),
                "mean_dense_staleness": sum(c["staleness_sum"] for c in counts) / backwards if backwards else 0.0,
                "elastic_syncs": sum(c.get("elastic_syncs", 0) for c in counts),
                "elastic_sync_bytes": sum(c.get("elastic_sync_bytes", 0) for c in counts),
                "wire_bytes": wire, "wire_bytes_per_step": wire / steps if steps else 0.0,
                "dropped_graphs": sum(c["dropped_graphs"] for c in counts)}

    def state(self) -> dict:
        return {"model": self.model.state_dict(),
                "optimizer": None if self.optimizer is None else self.optimizer.state_dict()}

    def load(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])  # in place: a shared copy stays shared
        if self.optimizer is not None and state.get("optimizer") is not None:
            self.optimizer.load_state_dict(state["optimizer"])

    def close(self) -> None:
        if self.sync is not None:
            try:
                self.sync.stop(timeout=10.0)
            except RuntimeError:
                pass  # the failure was raised to the training thread already
            self.sync.client.close()
        if self.shared is not None and self.member == 0:
            self.shared.unlink()
        if self.servers is not None:
            self.servers.close()
        self.centre_client.close()


DENSE = GroupsDense
