"""The roles of a distributed job, declared once: what each server role runs, how many the job
has, and the addresses and argv every launcher gives them.

| role | names | command (`hybridrec ...`) | entry (in-process, Ray's actors) | how many |
|---|---|---|---|---|
| PS server | ps0.. | `serve-ps` | `hybridrec.ps.server:main` | `--ps` / strategy.roles.ps_servers, when the placement keeps tables on PS servers |
| embedding worker | ew0.. | `embedding-worker` | `hybridrec.persia.embedding_worker:main` | `--embedding-workers` / strategy.roles.embedding_workers |
| group PS | gp0.. | `group-ps` | `hybridrec.hierarchical.group_ps:main` | strategy.ht.group_ps per group (dense `groups`: strategy.ht.groups groups; `easgd`: one per trainer) |
| prediction server | serve | `serve` | `hybridrec.serving.server:run` | one per `hybridrec serve`; no training job starts it |
| trainers | nn | `torchrun -m hybridrec.parallel.trainer` | `hybridrec.parallel.trainer:main` | `--trainers` / strategy.roles.trainers |

`build_roles` turns a job into `Role`s (hybridrec.parallel.supervisor) with ports picked once, so
a restarted role keeps its address: `hybridrec launch` runs them under its supervisor (on this
machine or on emulated hosts), the Ray launcher runs the same argv inside actors (each server
role through its `entry`). Servers start first, in table order; the trainers start once every
server reported ready and get every server's addresses, so no trainer starts a server.
"""
from __future__ import annotations

import importlib
import json
import sys
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable, Sequence

from hybridrec.axes import server_roles
from hybridrec.config import ConfigError, JobConfig, load_config
from hybridrec.parallel.host import (dial_host, free_ports, merged_environment, new_job_id, ps_shm_name,
                                    role_environment)
from hybridrec.parallel.scale import replicas_reason
from hybridrec.parallel.supervisor import Role
from hybridrec.picasso.switches import MACHINE_TRAINERS_ENV

if TYPE_CHECKING:
    from hybridrec.parallel.emulated_hosts import EmulatedHosts


@dataclass(frozen=True)
class ServerRole:
    """One kind of server process. `ready`: what it prints once it serves (its address follows);
    `entry`: `module:function(argv, prog)` that runs it in a process of one's own; `resources`:
    its key of strategy.resources; `trainer_flag`: how trainers are given the addresses."""

    kind: str
    prefix: str
    command: str
    entry: str
    ready: str
    resources: str | None
    trainer_flag: str | None

    def run(self, argv: Sequence[str]) -> int:
        """Run this role here, in this process, from its `hybridrec <command>` arguments."""
        module, function = self.entry.split(":")
        return getattr(importlib.import_module(module), function)(list(argv), prog=f"hybridrec {self.command}") or 0


PS = ServerRole("ps", "ps", "serve-ps", "hybridrec.ps.server:main", "hybridrec-ps listening on ",
                "ps_servers", "--ps")
EMBEDDING_WORKER = ServerRole("embedding_worker", "ew", "embedding-worker", "hybridrec.persia.embedding_worker:main",
                              "hybridrec-embedding-worker listening on ", "embedding_workers", "--embedding-workers")
GROUP_PS = ServerRole("group_ps", "gp", "group-ps", "hybridrec.hierarchical.group_ps:main",
                      "hybridrec-group-ps listening on ", "group_ps", "--group-ps")
PREDICTION_SERVER = ServerRole("serve", "serve", "serve", "hybridrec.serving.server:run", "hybridrec serve: ",
                               None, None)
SERVER_ROLES = (PS, EMBEDDING_WORKER, GROUP_PS, PREDICTION_SERVER)  # the order servers start in
TRAINERS = "nn"  # the trainers' role (one torchrun per trainer host): its lines read [nn] as under torchrun


def server_role(name: str) -> ServerRole:
    """The kind of a server role from its name (ps0, ew1, gp3, serve) or its command (serve-ps, ...)."""
    for role in SERVER_ROLES:
        if name in (role.command, role.prefix) or (name.startswith(role.prefix) and name[len(role.prefix):].isdigit()):
            return role
    raise ValueError(f"{name!r} is not a server role: {', '.join(r.prefix + 'N' for r in SERVER_ROLES[:3])}, serve")


# ------------------------------------------------------------------------------ counts
def check_config(config: str, overrides: Sequence[str] = ()) -> JobConfig:
    """Load the job config and make sure it describes a distributed job."""
    cfg = load_config(config, list(overrides))
    if not cfg.strategy.distributed:
        raise ConfigError(
            f"{config}: strategy.placement is 'local'; `hybridrec launch` runs distributed jobs (PS servers, "
            f"embedding workers, trainers). Add `--set strategy.preset=persia`, set `strategy: {{preset: persia}}` "
            f"in the config, or run `hybridrec train {config}` for one process")
    reason = replicas_reason(cfg)
    if reason is not None:
        raise ConfigError(f"{config}: {reason}")
    return cfg


def role_counts(cfg: JobConfig, ps: int | None = None, embedding_workers: int | None = None,
                trainers: int | None = None) -> dict[str, int]:
    """The counts given, the rest from the config's strategy.roles; server roles the placement does
    not run (a `sharded` placement's trainers hold the tables) count 0, and asking for them is an
    error."""
    roles, needed = cfg.strategy.roles, server_roles(cfg.strategy.resolved)
    counts = {"ps": roles.ps_servers if ps is None else ps,
              "embedding_workers": roles.embedding_workers if embedding_workers is None else embedding_workers,
              "trainers": roles.trainers if trainers is None else trainers}
    for key, role, flag, given in (("ps", "ps_servers", "--ps", ps),
                                   ("embedding_workers", "embedding_workers", "--embedding-workers", embedding_workers)):
        if role not in needed:
            if given:
                raise ValueError(f"{flag} {given}: strategy.placement {cfg.strategy.placement!r} runs no {role} "
                                 "(its trainers hold the tables); leave the flag out")
            counts[key] = 0
    return counts


def group_ps_layout(cfg: JobConfig, trainers: int) -> tuple[int, int]:
    """(groups, group PSs per group) of Hierarchical Training's group PS processes: strategy.ht.
    group_ps per group (dense `groups`: strategy.ht.groups groups; `easgd`: a group per trainer);
    (0, 0) for a job without them. ValueError when the trainers do not divide into the groups."""
    dense, per_group = cfg.strategy.resolved["dense"], cfg.strategy.ht.group_ps
    groups = {"groups": cfg.strategy.ht.groups, "easgd": trainers}.get(dense, 0)
    if not groups or not per_group:
        return 0, 0
    if trainers % groups:
        raise ValueError(f"--trainers {trainers}: strategy.ht.groups {groups} groups of equal size cannot be made of "
                         f"{trainers} trainers; allowed: a multiple of {groups}")
    return groups, per_group


def check_arguments(*, ps: int, embedding_workers: int, trainers: int, max_restarts: int = 0,
                    role_restarts: int = 3, resume: bool = False, overwrite: bool = False,
                    timeout: float | None = None, needs_ps: bool = True) -> None:
    """ValueError naming the flag when a count or option of `hybridrec launch` is out of range.
    `needs_ps`: the placement keeps its tables on PS servers (else it runs none)."""
    for flag, value, least in (("--ps", ps, int(needs_ps)), ("--embedding-workers", embedding_workers, 0),
                               ("--trainers", trainers, 1)):
        if value < least:
            raise ValueError(f"{flag} must be at least {least}, got {value}")
    for flag, value in (("--max-restarts", max_restarts), ("--role-restarts", role_restarts)):
        if value < 0:
            raise ValueError(f"{flag} must be 0 or more, got {value}")
    if resume and overwrite:
        raise ValueError("--resume and --overwrite exclude each other")
    if timeout is not None and timeout <= 0:
        raise ValueError(f"--timeout must be positive, got {timeout:g}")


def command_line(config: str, counts: dict[str, int], overrides: Sequence[str] = ()) -> str:
    """The `hybridrec launch` command that runs this job with these counts."""
    sets = "".join(f" --set {item}" for item in overrides)
    servers = f"--ps {counts['ps']} --embedding-workers {counts['embedding_workers']} " if counts["ps"] else ""
    return f"hybridrec launch {config} {servers}--trainers {counts['trainers']}{sets}"


# ---------------------------------------------------------------------------- resources
def role_options(resources) -> dict:
    """Ray's resource options for one process with these `strategy.resources.<role>` values."""
    options = {"num_cpus": resources.cpus, "num_gpus": resources.gpus}
    if resources.memory_gb:
        options["memory"] = int(resources.memory_gb * 2**30)
    return options


RAY_RESOURCE = {"num_cpus": "CPU", "num_gpus": "GPU", "memory": "memory"}


def demand_of(options: dict) -> dict[str, float]:
    """Ray resource names and amounts of a role's options."""
    return {RAY_RESOURCE[k]: v for k, v in options.items() if k in RAY_RESOURCE and v}


def job_demand(resources, counts: dict[str, int]) -> dict[str, float]:
    """What the whole job asks Ray for (CPU, GPU, memory in bytes), every process together.
    `counts`: ps, embedding_workers, trainers and (optionally) group_ps."""
    demand: dict[str, float] = {}
    for role, count in (("ps_servers", counts["ps"]), ("embedding_workers", counts["embedding_workers"]),
                        ("group_ps", counts.get("group_ps", 0)), ("trainers", counts["trainers"])):
        for resource, amount in demand_of(role_options(getattr(resources, role))).items():
            demand[resource] = demand.get(resource, 0) + amount * count
    return demand


# --------------------------------------------------------------------------------- plan
@dataclass(frozen=True)
class JobPlan:
    """What `build_roles` decided: the roles, the addresses and the shared-memory prefixes."""

    job: str
    roles: list[Role]
    ps_addresses: list[str]
    embedding_worker_addresses: list[str]
    shm_names: list[str]
    group_ps_addresses: list[str] = ()


def _server_argv(role: ServerRole, python: str, config: str, sets: list[str], index: int, bind: str, port: int,
                 ps_addresses: str, shm_name: str, checkpoint_root: list[str], group_ps: tuple[int, int],
                 trainers: int) -> list[str]:
    """The argv of server `index` of kind `role`, as every launcher runs it."""
    base = [python, "-m", "hybridrec.cli", role.command]
    where = ["--host", bind, "--port", str(port)]
    if role is PS:
        return [*base, "--config", config, *sets, *where, "--shm-name", shm_name, *checkpoint_root]
    if role is EMBEDDING_WORKER:
        return [*base, config, *sets, "--rank", str(index), "--ps", ps_addresses, *where]
    group, member = divmod(index, group_ps[1])
    return [*base, config, *sets, "--group", str(group), "--index", str(member), "--trainers-per-group",
            str(trainers // group_ps[0]), "--ps", ps_addresses, *where]


def build_roles(config: str, *, ps: int, embedding_workers: int, trainers: int, group_ps: tuple[int, int] = (0, 0),
                overrides: Sequence[str] = (), host: str = "127.0.0.1", job: str | None = None,
                resume: bool = False, overwrite: bool = False, max_restarts: int = 0,
                role_restarts: int = 3, startup_timeout: float = 180.0,
                python: str = sys.executable, checkpoint_root: str | None = None,
                hosts: "EmulatedHosts | None" = None, job_key: bool = True) -> JobPlan:
    """The roles of one job, with ports picked now so a restarted role keeps its address.
    `group_ps`: (groups, group PSs per group) (`group_ps_layout`); gp<g * per group + j> is
    group g's j-th.
    `checkpoint_root`: the absolute train.output_dir, the only place the servers checkpoint to.
    `hosts`: emulated hosts (emulated_hosts.py) the roles run on, each server bound to its host's
    address, instead of `host` on this machine. `job_key`: give every role a new job key (the
    default, on loopback too); False serves without one on loopback (off loopback: ValueError)."""
    check_arguments(ps=ps, embedding_workers=embedding_workers, trainers=trainers, max_restarts=max_restarts,
                    role_restarts=role_restarts, resume=resume, overwrite=overwrite, needs_ps=ps > 0)
    job = job or new_job_id()
    counts = {PS: ps, EMBEDDING_WORKER: embedding_workers, GROUP_PS: group_ps[0] * group_ps[1]}
    servers = [(role, f"{role.prefix}{i}", i) for role in (PS, EMBEDDING_WORKER, GROUP_PS) for i in range(counts[role])]
    names = [name for _, name, _ in servers]
    if hosts is None:
        bind, dial = {name: host for name in names}, {name: dial_host(host) for name in names}
        ports = dict(zip(names, free_ports(len(names), host)))
        rendezvous = free_ports(1, "127.0.0.1", exclude=set(ports.values()))[0]  # not a server's port
        nodes = [(TRAINERS, 1, ["--rdzv-endpoint", f"127.0.0.1:{rendezvous}"], trainers, None)]
    else:
        bind = dial = {name: hosts.address(name) for name in names}
        ports = dict(zip(names, hosts.server_ports(len(names))))
        trainer_nodes = hosts.trainer_nodes(trainers)
        nodes = [(n.name, len(trainer_nodes), hosts.rendezvous_arguments(n, trainer_nodes), n.trainers, n.host)
                 for n in trainer_nodes]
        host = hosts.addresses[0]  # off loopback: the job key is required
    addresses = {role: [f"tcp://{dial[name]}:{ports[name]}" for kind, name, _ in servers if kind is role]
                 for role in counts}
    shm_names = [ps_shm_name(job, i) for i in range(ps)]
    sets = [arg for item in overrides for arg in ("--set", item)]
    env = role_environment(host, job_key)  # the job's key for every role, never in an argv
    if hosts is not None:
        env = hosts.environment(env)
    root = ["--checkpoint-root", checkpoint_root] if checkpoint_root else []
    # the trainers send checkpoint paths under that same absolute root
    trainer_root = ["--set", f"train.output_dir={json.dumps(checkpoint_root)}"] if checkpoint_root else []
    ps_list = ",".join(addresses[PS])
    roles = [Role(name, _server_argv(role, python, config, sets, i, bind[name], ports[name], ps_list,
                                     shm_names[i] if role is PS else "", root, group_ps, trainers),
                  ready_marker=role.ready, restarts=role_restarts, startup_timeout=startup_timeout, env=env)
             for role, name, i in servers]
    again = ["--resume"] if resume else ["--overwrite"] if overwrite else []
    # every trainer of this launch runs on this machine's cores (emulated hosts share them too),
    # whatever torchrun's LOCAL_WORLD_SIZE says
    trainer_env = merged_environment(env, **{MACHINE_TRAINERS_ENV: str(trainers)})
    served = [arg for role in (PS, EMBEDDING_WORKER) for arg in (role.trainer_flag, ",".join(addresses[role]))]
    if counts[GROUP_PS]:
        served += [GROUP_PS.trainer_flag, ",".join(addresses[GROUP_PS])]
    for name, count_nodes, rendezvous, count, _ in nodes:  # one torchrun per trainer host
        roles.append(Role(name, [python, "-m", "torch.distributed.run", "--nnodes", str(count_nodes),
                                 "--nproc-per-node", str(count), "--max-restarts", str(max_restarts),
                                 "--rdzv-backend", "c10d", *rendezvous,
                                 "-m", "hybridrec.parallel.trainer", config, *sets, *trainer_root, *served,
                                 *again], main=True, env=trainer_env))
    if hosts is not None:
        where = {**{name: hosts.host_of(name) for name in names}, **{node[0]: node[-1] for node in nodes}}
        roles = [replace(role, argv=hosts.wrap(where[role.name], role.argv)) for role in roles]
    return JobPlan(job, roles, addresses[PS], addresses[EMBEDDING_WORKER], shm_names, addresses[GROUP_PS])


def prediction_server_role(bundle: str, *, host: str = "127.0.0.1", port: int | None = None,
                           options: Sequence[str] = (), restarts: int = 3, python: str = sys.executable,
                           job_key: bool = True) -> Role:
    """`hybridrec serve BUNDLE` as a server role a supervisor runs (alone, or beside a job's
    roles), on `port` (None: one free now, kept across restarts). `options`: more of `hybridrec
    serve`'s flags. With `job_key` the server gets a new job key, so every request but /health
    needs its bearer token (`python -m hybridrec.comm.auth http-token` with that key)."""
    port = free_ports(1, host)[0] if port is None else port
    argv = [python, "-m", "hybridrec.cli", PREDICTION_SERVER.command, bundle, "--host", host, "--port", str(port),
            *options]
    return Role(PREDICTION_SERVER.prefix, argv, ready_marker=PREDICTION_SERVER.ready, restarts=restarts,
                env=role_environment(host, job_key))
