"""ZeroMQ transport: array echo, timeouts + retries, malformed frames, bounded shutdown."""

import json
import socket
import threading
import time

import numpy as np
import pytest
import zmq

from hybridrec.comm.auth import JobKey
from hybridrec.comm.transport import (
    Client, ConnectionRefused, Message, Operation, RemoteError, Server, encode_frames, request_all,
)
from helpers import raw_request


def echo(request: Message) -> Message:
    return Message("echo", {name: np.array(a) for name, a in request.arrays.items()}, request.meta)


def fail(request: Message) -> Message:
    raise ValueError("keys must be sorted, got [3, 1]")


def sum_keys(request: Message) -> Message:
    return Message("sum", {"total": np.array([request.arrays["keys"].sum()], np.uint64)})


OPERATIONS = {
    "echo": Operation(echo, arrays=None),
    "fail": Operation(fail),
    "sum": Operation(sum_keys, {"keys": "uint64"}),
}


@pytest.fixture
def server():
    srv = Server(OPERATIONS, threads=2)
    srv.start()
    try:
        yield srv
    finally:
        assert srv.stop(timeout=5)


@pytest.fixture
def client(server):
    with Client(server.address, timeout=5, retries=0) as c:
        yield c


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_arrays_and_meta_survive_the_round_trip(client):
    arrays = {
        "keys": np.array([0, 1, 2**64 - 1], dtype=np.uint64),
        "rows": np.arange(12, dtype=np.float32).reshape(3, 4),
        "half": np.array([[1.5, -2.0]], dtype=np.float16),
        "empty": np.zeros((0, 8), dtype=np.float32),
        "strided": np.arange(10, dtype=np.int64)[::2],
    }
    reply = client.request("echo", arrays, {"table": "user", "insert": True})
    assert reply.meta == {"table": "user", "insert": True}
    for name, array in arrays.items():
        assert reply.arrays[name].dtype == array.dtype
        np.testing.assert_array_equal(reply.arrays[name], array)


def test_handler_errors_reach_the_client_and_the_server_keeps_serving(client):
    with pytest.raises(RemoteError, match="keys must be sorted") as info:
        client.request("fail")
    assert info.value.kind == "ValueError"
    assert client.request("sum", {"keys": np.array([2, 3], np.uint64)}).arrays["total"][0] == 5


def test_operation_checks_array_names_and_dtypes(client):
    with pytest.raises(RemoteError, match="must be uint64, got float32"):
        client.request("sum", {"keys": np.array([2.0], np.float32)})
    with pytest.raises(RemoteError, match="takes arrays"):
        client.request("sum", {"ids": np.array([2], np.uint64)})
    with pytest.raises(RemoteError, match="unknown op 'nope'"):
        client.request("nope")


MALFORMED = [
    ([b"\xff not json"], "not UTF-8 JSON"),
    ([b"[1, 2]"], "JSON object"),
    ([json.dumps({"op": "sum", "id": 1, "arrays": [["keys", "<u8", [10]]]}).encode(),
      np.arange(2, dtype=np.uint64).tobytes()], "80 bytes but its frame has 16"),
    ([json.dumps({"op": "sum", "id": 1, "arrays": [["keys", "<u8", [2]]]}).encode()],
     "declares 1 arrays but 0"),
    ([json.dumps({"op": "sum", "id": 1, "arrays": [["keys", "<c16", [1]]]}).encode(),
      b"\0" * 16], "dtype '<c16'"),
    ([json.dumps({"op": "sum", "id": 1, "arrays": [["keys", "<u8", [-1]]]}).encode(), b""],
     "dimensions must be ints >= 0"),
    ([json.dumps({"op": 7, "id": 1}).encode()], "'op' must be a string"),
    ([b"[" * 100_000 + b"]" * 100_000], "nests JSON too deeply"),
]


@pytest.mark.parametrize("frames, complaint", MALFORMED)
def test_malformed_frames_get_an_error_reply_and_the_server_keeps_serving(server, client,
                                                                          frames, complaint):
    header = raw_request(server.address, frames)
    assert header["ok"] is False
    assert complaint in header["error"]
    assert client.request("sum", {"keys": np.array([4], np.uint64)}).arrays["total"][0] == 4


def test_malformed_frames_over_an_authenticated_connection_get_error_replies_too():
    key = JobKey.new()
    with Server(OPERATIONS, key=key) as keyed, Client(keyed.address, key=key, timeout=5, retries=0) as client:
        for frames, complaint in MALFORMED:
            header = raw_request(keyed.address, frames, key=key)
            assert header["ok"] is False and complaint in header["error"]
        assert client.request("sum", {"keys": np.array([4], np.uint64)}).arrays["total"][0] == 4


def test_idempotent_request_retries_until_a_late_server_comes_up():
    port = free_port()
    late = Server(OPERATIONS, port=port)
    starter = threading.Timer(0.8, late.start)
    starter.start()
    try:
        with Client(f"tcp://127.0.0.1:{port}", timeout=0.5, retries=8) as client:
            reply = client.request("sum", {"keys": np.array([1, 2], np.uint64)}, idempotent=True)
        assert reply.arrays["total"][0] == 3
    finally:
        starter.join()
        assert late.stop(timeout=5)


def test_non_idempotent_request_to_a_down_server_times_out_without_retry():
    with Client(f"tcp://127.0.0.1:{free_port()}", timeout=0.2, retries=5) as client:
        with pytest.raises(TimeoutError, match="1 attempt.*may or may not have been applied"):
            client.request("sum", {"keys": np.array([1], np.uint64)})


def test_fail_fast_takes_a_refused_connection_for_a_gone_server_but_waits_for_a_slow_one():
    gone = f"tcp://127.0.0.1:{free_port()}"
    with Client(gone, timeout=600, retries=0) as client:  # a replicated PS client fails over, not waits
        with pytest.raises(ConnectionRefused, match="nothing listens"):
            client.receive(client.send("sum", {"keys": np.array([1], np.uint64)}), fail_fast=True)
    slow = Server({"sum": Operation(lambda request: time.sleep(0.5) or sum_keys(request), {"keys": "uint64"})})
    slow.start()
    try:
        with Client(slow.address, timeout=30, retries=0) as client:
            request = client.send("sum", {"keys": np.array([2, 3], np.uint64)})
            assert client.receive(request, fail_fast=True).arrays["total"][0] == 5
    finally:
        assert slow.stop(timeout=5)


def test_request_all_fans_out_to_several_servers():
    servers = [Server(OPERATIONS) for _ in range(2)]
    try:
        clients = [Client(s.address, timeout=5) for s in servers if s.start()]
        replies = request_all([(c, "sum", {"keys": np.array([i, 10], np.uint64)}, {})
                               for i, c in enumerate(clients)], idempotent=True)
        assert [int(r.arrays["total"][0]) for r in replies] == [10, 11]
        for c in clients:
            c.close()
    finally:
        for s in servers:
            assert s.stop(timeout=5)


def test_a_handler_can_stop_the_server_and_its_reply_still_arrives():
    holder = {}

    def shutdown(request):
        holder["server"].request_stop()
        return Message("shutdown", meta={"bye": True})

    server = Server({"shutdown": Operation(shutdown)})
    holder["server"] = server
    server.start()
    try:
        with Client(server.address, timeout=5) as client:
            assert client.request("shutdown").meta == {"bye": True}
        assert server.wait(timeout=5)
    finally:
        assert server.stop(timeout=5)


def test_bad_arguments_are_rejected_with_what_is_allowed():
    with pytest.raises(ValueError, match="address"):
        Client("127.0.0.1:5555")
    with pytest.raises(ValueError, match="timeout"):
        Client("tcp://127.0.0.1:5555", timeout=0)
    with pytest.raises(ValueError, match="threads"):
        Server(OPERATIONS, threads=0)
    with pytest.raises(TypeError, match="object"):
        encode_frames(Message("echo", {"bad": np.array(["a"], dtype=object)}), 1)


def test_replies_that_overtake_each_other_reach_the_right_request():
    def nap(request):
        time.sleep(request.meta["seconds"])
        return Message("nap", meta=request.meta)

    server = Server({"nap": Operation(nap)}, threads=2)
    server.start()
    try:
        with Client(server.address, timeout=10, retries=0) as client:
            slow = client.send("nap", meta={"seconds": 0.5, "tag": "slow"})
            fast = client.send("nap", meta={"seconds": 0.0, "tag": "fast"})  # answered first
            assert client.receive(slow).meta["tag"] == "slow"
            assert client.receive(fast).meta["tag"] == "fast"
    finally:
        assert server.stop(timeout=5)


def test_request_all_survives_a_remote_error_among_many_requests(client):
    requests = [(client, "sum", {"keys": np.array([i], np.uint64)}, {}) for i in range(3)]
    requests.insert(1, (client, "fail", {}, {}))
    with pytest.raises(RemoteError, match="sorted"):
        request_all(requests)
    assert client.request("sum", {"keys": np.array([9], np.uint64)}).arrays["total"][0] == 9
