"""Tests of emulated hosts (hybridrec/parallel/emulated_hosts.py, `hybridrec launch --emulate-hosts`):
a transfer between two hosts takes at least size / rate (the shaped link is the only way across,
and the root namespace gets no address or link); a tiny Persia job on 3 hosts completes, after a
launcher killed with SIGKILL, whose namespaces that next launch deletes, and leaves none of its
own; the flags are checked before anything starts. Tests that build namespaces skip, saying why,
without root (CAP_NET_ADMIN, CAP_SYS_ADMIN) or iproute2; every namespace they make is deleted in a
`finally`. The only timing asserted is the physical lower bound of the shaped rate."""
from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from hybridrec.cli import main
from hybridrec.parallel import emulated_hosts
from hybridrec.parallel.emulated_hosts import (EmulatedHosts, EmulationUnsupported, HostEmulation, job_namespaces,
                                               list_namespaces, parse_rate)
from hybridrec.parallel.host import new_job_id
from hybridrec.parallel.launch import launch

REPO = pathlib.Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "configs" / "persia_synthetic.yaml")
TINY = ["data.synthetic.train_rows=8192", "data.synthetic.test_rows=1000", "data.synthetic.vocab_size=100",
        "data.batch_size=256", "embedding.default.capacity=5000", "strategy.tau=2"]


def _unsupported() -> str | None:
    try:
        emulated_hosts.check_support()
    except EmulationUnsupported as exc:
        return str(exc)
    return None


needs_namespaces = pytest.mark.skipif(_unsupported() is not None, reason=f"{_unsupported()}")


def _root_links_and_addresses() -> tuple[str, str]:
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    addresses = subprocess.run(["ip", "-o", "addr", "show"], capture_output=True, text=True).stdout
    return re.sub(r"\\.*", "", links), addresses  # the names and flags, not the counters


@pytest.fixture
def hosts_factory():
    """Builds EmulatedHosts and deletes all of them at the end, whatever the test did."""
    made = []

    def make(emulation: HostEmulation) -> EmulatedHosts:
        hosts = EmulatedHosts(new_job_id(), emulation, {})
        made.append(hosts)
        hosts.create()
        return hosts

    try:
        yield make
    finally:
        for hosts in made:
            hosts.delete()
        for hosts in made:
            assert job_namespaces(hosts.job) == []


SERVER = textwrap.dedent("""
    import socket, sys
    server = socket.create_server((sys.argv[1], 7100))
    server.settimeout(30)
    print("ready", flush=True)
    connection, _ = server.accept()
    connection.settimeout(30)
    size, got = int(sys.argv[2]), 0
    while got < size:
        chunk = connection.recv(1 << 20)
        if not chunk:
            break
        got += len(chunk)
    connection.sendall(str(got).encode())
""")
CLIENT = textwrap.dedent("""
    import socket, sys, time
    size = int(sys.argv[2])
    start = time.monotonic()
    connection = socket.create_connection((sys.argv[1], 7100), timeout=30)
    connected = time.monotonic()
    connection.sendall(b"x" * size)
    got = int(connection.recv(64))
    print(connected - start, time.monotonic() - start, got, flush=True)
""")


def _transfer(hosts: EmulatedHosts, size: int) -> tuple[float, float]:
    """`size` bytes from host 1 to a server on host 0; (connect seconds, seconds until the server
    acknowledged every byte)."""
    server = subprocess.Popen(hosts.wrap(0, [sys.executable, "-c", SERVER, hosts.addresses[0], str(size)]),
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "ready"
        out = subprocess.run(hosts.wrap(1, [sys.executable, "-c", CLIENT, hosts.addresses[0], str(size)]),
                             capture_output=True, text=True, timeout=60, check=True).stdout.split()
        assert int(out[2]) == size
        return float(out[0]), float(out[1])
    finally:
        server.kill()
        server.wait()


@needs_namespaces
def test_transfer_between_hosts_takes_at_least_size_over_rate(hosts_factory):
    before = _root_links_and_addresses()
    rate, size = parse_rate("16mbit"), 1_000_000
    hosts = hosts_factory(HostEmulation(2, rate=rate))
    assert _root_links_and_addresses() == before  # nothing added to the root namespace
    assert emulated_hosts.SUBNET not in before[1]
    route = subprocess.run(["ip", "-n", hosts.namespaces[1], "route", "get", hosts.addresses[0]],
                           capture_output=True, text=True, check=True).stdout
    assert f"dev {emulated_hosts.HOST_DEVICE}" in route  # host 1 reaches host 0 through its link only
    _, seconds = _transfer(hosts, size)
    # the bucket may send one burst at once; everything else leaves at the rate, headers not counted
    assert seconds >= (size - hosts.burst_bytes()) * 8 / rate


@needs_namespaces
def test_a_failed_build_deletes_only_what_it_made(hosts_factory):
    first = hosts_factory(HostEmulation(2))
    clash = EmulatedHosts(first.job, HostEmulation(2), {})  # the same names: `ip netns add` fails
    with pytest.raises(emulated_hosts.EmulationFailed, match="ip netns add"):
        clash.create()
    assert sorted(job_namespaces(first.job)) == sorted([first.bridge, *first.namespaces])


@needs_namespaces
def test_latency_delays_the_handshake(hosts_factory):
    try:
        hosts = hosts_factory(HostEmulation(2, latency_ms=40.0))
    except EmulationUnsupported as exc:  # e.g. a kernel without netem
        pytest.skip(str(exc))
    connect, _ = _transfer(hosts, 1000)
    assert connect >= 2 * 0.040  # SYN and SYN-ACK each cross from one host to the other


def _launch_line_job(text: str) -> str:
    return re.search(r"\[launch\] job (\S+):", text).group(1)


@needs_namespaces
def test_killed_launcher_swept_by_next_launch_which_completes_on_three_hosts_and_leaves_nothing(tmp_path):
    before = _root_links_and_addresses()
    killed = subprocess.Popen(
        [sys.executable, "-m", "hybridrec.cli", "launch", CONFIG, "--ps", "1", "--embedding-workers", "1",
         "--trainers", "1", "--emulate-hosts", "2", "--timeout", "120",
         *[arg for item in [*TINY, f"train.output_dir={tmp_path / 'killed'}"] for arg in ("--set", item)]],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    dead_job = None
    try:
        lines = []
        for line in killed.stdout:  # the namespaces exist once the launcher names the hosts
            lines.append(line)
            if "[launch] emulated hosts:" in line:
                break
        dead_job = _launch_line_job("".join(lines))
        killed.send_signal(signal.SIGKILL)
        killed.wait(timeout=30)
        assert len(job_namespaces(dead_job)) == 3  # the bridge and two hosts, left behind

        out = tmp_path / "launch.log"
        with open(out, "w") as log:
            code = launch(CONFIG, ps=1, embedding_workers=1, trainers=2, overwrite=True, timeout=240,
                          overrides=[*TINY, f"train.output_dir={tmp_path / 'run'}"], out=log,
                          emulation=HostEmulation(3, rate=parse_rate("1gbit")))
        text = out.read_text()
        assert code == 0, text
        assert f"removed network namespace of dead job {dead_job}" in text
        assert job_namespaces(dead_job) == []
        job = _launch_line_job(text)
        assert job_namespaces(job) == []
        assert "trainer0" in text and re.search(r"h2 10\.213\.0\.3: \S", text)  # three hosts in use
        metrics = json.loads((tmp_path / "run" / "final_metrics.json").read_text())
        assert metrics["step"] > 0 and 0.5 < metrics["auc"] <= 1 and metrics["trainers"] == 2
        assert _root_links_and_addresses() == before
        assert not [name for name in list_namespaces() if job in name or dead_job in name]
    finally:
        if killed.poll() is None:
            killed.kill()
        if dead_job is not None:  # whatever failed above, none of its namespaces stays
            emulated_hosts.remove_dead_jobs_namespaces()


def test_flags_are_checked_before_anything_starts(capsys, monkeypatch):
    base = ["launch", CONFIG, "--ps", "1"]
    for extra, expected in (
            (["--bandwidth", "100mbit"], "--bandwidth need(s) --emulate-hosts"),
            (["--emulate-hosts", "0"], "--emulate-hosts must be between 1 and"),
            (["--emulate-hosts", "2", "--bandwidth", "10mbps"], "--bandwidth 10mbps: expected a rate"),
            (["--emulate-hosts", "2", "--latency", "-1"], "--latency must be between 0"),
            (["--emulate-hosts", "2", "--place", "ps0=5"], "host 5 of ps0 does not exist"),
            (["--emulate-hosts", "2", "--place", "db0=1"], "is not ROLE=HOST"),
            (["--emulate-hosts", "2", "--host", "0.0.0.0"], "--host 0.0.0.0 and --emulate-hosts exclude"),
    ):
        monkeypatch.setattr(emulated_hosts, "check_support", lambda: None)
        assert main([*base, *extra]) == 2, extra
        err = capsys.readouterr().err
        assert expected in err and "Traceback" not in err, (extra, err)


def test_refused_without_privilege_with_the_reason(capsys, monkeypatch):
    monkeypatch.setattr(emulated_hosts, "_capabilities", lambda: 0)
    assert main(["launch", CONFIG, "--ps", "1", "--emulate-hosts", "2"]) == 2
    err = capsys.readouterr().err
    assert "--emulate-hosts needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN missing" in err


def test_roles_go_round_robin_unless_placed():
    roles = ["ps0", "ps1", "ew0", "trainer0", "trainer1"]
    assert emulated_hosts.assign_hosts(roles, 3, {}) == {"ps0": 0, "ps1": 1, "ew0": 2, "trainer0": 0, "trainer1": 1}
    placed = emulated_hosts.assign_hosts(roles, 3, {"trainer0": 2, "trainer1": 2})
    assert placed["trainer0"] == placed["trainer1"] == 2 and placed["ps0"] == 0
    with pytest.raises(ValueError, match="--place names ew3"):
        emulated_hosts.assign_hosts(roles, 3, {"ew3": 1})
    hosts = EmulatedHosts("1-2-abcdef-000000", HostEmulation(3), placed)
    nodes = hosts.trainer_nodes(2)
    assert [(n.name, n.host, n.trainers) for n in nodes] == [("nn", 2, 2)]
    spread = EmulatedHosts("1-2-abcdef-000000", HostEmulation(3), emulated_hosts.assign_hosts(roles, 3, {}))
    nodes = spread.trainer_nodes(2)
    assert [(n.name, n.host) for n in nodes] == [("nn-h0", 0), ("nn-h1", 1)]
    first = spread.rendezvous_arguments(nodes[0], nodes)
    assert "10.213.0.1:29500" in first and "is_host=1" in first and "10.213.0.1" == first[-1]
    assert "is_host=0" in spread.rendezvous_arguments(nodes[1], nodes)
