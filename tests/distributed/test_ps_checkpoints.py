"""PS checkpoints and loads (hybridrec.ps.checkpoints): through directory handles that a symlink
swapped in mid-way cannot redirect, idempotent under retries, in the background, and resumed by
a server restarted in the middle of one."""

import ctypes
import json
import logging
import os
import signal
import threading
import time

import numpy as np
import pytest

from hybridrec.comm.transport import Client, RemoteError
from hybridrec.ps import PSClient, serve
from hybridrec.ps.checkpoints import MARKER
from hybridrec.ps.server import launch

TABLES = {"user": {"dim": 16, "capacity": 30_000, "optimizer": {"name": "sgd", "lr": 0.5}, "seed": 3}}
KEYS = np.arange(1, 20_001, dtype=np.uint64)
RACES = 25
AT_FDCWD, RENAME_EXCHANGE = -100, 2  # <fcntl.h>, <linux/fs.h>
LIBC = ctypes.CDLL(None, use_errno=True)  # the C library already loaded: renameat2


@pytest.fixture
def server_in(tmp_path):
    servers = []

    def start(root, tables=TABLES):
        servers.append(serve(tables=tables, block=False, checkpoint_root=root, key=None))
        return servers[-1]

    yield start
    for server in servers:
        assert server.stop(timeout=10)


def _exchange(a, b):
    """Swaps the names `a` and `b` in one atomic step (renameat2 RENAME_EXCHANGE), so that neither
    path is ever missing: a server that makes a missing directory again cannot end the swapping."""
    if LIBC.renameat2(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno), f"{a} <-> {b}")


class Swapper:
    """Swaps `path` between a real directory and a symlink to `outside`, over and over, by atomic
    exchanges, until stopped (at most `seconds`)."""

    def __init__(self, path, outside, seconds=60.0):
        self.path, self.link = path, path.with_name(path.name + ".link")
        self.link.symlink_to(outside, target_is_directory=True)
        self.stop, self.swaps, self.seconds, self.error = threading.Event(), 0, seconds, None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        deadline = time.monotonic() + self.seconds
        try:
            while not self.stop.is_set() and time.monotonic() < deadline:
                _exchange(self.path, self.link)  # now a symlink out of the root
                time.sleep(0.0005)
                _exchange(self.path, self.link)  # a real directory again
                self.swaps += 1
                time.sleep(0.0005)
        except OSError as error:  # raised again by __exit__: a swapping that stopped early tests less
            self.error = error

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(10)
        if self.error is not None:
            raise self.error


def test_a_symlink_swapped_in_during_checkpoints_and_loads_never_leads_outside_the_root(server_in, tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "run").mkdir(parents=True)
    outside.mkdir()
    server = server_in(root)
    with PSClient([server.address]) as client:
        client.push("user", KEYS, np.ones((len(KEYS), 16), np.float32))
        inside = client.lookup("user", KEYS, insert=False)
        client.checkpoint(root / "run" / "good")
        # a checkpoint of other values outside the root, where the swapped symlink points
        other = serve(tables=TABLES, block=False, checkpoint_root=outside, key=None)
        with PSClient([other.address]) as other_client:
            other_client.push("user", KEYS, -np.ones((len(KEYS), 16), np.float32))
            other_client.checkpoint(outside / "good")
        assert other.stop(timeout=10)
        outside_before = sorted(p.relative_to(outside) for p in outside.rglob("*"))
        loaded, refused = 0, 0
        with Swapper(root / "run", outside) as swapper:
            for i in range(RACES):
                for op, directory in (("checkpoint", f"run/c{i}"), ("load", "run/good")):
                    try:
                        getattr(client, op)(directory)
                        if op == "load":
                            np.testing.assert_array_equal(client.lookup("user", KEYS, insert=False), inside)
                            loaded += 1
                    except RemoteError as error:  # the swap was in place when the request walked the path
                        assert "follows no symlink inside its checkpoint root" in str(error) \
                            or "does not exist" in str(error), str(error)
                        refused += 1
        assert swapper.swaps > 0 and loaded > 0
    assert sorted(p.relative_to(outside) for p in outside.rglob("*")) == outside_before  # nothing written there


def test_a_retried_checkpoint_cleans_its_own_partial_output_and_keeps_others_files(server_in, tmp_path):
    server = server_in(tmp_path)
    partial = tmp_path / "step-1"
    (partial / "user").mkdir(parents=True)  # what an interrupted attempt of token "t1" left
    (partial / "user" / "rows.bin").write_bytes(b"half")
    (partial / ".user.tmp-999").mkdir()
    (partial / "notes.txt").write_text("someone else's")
    (partial / MARKER).write_text(json.dumps({"token": "t1", "state": "writing", "entries": ["dense", "user"]}))
    with Client(server.address, timeout=10) as raw:
        with pytest.raises(RemoteError, match="holds another checkpoint"):
            raw.request("checkpoint", meta={"directory": "step-1", "token": "t2"})
        reply = raw.request("checkpoint", meta={"directory": "step-1", "token": "t1", "wait": 10})
        assert reply.meta["state"] == "done" and reply.meta["tables"] == ["user"]
        assert sorted(p.name for p in partial.iterdir()) == [MARKER, "notes.txt", "routing.json", "user"]
        assert (partial / "notes.txt").read_text() == "someone else's"
        written = (partial / "user" / "manifest.json").stat().st_mtime_ns
        again = raw.request("checkpoint", meta={"directory": "step-1", "token": "t1"})  # a retry after a lost reply
        assert again.meta["state"] == "done" and (partial / "user" / "manifest.json").stat().st_mtime_ns == written
        raw.request("load", meta={"directory": "step-1", "token": "l1", "wait": 10})


def test_a_long_checkpoint_answers_at_once_and_is_polled_and_a_load_waits_for_it(server_in, tmp_path):
    big = {f"t{i}": {"dim": 32, "capacity": 200_000, "optimizer": {"name": "adagrad", "lr": 0.1}} for i in range(3)}
    server = server_in(tmp_path, big)
    with PSClient([server.address]) as client:
        for table in big:
            client.lookup(table, np.arange(200_000, dtype=np.uint64))
    with Client(server.address, timeout=10) as raw:
        meta = {"directory": "slow", "token": "s", "wait": 0}
        assert raw.request("checkpoint", meta=meta).meta["state"] == "running"
        with pytest.raises(RemoteError, match="a checkpoint of .*slow' is running on this server"):
            raw.request("load", meta={"directory": "slow", "token": "x", "wait": 0})
        deadline = time.monotonic() + 120
        while raw.request("checkpoint", meta=meta).meta["state"] == "running":  # the same request polls it
            assert time.monotonic() < deadline
            time.sleep(0.05)
    assert json.loads((tmp_path / "slow" / MARKER).read_text())["state"] == "complete"


def test_a_server_killed_mid_checkpoint_and_restarted_finishes_the_same_request(tmp_path):
    shm = f"hybridrec-test-ckpt-{os.getpid()}"
    tables = {f"t{i}": {"dim": 32, "capacity": 150_000, "optimizer": {"name": "sgd", "lr": 0.5}} for i in range(3)}
    args = ["--tables-json", json.dumps(tables), "--shm-name", shm, "--checkpoint-root", str(tmp_path)]
    keys = np.arange(150_000, dtype=np.uint64)
    process, address = launch(args)
    try:
        with PSClient([address]) as client:
            for table in tables:
                client.push(table, keys, np.ones((len(keys), 32), np.float32))
            saved = client.lookup("t2", keys[:1000], insert=False)
        meta = {"directory": "step-7", "token": "abc", "wait": 0}
        with Client(address, timeout=10, retries=0) as raw:
            assert raw.request("checkpoint", meta=meta).meta["state"] == "running"
        marker = tmp_path / "step-7" / MARKER
        deadline = time.monotonic() + 30
        while not (marker.exists() and json.loads(marker.read_text())["state"] == "writing"):
            assert time.monotonic() < deadline
        os.kill(process.pid, signal.SIGKILL)  # in the middle of writing its tables
        process.wait(10)
        assert json.loads(marker.read_text())["state"] == "writing"
        process, address = launch(args + ["--port", address.rsplit(":", 1)[1]])  # as launch restarts a PS
        with Client(address, timeout=10, retries=3) as raw:
            reply = raw.request("checkpoint", meta={**meta, "wait": 10}, idempotent=True)  # the same request again
            while reply.meta["state"] == "running":
                reply = raw.request("checkpoint", meta={**meta, "wait": 10}, idempotent=True)
        assert reply.meta == {"state": "done", "directory": str(tmp_path / "step-7"), "tables": ["t0", "t1", "t2"]}
    finally:
        process.kill()
        process.wait(10)
        for name in os.listdir("/dev/shm"):
            if name.startswith(shm):
                os.unlink(f"/dev/shm/{name}")
    fresh = serve(tables=tables, block=False, checkpoint_root=tmp_path, key=None)
    try:
        with Client(fresh.address, timeout=10) as raw:
            assert raw.request("load", meta={"directory": "step-7", "wait": 10}).meta["state"] == "done"
        with PSClient([fresh.address]) as client:
            np.testing.assert_array_equal(client.lookup("t2", keys[:1000], insert=False), saved)
    finally:
        assert fresh.stop(timeout=10)


def test_os_errors_of_checkpoints_are_one_rate_limited_line_each(server_in, tmp_path, caplog):
    server = server_in(tmp_path)
    with caplog.at_level(logging.WARNING, logger="hybridrec.comm"), Client(server.address, timeout=10) as raw:
        for i in range(300):
            with pytest.raises(RemoteError, match="File name too long"):
                raw.request("checkpoint" if i % 2 else "load", meta={"directory": "x" * 300 + str(i)})
    records = [r for r in caplog.records if r.name.startswith("hybridrec.comm")]
    assert 1 <= len(records) <= 10 and all(r.exc_info is None for r in records)
    assert "Traceback" not in caplog.text and len(caplog.text) < 10_000
