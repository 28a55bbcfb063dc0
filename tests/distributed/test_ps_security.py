"""PS security: the job key off loopback, checkpoint paths kept inside the root, request and
dense-parameter limits, one rate-limited line per bad request."""

import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest

from hybridrec.comm.auth import (AUTH_KEY_ENV, AUTH_KEY_FILE_ENV, AuthError, JobKey, key_from_environment,
                                 write_key_file)
from hybridrec.parallel.host import role_environment
from hybridrec.comm.transport import Client, Operation, RemoteError, RequestTooLarge, Server
from hybridrec.ps import PSClient, serve
from hybridrec.ps.server import main as server_main
from helpers import raw_request

TABLES = {"user": {"dim": 8, "capacity": 1_000, "optimizer": {"name": "sgd", "lr": 0.5}, "seed": 3}}
DENSE = {"mlp.weight": (4, 2), "mlp.bias": (4,)}
ADAM = {"name": "adam", "lr": 0.01, "weight_decay": 0.0}


@pytest.fixture
def no_key_in_environment(monkeypatch):
    monkeypatch.delenv(AUTH_KEY_ENV, raising=False)
    monkeypatch.delenv(AUTH_KEY_FILE_ENV, raising=False)


@pytest.fixture
def started():
    """serve(...) with these tables; every server is stopped at the end."""
    servers = []

    def start(**options):
        servers.append(serve(tables=TABLES, block=False, **options))
        return servers[-1]

    yield start
    for server in servers:
        assert server.stop(timeout=5)


# ---------------------------------------------------------------- 1. authentication off loopback
@pytest.mark.parametrize("host", ["0.0.0.0", "*", "10.1.2.3", "::"])
def test_a_server_off_loopback_refuses_to_start_without_the_job_key(no_key_in_environment, host):
    with pytest.raises(AuthError, match=f"host {re.escape(repr(host))} is not a loopback address.*{AUTH_KEY_FILE_ENV}"):
        Server({}, host=host)


def test_serve_ps_off_loopback_without_the_key_exits_2_with_one_line(no_key_in_environment, capsys):
    with pytest.raises(SystemExit) as exit_info:
        server_main(["--host", "0.0.0.0", "--table", "user:8:100"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--host: host '0.0.0.0' is not a loopback address" in error and AUTH_KEY_FILE_ENV in error


def test_loopback_needs_no_key(no_key_in_environment, started):
    server = started()
    with PSClient([server.address]) as client:
        assert client.lookup("user", np.array([1], np.uint64)).shape == (1, 8)


def test_with_the_job_key_only_clients_that_hold_it_are_served(no_key_in_environment, started):
    key = JobKey.new()
    server = started(key=key)
    with PSClient([server.address], key=key) as client:
        assert client.lookup("user", np.array([1, 2], np.uint64)).shape == (2, 8)
    began = time.monotonic()
    for wrong in (None, JobKey.new()):
        with Client(server.address, key=wrong, timeout=5, retries=0) as stranger:
            with pytest.raises(AuthError, match="job key"):
                stranger.request("shutdown")
    assert time.monotonic() - began < 4  # refused at the handshake, not after a timeout
    for wrong in (None, JobKey.new()):  # a client whose handshake was refused before its first request
        with Client(server.address, key=wrong, timeout=5, retries=0) as stranger:
            time.sleep(0.5)  # its refused connection is gone by the time it sends: the send blocked for good
            for _ in range(2):
                with pytest.raises(AuthError, match="job key"):
                    stranger.request("stats", idempotent=True)
    assert not server.wait(0.2)  # still serving
    with PSClient([server.address], key=key) as client:
        assert client.stats()[0]["tables"]["user"]["size"] == 2


def test_clients_read_the_key_from_the_environment(no_key_in_environment, started, monkeypatch, tmp_path):
    key = write_key_file(tmp_path / "job.key")
    server = started(key=key)
    monkeypatch.setenv(AUTH_KEY_FILE_ENV, str(tmp_path / "job.key"))
    with PSClient([server.address]) as client:
        assert client.ping()[0]["tables"] == {"user": 8}
    monkeypatch.delenv(AUTH_KEY_FILE_ENV)
    monkeypatch.setenv(AUTH_KEY_ENV, key.secret)
    with Client(server.address, timeout=5) as raw:
        assert raw.request("ping").meta["tables"] == {"user": 8}


def test_bad_key_settings_are_refused_naming_the_setting_but_never_the_key(no_key_in_environment, tmp_path):
    path = tmp_path / "job.key"
    key = write_key_file(path)
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert key_from_environment({AUTH_KEY_FILE_ENV: str(path)}).client_public == key.client_public
    path.chmod(0o644)
    with pytest.raises(AuthError, match=r"may be read by other users \(mode 0644\)"):
        key_from_environment({AUTH_KEY_FILE_ENV: str(path)})
    with pytest.raises(AuthError, match=f"{AUTH_KEY_ENV} must hold a job key of 64 hex digits") as info:
        key_from_environment({AUTH_KEY_ENV: "secret-but-short"})
    assert "secret-but-short" not in str(info.value)
    with pytest.raises(AuthError, match="cannot be read"):
        key_from_environment({AUTH_KEY_FILE_ENV: str(tmp_path / "missing")})
    with pytest.raises(AuthError, match="set one of them"):
        key_from_environment({AUTH_KEY_ENV: key.secret, AUTH_KEY_FILE_ENV: str(path)})
    assert key.secret not in repr(key)


def test_the_launcher_hands_a_new_key_per_job_through_the_environment_on_loopback_too(no_key_in_environment,
                                                                                         tmp_path):
    first, second = role_environment("127.0.0.1"), role_environment("0.0.0.0")
    assert JobKey.from_text(first[AUTH_KEY_ENV], "test").secret != second[AUTH_KEY_ENV]
    assert first["PATH"] == os.environ["PATH"]
    # opted out: on loopback the roles inherit this environment and serve without a key; off it, refused
    assert role_environment("127.0.0.1", job_key=False) is None and role_environment("localhost", job_key=False) is None
    with pytest.raises(ValueError, match="--no-job-key: the servers bind 0.0.0.0, off loopback"):
        role_environment("0.0.0.0", job_key=False)
    mine = JobKey.new()  # a key the launcher's user configured: every role gets it, so the user reaches them too
    path = tmp_path / "job.key"
    write_key_file(path, mine)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(AUTH_KEY_FILE_ENV, str(path))
        given = role_environment("127.0.0.1")
    assert given[AUTH_KEY_ENV] == mine.secret and AUTH_KEY_FILE_ENV not in given


NETNS_SERVER = """
import sys
from hybridrec.ps.server import main
sys.exit(main(["--host", sys.argv[1], "--port", "7001", "--table", "user:8:1000"]))
"""
NETNS_CLIENT = """
import sys, numpy as np
from hybridrec.comm.auth import AuthError, JobKey
from hybridrec.comm.transport import Client
from hybridrec.ps import PSClient
address = sys.argv[1]
try:
    Client(address, key=None, timeout=10, retries=0).request("shutdown")
    print("unauthenticated client served")
except AuthError:
    print("unauthenticated client refused")
with PSClient([address], timeout=10) as client:  # the key from the environment
    print("lookup", client.lookup("user", np.array([5], np.uint64)).shape)
    client.shutdown()
"""


def _netns(name, *command, **options):
    return subprocess.run(["ip", "netns", "exec", name, *command], check=True, timeout=20, **options)


def test_off_loopback_in_a_network_namespace_only_key_holders_are_served(tmp_path):
    """A real non-loopback bind, in a namespace of the test's own (two veth ends, no route out)."""
    if shutil.which("ip") is None or os.geteuid() != 0:
        pytest.skip("needs root and iproute2 to make a network namespace")
    name = f"hrsec-{uuid.uuid4().hex[:8]}"
    if subprocess.run(["ip", "netns", "add", name], capture_output=True).returncode != 0:
        pytest.skip("network namespaces are not available here")
    server = None
    try:
        _netns(name, "ip", "link", "set", "lo", "up")  # local delivery to the veth addresses goes through lo
        _netns(name, "ip", "link", "add", "hr0", "type", "veth", "peer", "name", "hr1")
        for device, address in (("hr0", "10.231.0.1/24"), ("hr1", "10.231.0.2/24")):
            _netns(name, "ip", "addr", "add", address, "dev", device)
            _netns(name, "ip", "link", "set", device, "up")
        env = {**{k: v for k, v in os.environ.items() if k != AUTH_KEY_FILE_ENV}, AUTH_KEY_ENV: JobKey.new().secret}
        server = subprocess.Popen(["ip", "netns", "exec", name, sys.executable, "-c", NETNS_SERVER, "10.231.0.1"],
                                  env=env, stdout=subprocess.PIPE, text=True)
        assert "listening on tcp://10.231.0.1:7001" in server.stdout.readline()
        client = subprocess.run(["ip", "netns", "exec", name, sys.executable, "-c", NETNS_CLIENT,
                                 "tcp://10.231.0.1:7001"], env=env, capture_output=True, text=True, timeout=60)
        assert client.stdout.splitlines() == ["unauthenticated client refused", "lookup (1, 8)"], client.stderr
        assert server.wait(timeout=15) == 0  # the key holder's shutdown
    finally:
        if server is not None and server.poll() is None:
            server.kill()
            server.wait(10)
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=20)


# ---------------------------------------------------------------- 2. checkpoint paths
def test_a_server_without_a_checkpoint_root_refuses_checkpoint_and_load(started, tmp_path):
    server = started()
    with Client(server.address, timeout=10) as raw:
        for op in ("checkpoint", "load"):
            with pytest.raises(RemoteError, match="no checkpoint root.*--checkpoint-root DIR"):
                raw.request(op, meta={"directory": str(tmp_path / "c")})
    assert not list(tmp_path.iterdir())


def test_checkpoint_and_load_paths_that_leave_the_root_are_refused(started, tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "inside").mkdir(parents=True)
    outside.mkdir()
    (root / "link").symlink_to(outside)
    server = started(checkpoint_root=root)
    with Client(server.address, timeout=10) as raw:
        for directory in ["inside/../../escape", str(root / "inside/../../escape"), str(outside / "c"),
                          "link/c", "/etc", "../root2"]:
            for op in ("checkpoint", "load"):
                with pytest.raises(RemoteError, match="outside this server's checkpoint root|follows no symlink inside"):
                    raw.request(op, meta={"directory": directory})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outside", "root"]
    assert not list(outside.iterdir())


def test_a_checkpoint_never_replaces_or_deletes_files_it_did_not_write(started, tmp_path):
    folder = tmp_path / "mine"
    (folder / "user").mkdir(parents=True)
    (folder / "user" / "notes.txt").write_text("keep me")
    (folder / "dense").mkdir()
    (folder / "dense" / "meta.json").write_text("{}")
    server = started(checkpoint_root=tmp_path)
    with Client(server.address, timeout=10) as raw:
        with pytest.raises(RemoteError, match="already exists and is not an empty directory"):
            raw.request("checkpoint", meta={"directory": "mine"})
    assert (folder / "user" / "notes.txt").read_text() == "keep me"
    assert (folder / "dense" / "meta.json").read_text() == "{}"
    assert sorted(p.name for p in folder.iterdir()) == ["dense", "user"]


def test_paths_inside_the_root_work_absolute_or_relative(started, tmp_path):
    server = started(checkpoint_root=tmp_path)
    keys = np.arange(1, 50, dtype=np.uint64)
    with PSClient([server.address]) as client:
        saved = client.lookup("user", keys)
        client.checkpoint(tmp_path / "run" / "checkpoints" / "step-1")  # as a trainer sends it
        client.push("user", keys, np.ones((len(keys), 8), np.float32))
        client.load("run/checkpoints/step-1")  # relative: from the root
        np.testing.assert_array_equal(client.lookup("user", keys, insert=False), saved)
    assert (tmp_path / "run/checkpoints/step-1/shard-0000-of-0001/user").is_dir()


# ---------------------------------------------------------------- 3. memory limits
def test_dense_init_takes_only_the_jobs_declared_params(started):
    server = started(dense_params=DENSE)
    good = {name: np.ones(shape, np.float32) for name, shape in DENSE.items()}
    with Client(server.address, timeout=10) as raw:
        with pytest.raises(RemoteError, match=r"\['extra'\] are not parameters of this job's dense model"):
            raw.request("dense_init", {**good, "extra": np.ones(10, np.float32)}, {"optimizer": ADAM})
        with pytest.raises(RemoteError, match=r"'mlp.bias'.*\(given, declared\).*\[1000\].*\[4\]"):
            raw.request("dense_init", {"mlp.bias": np.ones(1000, np.float32)}, {"optimizer": ADAM})
        assert raw.request("stats").meta["dense"]["params"] == {}  # nothing was taken
        raw.request("dense_init", good, {"optimizer": ADAM})
        assert raw.request("stats").meta["dense"]["params"] == {"mlp.bias": [4], "mlp.weight": [4, 2]}
    plain = started()
    with Client(plain.address, timeout=10) as raw:
        with pytest.raises(RemoteError, match="this server declares none.*--config"):
            raw.request("dense_init", good, {"optimizer": ADAM})


def test_requests_with_too_many_keys_or_bytes_are_refused(started):
    server = started(max_keys_per_request=100)
    with Client(server.address, timeout=10) as raw:
        with pytest.raises(RemoteError, match="carries 101 keys; this server takes at most 100"):
            raw.request("lookup", {"keys": np.arange(101, dtype=np.uint64)}, {"table": "user"})
        with pytest.raises(RemoteError, match="carries 120 keys"):
            raw.request("lookup_many", {"keys.0": np.arange(60, dtype=np.uint64),
                                        "keys.1": np.arange(60, dtype=np.uint64)}, {"tables": ["user", "user"]})
        limit = server.transport.max_request_bytes
        chunks = {f"c{i}": np.zeros(limit // 4 // 2, np.float32) for i in range(3)}  # each frame under the limit
        with pytest.raises(RequestTooLarge, match=f"larger than this server's limit of {limit} bytes"):
            raw.request("dense_push", chunks)  # the client asks the limit first and does not send it
        assert raw.request("stats").meta["tables"]["user"]["size"] == 0
    header = json.dumps({"op": "dense_push", "id": 7, "arrays": [["c", "<f4", [limit // 4 + 10]]]}).encode()
    for frames in ([header, bytes(limit + 40)], [header, *[bytes(limit // 2)] * 3]):  # one frame over, or many
        reply = raw_request(server.address, frames)  # a bare client that sends it anyway gets an answer
        assert reply["ok"] is False and f"larger than this server's limit of {limit} bytes" in reply["error"]
    with PSClient([server.address], max_keys_per_request=100) as client:  # a client that splits is served
        assert client.lookup("user", np.arange(250, dtype=np.uint64)).shape == (250, 8)


# ---------------------------------------------------------------- 4. bad requests in the log
def test_a_deeply_nested_header_logs_one_line_per_request_rate_limited(caplog):
    server = Server({"ping": Operation(lambda request: request)}, key=None)
    server.start()
    nested = ("[" * 100_000 + "]" * 100_000).encode()
    try:
        with caplog.at_level(logging.WARNING, logger="hybridrec.comm"):
            for _ in range(30):
                header = raw_request(server.address, [nested])
                assert header["ok"] is False and "nests JSON too deeply" in header["error"]
    finally:
        assert server.stop(timeout=5)
    records = [r for r in caplog.records if r.name.startswith("hybridrec.comm")]
    assert 1 <= len(records) <= 10  # rate-limited
    for record in records:
        assert record.exc_info is None and "\n" not in record.getMessage()
        assert "nests JSON too deeply" in record.getMessage()
    assert "Traceback" not in caplog.text and "RecursionError" not in caplog.text
