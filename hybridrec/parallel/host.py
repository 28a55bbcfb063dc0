"""Host plumbing every launcher shares: ports, job ids, the job key's environment, shared memory,
and how a role process is tied to its launcher's life.

`hybridrec launch` (launch.py, with or without emulated hosts), the Ray launcher (ray_launch.py,
ray_roles.py, ray_emulated.py) and the emulated hosts (emulated_hosts.py) all take these from
here, so none of them imports another for its plumbing.

* Ports: `free_ports` draws ports that were free a moment ago; a role keeps its port across
  restarts because the launcher picks it once.
* Job ids: `new_job_id` names a launch by the launcher's pid, start time and boot / pid-namespace
  tag, so that later `launcher_alive` can tell whether that launcher still runs (what the sweeps
  of dead jobs' shared memory and network namespaces rely on).
* The job key: `role_environment` gives every role the job's key (a new one per job, on loopback
  too, unless the launcher was told `--no-job-key`), through the environment, never an argv.
* Shared memory: the PS servers' sets are named after the job (`ps_shm_name`); a finished job's
  are removed (`remove_shared_memory`), a dead launcher's at the next launch
  (`remove_dead_jobs_shared_memory`).
* Lifetime: every role dies with its launcher (`die_with_parent`, Linux's PR_SET_PDEATHSIG, set
  between fork and exec by the supervisor, and by a trainer for torchrun's agent); a server told
  to stop leaves within a bounded time (hybridrec.ps.server.run_until_stopped).
"""
from __future__ import annotations

import hashlib
import os
import re
import secrets
import shutil
import signal
import socket
import sys
from pathlib import Path
from typing import Callable, Mapping, Sequence

PR_SET_PDEATHSIG = 1  # linux/prctl.h
LOOPBACK = "127.0.0.1"

try:  # loaded here: a child may only make a plain C call between fork and exec
    import ctypes

    _LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
except (ImportError, OSError):
    _LIBC = None


# ----------------------------------------------------------------------------- lifetime
def die_with_parent(signum: int = signal.SIGTERM, parent: int | None = None) -> None:
    """Ask the kernel to send this process `signum` when its parent dies, even by SIGKILL, when
    no teardown can run (Linux; elsewhere a no-op). Safe between fork and exec (`preexec_fn`).

    `parent`: the parent's pid as the process read it when it started. The kernel signals only a
    death that comes after the request, so a process that asks late (after slow imports) and
    whose parent is already gone (it was re-parented) sends itself `signum` at once."""
    if _LIBC is not None:
        _LIBC.prctl(PR_SET_PDEATHSIG, int(signum))
        if parent is not None and os.getppid() != parent:
            os.kill(os.getpid(), int(signum))


def proc_stat_fields(pid: int | str) -> list[str] | None:
    """Fields 3 on (state, ppid, pgrp, ...) of /proc/<pid>/stat, or None when it cannot be read.
    The command name (field 2) is cut off by its last ")", since it may hold spaces."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError):
        return None
    return stat[stat.rfind(")") + 2:].split()


# -------------------------------------------------------------------------------- ports
def free_ports(count: int, host: str = LOOPBACK, exclude=()) -> list[int]:
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


def dial_host(bind: str) -> str:
    """The address clients dial for a server bound to `bind` (a wildcard bind: loopback)."""
    return LOOPBACK if bind in ("0.0.0.0", "") else bind


# ------------------------------------------------------------------------------ job key
def role_environment(host: str, job_key: bool = True) -> dict[str, str] | None:
    """The environment of every role of one job whose servers bind `host`: this process's with the
    job key in HYBRIDREC_AUTH_KEY: the one this environment configures (HYBRIDREC_AUTH_KEY or
    HYBRIDREC_AUTH_KEY_FILE: so its owner can reach the job's servers too), else a new one, so each
    job has its own, as Redis's protected mode keeps a server closed until it is configured. With
    `job_key=False` on loopback, None: the roles inherit ours (and serve without a key unless it
    configures one). Off loopback a key is required: ValueError."""
    from hybridrec.comm.auth import AUTH_KEY_ENV, AUTH_KEY_FILE_ENV, JobKey, is_loopback, key_from_environment

    if not job_key:
        if not is_loopback(host):
            raise ValueError(f"--no-job-key: the servers bind {host}, off loopback, where every server needs the "
                             "job key; leave --no-job-key out")
        return None
    environment = {name: value for name, value in os.environ.items() if name != AUTH_KEY_FILE_ENV}
    environment[AUTH_KEY_ENV] = (key_from_environment() or JobKey.new()).secret
    return environment


# -------------------------------------------------------------------------------- job ids
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


def launcher_alive(job: str) -> bool | None:
    """Whether the launcher of `job` is still running: None when that cannot be told here (a job
    id without pid and start time, or one from another boot, pid namespace or machine)."""
    match = re.fullmatch(JOB_ID, job)
    if match is None or match["tag"] != _namespace_tag():
        return None
    return _process_start(int(match["pid"])) == match["start"]  # same pid, other start: pid reused


# ------------------------------------------------------------------------- shared memory
def ps_shm_name(job: str, index: int) -> str:
    return f"hybridrec-{job}-ps{index}"


# What a launcher's PS servers create under shm_root(): shm_path(ps_shm_name(job, i)) and
# shm_path(table_shm_name(ps_shm_name(job, i), table)), i.e. "hybridrec-" + ps_shm_name + ".<table>".
_JOB_SET = re.compile(rf"hybridrec-hybridrec-(?P<job>{JOB_ID})-ps[0-9]+(?:\..+)?")


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


def merged_environment(env: Mapping[str, str] | None, **extra: str) -> dict[str, str]:
    """`env` (None: this process's) with `extra` set."""
    merged = dict(os.environ if env is None else env)
    merged.update(extra)
    return merged
