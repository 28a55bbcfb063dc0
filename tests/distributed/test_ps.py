"""Embedding PS: lookup/push across server processes, codecs, bad requests, kill -9 + restart."""

import os
import signal
import threading

import numpy as np
import pytest

from hybridrec.comm.transport import Client, RemoteError
from hybridrec.embedding import EmbeddingStore, TableConfig
from hybridrec.ps import PSClient, serve
from hybridrec.ps.server import launch, main as server_main

TABLES = {"user": {"dim": 8, "capacity": 20_000, "optimizer": {"name": "sgd", "lr": 0.5}, "seed": 3},
          "item": {"dim": 4, "capacity": 1_000, "optimizer": {"name": "sgd", "lr": 0.5}, "seed": 3}}
TABLE_ARGS = ["--table", "user:8:20000", "--table", "item:4:1000", "--optimizer", "sgd",
              "--lr", "0.5", "--seed", "3"]
STARTUP_SECONDS = 120  # a cold numba cache compiles the store kernels on first start


def start_server_process(shm_dir, *extra):
    """A `python -m hybridrec.ps.server` process on a free port and its address."""
    env = {**os.environ, "HYBRIDREC_SHM_DIR": str(shm_dir)}
    return launch(["--port", "0", *TABLE_ARGS, *extra], env=env, startup_timeout=STARTUP_SECONDS)


def stop_process(process):
    if process.poll() is None:
        process.kill()
    process.wait(10)


@pytest.fixture
def two_servers(tmp_path):
    processes = []
    try:
        for _ in range(2):
            processes.append(start_server_process(tmp_path))
        yield [address for _, address in processes]
    finally:
        for process, _ in processes:
            stop_process(process)


@pytest.fixture
def local_server(tmp_path):
    server = serve(tables=TABLES, block=False, checkpoint_root=tmp_path)
    try:
        yield server
    finally:
        assert server.stop(timeout=5)


def zipf_keys(n, seed):
    rng = np.random.default_rng(seed)
    return rng.zipf(1.2, size=n).astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)


def test_lookup_and_push_across_two_server_processes_match_one_local_store(two_servers):
    reference = EmbeddingStore(TableConfig.from_dict(TABLES["user"]))
    keys = zipf_keys(3000, seed=0)
    grads = np.random.default_rng(1).standard_normal((len(keys), 8)).astype(np.float32)
    with PSClient(two_servers, timeout=30) as client:
        rows = client.lookup("user", keys)
        np.testing.assert_array_equal(rows, reference.pull(keys))  # same init on every shard
        assert client.push("user", keys, grads) == 0
        reference.push(keys, grads)
        np.testing.assert_allclose(client.lookup("user", keys, insert=False),
                                   reference.pull(keys, insert=False), rtol=1e-5, atol=1e-6)
        sizes = [shard["tables"]["user"]["size"] for shard in client.stats()]
    assert all(size > 0 for size in sizes), sizes  # the keys were spread over both shards
    assert sum(sizes) == len(np.unique(keys))


def test_fp16_codec_rows_stay_within_the_fp16_bound(local_server):
    keys = zipf_keys(500, seed=2)
    with PSClient([local_server.address], value_codec="none") as exact, \
            PSClient([local_server.address], value_codec="fp16") as compressed:
        rows = exact.lookup("user", keys)
        approx = compressed.lookup("user", keys, insert=False)
        assert compressed.push("user", keys, np.ones((len(keys), 8), np.float32)) == 0
        updated = exact.lookup("user", keys, insert=False)
    norms = np.abs(rows).max(axis=1, keepdims=True)
    assert np.all(np.abs(approx - rows) <= norms * 2.0**-10)
    assert np.all(updated < rows)  # the fp16 gradients arrived and were applied


def test_lookup_of_absent_keys_without_insert_reads_zeros_and_stores_nothing(local_server):
    with PSClient([local_server.address]) as client:
        rows = client.lookup("item", np.array([11, 12, 11], np.uint64), insert=False)
        assert rows.shape == (3, 4) and not rows.any()
        assert client.stats()[0]["tables"]["item"]["size"] == 0


def test_bad_requests_get_clear_errors_and_the_server_keeps_serving(local_server):
    with Client(local_server.address, timeout=10) as raw:
        with pytest.raises(RemoteError, match="'nope'.*item.*user"):
            raw.request("lookup", {"keys": np.array([1], np.uint64)}, {"table": "nope"})
        with pytest.raises(RemoteError, match="'insert' must be true or false"):
            raw.request("lookup", {"keys": np.array([1], np.uint64)}, {"table": "user", "insert": 1})
        with pytest.raises(RemoteError, match=r"grads.*\(2, 8\)"):
            raw.request("push", {"keys": np.array([1, 2], np.uint64),
                                 "values": np.ones((2, 3), np.float32)}, {"table": "user"})
        with pytest.raises(RemoteError, match="value codec"):
            raw.request("lookup", {"keys": np.array([1], np.uint64)},
                        {"table": "user", "codec": "zip"})
    with PSClient([local_server.address]) as client:
        with pytest.raises(ValueError, match="NaN"):
            client.push("user", np.array([1], np.uint64), np.full((1, 8), np.nan, np.float32))
        with pytest.raises(TypeError, match="uint64"):
            client.lookup("user", np.array([1, 2], np.int64))
        with pytest.raises(ValueError, match="'nope' is not served"):
            client.lookup("nope", np.array([1], np.uint64))
        assert client.lookup("user", np.array([1], np.uint64)).shape == (1, 8)


def test_shutdown_request_stops_the_server(local_server):
    with PSClient([local_server.address]) as client:
        client.shutdown()
    assert local_server.wait(timeout=10)


@pytest.mark.parametrize("how", ["shutdown request", "SIGTERM"])
def test_server_process_exits_cleanly_when_asked(tmp_path, how):
    process, address = start_server_process(tmp_path)
    try:
        if how == "SIGTERM":
            process.terminate()
        else:
            with PSClient([address], timeout=30) as client:
                client.shutdown()
        assert process.wait(timeout=15) == 0
    finally:
        stop_process(process)


def test_killed_shared_memory_server_restarts_with_every_acknowledged_update(tmp_path):
    keys = zipf_keys(2000, seed=4)
    rng = np.random.default_rng(5)
    process, address = start_server_process(tmp_path, "--shm-name", "ps-test")
    try:
        with PSClient([address], timeout=30) as client:
            client.lookup("user", keys)
            for _ in range(3):
                client.push("user", keys, rng.standard_normal((len(keys), 8)).astype(np.float32))
            acknowledged = client.lookup("user", keys, insert=False)
            step = client.stats()[0]["tables"]["user"]["step"]
        os.kill(process.pid, signal.SIGKILL)
        process.wait(10)
        process, address = start_server_process(tmp_path, "--shm-name", "ps-test")
        with PSClient([address], timeout=30) as client:
            np.testing.assert_array_equal(client.lookup("user", keys, insert=False), acknowledged)
            assert client.stats()[0]["tables"]["user"]["step"] == step
    finally:
        stop_process(process)


def test_bad_client_and_server_arguments_are_rejected():
    with pytest.raises(ValueError, match="addresses"):
        PSClient("tcp://127.0.0.1:1")
    with pytest.raises(ValueError, match="value codec"):
        PSClient(["tcp://127.0.0.1:1"], value_codec="bf17")
    with pytest.raises(ValueError, match="tables"):
        serve(tables={}, block=False)
    with pytest.raises(TypeError, match="tables\\['user'\\]"):
        serve(tables={"user": 16}, block=False)


def test_checkpoint_then_load_restores_the_rows_of_the_checkpoint(local_server, tmp_path):
    keys = zipf_keys(1000, seed=6)
    grads = np.ones((len(keys), 8), np.float32)
    with PSClient([local_server.address]) as client:
        client.lookup("user", keys)
        client.push("user", keys, grads)
        saved = client.lookup("user", keys, insert=False)
        client.checkpoint(tmp_path / "ckpt")
        client.push("user", keys, grads)
        assert not np.array_equal(client.lookup("user", keys, insert=False), saved)
        with pytest.raises(RemoteError, match="elsewhere' does not exist"):
            client.load(tmp_path / "elsewhere")
        (tmp_path / "empty" / "shard-0000-of-0001").mkdir(parents=True)
        with pytest.raises(RemoteError, match="has no checkpoint of tables"):
            client.load(tmp_path / "empty")
        client.load(tmp_path / "ckpt")
        np.testing.assert_array_equal(client.lookup("user", keys, insert=False), saved)


def test_concurrent_clients_on_a_threaded_server_lose_no_push(local_server):
    keys = [np.arange(k * 1000, (k + 1) * 1000, dtype=np.uint64) for k in range(4)]
    with PSClient([local_server.address]) as client:
        before = [client.lookup("user", k) for k in keys]
    errors = []

    def push_twice(k):
        try:
            with PSClient([local_server.address], timeout=30) as own:
                for _ in range(2):
                    own.push("user", k, np.ones((len(k), 8), np.float32))
        except Exception as error:  # surfaced below; a thread cannot fail the test itself
            errors.append(error)

    threads = [threading.Thread(target=push_twice, args=(k,), daemon=True) for k in keys]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors and not any(thread.is_alive() for thread in threads)
    with PSClient([local_server.address]) as client:
        for k, rows in zip(keys, before):  # sgd, lr 0.5, two pushes of ones: every row moved by -1
            np.testing.assert_allclose(client.lookup("user", k, insert=False), rows - 1.0, atol=1e-6)


def test_lookups_and_pushes_split_into_many_requests_give_the_same_rows(local_server):
    keys = zipf_keys(700, seed=7)  # repeated keys: a push sums their gradients
    grads = np.random.default_rng(8).standard_normal((len(keys), 8)).astype(np.float32)
    unique, inverse = np.unique(keys, return_inverse=True)
    summed = np.zeros((len(unique), 8), np.float32)
    np.add.at(summed, inverse, grads)
    sgd_step = -0.5 * summed[inverse]  # TABLES["user"]: sgd with lr 0.5
    with PSClient([local_server.address]) as whole, \
            PSClient([local_server.address], max_keys_per_request=7) as split:
        before = whole.lookup("user", keys)
        np.testing.assert_array_equal(split.lookup("user", keys, insert=False), before)
        split.push("user", keys, grads)
        np.testing.assert_allclose(whole.lookup("user", keys, insert=False), before + sgd_step, atol=1e-5)


def test_server_command_line_rejects_bad_tables_and_launch_reports_it():
    with pytest.raises(SystemExit):
        server_main(["--table", "user:sixteen:1000"])
    with pytest.raises(SystemExit):
        server_main([])  # no table at all
    with pytest.raises(RuntimeError, match="did not start"):
        launch(["--table", "user:8"], startup_timeout=STARTUP_SECONDS)


def test_a_server_killed_under_a_request_is_retried_at_once_and_answers_after_its_restart(tmp_path):
    """The request's connection closes with the server: the client says so (ConnectionLost) instead
    of waiting out its timeout, and the retry is answered by the server restarted on that port."""
    from hybridrec.comm.transport import ConnectionLost

    process, address = start_server_process(tmp_path, "--shm-name", "lost")
    try:
        client = Client(address, timeout=120, retries=0)
        client.request("ping", idempotent=True)
        os.kill(process.pid, signal.SIGSTOP)  # the next request waits for a reply that never comes
        threading.Timer(0.5, os.kill, (process.pid, signal.SIGKILL)).start()
        with pytest.raises(ConnectionLost, match="closed before the reply"):
            client.request("stats", idempotent=True)
        process.wait(30)
        process, _ = start_server_process(tmp_path, "--shm-name", "lost", "--port", address.rsplit(":", 1)[1])
        assert "user" in client.request("stats", idempotent=True, retries=2).meta["tables"]
        client.close()
    finally:
        stop_process(process)
