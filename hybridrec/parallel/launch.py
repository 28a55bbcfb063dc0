"""`hybridrec launch`: every role of a distributed job on this machine, under one supervisor.

N PS servers (each with its tables in named shared memory, so a restarted server reattaches),
E embedding workers (none: trainers talk to the servers directly), then K trainers under
torchrun once every server and embedding worker
reported ready. PS servers and embedding workers are restarted on the same port when they die
(`role_restarts` times each); torchrun restarts its own workers (`max_restarts`). When the job
ends, for whatever reason, every process is stopped and the job's shared memory is deleted. A
launcher killed with SIGKILL cannot do that, so each launch first removes the shared memory of
launcher jobs whose launcher process is gone (`remove_dead_jobs_shared_memory`).

With `emulation` the roles run on emulated hosts instead (network namespaces behind shaped
links, `emulated_hosts.py`), which are deleted with the job.

Counts not given come from the config's `strategy.roles`. Python API: `launch(config, ps=N,
embedding_workers=E, trainers=K, ...)` returns the exit code; `build_roles(...)` gives the
`Role`s without running them.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import shutil
import socket
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence, TextIO

from hybridrec.axes import server_roles
from hybridrec.comm.auth import launcher_environment
from hybridrec.config import ConfigError, JobConfig, load_config
from hybridrec.parallel.supervisor import Role, Supervisor, proc_stat_fields

if TYPE_CHECKING:
    from hybridrec.parallel.emulated_hosts import EmulatedHosts, HostEmulation

PS_READY = "hybridrec-ps listening on "
EMBEDDING_WORKER_READY = "hybridrec-embedding-worker listening on "


def free_ports(count: int, host: str = "127.0.0.1", exclude=()) -> list[int]:
    """`count` distinct ports that were free a moment ago (all bound at once, then released), none
    of them in `exclude`: ports drawn earlier are released too, and the kernel may hand them out
    again."""
    sockets, ports = [], []
    try:
        while len(ports) < count:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(s)
            s.bind((host, 0))
            if s.getsockname()[1] not in exclude:  # an excluded port stays bound, so it is not drawn again
                ports.append(s.getsockname()[1])
        return ports
    finally:
        for s in sockets:
            s.close()


def _process_start(pid: int) -> str | None:
    """Start time of a live process (field 22 of /proc/<pid>/stat, clock ticks after boot);
    None when there is no such process, or only its zombie."""
    fields = proc_stat_fields(pid)
    if fields is None or len(fields) < 20 or fields[0] in ("Z", "X"):
        return None
    return fields[19]


def _namespace_tag() -> str | None:
    """Names this kernel boot and pid namespace: pids and start times only mean something within
    both. (A shared-memory directory can be seen from other pid namespaces, e.g. containers of one
    pod, or from other machines when HYBRIDREC_SHM_DIR is on a shared file system.)"""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        return None
    return hashlib.sha1(f"{boot} {namespace}".encode()).hexdigest()[:6]


# <launcher pid>-<its start time>-<namespace tag>-<random>: enough to tell, later, whether the
# launcher of a job is still running. Without /proc the id is <pid>-<random>, which no sweep matches.
JOB_ID = r"(?P<pid>[0-9]+)-(?P<start>[0-9]+)-(?P<tag>[0-9a-f]{6})-[0-9a-f]{6}"


def new_job_id() -> str:
    """Unique per launch; names the job's shared memory and says which process launched it."""
    pid, token = os.getpid(), secrets.token_hex(3)
    start, tag = _process_start(pid), _namespace_tag()
    if start is None or tag is None:
        return f"{pid}-{token}"
    return f"{pid}-{start}-{tag}-{token}"


def ps_shm_name(job: str, index: int) -> str:
    return f"hybridrec-{job}-ps{index}"


# What a launcher's PS servers create under shm_root(): shm_path(ps_shm_name(job, i)) and
# shm_path(table_shm_name(ps_shm_name(job, i), table)), i.e. "hybridrec-" + ps_shm_name + ".<table>".
_JOB_SET = re.compile(rf"hybridrec-hybridrec-(?P<job>{JOB_ID})-ps[0-9]+(?:\..+)?")


def launcher_alive(job: str) -> bool | None:
    """Whether the launcher of `job` is still running: None when that cannot be told here (a job
    id without pid and start time, or one from another boot, pid namespace or machine)."""
    match = re.fullmatch(JOB_ID, job)
    if match is None or match["tag"] != _namespace_tag():
        return None
    return _process_start(int(match["pid"])) == match["start"]  # same pid, other start: pid reused


def remove_dead_jobs_shared_memory(log: Callable[[str], None] | None = None) -> list[tuple[str, Path]]:
    """Delete the shared memory left by launcher jobs whose launcher is gone (killed with SIGKILL,
    so it could not clean up). Only directories named as a launcher names them, with a job id this
    machine can judge, are looked at; a live launcher's sets and every other name are left alone.
    One listing of shm_root() and one /proc read per job; logs one line per removed set through
    `log` and nothing when there is nothing to remove. Returns (job, path) of each removed set."""
    from hybridrec.embedding.memory import shm_root

    root, verdicts, removed = shm_root(), {}, []
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except OSError:
        return removed
    for entry in entries:
        match = _JOB_SET.fullmatch(entry.name)
        if match is None:
            continue
        job = match["job"]
        if job not in verdicts:
            verdicts[job] = launcher_alive(job)
        try:
            is_set = entry.is_dir(follow_symlinks=False)
        except OSError:
            continue
        if verdicts[job] is not False or not is_set:
            continue
        path = Path(entry.path)
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            removed.append((job, path))
            if log is not None:
                log(f"removed shared memory of dead job {job}: {path}")
    return removed


@dataclass(frozen=True)
class JobPlan:
    """What `build_roles` decided: the roles, the addresses and the shared-memory prefixes."""

    job: str
    roles: list[Role]
    ps_addresses: list[str]
    embedding_worker_addresses: list[str]
    shm_names: list[str]


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


def check_config(config: str, overrides: Sequence[str] = ()) -> JobConfig:
    """Load the job config and make sure it describes a distributed job."""
    cfg = load_config(config, list(overrides))
    if not cfg.strategy.distributed:
        raise ConfigError(
            f"{config}: strategy.placement is 'local'; `hybridrec launch` runs distributed jobs (PS servers, "
            f"embedding workers, trainers). Add `--set strategy.preset=persia`, set `strategy: {{preset: persia}}` "
            f"in the config, or run `hybridrec train {config}` for one process")
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


def command_line(config: str, counts: dict[str, int], overrides: Sequence[str] = ()) -> str:
    """The `hybridrec launch` command that runs this job with these counts."""
    sets = "".join(f" --set {item}" for item in overrides)
    servers = f"--ps {counts['ps']} --embedding-workers {counts['embedding_workers']} " if counts["ps"] else ""
    return f"hybridrec launch {config} {servers}--trainers {counts['trainers']}{sets}"


def build_roles(config: str, *, ps: int, embedding_workers: int, trainers: int,
                overrides: Sequence[str] = (), host: str = "127.0.0.1", job: str | None = None,
                resume: bool = False, overwrite: bool = False, max_restarts: int = 0,
                role_restarts: int = 3, startup_timeout: float = 180.0,
                python: str = sys.executable, checkpoint_root: str | None = None,
                hosts: "EmulatedHosts | None" = None) -> JobPlan:
    """The roles of one job, with ports picked now so a restarted role keeps its address.
    `checkpoint_root`: the absolute train.output_dir, the only place the servers checkpoint to.
    `hosts`: emulated hosts (emulated_hosts.py) the roles run on, each server bound to its host's
    address, instead of `host` on this machine."""
    check_arguments(ps=ps, embedding_workers=embedding_workers, trainers=trainers, max_restarts=max_restarts,
                    role_restarts=role_restarts, resume=resume, overwrite=overwrite, needs_ps=ps > 0)
    job = job or new_job_id()
    servers = [f"ps{i}" for i in range(ps)] + [f"ew{e}" for e in range(embedding_workers)]
    if hosts is None:
        connect_host = "127.0.0.1" if host in ("0.0.0.0", "") else host  # what clients dial
        bind, dial = {name: host for name in servers}, {name: connect_host for name in servers}
        ports = dict(zip(servers, free_ports(len(servers), host)))
        rendezvous = free_ports(1, "127.0.0.1", exclude=set(ports.values()))[0]  # not a server's port
        nodes = [("nn", 1, ["--rdzv-endpoint", f"127.0.0.1:{rendezvous}"], trainers, None)]
    else:
        bind = dial = {name: hosts.address(name) for name in servers}
        ports = dict(zip(servers, hosts.server_ports(len(servers))))
        trainer_nodes = hosts.trainer_nodes(trainers)
        nodes = [(n.name, len(trainer_nodes), hosts.rendezvous_arguments(n, trainer_nodes), n.trainers, n.host)
                 for n in trainer_nodes]
        host = hosts.addresses[0]  # off loopback: the launcher makes a job key
    ps_ports, ew_ports = [ports[f"ps{i}"] for i in range(ps)], [ports[f"ew{e}"] for e in range(embedding_workers)]
    ps_addresses = [f"tcp://{dial[f'ps{i}']}:{p}" for i, p in enumerate(ps_ports)]
    ew_addresses = [f"tcp://{dial[f'ew{e}']}:{p}" for e, p in enumerate(ew_ports)]
    shm_names = [ps_shm_name(job, i) for i in range(ps)]
    sets = [arg for item in overrides for arg in ("--set", item)]
    env = launcher_environment(host)  # off loopback: the job's new key for every role, never in an argv
    if hosts is not None:
        env = hosts.environment(env)
    root = ["--checkpoint-root", checkpoint_root] if checkpoint_root else []
    # the trainers send checkpoint paths under that same absolute root
    trainer_root = ["--set", f"train.output_dir={json.dumps(checkpoint_root)}"] if checkpoint_root else []
    roles = [Role(f"ps{i}", [python, "-m", "hybridrec.cli", "serve-ps", "--config", config, *sets,
                             "--host", bind[f"ps{i}"], "--port", str(port), "--shm-name", shm_names[i], *root],
                  ready_marker=PS_READY, restarts=role_restarts, startup_timeout=startup_timeout, env=env)
             for i, port in enumerate(ps_ports)]
    roles += [Role(f"ew{e}", [python, "-m", "hybridrec.cli", "embedding-worker", config, *sets, "--rank", str(e),
                              "--ps", ",".join(ps_addresses), "--host", bind[f"ew{e}"], "--port", str(port)],
                   ready_marker=EMBEDDING_WORKER_READY, restarts=role_restarts, startup_timeout=startup_timeout,
                   env=env)
              for e, port in enumerate(ew_ports)]
    again = ["--resume"] if resume else ["--overwrite"] if overwrite else []
    for name, count_nodes, rendezvous, count, _ in nodes:  # one torchrun per trainer host
        roles.append(Role(name, [python, "-m", "torch.distributed.run", "--nnodes", str(count_nodes),
                                 "--nproc-per-node", str(count), "--max-restarts", str(max_restarts),
                                 "--rdzv-backend", "c10d", *rendezvous,
                                 "-m", "hybridrec.parallel.trainer", config, *sets, *trainer_root,
                                 "--ps", ",".join(ps_addresses), "--embedding-workers", ",".join(ew_addresses),
                                 *again], main=True, env=env))
    if hosts is not None:
        where = {**{name: hosts.host_of(name) for name in servers}, **{node[0]: node[-1] for node in nodes}}
        roles = [replace(role, argv=hosts.wrap(where[role.name], role.argv)) for role in roles]
    return JobPlan(job, roles, ps_addresses, ew_addresses, shm_names)


def remove_shared_memory(shm_names: Sequence[str], tables: Sequence[str]) -> list[str]:
    """Delete each table of each PS prefix, then anything else left under those prefixes
    (the prefixes hold a per-launch job id, so nothing else can match). Returns what was removed."""
    from hybridrec.embedding.memory import shm_path, unlink_shared
    from hybridrec.ps.server import table_shm_name

    removed = []
    for prefix in shm_names:
        for table in tables:
            try:
                if unlink_shared(table_shm_name(prefix, table)):
                    removed.append(table_shm_name(prefix, table))
            except ValueError:  # a table name the shm naming does not accept: the sweep below finds it
                pass
        base = shm_path(prefix)
        for leftover in sorted(base.parent.glob(f"{base.name}.*")) + ([base] if base.exists() else []):
            shutil.rmtree(leftover, ignore_errors=True)
            removed.append(leftover.name)
    return removed


def launch(config: str, *, ps: int | None = None, embedding_workers: int | None = None, trainers: int | None = None,
           overrides: Sequence[str] = (),
           host: str = "127.0.0.1", resume: bool = False, overwrite: bool = False, max_restarts: int = 0,
           role_restarts: int = 3, timeout: float | None = None, grace: float = 10.0,
           out: TextIO | None = None, emulation: "HostEmulation | None" = None) -> int:
    """Run a whole job here; the exit code: 0 done, 1 a role failed, 124 timeout, 130 interrupted.
    `emulation`: run the roles on emulated hosts (emulated_hosts.py), deleted when the job ends.

    Raises ConfigError / ValueError before anything starts when the arguments or config are wrong.
    """
    from hybridrec.job.tables import job_tables

    cfg = check_config(config, overrides)
    counts = role_counts(cfg, ps, embedding_workers, trainers)
    ps, embedding_workers, trainers = counts["ps"], counts["embedding_workers"], counts["trainers"]
    check_arguments(ps=ps, embedding_workers=embedding_workers, trainers=trainers, max_restarts=max_restarts,
                    role_restarts=role_restarts, resume=resume, overwrite=overwrite, timeout=timeout,
                    needs_ps="ps_servers" in server_roles(cfg.strategy.resolved))
    tables = list(job_tables(cfg).all_tables())
    job = new_job_id()
    hosts = None
    if emulation is not None:
        from hybridrec.parallel.emulated_hosts import emulated_hosts

        hosts = emulated_hosts(job, emulation, ps=ps, embedding_workers=embedding_workers, trainers=trainers,
                               host=host)
    with hosts or contextlib.nullcontext():  # deletes the namespaces however the job ends
        plan = build_roles(config, ps=ps, embedding_workers=embedding_workers, trainers=trainers,
                           overrides=overrides, host=host, job=job, resume=resume, overwrite=overwrite,
                           max_restarts=max_restarts, role_restarts=role_restarts,
                           checkpoint_root=str(Path(cfg.train.output_dir).resolve()), hosts=hosts)
        supervisor = Supervisor(plan.roles, out=out, grace=grace)
        supervisor.on_teardown.append(lambda: remove_shared_memory(plan.shm_names, tables))
        servers = "".join(f"{count} {what} ({', '.join(addresses)}), " for count, what, addresses in (
            (ps, "PS", plan.ps_addresses), (embedding_workers, "embedding worker(s)", plan.embedding_worker_addresses))
            if count)
        supervisor.log(f"job {plan.job}: {servers}{trainers} trainer(s)")
        remove_dead_jobs_shared_memory(supervisor.log)  # after the job line: tools read that one first
        if hosts is not None:
            hosts.announce(supervisor.log)
        code = supervisor.run(timeout)
    if code != 0:
        print(f"hybridrec launch: {supervisor.reason}", file=sys.stderr, flush=True)
    return code
