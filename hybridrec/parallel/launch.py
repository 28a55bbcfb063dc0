"""`hybridrec launch`: every role of a distributed job on this machine, under one supervisor.

The roles of roles.py: N PS servers (each with its tables in named shared memory, so a restarted
server reattaches), E embedding workers (none: trainers talk to the servers directly), the group
PSs of Hierarchical Training (strategy.ht.group_ps per group), then K trainers under torchrun once
every server reported ready. Servers are restarted on the same port when they die
(`role_restarts` times each); torchrun restarts its own workers (`max_restarts`). When the job
ends, for whatever reason, every process is stopped and the job's shared memory is deleted. A
launcher killed with SIGKILL cannot do that: its roles die with it (host.die_with_parent), and
each launch first removes the shared memory of launcher jobs whose launcher process is gone
(`remove_dead_jobs_shared_memory`).

Every role gets a new job key for the job (on loopback too; `job_key=False`, the command's
`--no-job-key`, serves without one on loopback), through its environment.

On this machine the PS tier is elastic: `hybridrec scale RUN --ps N` adds or removes PS servers
while the job trains, and with strategy.ps_replicas 2 a lost PS fails over to the backups
(`scale.py`).

With `emulation` the roles run on emulated hosts instead (network namespaces behind shaped
links, `emulated_hosts.py`), which are deleted with the job.

Counts not given come from the config's `strategy.roles`. Python API: `launch(config, ps=N,
embedding_workers=E, trainers=K, ...)` returns the exit code; `roles.build_roles(...)` gives the
`Role`s without running them.
"""
from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Sequence, TextIO

from hybridrec.axes import server_roles
from hybridrec.config import ConfigError
from hybridrec.parallel.host import new_job_id, remove_dead_jobs_shared_memory, remove_shared_memory
from hybridrec.parallel.progress_relay import ProgressRelay
from hybridrec.parallel.scale import ScaleControl, SupervisedServers
from hybridrec.parallel.roles import build_roles, check_arguments, check_config, group_ps_layout, role_counts
from hybridrec.parallel.supervisor import Supervisor

if TYPE_CHECKING:
    from hybridrec.parallel.emulated_hosts import HostEmulation


def launch(config: str, *, ps: int | None = None, embedding_workers: int | None = None, trainers: int | None = None,
           overrides: Sequence[str] = (),
           host: str = "127.0.0.1", resume: bool = False, overwrite: bool = False, max_restarts: int = 0,
           role_restarts: int = 3, timeout: float | None = None, grace: float = 10.0,
           out: TextIO | None = None, emulation: "HostEmulation | None" = None, job_key: bool = True,
           ray: str | None = None) -> int:
    """Run a whole job here; the exit code: 0 done, 1 a role failed, 124 timeout, 130 interrupted.
    `emulation`: run the roles on emulated hosts (emulated_hosts.py), deleted when the job ends.
    `job_key`: a new job key for every role (False: none, on loopback only).
    `ray`: place the roles on the Ray cluster at that address instead (`--ray`, ray_launch.py;
    with `emulation`, only "auto": a Ray cluster of the emulated hosts' own, ray_emulated.py).

    Raises ConfigError / ValueError before anything starts when the arguments or config are wrong.
    """
    from hybridrec.job.tables import job_tables

    if ray is not None:
        from hybridrec.parallel.ray_launch import launch_on_cluster

        return launch_on_cluster(config, ray, emulation, host=host, out=out, ps=ps, embedding_workers=embedding_workers,
                                 trainers=trainers, overrides=overrides, resume=resume, overwrite=overwrite,
                                 max_restarts=max_restarts, role_restarts=role_restarts, timeout=timeout,
                                 job_key=job_key)

    cfg = check_config(config, overrides)
    if emulation is not None and cfg.strategy.ps_replicas > 1:  # the elastic tier runs on this machine only
        raise ConfigError(f"strategy.ps_replicas is {cfg.strategy.ps_replicas}, but a job on emulated hosts "
                          f"(--emulate-hosts) runs a fixed PS tier, neither routed nor replicated; use ps_replicas 1 "
                          f"there, or launch without --emulate-hosts")
    counts = role_counts(cfg, ps, embedding_workers, trainers)
    ps, embedding_workers, trainers = counts["ps"], counts["embedding_workers"], counts["trainers"]
    check_arguments(ps=ps, embedding_workers=embedding_workers, trainers=trainers, max_restarts=max_restarts,
                    role_restarts=role_restarts, resume=resume, overwrite=overwrite, timeout=timeout,
                    needs_ps="ps_servers" in server_roles(cfg.strategy.resolved))
    tables = list(job_tables(cfg).all_tables())
    group_ps = group_ps_layout(cfg, trainers)
    job = new_job_id()
    hosts = None
    if emulation is not None:
        from hybridrec.parallel.emulated_hosts import emulated_hosts

        hosts = emulated_hosts(job, emulation, ps=ps, embedding_workers=embedding_workers, trainers=trainers,
                               group_ps=group_ps[0] * group_ps[1], host=host)
    with hosts or contextlib.nullcontext():  # deletes the namespaces however the job ends
        plan = build_roles(config, ps=ps, embedding_workers=embedding_workers, trainers=trainers,
                           group_ps=group_ps, overrides=overrides, host=host, job=job, resume=resume,
                           overwrite=overwrite, max_restarts=max_restarts, role_restarts=role_restarts, job_key=job_key,
                           checkpoint_root=str(Path(cfg.train.output_dir).resolve()), hosts=hosts)
        elastic = ps > 0 and hosts is None  # the PS tier scales and fails over (parallel/scale.py)
        if elastic:
            ScaleControl.routed_roles(plan, cfg.strategy.ps_replicas)
        relay = ProgressRelay(out if out is not None else sys.stdout)  # the leader's progress: a bar on a terminal
        supervisor = Supervisor(plan.roles, out=out, grace=grace, writer=relay)
        supervisor.on_teardown.append(relay.close)
        supervisor.on_teardown.append(lambda: remove_shared_memory(plan.shm_names, tables))
        control = ScaleControl(cfg, plan, SupervisedServers(supervisor, plan), tables, job=plan.job) if elastic else None
        servers = "".join(f"{count} {what} ({', '.join(addresses)}), " for count, what, addresses in (
            (ps, "PS", plan.ps_addresses), (embedding_workers, "embedding worker(s)", plan.embedding_worker_addresses),
            (len(plan.group_ps_addresses), "group PS(s)", plan.group_ps_addresses)) if count)
        supervisor.log(f"job {plan.job}: {servers}{trainers} trainer(s)")
        remove_dead_jobs_shared_memory(supervisor.log)  # after the job line: tools read that one first
        if hosts is not None:
            hosts.announce(supervisor.log)
        if control is not None:
            control.start()
        try:
            code = supervisor.run(timeout)
        finally:
            if control is not None:
                control.stop()
    if code != 0:
        print(f"hybridrec launch: {supervisor.reason}", file=sys.stderr, flush=True)
    return code

