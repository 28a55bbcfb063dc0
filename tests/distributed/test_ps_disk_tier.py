"""A PS server with a disk tier (`serve-ps --tier-path DIR --tier-capacity N`): rows its memory
cannot hold go to disk, and after a kill -9 and a restart on the same directories (memory tier in
shared memory, disk tier in files) the server serves every row again, the cold ones from disk,
and loading a checkpoint brings back the rows it holds."""
import os
import signal

import numpy as np

from hybridrec.ps import PSClient
from hybridrec.ps.server import launch

STARTUP_SECONDS = 120  # a cold numba cache compiles the store kernels on first start
ARGS = ["--port", "0", "--table", "user:8:512", "--optimizer", "adagrad", "--seed", "3"]


def _start(tmp_path):
    """The server, its memory tier in named shared memory under tmp_path and its disk tier there."""
    return launch([*ARGS, "--tier-path", str(tmp_path / "tiers"), "--tier-capacity", "20000", "--shm-name", "tiered",
                   "--checkpoint-root", str(tmp_path)], env={**os.environ, "HYBRIDREC_SHM_DIR": str(tmp_path)},
                  startup_timeout=STARTUP_SECONDS)


def _stop(process):
    if process.poll() is None:
        process.kill()
    process.wait(10)


def test_a_ps_server_with_a_disk_tier_restarts_and_serves_its_cold_rows(tmp_path):
    keys = np.arange(6000, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    rng = np.random.default_rng(0)
    process, address = _start(tmp_path)
    try:
        with PSClient([address], timeout=60) as client:
            for part in np.array_split(keys, 24):  # 6000 keys through 512 rows of memory
                client.lookup("user", part)
                client.push("user", part, rng.standard_normal((len(part), 8)).astype(np.float32))
            stats = client.stats()[0]["tables"]["user"]
            assert stats["rows_on_disk"] >= 6000 - 512 and stats["disk_dropped"] == 0
            client.checkpoint(tmp_path / "ck")
            before = np.concatenate([client.lookup("user", part, insert=False) for part in np.array_split(keys, 24)])
        os.kill(process.pid, signal.SIGKILL)
        process.wait(10)
        process, address = _start(tmp_path)
        with PSClient([address], timeout=60) as client:
            after = np.concatenate([client.lookup("user", part, insert=False) for part in np.array_split(keys, 24)])
            np.testing.assert_array_equal(after, before)
            # a dirty change, then the checkpoint loaded: the rows of the checkpoint again
            client.push("user", keys[:100], np.ones((100, 8), np.float32))
            client.load(tmp_path / "ck")
            loaded = np.concatenate([client.lookup("user", part, insert=False) for part in np.array_split(keys, 24)])
            np.testing.assert_array_equal(loaded, before)
    finally:
        _stop(process)
