"""What runs inside the Ray actors of a `hybridrec launch --ray` job (ray_launch.py places them).

* `ServiceHost`: a server role of roles.py (PS server, embedding worker, group PS), i.e. its
  `hybridrec.cli` argv run through the role's entry in the actor's process; ready once its port
  accepts connections.
* `TrainerHost`: one trainer rank; it joins the torch.distributed group at the address rank 0's
  actor names and runs the trainer entry point (`hybridrec.parallel.trainer.main`).
* `NodeAgent`: picks ports on a node before its roles start, deletes the job's shared memory
  there once they are dead.

Every actor first takes the job key into its own environment (off loopback) and moves to the
launcher's working directory when its node has it. The launcher subclasses `ServiceHost` and
`TrainerHost` under each role's name, so Ray prefixes their output with it from the first line.
"""
from __future__ import annotations

import os
import socket
import sys
import threading
import time
import traceback
from typing import Any, Sequence

from hybridrec.comm.auth import AUTH_KEY_ENV, AUTH_KEY_FILE_ENV
from hybridrec.parallel.host import free_ports, remove_shared_memory
from hybridrec.parallel.roles import TRAINERS, server_role


def _enter_job(key: str | None, cwd: str) -> None:
    """Run first in every actor: the job key in this process's environment (off loopback), and
    the launcher's working directory when this node has it (config paths are relative to it)."""
    if key is not None:
        os.environ.pop(AUTH_KEY_FILE_ENV, None)
        os.environ[AUTH_KEY_ENV] = key
    if os.path.isdir(cwd):
        os.chdir(cwd)


def flag_value(argv: Sequence[str], name: str) -> str:
    """The value after --name in argv."""
    return argv[list(argv).index(name) + 1]


def bind_host(loopback: bool) -> str:
    """The address roles on this node bind: loopback on a one-node cluster, else the node's."""
    import ray

    return "127.0.0.1" if loopback else ray.util.get_node_ip_address()


def interface_of(address: str) -> str | None:
    """The name of this host's network interface that holds IPv4 `address` (Linux), or None."""
    import fcntl
    import struct

    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                answer = fcntl.ioctl(probe.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on this interface
                continue
            if socket.inet_ntoa(answer[20:24]) == address:
                return name
    return None


def _listening(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def _service_main(argv: Sequence[str]) -> int:
    """Run a server role from its `hybridrec <command> ...` arguments (argv without `hybridrec`)
    through the role's entry point (roles.py; the command line sits above this package)."""
    return server_role(argv[0]).run(argv[1:])


class ServiceHost:
    """Runs one server role (its `hybridrec.cli` argv) in this actor's process.

    The constructor returns once the role accepts connections on its port, and raises if the
    role exits first (a bad config, say: Ray then marks the actor dead without restarting it).
    A role that stops later ends the whole process, so Ray restarts the actor."""

    def __init__(self, name: str, argv: Sequence[str], key: str | None, cwd: str, startup_timeout: float):
        _enter_job(key, cwd)
        self.name, self.argv = name, list(argv)
        self.exit: Any = None
        self.serving = False
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()
        host, port = flag_value(argv, "--host"), int(flag_value(argv, "--port"))
        deadline = time.monotonic() + startup_timeout
        while not _listening(host, port):
            if not self.thread.is_alive():
                raise RuntimeError(f"{name} exited ({self.exit}) before it listened on {host}:{port}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not listen on {host}:{port} within {startup_timeout:g}s")
            time.sleep(0.1)
        self.serving = True

    def __repr__(self) -> str:  # Ray names the actor's log lines after it
        return self.name

    def _run(self) -> None:
        try:
            self.exit = f"exit code {_service_main(self.argv)}"
        except SystemExit as stop:
            self.exit = f"exit code {stop.code}"
        except BaseException:  # a bug: its traceback goes to the log
            traceback.print_exc()
            self.exit = "an exception"
        sys.stdout.flush()
        sys.stderr.flush()
        if self.serving:  # stopped by itself after it served: let Ray restart the actor
            print(f"{self.name} stopped ({self.exit}); ending its actor", file=sys.stderr, flush=True)
            os._exit(1)

    def pid(self) -> int:
        return os.getpid()

    def watch(self) -> None:
        """Returns (or fails) only when the role is gone."""
        self.thread.join()


class TrainerHost:
    """One trainer rank: joins the torch.distributed group and runs the training loop."""

    def __init__(self, key: str | None, cwd: str):
        _enter_job(key, cwd)
        import hybridrec.parallel.trainer  # noqa: F401  (torch and the loop load while the services start)

    def __repr__(self) -> str:
        return TRAINERS

    def endpoint(self, loopback: bool) -> tuple[str, int]:
        """Where rank 0 serves the group's rendezvous store: this node's address and a free port."""
        host = bind_host(loopback)
        return host, free_ports(1, host)[0]

    def machine(self) -> str:
        """The machine this actor runs on (its host name): Ray nodes in network namespaces or
        containers of one machine share its cores."""
        return socket.gethostname()

    def run(self, argv: Sequence[str], rank: int, world: int, master: tuple[str, int], attempt: int,
            machine_trainers: int = 1) -> int:
        from hybridrec.parallel.trainer import main
        from hybridrec.picasso.switches import MACHINE_TRAINERS_ENV

        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          **{MACHINE_TRAINERS_ENV: str(machine_trainers)},
                          MASTER_ADDR=master[0], MASTER_PORT=str(master[1]),
                          TORCHELASTIC_RESTART_COUNT=str(attempt))  # > 0: the trainer resumes
        if master[0] != "127.0.0.1" and "GLOO_SOCKET_IFNAME" not in os.environ:
            # gloo takes the address the hostname resolves to, which on many machines (and on
            # emulated hosts) is a loopback one: name the interface of this node's Ray address
            interface = interface_of(bind_host(False))
            if interface is not None:
                os.environ["GLOO_SOCKET_IFNAME"] = interface
        try:
            return main(list(argv))
        except SystemExit as stop:
            return stop.code if isinstance(stop.code, int) else 2
        finally:
            sys.stdout.flush()
            sys.stderr.flush()


class NodeAgent:
    """The job's helper on one node that hosts PS servers or embedding workers: it picks their
    ports there before they start, and deletes the job's shared memory there once they are dead.
    (An actor rather than two tasks: Ray's idle task workers can crash as they exit.)"""

    def endpoint(self, count: int, loopback: bool) -> tuple[str, list[int]]:
        """The host roles on this node bind and `count` free ports there."""
        host = bind_host(loopback)
        return host, free_ports(count, host)

    def remove_memory(self, shm_names: Sequence[str], tables: Sequence[str]) -> list[str]:
        return remove_shared_memory(shm_names, tables)
