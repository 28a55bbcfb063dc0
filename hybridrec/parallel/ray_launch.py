"""`hybridrec launch CONFIG --ray ADDRESS`: every role of a distributed job placed on a Ray cluster.

The roles are the ones `hybridrec launch` builds (`roles.build_roles`), each run inside a Ray
actor (`ray_roles.py`) instead of a child process:

* Server roles (PS servers, embedding workers, group PSs) are actors pinned to a node (node
  affinity, not soft), each
  on a port picked on that node, with `max_restarts = role_restarts`. Ray restarts one that
  dies on the same node, where it binds the same port and a PS reattaches to its tables in
  named shared memory, so it comes back with every update it acknowledged. With
  `strategy.ps_replicas: 2` a PS that cannot come back (no restart left, or its node lost: a
  restart not placed within the start-up bound) is failed over instead: its buckets' backups
  serve them, a new PS actor takes its place where one can start, and the job goes on.
* The trainers are one torch.distributed group of actors: rank 0's node address and a port
  free there become MASTER_ADDR / MASTER_PORT, each actor calls the trainer entry point
  (`hybridrec.parallel.trainer.main`, which joins the group with gloo, or NCCL on GPUs, and
  runs the one training loop). A failed group is started again, as torchrun does, at most
  `max_restarts` times; it resumes from the newest checkpoint.
* Each role asks Ray for `strategy.resources.<role>` (cpus, gpus, memory_gb).
* Every line a role prints reaches this process through Ray's log forwarding and is shown as
  `[ps0] line`, `[ew0] line`, `[nn] line`; the launcher's own lines are `[launch] ...`.
* The end of training, a role that died more often than its restarts, Ctrl-C / SIGTERM or
  `timeout` kill every actor of the job; then a helper actor on each PS node deletes the job's
  shared memory there. Exit codes are `hybridrec launch`'s (0, 1, 124, 130; bad arguments raise
  ValueError, which the command line turns into 2).

`ADDRESS` is a Ray cluster's address (`HOST:6379`) or `auto`: attach to the Ray
instance running on this machine, or start one whose logical CPUs cover the job's request.
On a one-node cluster roles bind loopback; on several nodes they bind their node's address.
Either way they authenticate with a job key made per job (unless `--no-job-key`, on a one-node
cluster only), which each actor receives as an argument and puts in its own environment
(HYBRIDREC_AUTH_KEY), never on a command line.
"""
from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence, TextIO

from hybridrec.axes import server_roles
from hybridrec.comm.auth import AUTH_KEY_ENV
from hybridrec.parallel.host import new_job_id, remove_dead_jobs_shared_memory, role_environment
from hybridrec.parallel.ray_roles import NodeAgent, ServiceHost, TrainerHost, flag_value
from hybridrec.parallel.roles import (PS, TRAINERS, JobPlan, build_roles, check_arguments, check_config, demand_of,
                                      group_ps_layout, job_demand, role_counts, role_options, server_role)
from hybridrec.parallel.supervisor import FAILED, INTERRUPTED, OK, TIMED_OUT

NAMESPACE = "hybridrec"
LOG_DRAIN_SECONDS = 1.0  # after the trainers finish: time for their last lines to be forwarded
POLL_SECONDS = 0.2


@dataclass
class _Service:
    name: str
    argv: list[str]
    node: str
    options: dict
    actor: Any = None
    call: Any = None          # the outstanding `watch` (serving) or `pid` (restarting) call
    restarting: bool = False
    ask_at: float = 0.0       # restarting: when to ask again whether it is back
    deaths: int = 0
    pid: int | None = None    # its process, once it serves (a new one after a restart)
    died_at: float = 0.0      # restarting: when it died
    retired: bool = False     # stopped for good by `hybridrec scale` (its death is no failure)


def _import_ray():
    try:
        import ray
    except ImportError:
        raise ValueError("--ray needs the ray package, which is not installed: pip install 'hybridrec[ray]'") from None
    return ray


def connect(address: str, demand: dict[str, float]) -> bool:
    """Attach to the Ray cluster at `address` (`auto`: the one on this machine, else a new local
    instance with enough logical CPUs for `demand`). True when this call started Ray."""
    ray = _import_ray()
    import logging

    if ray.is_initialized():
        return False
    quiet = {"logging_level": logging.WARNING, "log_to_driver": True, "namespace": NAMESPACE}
    if address != "auto":
        try:
            ray.init(address=address, **quiet)
        except (ConnectionError, ValueError, RuntimeError) as error:
            raise ValueError(f"--ray {address}: no Ray cluster could be reached there ({error}); give the "
                             f"address `ray start --head` printed, or `auto`") from None
        return False
    try:
        ray.init(address="auto", **quiet)
        return False
    except ConnectionError:
        pass
    # as many logical CPUs as the job asks for (like `hybridrec launch`, reserve no core), and the
    # roles at normal priority: Ray runs workers at nice 15, below every other process here
    cpus = max(os.cpu_count() or 1, math.ceil(demand.get("CPU", 0)))
    try:
        ray.init(num_cpus=cpus, include_dashboard=False, _system_config={"worker_niceness": 0}, **quiet)
    except Exception as error:  # Ray's own processes did not come up (an overloaded machine, say)
        raise RayUnavailable(f"--ray auto: no Ray instance runs here and a new one did not start: {error}") from None
    return True


class RayUnavailable(RuntimeError):
    """Ray could not be started: the job fails (exit code 1), the arguments were fine."""


def _alive_nodes() -> list[dict]:
    import ray

    return sorted((n for n in ray.nodes() if n.get("Alive")), key=lambda n: n["NodeID"])


def place_services(nodes: list[dict], wanted: list[tuple[str, dict]]) -> list[str]:
    """A node id for each (name, options) service, round-robin over the nodes it fits on,
    counting what the earlier services took. ValueError names the role that fits nowhere."""
    free = {n["NodeID"]: dict(n.get("Resources", {})) for n in nodes}
    order = [n["NodeID"] for n in nodes]
    chosen, turn = [], 0
    for name, options in wanted:
        need = demand_of(options)
        for step in range(len(order)):
            node = order[(turn + step) % len(order)]
            if all(free[node].get(r, 0) >= v for r, v in need.items()):
                for r, v in need.items():
                    free[node][r] -= v
                chosen.append(node)
                turn = (turn + step + 1) % len(order)
                break
        else:
            raise ValueError(f"strategy.resources.{server_role(name).resources}: {name} asks Ray for {need}, which no node of the "
                             f"cluster has left ({len(order)} node(s)); lower the request or add nodes")
    return chosen


def _check_total(nodes: list[dict], demand: dict[str, float]) -> None:
    total: dict[str, float] = {}
    for node in nodes:
        for resource, amount in node.get("Resources", {}).items():
            total[resource] = total.get(resource, 0) + amount
    for resource, amount in demand.items():
        if total.get(resource, 0) < amount:
            key, unit, scale = {"CPU": ("cpus", " CPU", 1), "GPU": ("gpus", " GPU", 1),
                                "memory": ("memory_gb", " GiB of memory", 2**30)}[resource]
            raise ValueError(f"strategy.resources: the job asks Ray for {amount / scale:g}{unit} in all, the "
                             f"cluster has {total.get(resource, 0) / scale:g}; lower strategy.resources.<role>.{key} "
                             f"or add nodes")


def _with(argv: Sequence[str], **values: str) -> list[str]:
    """argv with the value after each --flag replaced (flag names with _ for -)."""
    argv = list(argv)
    for name, value in values.items():
        argv[argv.index("--" + name.replace("_", "-")) + 1] = value
    return argv


def _cli_argv(role_argv: Sequence[str]) -> list[str]:
    """A service role's `python -m hybridrec.cli ARGS`: ARGS."""
    return list(role_argv)[list(role_argv).index("hybridrec.cli") + 1:]


def _trainer_argv(role_argv: Sequence[str]) -> list[str]:
    """The trainer role's `torchrun ... -m hybridrec.parallel.trainer ARGS`: ARGS."""
    return list(role_argv)[list(role_argv).index("hybridrec.parallel.trainer") + 1:]


class RayLauncher:
    """One job on a Ray cluster, from placement to teardown (see the module docstring)."""

    def __init__(self, plan: JobPlan, cfg, tables: list[str], demand: dict[str, float], *, trainers: int,
                 max_restarts: int, role_restarts: int, grace: float, out: TextIO | None, started_ray: bool,
                 startup_timeout: float = 180.0, job_key: bool = True):
        import ray

        self.ray = ray
        self.plan, self.tables, self.trainers = plan, tables, trainers
        self.max_restarts, self.role_restarts, self.grace = max_restarts, role_restarts, grace
        self.out = out if out is not None else sys.stdout
        self.started_ray, self.startup_timeout = started_ray, startup_timeout
        self.resources, self.demand = cfg.strategy.resources, demand
        self.reason = ""
        self.services: list[_Service] = []
        self.trainer_actors: list[Any] = []
        self.shm_nodes: dict[str, list[str]] = {}
        self.agents: dict[str, Any] = {}
        self.ps_addresses: list[str] = []
        self.server_addresses: dict = {}  # ServerRole -> its addresses, as placed
        self.job_key = job_key
        self.cfg, self.control = cfg, None  # the elastic PS tier (`hybridrec scale`), once the servers serve
        self._lock = threading.Lock()
        self._signal: int | None = None
        self._key: str | None = None
        self._loopback = True
        self._cwd = os.getcwd()

    # ------------------------------------------------------------------ output
    def emit(self, name: str, line: str) -> None:
        with self._lock:
            try:
                self.out.write(f"[{name}] {line}\n")
                self.out.flush()
            except (ValueError, OSError):
                pass

    def log(self, line: str) -> None:
        self.emit("launch", line)

    def _forward(self, data: dict) -> None:
        """Ray's batch of one worker's output lines, each shown with its role's prefix."""
        name = data.get("actor_name") or ""
        lines = data.get("lines") or []
        if data.get("pid") == "autoscaler":
            try:
                from ray._private.worker import filter_autoscaler_events
                lines = list(filter_autoscaler_events(lines))
            except ImportError:
                pass
        roles = {s.name for s in self.services} | {TRAINERS}
        source = "" if name in roles else f"({data.get('task_name') or name or 'worker'} pid={data.get('pid')}) "
        for line in lines:
            self.emit(name if name in roles else "ray", source + line)

    def _route_logs(self) -> Callable[[], None]:
        """Show forwarded worker output with role prefixes instead of Ray's `(name pid=N)`; returns
        the undo. Ray keeps its handlers in a private dispatcher: when that is not there, or this
        driver does not forward logs, Ray's own printing stays (prefixed with the role's name too)."""
        try:
            from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
        except ImportError:
            return lambda: None
        with dispatcher._lock:
            saved = list(dispatcher.handlers)
        if not any(name == "ray_print_logs" for name, _ in saved):
            return lambda: None
        dispatcher.remove_handler("ray_print_logs")
        dispatcher.add_handler("hybridrec_roles", self._forward)

        def undo() -> None:
            dispatcher.remove_handler("hybridrec_roles")
            with dispatcher._lock:
                dispatcher.handlers = saved
        return undo

    # ------------------------------------------------------------------ placement
    def _plan_services(self, deadline: float | None) -> None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        ray, plan = self.ray, self.plan
        nodes = _alive_nodes()
        self._loopback = len(nodes) == 1
        services = [r for r in plan.roles if not r.main]
        wanted = [(r.name, role_options(getattr(self.resources, server_role(r.name).resources))) for r in services]
        _check_total(nodes, self.demand)
        chosen = place_services(nodes, wanted)
        per_node: dict[str, int] = {}
        for node in chosen:
            per_node[node] = per_node.get(node, 0) + 1
        agent = ray.remote(NodeAgent)
        self.agents = {node: agent.options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(
            node, soft=False)).remote() for node in per_node}
        endpoints = {node: self.agents[node].endpoint.remote(count, self._loopback)
                     for node, count in per_node.items()}
        endpoints = {node: self._await(ref, deadline, "the node agent") for node, ref in endpoints.items()}
        # the servers' host decides whether the job needs its key; a job of trainers alone
        # (PICASSO's or DES's tables on the trainers) binds where its trainers do
        first = endpoints[chosen[0]][0] if chosen else "127.0.0.1" if self._loopback else ray.util.get_node_ip_address()
        self._key = (role_environment(first, self.job_key) or {}).get(AUTH_KEY_ENV)
        addresses: dict[str, str] = {}
        for role, node, (_, options) in zip(services, chosen, wanted):
            host, ports = endpoints[node]
            port = ports.pop(0)
            addresses[role.name] = f"tcp://{host}:{port}"
            self.services.append(_Service(role.name, _with(_cli_argv(role.argv), host=host, port=str(port)),
                                          node, options))
        lists = {kind: ",".join(addresses[s.name] for s in self.services if server_role(s.name) is kind)
                 for kind in {server_role(s.name) for s in self.services} | {PS}}
        for service in self.services:
            if server_role(service.name) is PS:
                self.shm_nodes.setdefault(service.node, []).append(plan.shm_names[int(service.name[2:])])
            else:  # the servers that talk to the PS servers get their addresses on this cluster
                service.argv = _with(service.argv, ps=lists[PS])
        trainer_role = next(r for r in plan.roles if r.main)
        self.trainer_argv = _with(_trainer_argv(trainer_role.argv),
                                  **{kind.trainer_flag[2:]: listed for kind, listed in lists.items()})
        self.trainer_options = role_options(self.resources.trainers)
        self.ps_addresses = [a for a in lists[PS].split(",") if a]
        self.server_addresses = {kind: [a for a in listed.split(",") if a] for kind, listed in lists.items()}

    # ------------------------------------------------------------------ running
    def _await(self, ref, deadline: float | None, what: str):
        """ray.get(ref), watching for a signal and the deadline meanwhile; _Stop when the job ends."""
        while not self.ray.wait([ref], timeout=POLL_SECONDS)[0]:
            code = self._stopping(deadline)
            if code is not None:
                raise _Stop(code)
        try:
            return self.ray.get(ref)
        except Exception as error:  # the actor died or raised
            self.reason = f"{what} failed: {_cause(error)}"
            raise _Stop(FAILED) from None

    def _stopping(self, deadline: float | None) -> int | None:
        if self._signal is not None:
            self.reason = f"interrupted by {signal.Signals(self._signal).name}"
            return INTERRUPTED
        if deadline is not None and time.monotonic() > deadline:
            self.reason = "the --timeout passed"
            return TIMED_OUT
        return None

    def _start_services(self, services: list[_Service], deadline: float | None) -> int | None:
        """Create the actors and wait until each serves; an exit code when the job ends here."""
        ray = self.ray
        for service in services:
            self._create_actor(service)
        pending = {s.actor.pid.remote(): s for s in services}
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1, timeout=POLL_SECONDS)
            for ref in done:
                service = pending.pop(ref)
                try:
                    pid = ray.get(ref)
                except Exception as error:  # the constructor raised or the actor died
                    self.reason = f"{service.name} did not start: {_cause(error)}"
                    return FAILED
                self._serving(service, pid)
            code = self._stopping(deadline)
            if code is not None:
                return code
        return None

    def _create_actor(self, service: _Service) -> None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        cls = self.ray.remote(type(service.name, (ServiceHost,), {"__module__": __name__}))
        service.actor = cls.options(
            name=f"hybridrec-{self.plan.job}-{service.name}", namespace=NAMESPACE, max_restarts=self.role_restarts,
            max_task_retries=0, max_concurrency=4,
            scheduling_strategy=NodeAffinitySchedulingStrategy(service.node, soft=False),
            **service.options).remote(service.name, service.argv, self._key, self._cwd, self.startup_timeout)

    def _serving(self, service: _Service, pid: int) -> None:
        service.pid = pid
        self.log(f"{service.name} serves at {flag_value(service.argv, '--host')}:{flag_value(service.argv, '--port')} "
                 f"(pid {pid}, node {service.node[:12]})")
        service.call = service.actor.watch.remote()

    # ------------------------------------------------------------------ the elastic PS tier
    # What `hybridrec.parallel.scale.ScaleControl` needs of a launcher (as `SupervisedServers`).
    def pids(self) -> dict[str, int]:
        """The process of each serving role; a PS whose pid changed was restarted by Ray (lost)."""
        return {s.name: s.pid for s in list(self.services) if s.pid is not None}

    def start_ps(self, name: str, template, shm_name: str) -> str:
        """Start PS actor `name` like `template` (the plan's ps0 role) on the node that holds the
        fewest of the job's PS servers, on a port its node agent picks; its address once it serves."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        held = {node: 0 for node in (n["NodeID"] for n in _alive_nodes())}
        for service in self.services:
            if server_role(service.name) is PS and service.node in held:
                held[service.node] += 1
        node = min(held, key=held.get)
        if node not in self.agents:
            self.agents[node] = self.ray.remote(NodeAgent).options(num_cpus=0, scheduling_strategy=(
                NodeAffinitySchedulingStrategy(node, soft=False))).remote()
        host, ports = self.ray.get(self.agents[node].endpoint.remote(1, self._loopback), timeout=self.startup_timeout)
        service = _Service(name, _with(_cli_argv(template.argv), host=host, port=str(ports[0]), shm_name=shm_name),
                           node, role_options(getattr(self.resources, server_role(name).resources)))
        self.shm_nodes.setdefault(node, []).append(shm_name)  # deleted with the job's
        self._create_actor(service)
        try:
            pid = self.ray.get(service.actor.pid.remote(), timeout=self.startup_timeout)
        except Exception as error:  # it did not start (or not in time): the scale request fails, the job goes on
            self._kill(service.actor)
            raise RuntimeError(f"{name} did not start: {_cause(error)}") from None
        self._serving(service, pid)
        self.services.append(service)
        return f"tcp://{host}:{ports[0]}"

    def retire(self, name: str) -> None:
        """Stop PS actor `name` for good (`hybridrec scale` moved its buckets off)."""
        service = next((s for s in self.services if s.name == name), None)
        if service is None:
            return
        service.retired = True
        self.services.remove(service)
        self._kill(service.actor)
        self.log(f"{name} retired")

    def _start_control(self) -> None:
        """The control channel of `hybridrec scale`, once the PS servers serve (jobs with PS servers)."""
        from hybridrec.comm.auth import JobKey
        from hybridrec.parallel.scale import ScaleControl

        if not self.ps_addresses:
            return
        key = None if self._key is None else JobKey.from_text(self._key, "the job key")
        self.control = ScaleControl(self.cfg, self.plan, self, self.tables, job=self.plan.job,
                                    addresses=self.ps_addresses, key=key)
        self.control.start()

    def _create_trainers(self) -> None:
        cls = self.ray.remote(type(TRAINERS, (TrainerHost,), {"__module__": __name__}))
        self.trainer_actors = [cls.options(max_restarts=0, **self.trainer_options).remote(self._key, self._cwd)
                               for _ in range(self.trainers)]

    def _start_trainers(self, attempt: int, deadline: float | None) -> list[Any]:
        """Run the trainer group on the trainer actors (made already: see _create_trainers)."""
        master = self._await(self.trainer_actors[0].endpoint.remote(self._loopback), deadline, "trainer rank 0")
        self.log(f"trainers: {self.trainers} rank(s), group at {master[0]}:{master[1]}"
                 + (f", attempt {attempt + 1}" if attempt else ""))
        machines = [self._await(actor.machine.remote(), deadline, f"trainer rank {rank}")
                    for rank, actor in enumerate(self.trainer_actors)]
        return [actor.run.remote(self.trainer_argv, rank, self.trainers, master, attempt, machines.count(machine))
                for rank, (actor, machine) in enumerate(zip(self.trainer_actors, machines))]

    def _service_answered(self, service: _Service) -> int | None:
        """A service's outstanding call ended. Serving: its watch ended, so it died; Ray restarts it
        (then ask its pid until it is back) or it is dead for good (`_dead_for_good`)."""
        from ray.exceptions import ActorDiedError, ActorUnschedulableError

        if service.retired:
            return None
        try:
            pid, error = self.ray.get(service.call), None
        except Exception as exc:
            pid, error = None, exc
        if isinstance(error, (ActorDiedError, ActorUnschedulableError)):  # no restart left, or its node is gone
            return self._dead_for_good(service, f"Ray does not restart it (after {service.deaths} restart(s) of "
                                                f"{self.role_restarts}): {_cause(error)}")
        if service.restarting and error is None:
            service.restarting, service.pid = False, pid
            self.log(f"{service.name} is back (pid {pid})")
            service.call = service.actor.watch.remote()
        elif service.restarting:  # still restarting: ask again in a moment
            service.call, service.ask_at = None, time.monotonic() + POLL_SECONDS
        else:
            service.deaths += 1
            if service.deaths > self.role_restarts:
                return self._dead_for_good(service, f"it died more often than its {self.role_restarts} restart(s)")
            self.log(f"{service.name} died; Ray restarts it on its node ({service.deaths} of {self.role_restarts})")
            service.restarting, service.call, service.died_at = True, service.actor.pid.remote(), time.monotonic()
        return None

    def _dead_for_good(self, service: _Service, why: str) -> int | None:
        """Service `service` will not serve again. A PS server of a replicated job is failed over
        (its buckets' backups take them, a new PS takes its place: `ScaleControl.lose`) and the job
        goes on; any other role fails the job."""
        if (server_role(service.name) is PS and self.control is not None and self.control.replicas >= 2
                and len([s for s in self.services if server_role(s.name) is PS]) > 1):
            self.services.remove(service)
            self._kill(service.actor)  # (dead already, or a restart still waiting for its node)
            self.log(f"{service.name} is lost for good ({why}); its buckets fail over to their backups")
            self.control.lose(service.name)
            return None
        self.reason = f"{service.name} died and will not serve again: {why}"
        return FAILED

    def _kill(self, actor) -> None:
        try:
            self.ray.kill(actor, no_restart=True)
        except Exception:  # already gone
            pass

    def _kill_trainers(self) -> None:
        for actor in self.trainer_actors:
            self._kill(actor)
        self.trainer_actors = []

    def _run(self, deadline: float | None) -> int:
        ray = self.ray
        self._create_trainers()
        code = self._start_services(self.services, deadline)
        if code is not None:
            return code
        self._start_control()
        attempt = 0
        runs = self._start_trainers(attempt, deadline)
        finished: set = set()
        while True:
            for service in list(self.services):
                if service.restarting and time.monotonic() > service.died_at + self.startup_timeout:
                    # a restart Ray cannot place (its node is lost) waits for ever
                    code = self._dead_for_good(service, f"Ray did not bring it back within {self.startup_timeout:g}s")
                    if code is not None:
                        return code
                elif service.call is None and time.monotonic() >= service.ask_at:
                    service.call = service.actor.pid.remote()
            calls = {s.call: s for s in list(self.services) if s.call is not None}
            pending = [r for r in runs if r not in finished]
            done, _ = ray.wait(pending + list(calls), num_returns=1, timeout=POLL_SECONDS)
            for ref in done:
                if ref in calls:
                    code = self._service_answered(calls[ref])
                    if code is not None:
                        return code
                    continue
                finished.add(ref)
                try:
                    result = ray.get(ref)
                    failure = None if result == 0 else f"exit code {result}"
                except Exception as error:
                    failure = _cause(error)
                if failure is None:
                    continue
                if attempt >= self.max_restarts:
                    self.reason = f"a trainer failed ({failure})" + (
                        f" and its group was restarted {attempt} time(s) already" if attempt else "")
                    return FAILED
                self.log(f"a trainer failed ({failure}); restarting the trainer group "
                         f"({attempt + 1} of {self.max_restarts})")
                self._kill_trainers()
                self._create_trainers()
                attempt += 1
                runs, finished = self._start_trainers(attempt, deadline), set()
                break
            if runs and all(r in finished for r in runs):
                self.reason = "the trainers finished"
                time.sleep(LOG_DRAIN_SECONDS)
                return OK
            code = self._stopping(deadline)
            if code is not None:
                return code

    def _teardown(self) -> None:
        """Kill every actor of the job, wait (up to `grace`) until each is gone, then delete the
        job's shared memory on each PS node."""
        ray = self.ray
        if self.control is not None:
            self.control.stop()
        actors = self.trainer_actors + [s.actor for s in self.services if s.actor is not None]
        for actor in actors:
            self._kill(actor)
        deadline = time.monotonic() + self.grace
        for actor in actors:
            try:
                ray.get(actor.__ray_ready__.remote(), timeout=max(0.1, deadline - time.monotonic()))
            except Exception:  # dead (or still dying after the grace period: its node's raylet finishes it)
                pass
        self.trainer_actors = []
        refs = {node: self.agents[node].remove_memory.remote(names, self.tables)
                for node, names in self.shm_nodes.items()}
        for node, ref in refs.items():
            try:
                removed = ray.get(ref, timeout=max(self.grace, 30.0))
                self.log(f"deleted the job's shared memory on node {node[:12]} ({len(removed)} item(s))")
            except Exception as error:
                self.log(f"could not delete the job's shared memory on node {node[:12]}: {_cause(error)}")
        for agent in self.agents.values():
            self._kill(agent)

    def run(self, timeout: float | None = None) -> int:
        """The whole job; the exit code. `reason` says why it ended."""
        deadline = None if timeout is None else time.monotonic() + timeout
        undo_logs = self._route_logs()
        handlers = {}
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                handlers[signum] = signal.signal(signum, self._on_signal)
        try:
            self._plan_services(deadline)
            servers = "".join(f"{len(listed)} {kind.command} ({', '.join(listed)}), "
                              for kind, listed in self.server_addresses.items() if listed)
            self.log(f"job {self.plan.job} on Ray: {servers}{self.trainers} trainer(s)")
            remove_dead_jobs_shared_memory(self.log)
            return self._run(deadline)
        except _Stop as stop:
            return stop.code
        except BaseException:
            self.reason = self.reason or "the launcher failed"
            raise
        finally:
            try:
                self._teardown()
            finally:
                for signum, handler in handlers.items():
                    signal.signal(signum, handler)
                undo_logs()
                if self.started_ray:
                    self.ray.shutdown()

    def _on_signal(self, signum, frame) -> None:
        self._signal = signum


class _Stop(Exception):
    """The job ends while the launcher waits for something; `code` is its exit code."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


def _cause(error: BaseException | None) -> str:
    """One line for a Ray error: the role's own exception when there is one."""
    if error is None:
        return "no error"
    cause = getattr(error, "cause", None)
    text = str(cause if isinstance(cause, BaseException) else error).strip()
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__


def launch_on_ray(config: str, *, address: str = "auto", ps: int | None = None,
                  embedding_workers: int | None = None, trainers: int | None = None,
                  overrides: Sequence[str] = (), resume: bool = False, overwrite: bool = False,
                  max_restarts: int = 0, role_restarts: int = 3, timeout: float | None = None,
                  grace: float = 10.0, out: TextIO | None = None, job_key: bool = True) -> int:
    """Run a whole job on the Ray cluster at `address`; the exit code: 0 done, 1 a role failed,
    124 timeout, 130 interrupted. Raises ConfigError / ValueError before anything starts when the
    arguments, the config or the cluster's resources do not fit. `job_key`: a new job key for
    every role (False: none, on a one-node cluster only)."""
    from hybridrec.job.tables import job_tables

    cfg = check_config(config, overrides)
    counts = role_counts(cfg, ps, embedding_workers, trainers)
    check_arguments(ps=counts["ps"], embedding_workers=counts["embedding_workers"], trainers=counts["trainers"],
                    max_restarts=max_restarts, role_restarts=role_restarts, resume=resume, overwrite=overwrite,
                    timeout=timeout, needs_ps="ps_servers" in server_roles(cfg.strategy.resolved))
    _import_ray()
    group_ps = group_ps_layout(cfg, counts["trainers"])
    demand = job_demand(cfg.strategy.resources, {**counts, "group_ps": group_ps[0] * group_ps[1]})
    plan = build_roles(str(Path(config).resolve()), **counts, group_ps=group_ps, overrides=overrides, job=new_job_id(),
                       resume=resume, overwrite=overwrite, max_restarts=max_restarts, role_restarts=role_restarts,
                       checkpoint_root=str(Path(cfg.train.output_dir).resolve()))
    tables = list(job_tables(cfg).all_tables())
    if counts["ps"]:  # the elastic PS tier: with replicas the servers serve what the coordinator gives them
        from hybridrec.parallel.scale import ScaleControl

        ScaleControl.routed_roles(plan, cfg.strategy.ps_replicas)
    try:
        started = connect(address, demand)
    except RayUnavailable as error:
        print(f"hybridrec launch: {error}", file=sys.stderr, flush=True)
        return FAILED
    launcher = RayLauncher(plan, cfg, tables, demand, trainers=counts["trainers"], max_restarts=max_restarts,
                           role_restarts=role_restarts, grace=grace, out=out, started_ray=started, job_key=job_key)
    code = launcher.run(timeout)
    if code != 0:
        print(f"hybridrec launch: {launcher.reason}", file=sys.stderr, flush=True)
    return code


def launch_on_cluster(config: str, address: str, emulation, *, host: str = "127.0.0.1", out: TextIO | None = None,
                      **job) -> int:
    """`hybridrec launch --ray ADDRESS` (`launch(..., ray=ADDRESS)`): the job on the Ray cluster at
    `address`, or, with `emulation` (a HostEmulation), on a Ray cluster of its own across the
    emulated hosts (ray_emulated.py). ValueError for flags that do not apply."""
    if host != "127.0.0.1":
        raise ValueError(f"--host {host} does not apply with --ray: each role binds its node's address "
                         "(loopback on a one-node cluster)")
    if emulation is None:
        return launch_on_ray(config, address=address, out=out, **job)
    if address != "auto":
        raise ValueError(f"--emulate-hosts {emulation.hosts} with --ray {address}: the emulated hosts get a Ray "
                         "cluster of their own; allowed: --ray auto")
    from hybridrec.parallel.ray_emulated import launch_on_emulated_cluster

    return launch_on_emulated_cluster(config, emulation, out=out, **job)
