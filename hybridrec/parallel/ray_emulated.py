"""A Ray cluster across emulated hosts: `hybridrec launch CONFIG --ray auto --emulate-hosts N
--bandwidth RATE` runs the job on a real multi-node Ray cluster whose nodes are this machine's
network namespaces (hybridrec.parallel.emulated_hosts), so every byte between roles Ray placed
on different nodes crosses a shaped link.

For one job it builds the emulated hosts, starts a Ray head node in host 0 and a worker node in
each other host (`ray start --block`, each bound to its host's address, with its own temp dir
and a fresh cluster token: Ray's token authentication is on, since the nodes listen off
loopback), then runs the Ray launcher (`hybridrec launch --ray <head>`, hybridrec.parallel.
ray_launch) inside host 0 as the driver. When the driver ends, however it ends, every Ray
process dies with the namespaces (emulated_hosts deletes them after killing what runs inside)
and the temp dirs are removed.
"""
from __future__ import annotations

import math
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Sequence

HEAD_PORT = 6379
NODE_START_SECONDS = 180.0  # a loaded machine takes a while to bring up a Ray node
STARTED_MARKER = "Ray runtime started"


class RayNodeFailed(RuntimeError):
    """A Ray node of the emulated cluster did not come up; names the host and Ray's last output."""


def ray_environment(token: str) -> dict[str, str]:
    """Every Ray process of the cluster: token authentication with this cluster's token, and
    workers at normal priority (Ray would run them at nice 15, below every other process)."""
    env = dict(os.environ)
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token, RAY_worker_niceness="0", RAY_USAGE_STATS_ENABLED="0")
    return env


def node_cpus(demand_cpus: float, hosts: int) -> int:
    """Logical CPUs each node offers: the job's demand spread over the hosts, plus one spare."""
    return max(1, math.ceil(demand_cpus / hosts)) + 1


def _start_node(hosts, index: int, argv: Sequence[str], env: dict, log: Path) -> subprocess.Popen:
    return subprocess.Popen(hosts.wrap(index, argv), env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def _wait_started(process: subprocess.Popen, log: Path, host: int, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace") if log.exists() else ""
        if STARTED_MARKER in text:
            return
        if process.poll() is not None:
            break
        time.sleep(0.5)
    tail = (log.read_text(errors="replace") if log.exists() else "")[-2000:]
    raise RayNodeFailed(f"the Ray node on emulated host h{host} did not start within {seconds:g} s; its output:\n{tail}")


def _node(hosts, index: int, argv: Sequence[str], env: dict, root: Path, attempts: int = 2) -> subprocess.Popen:
    """One started Ray node on host `index`. Ray gives a raylet 30 s to register, which a loaded
    machine can miss: a node that fails so is killed (its process group) and started again."""
    for attempt in range(attempts):
        log = root / f"ray-h{index}-{attempt}.log"
        process = _start_node(hosts, index, [*argv, "--temp-dir", str(root / f"h{index}-{attempt}")], env, log)
        try:
            _wait_started(process, log, index, NODE_START_SECONDS)
            return process
        except RayNodeFailed:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait()
            if attempt + 1 == attempts:
                raise
    raise AssertionError("unreachable")


def start_cluster(hosts, cpus: int, root: Path, env: dict, nodes: list[subprocess.Popen]) -> str:
    """A Ray head on host 0 and a worker node on each other host, started one after the other (so
    they do not compete for the cores while they register), appended to `nodes`; the head's
    address."""
    ray = [sys.executable, "-m", "ray.scripts.scripts", "start", "--block", "--disable-usage-stats",
           "--num-cpus", str(cpus)]
    head = f"{hosts.addresses[0]}:{HEAD_PORT}"
    nodes.append(_node(hosts, 0, [*ray, "--head", "--port", str(HEAD_PORT), "--include-dashboard", "false",
                                  "--node-ip-address", hosts.addresses[0]], env, root))
    for i in range(1, len(hosts.addresses)):
        nodes.append(_node(hosts, i, [*ray, "--address", head, "--node-ip-address", hosts.addresses[i]], env, root))
    return head


def driver_arguments(config: str, head: str, job: dict) -> list[str]:
    """The `hybridrec launch --ray HEAD` command the driver runs inside host 0, for `job`
    (`launch_on_emulated_cluster`'s keyword arguments)."""
    argv = [sys.executable, "-m", "hybridrec.cli", "launch", config, "--ray", head,
            "--max-restarts", str(job["max_restarts"]), "--role-restarts", str(job["role_restarts"])]
    for flag, value in (("--ps", job["ps"]), ("--embedding-workers", job["embedding_workers"]),
                        ("--trainers", job["trainers"]), ("--timeout", job["timeout"])):
        if value is not None:
            argv += [flag, str(value)]
    argv += [arg for item in job["overrides"] for arg in ("--set", item)]
    argv += ["--resume"] if job["resume"] else ["--overwrite"] if job["overwrite"] else []
    return argv


def _forward(stream, out) -> None:
    for line in iter(stream.readline, ""):
        out.write(line)
        out.flush()


def launch_on_emulated_cluster(config: str, emulation, *, ps: int | None = None,
                               embedding_workers: int | None = None, trainers: int | None = None,
                               overrides: Sequence[str] = (), resume: bool = False, overwrite: bool = False,
                               max_restarts: int = 0, role_restarts: int = 3, timeout: float | None = None,
                               job_key: bool = True, out=None) -> int:
    """Run the job (`hybridrec launch`'s arguments) on a Ray cluster across the emulated hosts
    `emulation` (a HostEmulation) asks for; the driver's exit code (1 when the cluster did not
    come up). ValueError before anything starts for what does not apply here."""
    from hybridrec.parallel.emulated_hosts import EmulatedHosts, check_support
    from hybridrec.parallel.host import new_job_id
    from hybridrec.parallel.roles import check_config, group_ps_layout, job_demand, role_counts

    out = out or sys.stdout
    if emulation.place:
        raise ValueError("--place does not apply with --ray: Ray places the roles on the emulated hosts' nodes")
    if not job_key:
        raise ValueError("--no-job-key: the roles on emulated hosts serve off loopback, where every server needs the "
                         "job key; leave --no-job-key out")
    cfg = check_config(config, overrides)
    counts = role_counts(cfg, ps, embedding_workers, trainers)
    groups, per_group = group_ps_layout(cfg, counts["trainers"])
    counts["group_ps"] = groups * per_group
    check_support()
    cpus = node_cpus(job_demand(cfg.strategy.resources, counts).get("CPU", 0.0), emulation.hosts)
    env = ray_environment(secrets.token_hex(32))
    root = Path(tempfile.mkdtemp(prefix="hybridrec-ray-"))
    nodes: list[subprocess.Popen] = []
    try:
        with EmulatedHosts(new_job_id(), emulation, {}) as hosts:
            out.write(f"[launch] emulated hosts: {hosts.describe()}; Ray nodes with {cpus} logical CPUs each\n")
            try:
                head = start_cluster(hosts, cpus, root, env, nodes)
            except RayNodeFailed as error:
                print(f"hybridrec launch: {error}", file=sys.stderr, flush=True)
                return 1
            out.write(f"[launch] Ray cluster of {len(nodes)} nodes, head at {head}\n")
            job = {"ps": ps, "embedding_workers": embedding_workers, "trainers": trainers, "overrides": list(overrides),
                   "resume": resume, "overwrite": overwrite, "max_restarts": max_restarts,
                   "role_restarts": role_restarts, "timeout": timeout}
            driver = subprocess.Popen(hosts.wrap(0, driver_arguments(config, head, job)), env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True)
            forward = threading.Thread(target=_forward, args=(driver.stdout, out), daemon=True)
            forward.start()
            try:
                code = driver.wait()
            except KeyboardInterrupt:
                driver.terminate()
                code = driver.wait()
            forward.join(5)
            return code
    finally:
        for node in nodes:  # the namespaces' deletion killed them; reap
            if node.poll() is None:
                node.kill()
            node.wait()
        shutil.rmtree(root, ignore_errors=True)
