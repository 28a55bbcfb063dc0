"""Emulated hosts: a job's roles on N network namespaces behind shaped links, as if on N machines.

`hybridrec launch CONFIG --emulate-hosts N --bandwidth RATE --latency MS [--place ROLE=HOST,...]`
(and `hybridrec bench hybrid` with the same flags) builds, for one job:

* a bridge namespace `hybridrec-<job>-br` holding a Linux bridge, and N host namespaces
  `hybridrec-<job>-h<i>`; each host's `eth0` is one end of a veth pair whose other end (`h<i>`)
  is a port of the bridge. Nothing is added to the root namespace.
* host i has the address 10.213.0.<i+1>/24 on its `eth0`. The subnet exists only inside these
  namespaces, which have no route anywhere else, so no traffic leaves them.
* each link is shaped in both directions (egress of the host's `eth0` and of the bridge's port):
  a token bucket (tbf) at `--bandwidth`, and with `--latency` a netem delay of half the latency
  per link direction, so a packet from one host to another is delayed by `--latency` in all and
  crosses two links of `--bandwidth`.

Roles are placed on the hosts round-robin, in the order ps0.., ew0.., gp0.., trainer0.. (`--place`
pins any of them to a host index; the others still go round-robin). Each role runs as
`ip netns exec <its host's namespace> <its argv>`; PS servers and embedding workers bind to their
host's address, which is off loopback, so they need the job key (the launcher makes one per job).
The trainers of one host form one torchrun node (`--nnodes` = trainer hosts); the rendezvous runs
on the first trainer host's address, and gloo uses `eth0`.

The namespaces (and with them every link and address inside) are deleted when the job ends,
whatever way. A launcher killed with SIGKILL cannot do that, so each launch first deletes the
namespaces of jobs whose launcher is gone (`remove_dead_jobs_namespaces`, by the job-id scheme of
`host.py`), after killing any process still inside them.

Needs CAP_NET_ADMIN and CAP_SYS_ADMIN (root) and the `ip` and `tc` programs; without them the
flags are refused with the reason (`EmulationUnsupported`).
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from hybridrec.parallel.host import JOB_ID, launcher_alive, merged_environment

SUBNET = "10.213.0"            # host i is SUBNET.(i+1)/24, inside the job's namespaces only
MAX_HOSTS = 250
HOST_DEVICE = "eth0"           # each host's end of its veth pair
BRIDGE_DEVICE = "br0"
SERVER_PORT_BASE = 7000        # PS servers and embedding workers: 7000, 7001, ... (fresh namespaces)
RENDEZVOUS_PORT = 29500        # torchrun's c10d store, on the first trainer host
COMMAND_TIMEOUT = 30.0         # seconds for one ip / tc command
CAP_NET_ADMIN, CAP_SYS_ADMIN = 12, 21
_RATE = re.compile(r"(?P<number>[0-9]+(?:\.[0-9]+)?)(?P<unit>bit|kbit|mbit|gbit)", re.IGNORECASE)
_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}


class EmulationUnsupported(ValueError):
    """This machine or process cannot emulate hosts (no privilege, no ip/tc, no netem)."""


class EmulationFailed(ValueError):
    """An ip or tc command failed while building the namespaces (everything built is deleted).
    A ValueError, like bad flags: the launcher reports it in one line (exit 2), nothing started."""


def parse_rate(text: str) -> int:
    """Bits per second of `--bandwidth` (e.g. 100mbit, 1gbit, 1.5mbit)."""
    match = _RATE.fullmatch(text.strip())
    rate = int(float(match["number"]) * _RATE_UNITS[match["unit"].lower()]) if match else 0
    if rate < 8_000:
        raise ValueError(f"--bandwidth {text}: expected a rate of at least 8kbit, written as a number and "
                         f"one of the units bit, kbit, mbit, gbit (e.g. 100mbit, 1gbit)")
    return rate


def parse_place(text: str | None, hosts: int) -> dict[str, int]:
    """`ROLE=HOST,...` (e.g. ps0=0,ew0=1,trainer1=2) as {role: host index}."""
    placed: dict[str, int] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        role, sep, host = item.partition("=")
        role, host = role.strip(), host.strip()
        if not sep or not re.fullmatch(r"(ps|ew|gp|trainer)[0-9]+", role) or not host.isdigit():
            raise ValueError(f"--place {text}: {item!r} is not ROLE=HOST with ROLE one of psI, ewI, gpI, trainerI "
                             f"and HOST a host index, e.g. --place ps0=0,ew0=1,trainer0=2")
        if int(host) >= hosts:
            raise ValueError(f"--place {text}: host {host} of {role} does not exist; --emulate-hosts {hosts} "
                             f"gives hosts 0..{hosts - 1}")
        if role in placed:
            raise ValueError(f"--place {text}: {role} is placed twice")
        placed[role] = int(host)
    return placed


@dataclass(frozen=True)
class HostEmulation:
    """What the flags ask for: host count, link rate (bits/s, None: unlimited), one-way latency
    between two hosts (ms) and the pinned roles."""

    hosts: int
    rate: int | None = None
    latency_ms: float = 0.0
    place: Mapping[str, int] = field(default_factory=dict)

    def describe(self) -> str:
        rate = "unlimited" if self.rate is None else f"{self.rate / 1e6:g} Mbit/s"
        return f"{self.hosts} emulated hosts, links {rate}, latency {self.latency_ms:g} ms"


def add_arguments(parser: argparse.ArgumentParser, *, sweep: bool = False) -> None:
    """The emulation flags, on `hybridrec launch` and on every bench that runs a distributed job
    (`sweep`: a bench that takes several comma-separated rates, one set of jobs each)."""
    parser.add_argument("--emulate-hosts", type=int, default=None, metavar="N",
                        help="run the roles on N network namespaces joined by shaped links (needs root; "
                             "see docs/distributed.md, Emulated hosts)")
    parser.add_argument("--bandwidth", default=None, metavar="RATE[,RATE...]" if sweep else "RATE",
                        help="with --emulate-hosts: each host's link rate in both directions, e.g. 100mbit, 1gbit"
                             + ("; several, comma-separated: the jobs run at each rate in turn" if sweep else ""))
    parser.add_argument("--latency", type=float, default=None, metavar="MS",
                        help="with --emulate-hosts: one-way delay between two hosts in milliseconds")
    parser.add_argument("--place", default=None, metavar="ROLE=HOST,...",
                        help="with --emulate-hosts: pin roles to hosts (psI, ewI, gpI, trainerI = host index); "
                             "the rest go round-robin")


def from_arguments(args: argparse.Namespace) -> HostEmulation | None:
    """The HostEmulation the parsed flags ask for, None without --emulate-hosts; ValueError naming
    the flag and the value for anything out of range."""
    hosts, bandwidth, latency, place = args.emulate_hosts, args.bandwidth, args.latency, args.place
    if hosts is None:
        given = [flag for flag, value in (("--bandwidth", bandwidth), ("--latency", latency), ("--place", place))
                 if value is not None]
        if given:
            raise ValueError(f"{', '.join(given)} need(s) --emulate-hosts N")
        return None
    if not 1 <= hosts <= MAX_HOSTS:
        raise ValueError(f"--emulate-hosts must be between 1 and {MAX_HOSTS}, got {hosts}")
    if latency is not None and not 0 <= latency <= 10_000:
        raise ValueError(f"--latency must be between 0 and 10000 ms, got {latency:g}")
    return HostEmulation(hosts, None if bandwidth is None else parse_rate(bandwidth), latency or 0.0,
                         parse_place(place, hosts))


def _capabilities() -> int:
    try:
        for line in open("/proc/self/status"):
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    except OSError:
        pass
    return 0


def check_support() -> None:
    """EmulationUnsupported naming what is missing: privilege or the ip / tc programs."""
    caps = _capabilities()
    missing = [name for name, bit in (("CAP_NET_ADMIN", CAP_NET_ADMIN), ("CAP_SYS_ADMIN", CAP_SYS_ADMIN))
               if not caps >> bit & 1]
    if missing:
        raise EmulationUnsupported(f"--emulate-hosts needs root ({' and '.join(missing)} missing in this process) "
                                   f"to create network namespaces and shape links")
    tools = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if tools:
        raise EmulationUnsupported(f"--emulate-hosts needs the {' and '.join(tools)} program(s) (iproute2)")


def _run(argv: Sequence[str]) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=COMMAND_TIMEOUT)


def assign_hosts(roles: Sequence[str], hosts: int, place: Mapping[str, int]) -> dict[str, int]:
    """Host index of each role: as `place` says, the rest round-robin in the order given."""
    unknown = sorted(set(place) - set(roles))
    if unknown:
        raise ValueError(f"--place names {', '.join(unknown)}, which this job does not have; its roles: "
                         f"{', '.join(roles)}")
    free = [role for role in roles if role not in place]
    return {**{role: i % hosts for i, role in enumerate(free)}, **place}


@dataclass(frozen=True)
class TrainerNode:
    """One torchrun node: the trainers placed on one host."""

    name: str
    host: int
    node_rank: int
    trainers: int


class EmulatedHosts:
    """The namespaces of one job and where its roles run. Use as a context manager (or call
    `create` and `delete`): leaving it deletes every namespace, link and address it made."""

    def __init__(self, job: str, emulation: HostEmulation, placement: Mapping[str, int]):
        self.job, self.emulation, self.placement = job, emulation, dict(placement)
        self.bridge = f"hybridrec-{job}-br"
        self.namespaces = [f"hybridrec-{job}-h{i}" for i in range(emulation.hosts)]
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(emulation.hosts)]
        self._created: list[str] = []

    # ----------------------------------------------------------------------- lifetime
    def __enter__(self) -> "EmulatedHosts":
        self.create()
        return self

    def __exit__(self, *exc) -> None:
        self.delete()

    def _do(self, *argv: str) -> None:
        result = _run(argv)
        if result.returncode != 0:
            detail = result.stderr.strip() or result.stdout.strip()
            if argv[0] == "tc" and "netem" in argv and "unknown" in detail.lower():
                raise EmulationUnsupported("--latency needs the kernel's netem qdisc (CONFIG_NET_SCH_NETEM), "
                                           "which this kernel lacks; --bandwidth alone works (tbf)")
            raise EmulationFailed(f"`{' '.join(argv)}` failed ({result.returncode}): {detail}")

    def _add_namespace(self, name: str) -> None:
        self._do("ip", "netns", "add", name)
        self._created.append(name)

    def burst_bytes(self) -> int:
        """Bytes the token bucket lets through at once: the link rate for 1 ms, but never fewer
        than 10 full frames (tbf refuses a burst smaller than a frame)."""
        return max(15_000, (self.emulation.rate or 0) // 8 // 1000)

    def _shape(self, namespace: str, device: str) -> None:
        rate, delay = self.emulation.rate, self.emulation.latency_ms / 2
        if rate is not None:
            self._do("tc", "-n", namespace, "qdisc", "add", "dev", device, "root", "handle", "1:", "tbf",
                     "rate", f"{rate}bit", "burst", str(self.burst_bytes()), "latency", "100ms")
        if delay > 0:
            parent = ["parent", "1:1"] if rate is not None else ["root"]
            self._do("tc", "-n", namespace, "qdisc", "add", "dev", device, *parent, "handle", "10:", "netem",
                     "delay", f"{delay:g}ms", "limit", "100000")

    def create(self) -> None:
        """Build the bridge, the hosts and their shaped links; on any failure (or interruption)
        delete what was built and raise."""
        try:
            self._add_namespace(self.bridge)
            self._do("ip", "-n", self.bridge, "link", "add", BRIDGE_DEVICE, "type", "bridge")
            self._do("ip", "-n", self.bridge, "link", "set", BRIDGE_DEVICE, "up")
            for i, (namespace, address) in enumerate(zip(self.namespaces, self.addresses)):
                port = f"h{i}"
                self._add_namespace(namespace)
                self._do("ip", "-n", self.bridge, "link", "add", port, "type", "veth",
                         "peer", "name", HOST_DEVICE, "netns", namespace)
                self._do("ip", "-n", self.bridge, "link", "set", port, "master", BRIDGE_DEVICE, "up")
                self._do("ip", "-n", namespace, "addr", "add", f"{address}/24", "dev", HOST_DEVICE)
                self._do("ip", "-n", namespace, "link", "set", HOST_DEVICE, "up")
                self._do("ip", "-n", namespace, "link", "set", "lo", "up")
                self._shape(namespace, HOST_DEVICE)
                self._shape(self.bridge, port)
        except BaseException:
            self.delete()
            raise

    def delete(self) -> list[str]:
        """Delete every namespace this object made (the veth pairs and addresses go with them);
        safe to call more than once. Returns the names deleted."""
        deleted = []
        while self._created:
            name = self._created.pop()
            if _delete_namespace(name):
                deleted.append(name)
        return deleted

    # ---------------------------------------------------------------------- placement
    def host_of(self, role: str) -> int:
        return self.placement[role]

    def address(self, role: str) -> str:
        """The address `role` (psI / ewI / gpI) binds and its clients dial."""
        return self.addresses[self.host_of(role)]

    def server_ports(self, count: int) -> list[int]:
        return [SERVER_PORT_BASE + i for i in range(count)]

    def trainer_nodes(self, trainers: int) -> list[TrainerNode]:
        """One torchrun node per host holding trainers, in host order of their first trainer."""
        hosts: list[int] = []
        for k in range(trainers):
            if self.host_of(f"trainer{k}") not in hosts:
                hosts.append(self.host_of(f"trainer{k}"))
        counts = {h: sum(self.host_of(f"trainer{k}") == h for k in range(trainers)) for h in hosts}
        single = len(hosts) == 1
        return [TrainerNode("nn" if single else f"nn-h{h}", h, rank, counts[h]) for rank, h in enumerate(hosts)]

    def rendezvous_arguments(self, node: TrainerNode, nodes: Sequence[TrainerNode]) -> list[str]:
        """torchrun's rendezvous arguments for one node: the endpoint on the first trainer host's
        address (the first node hosts the store; c10d assigns the node ranks), and the node's own
        address, which the node of rank 0 publishes as the trainers' master address."""
        return ["--rdzv-endpoint", f"{self.addresses[nodes[0].host]}:{RENDEZVOUS_PORT}",
                "--rdzv-conf", f"is_host={int(node.node_rank == 0)}", "--local-addr", self.addresses[node.host]]

    def environment(self, env: Mapping[str, str] | None) -> dict[str, str]:
        """The roles' environment: gloo finds its interface by name (the hostname resolves to an
        address of the root namespace, which the hosts do not have)."""
        return merged_environment(env, GLOO_SOCKET_IFNAME=HOST_DEVICE)

    def wrap(self, namespace_of: int, argv: Sequence[str]) -> list[str]:
        """`argv` run inside host `namespace_of`'s namespace."""
        return ["ip", "netns", "exec", self.namespaces[namespace_of], *argv]

    def announce(self, log: Callable[[str], None]) -> None:
        """Log where the roles run, then sweep the namespaces of dead launchers' jobs."""
        log(f"emulated hosts: {self.describe()}")
        remove_dead_jobs_namespaces(log)

    def describe(self) -> str:
        by_host = {h: [r for r, host in sorted(self.placement.items()) if host == h]
                   for h in range(self.emulation.hosts)}
        hosts = "; ".join(f"h{h} {self.addresses[h]}: {', '.join(roles) or '-'}" for h, roles in by_host.items())
        return f"{self.emulation.describe()} ({hosts})"


def emulated_hosts(job: str, emulation: HostEmulation, *, ps: int, embedding_workers: int, trainers: int,
                   group_ps: int = 0, host: str = "127.0.0.1") -> EmulatedHosts:
    """The (not yet created) hosts of one job with its roles placed; EmulationUnsupported or
    ValueError (naming the flag) when they cannot be made here or the flags do not fit the job."""
    if host not in ("127.0.0.1", "localhost"):
        raise ValueError(f"--host {host} and --emulate-hosts exclude each other: each emulated host's servers "
                         f"bind to that host's address")
    check_support()
    roles = ([f"ps{i}" for i in range(ps)] + [f"ew{e}" for e in range(embedding_workers)]
             + [f"gp{g}" for g in range(group_ps)] + [f"trainer{k}" for k in range(trainers)])
    return EmulatedHosts(job, emulation, assign_hosts(roles, emulation.hosts, emulation.place))


def _delete_namespace(name: str) -> bool:
    """Kill what still runs inside namespace `name`, then delete it. Whether it is gone."""
    pids = _run(["ip", "netns", "pids", name])
    for pid in pids.stdout.split() if pids.returncode == 0 else []:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    _run(["ip", "netns", "del", name])
    return name not in list_namespaces()


def _namespace_pattern() -> re.Pattern:
    """How a job's namespaces are named."""
    return re.compile(rf"hybridrec-(?P<job>{JOB_ID})-(?:br|h[0-9]+)")


def list_namespaces() -> list[str]:
    """Names of the network namespaces `ip netns` knows."""
    result = _run(["ip", "netns", "list"])
    return [line.split()[0] for line in result.stdout.splitlines() if line.strip()] if result.returncode == 0 else []


def job_namespaces(job: str) -> list[str]:
    """The namespaces of one job that still exist."""
    pattern = _namespace_pattern()
    return [name for name in list_namespaces()
            if (match := pattern.fullmatch(name)) is not None and match["job"] == job]


def remove_dead_jobs_namespaces(log: Callable[[str], None] | None = None) -> list[tuple[str, str]]:
    """Delete the namespaces of jobs whose launcher is gone (killed with SIGKILL, so it could not
    clean up), killing whatever still runs inside them. Namespaces named otherwise, of live
    launchers, or of job ids this machine cannot judge are left alone. Returns (job, namespace)
    of each one deleted; logs one line for each through `log`."""
    if shutil.which("ip") is None:
        return []
    pattern = _namespace_pattern()
    verdicts: dict[str, bool | None] = {}
    removed = []
    for name in sorted(list_namespaces()):
        match = pattern.fullmatch(name)
        if match is None:
            continue
        job = match["job"]
        if job not in verdicts:
            verdicts[job] = launcher_alive(job)
        if verdicts[job] is False and _delete_namespace(name):
            removed.append((job, name))
            if log is not None:
                log(f"removed network namespace of dead job {job}: {name}")
    return removed
