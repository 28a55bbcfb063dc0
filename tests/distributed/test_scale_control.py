"""The launcher's control channel (`hybridrec scale RUN --ps N`) takes the job key: only the
holder of the key file the launcher wrote (mode 0600) can rescale the job, a client without the
key or with another job's is refused at once, and malformed requests get a one-line error from
a channel that keeps serving."""
import json
import os
import stat
import sys
from types import SimpleNamespace

import pytest

from hybridrec.comm.auth import AUTH_KEY_ENV, AuthError, JobKey
from hybridrec.comm.transport import Client, RemoteError
from hybridrec.errors import UserError
from hybridrec.parallel.scale import CONTROL_FILE, KEY_FILE, ScaleControl, SupervisedServers, scale
from hybridrec.parallel.supervisor import Role, Supervisor
from hybridrec.ps import serve

TABLES = {"user": {"dim": 4, "capacity": 1000, "optimizer": {"name": "sgd", "lr": 1.0}, "seed": 1}}


def control_of(run, key):
    """A ScaleControl over one in-process PS server, as `hybridrec launch` makes it (`key`: the
    roles' job key, None: a --no-job-key job)."""
    server = serve(tables=TABLES, block=False, key=key)
    env = None if key is None else {**os.environ, AUTH_KEY_ENV: key.secret}
    ps0 = Role("ps0", [sys.executable, "-m", "hybridrec.cli", "serve-ps", "--host", "127.0.0.1", "--port",
                       server.address.rsplit(":", 1)[1], "--shm-name", "unused"], env=env)
    trainer = Role("trainer0", ["true"], main=True, env=env)
    plan = SimpleNamespace(roles=[ps0, trainer], ps_addresses=[server.address], shm_names=[])
    cfg = SimpleNamespace(strategy=SimpleNamespace(ps_replicas=1, consistency="sync", dense="allreduce"),
                          train=SimpleNamespace(output_dir=str(run)))
    servers = SupervisedServers(Supervisor([ps0, trainer], out=open(os.devnull, "w")), plan)
    control = ScaleControl(cfg, plan, servers, list(TABLES), job="j")
    control.start()
    return control, server


def test_only_the_job_key_file_holder_can_rescale_and_bad_requests_leave_the_channel_serving(tmp_path, monkeypatch):
    monkeypatch.delenv(AUTH_KEY_ENV, raising=False)
    run, key = tmp_path / "run", JobKey.new()
    control, server = control_of(run, key)
    try:
        info = json.loads((run / CONTROL_FILE).read_text())
        assert key.secret not in (run / CONTROL_FILE).read_text() and info["key_file"] == KEY_FILE
        assert stat.S_IMODE((run / KEY_FILE).stat().st_mode) == 0o600
        assert (run / KEY_FILE).read_text().strip() == key.secret
        for stranger in (None, JobKey.new()):  # no key, another job's: refused at the handshake
            with Client(info["address"], timeout=30, retries=0, key=stranger) as client, pytest.raises(AuthError):
                client.request("status")
        with Client(info["address"], timeout=30, retries=0, key=key) as client:
            for op, meta in (("scale", {"ps": "three"}), ("scale", {}), ("scale", {"ps": True}), ("drop_table", {})):
                with pytest.raises(RemoteError) as refused:
                    client.request(op, meta=meta)
                assert "\n" not in refused.value.message
            assert client.request("status").meta["servers"] == [server.address]  # still serving
        with pytest.raises(UserError, match=r"--ps must be a whole number in \[1, 64\], got 0"):
            scale(run, 0)
        assert scale(run, 1)["servers"] == [server.address]  # the key file's holder rescales
        (run / KEY_FILE).chmod(0o644)
        with pytest.raises(UserError, match="may be read by other users.*only the user who launched the job"):
            scale(run, 1)
    finally:
        control.stop()
        server.stop(timeout=5)
    assert not (run / CONTROL_FILE).exists() and not (run / KEY_FILE).exists()


def test_a_job_launched_without_a_key_has_a_keyless_channel(tmp_path, monkeypatch):
    monkeypatch.delenv(AUTH_KEY_ENV, raising=False)
    run = tmp_path / "run"
    control, server = control_of(run, None)
    try:
        assert "key_file" not in json.loads((run / CONTROL_FILE).read_text()) and not (run / KEY_FILE).exists()
        assert scale(run, 1)["servers"] == [server.address]
    finally:
        control.stop()
        server.stop(timeout=5)
