"""Elastic PS servers under `hybridrec launch`: the launcher's control channel, `hybridrec
scale RUN --ps N`, and failover to the backups when a PS server is lost.

The launcher of a job whose tables live on PS servers runs a `ScaleControl`: a coordinator
(`hybridrec.ps.migration`) over the job's servers and a control channel, a transport server on
loopback whose address it writes to `<train.output_dir>/control.json`. The channel
authenticates with the job key, as the job's PS servers do (`hybridrec.comm.auth`): the
launcher writes the key beside control.json into `control.key`, a file only its owner may read
(mode 0600, as Jupyter keeps a kernel's key in its connection file), so only the user who
launched the job (or root) can rescale it; a job launched with `--no-job-key` has a keyless
channel and no key file.
`hybridrec scale RUN --ps N` reads those files and asks for N servers: new ones are started as
roles of the launcher's supervisor (on the next free index and port) and buckets move to them
while training runs; for fewer, buckets move off the last servers, which are retired once the
clients had `DRAIN_SECONDS` to learn the new table (until then they answer with it).

With `strategy.ps_replicas: 2` the PS servers run `--routed`: they serve only once the
coordinator installed the first table (right after they start; trainers that come first
wait), and a server restarted without its shared memory serves nothing until the coordinator
made it a backup again. The control thread watches the servers' processes: when one is
restarted by the supervisor (it died), the coordinator promotes the backups of its buckets and
rebuilds the missing backups in the background (`Coordinator.fail_over`).

The coordinator's figures (routing version, buckets and bytes moved, longest pause, failovers)
travel with every table it installs; the trainers report them (`PSClient.job_metrics`).
"""
from __future__ import annotations

import json
import os
import queue
from dataclasses import replace
import threading
import time
from pathlib import Path
from typing import Sequence

from hybridrec.comm.auth import HOW_TO, AuthError, JobKey, key_from_environment, read_key_file
from hybridrec.comm.transport import Client, Message, Operation, Server
from hybridrec.errors import UserError
from hybridrec.parallel.host import dial_host, free_ports, ps_shm_name
from hybridrec.parallel.supervisor import Role, Supervisor

CONTROL_FILE = "control.json"
KEY_FILE = "control.key"  # the job key, mode 0600, while a keyed job runs
DRAIN_SECONDS = 5.0  # a server scaled away keeps answering with the new table this long
READY_SECONDS = 180.0
MAX_PS = 64
# strategies whose PS servers hold state keyed by server index: their server count is fixed
FIXED_COUNT = {"consistency": ("het", "ssp"), "dense": ("ps_async", "easgd", "groups")}


def server_indexed_state(cfg) -> tuple[str, str] | None:
    """The strategy axis and value whose PS state is kept by server index (HET's or SSP's clocks,
    dense parameters on the PS), None when the PS servers hold embedding buckets alone."""
    for axis, values in FIXED_COUNT.items():
        value = str(getattr(cfg.strategy, axis))
        if value in values:
            return axis, value
    return None


def fixed_reason(cfg) -> str | None:
    """Why a job's PS servers cannot be scaled, None when they can."""
    state = server_indexed_state(cfg)
    if state is None:
        return None
    return (f"strategy.{state[0]} {state[1]} keeps state by PS server index (clocks or dense parameters), "
            f"so its PS count is fixed; scaling takes jobs with consistency sync or bounded and dense allreduce")


def replicas_reason(cfg) -> str | None:
    """Why a job cannot have `strategy.ps_replicas` 2, None when it can: replication copies the
    embedding buckets (pushes through `push_many`), not the state a strategy keeps by server index."""
    state = server_indexed_state(cfg)
    if cfg.strategy.ps_replicas < 2 or state is None:
        return None
    return (f"strategy.ps_replicas is {cfg.strategy.ps_replicas}, but strategy.{state[0]} {state[1]} keeps state "
            f"on the PS servers by server index (clocks or dense parameters), which replication does not copy (a "
            f"failover would lose it); use ps_replicas 1 with it, or consistency sync or bounded with dense allreduce")


class SupervisedServers:
    """The PS servers of a job under `hybridrec launch`: processes its supervisor runs. What
    `ScaleControl` needs of a launcher (the Ray launcher has the same methods, for actors)."""

    def __init__(self, supervisor: Supervisor, plan):
        self.supervisor, self.plan = supervisor, plan
        self.log = supervisor.log

    def pids(self) -> dict[str, int]:
        """The process of each role; a PS whose pid changed was restarted (lost)."""
        return self.supervisor.pids()

    def start_ps(self, name: str, template: Role, shm_name: str) -> str:
        """Start PS server `name` like `template` on a free port; its address once it serves."""
        host = _flag(template.argv, "--host")
        port = free_ports(1, host)[0]
        argv = _set_flag(_set_flag(list(template.argv), "--port", str(port)), "--shm-name", shm_name)
        self.plan.shm_names.append(shm_name)  # deleted with the job's
        ready = self.supervisor.add_service(_with_argv(template, argv, name))
        if not ready.wait(READY_SECONDS):
            raise RuntimeError(f"{name} did not report ready within {READY_SECONDS:g}s")
        return f"tcp://{dial_host(host)}:{port}"

    def retire(self, name: str) -> None:
        self.supervisor.retire(name)


class ScaleControl:
    """The elastic PS tier of one launched job (see the module docstring). `servers` starts
    and stops its PS servers (`SupervisedServers`, or the Ray launcher); `addresses`: where the
    job's PS servers serve (default: the plan's); `key`: the job key (default: the roles')."""

    def __init__(self, cfg, plan, servers, tables: Sequence[str], *, job: str,
                 addresses: Sequence[str] | None = None, key: JobKey | None | str = "roles"):
        from hybridrec.ps.migration import Coordinator

        self.cfg, self.plan, self.servers, self.job = cfg, plan, servers, job
        self.replicas = cfg.strategy.ps_replicas
        env = next((role.env for role in plan.roles if role.env is not None), None)
        # None (roles inheriting ours): the one ours configures, if any
        self.key = key_from_environment(env) if key == "roles" else key
        self.output_dir = Path(cfg.train.output_dir).resolve()
        addresses = list(plan.ps_addresses if addresses is None else addresses)
        self.roles = {f"ps{i}": role for i, role in enumerate(plan.roles[:len(addresses)])}
        self.addresses = {f"ps{i}": a for i, a in enumerate(addresses)}
        self.coordinator = Coordinator(addresses, tables, replicas=self.replicas, key=self.key, log=servers.log)
        self._started = threading.Event()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._gone: queue.SimpleQueue[str] = queue.SimpleQueue()  # servers their launcher cannot bring back
        self._made_dir = False
        self.transport = Server({"scale": Operation(self._scale), "status": Operation(self._status)},
                                host="127.0.0.1", port=0, threads=2, key=self.key)
        self._watcher = threading.Thread(target=self._watch, name="ps-control", daemon=True)

    @staticmethod
    def routed_roles(plan, replicas: int) -> None:
        """With replication, the PS roles serve only what the coordinator gives them (`--routed`)."""
        if replicas >= 2:
            for i in range(len(plan.ps_addresses)):
                plan.roles[i] = _with_argv(plan.roles[i], [*plan.roles[i].argv, "--routed"])

    def start(self) -> None:
        self.transport.start()
        self._made_dir = not self.output_dir.exists()  # removed again at stop if the job left it empty
        self.output_dir.mkdir(parents=True, exist_ok=True)
        info = {"address": self.transport.address, "job": self.job, "pid": os.getpid()}
        if self.key is not None:
            _write_private(self.output_dir / KEY_FILE, self.key.secret + "\n")
            info["key_file"] = KEY_FILE
        _write_private(self.output_dir / CONTROL_FILE, json.dumps(info))
        self._watcher.start()

    def stop(self) -> None:
        """Stop the channel and the watcher and remove control.json (once; later calls do nothing)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self.transport.stop(5)
        self._watcher.join(10)
        self.coordinator.close()
        (self.output_dir / CONTROL_FILE).unlink(missing_ok=True)
        (self.output_dir / KEY_FILE).unlink(missing_ok=True)
        if self._made_dir and not any(self.output_dir.iterdir()):
            self.output_dir.rmdir()

    # ---------------------------------------------------------------- watching
    def _pids(self) -> dict[str, int]:
        return {name: pid for name, pid in self.servers.pids().items() if name in self.addresses}

    def _watch(self) -> None:
        """Install the first table once every server answers (with replication: at once, the
        servers wait for it), then fail over when a server's process is replaced (it died and came
        back) or its launcher reports it lost for good (`lose`)."""
        while not self._stop.is_set():
            try:
                if self.replicas >= 2 or self.coordinator.newest() is not None:
                    self.coordinator.start()
                break
            except (TimeoutError, OSError):
                self._stop.wait(0.5)
        self._started.set()
        seen = self._pids()
        while not self._stop.wait(0.1):
            now = self._pids()
            for name in [name for name, pid in seen.items() if now.get(name, pid) != pid]:
                self._fail_over(name, self._rejoin)
            while not self._gone.empty():
                self._fail_over(self._gone.get(), self._replace)
            seen = {**seen, **now}

    def lose(self, name: str) -> None:
        """PS server `name` is gone for good (its launcher cannot start it again, e.g. its node is
        lost): with replication its buckets fail over to their backups and a new server takes its
        place where one can start (the watcher does both, in the background)."""
        self._gone.put(name)

    def _fail_over(self, name: str, then) -> None:
        """The backups of lost server `name` take over its buckets; then `then(name)` (the lost
        server comes back, or another replaces it)."""
        if self.replicas < 2 or self._stop.is_set():
            return
        try:
            with self._lock:
                self.coordinator.fail_over(self.addresses[name])
            then(name)
        except Exception as error:  # the job goes on; its log says why the backups were not rebuilt
            self.servers.log(f"failover of {name} failed: {error!r}")

    def _replace(self, name: str) -> None:
        """A new PS server in the place of `name`, lost for good; buckets move to it (with two
        servers left this gives the buckets backups again). When none can start, the job goes on
        with the servers it has."""
        self.addresses.pop(name, None)
        try:
            with self._lock:
                address = self._add_server()
                self.coordinator.scale_to([*self.coordinator.table.addresses, address])
        except (RuntimeError, TimeoutError, OSError) as error:
            self.servers.log(f"no PS server replaces {name} ({error}); the job goes on with "
                             f"{len(self.coordinator.table.addresses)}")
            return
        self.servers.log(f"{next(n for n, a in self.addresses.items() if a == address)} replaces {name}")

    def _rejoin(self, name: str) -> None:
        """Once the supervisor's replacement of lost server `name` answers, buckets move back to it."""
        deadline = time.monotonic() + READY_SECONDS
        while not self._stop.is_set() and time.monotonic() < deadline:
            if self.coordinator.newest([self.addresses[name]]) is not None or self._answers(name):
                with self._lock:
                    self.coordinator.scale_to([*self.coordinator.table.addresses, self.addresses[name]])
                return
            self._stop.wait(0.5)

    def _answers(self, name: str) -> bool:
        try:
            with Client(self.addresses[name], timeout=2.0, retries=0, key=self.key) as client:
                client.request("ping")
            return True
        except (TimeoutError, OSError):
            return False

    # ---------------------------------------------------------------- requests
    def _status(self, request: Message) -> Message:
        table = self.coordinator.table
        return Message("status", meta={"servers": list(table.addresses), "version": table.version,
                                       **self.coordinator.metrics.as_dict()})

    def _scale(self, request: Message) -> Message:
        count = request.meta.get("ps")
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_PS:
            raise ValueError(f"--ps must be a whole number in [1, {MAX_PS}], got {count!r}")
        reason = fixed_reason(self.cfg)
        if reason is not None:
            raise ValueError(reason)
        if _emulated(self.roles["ps0"]):
            raise ValueError("jobs on emulated hosts keep their PS count")
        if count < self.replicas:
            raise ValueError(f"--ps {count}: strategy.ps_replicas is {self.replicas}, so at least {self.replicas} "
                             "PS servers are needed")
        self._started.wait(READY_SECONDS)
        with self._lock:
            if self.coordinator.table.version == 0:
                self.coordinator.start()
            current = list(self.coordinator.table.addresses)
            names = {address: name for name, address in self.addresses.items()}
            wanted = current[:count] + [self._add_server() for _ in range(count - len(current))]
            final = self.coordinator.scale_to(wanted)
            leaving = [names[a] for a in current if a not in final.addresses]
        if leaving:
            threading.Thread(target=self._retire, args=(leaving,), daemon=True).start()
        return self._status(request)

    def _add_server(self) -> str:
        """Start PS server ps<i> on the next free index; its address once it serves."""
        index = len(self.roles)
        name, template = f"ps{index}", self.roles["ps0"]
        self.addresses[name] = self.servers.start_ps(name, template, ps_shm_name(self.job, index))
        self.roles[name] = template
        return self.addresses[name]

    def _retire(self, names: list[str]) -> None:
        time.sleep(DRAIN_SECONDS)
        for name in names:
            self.servers.retire(name)
            self.addresses.pop(name, None)


def _write_private(path: Path, text: str) -> None:
    """Write `path` whole (a reader sees the old file or the new one) with mode 0600."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    temporary.unlink(missing_ok=True)
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as file:
        file.write(text)
    os.replace(temporary, path)


def _emulated(role: Role) -> bool:
    return "hybridrec.cli" not in role.argv[:4]


def _flag(argv: Sequence[str], flag: str) -> str:
    return argv[list(argv).index(flag) + 1]


def _set_flag(argv: list[str], flag: str, value: str) -> list[str]:
    argv[argv.index(flag) + 1] = value
    return argv


def _with_argv(role: Role, argv: list[str], name: str | None = None) -> Role:
    return replace(role, argv=argv, name=name or role.name)


def control_channel(run: str | Path) -> tuple[str, JobKey | None]:
    """The address of the control channel of the job running in `run` (its train.output_dir)
    and the job key it takes (None: a job launched with --no-job-key), or UserError."""
    path = Path(run) / CONTROL_FILE
    try:
        info = json.loads(path.read_text())
        address, key_file = str(info["address"]), info.get("key_file")
    except FileNotFoundError:
        raise UserError(f"{path}: no such file; RUN must be the train.output_dir of a job running under "
                        "`hybridrec launch` (its launcher writes control.json there)") from None
    except PermissionError:
        raise UserError(f"{path}: permission denied; only the user who launched the job can scale it") from None
    except (ValueError, KeyError, TypeError, AttributeError):
        raise UserError(f"{path}: not a control file of hybridrec launch") from None
    if key_file is None:
        return address, None
    if not isinstance(key_file, str) or Path(key_file).name != key_file:
        raise UserError(f"{path}: key_file must name a file beside it, got {key_file!r:.80}")
    try:
        return address, read_key_file(Path(run) / key_file)
    except AuthError as error:  # unreadable, or readable by others
        why = str(error).replace(f"; {HOW_TO}", "")
        raise UserError(f"hybridrec scale {run}: {why}; only the user who launched the job can scale it") from None


def scale(run: str | Path, ps: int, *, timeout: float = 3600.0) -> dict:
    """Ask the launcher of the job in `run` for `ps` PS servers; its status once the buckets
    moved (`hybridrec scale RUN --ps N`)."""
    from hybridrec.comm.transport import RemoteError

    address, key = control_channel(run)
    with Client(address, timeout=timeout, retries=0, key=key) as client:
        try:
            return client.request("scale", meta={"ps": ps}).meta
        except RemoteError as error:
            raise UserError(f"hybridrec scale {run} --ps {ps}: {error.message}") from None
        except AuthError as error:
            raise UserError(f"hybridrec scale {run}: the launcher at {address} refused this key ({error})") from None
        except TimeoutError:
            raise UserError(f"hybridrec scale {run}: the launcher at {address} did not answer within "
                            f"{timeout:g}s (is the job still running?)") from None
