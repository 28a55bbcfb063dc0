"""A server's limits (hybridrec.comm.flow): bytes queued for a client that never reads, the
connection cap, and failures in the log, each under its bound."""

import json
import logging
import os
import time

import numpy as np
import pytest
import zmq

from hybridrec.comm.flow import Flow, FlowLimits
from hybridrec.comm.transport import (Client, Message, Operation, RequestTooLarge, Server, ServerFull,
                                      encode_frames)
from hybridrec.ps.server import launch
from helpers import raw_request

DIM, KEYS = 64, 16_384
REPLY_BYTES = KEYS * DIM * 4  # 4 MiB a lookup reply


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def lookup_frames(request_id: int) -> list:
    return encode_frames(Message("lookup", {"keys": np.arange(KEYS, dtype=np.uint64) + request_id * KEYS},
                                 {"table": "t", "insert": False}), request_id)


def test_a_client_that_never_reads_costs_the_server_a_bounded_number_of_bytes():
    process, address = launch(["--table", f"t:{DIM}:100000"])
    context = zmq.Context.instance()
    greedy = context.socket(zmq.DEALER)
    greedy.setsockopt(zmq.LINGER, 0)
    greedy.setsockopt(zmq.RCVHWM, 1)  # what it does not read stays at the server, not here
    greedy.setsockopt(zmq.RCVBUF, 1 << 16)
    try:
        greedy.connect(address)
        with Client(address, timeout=20, retries=0) as polite:
            polite.request("lookup", {"keys": np.arange(KEYS, dtype=np.uint64)}, {"table": "t", "insert": False})
            before = rss_bytes(process.pid)  # with the lookup's code loaded
            sent = 80  # 320 MiB of replies asked for; the server used to queue every one of them
            for request_id in range(1, sent + 1):
                greedy.send_multipart(lookup_frames(request_id))
            time.sleep(3)
            assert polite.request("ping").meta["pid"] == process.pid  # others are still served at once
            grown = rss_bytes(process.pid) - before
            # at most 8 replies parked, 3 in ZeroMQ and the requests held: 15 replies' worth with the allocator's slack
            assert grown < 20 * REPLY_BYTES, f"the server grew {grown >> 20} MiB for a client that does not read"
        got = 0  # backpressure, not loss: every reply comes once the client reads
        while got < sent and greedy.poll(20_000):
            header = json.loads(greedy.recv_multipart()[0])
            assert header["ok"], header
            got += 1
        assert got == sent
    finally:
        greedy.close()
        process.kill()
        process.wait(10)


def test_requests_of_a_blocked_connection_are_held_up_to_its_bound_then_discarded():
    flow = Flow(FlowLimits.make(100, held_bytes_per_connection=250, queued_bytes_total=1000, max_in_flight=4))
    assert flow.arrived(b"a", ["r1"], 100) and flow.next_request() == (b"a", ["r1"])
    assert flow.answered(b"a")  # nothing parked: the reply may go
    flow.park(b"a", ["reply1"], now=0.0)  # ... but the front socket did not take it
    assert [flow.arrived(b"a", [f"h{i}"], 100) for i in range(3)] == [True, True, False]
    assert flow.discarded == 1 and flow.held_bytes == 200
    assert flow.arrived(b"b", ["other"], 100)  # another connection is not held up
    assert flow.next_request() == (b"b", ["other"])
    assert flow.due(now=1.0) == [(b"a", ["reply1"])]
    flow.parked_sent(b"a")  # once the reply left, the held requests run, in order
    assert [flow.next_request(), flow.next_request(), flow.next_request()] == [(b"a", ["h0"]), (b"a", ["h1"]), None]
    assert flow.held_bytes == 0 and flow.pending_bytes == 0


def test_a_connection_has_a_bounded_number_of_requests_in_flight_and_the_workers_a_bounded_queue():
    flow = Flow(FlowLimits.make(100, held_bytes_per_connection=300, queued_bytes_total=500, max_in_flight=4))
    assert [flow.arrived(b"a", [i], 100) for i in range(8)] == [True] * 7 + [False]  # 4 run, 3 held
    assert flow.pending_bytes == 400 and flow.held_bytes == 300
    assert flow.accepting()
    assert flow.arrived(b"b", ["b"], 100) and not flow.accepting()  # the workers are behind: stop reading
    assert flow.next_request() == (b"a", [0])
    assert flow.answered(b"a")
    flow.sent(b"a")  # one reply out: one held request may run
    assert flow.held_bytes == 200 and [flow.next_request()[1] for _ in range(5)] == [[1], [2], [3], ["b"], [4]]


def test_a_header_too_large_to_parse_gets_an_error_reply_its_client_can_match():
    server = Server({"ping": Operation(lambda request: Message("ping"))}, key=None)
    server.start()
    try:
        header = json.dumps({"op": "ping", "id": 41, "meta": {"names": ["x" * 100] * 20_000}}).encode()
        reply = raw_request(server.address, [header])
        assert (reply["id"], reply["ok"]) == (41, False) and "more than the 1048576 allowed" in reply["error"]
        with Client(server.address, timeout=5) as client, pytest.raises(RequestTooLarge, match="its header"):
            client.request("ping", meta={"names": ["x" * 100] * 20_000})  # refused before it is sent
    finally:
        assert server.stop(timeout=5)


def test_connections_past_the_cap_are_refused_with_a_clear_error_and_the_others_served():
    server = Server({"ping": Operation(lambda request: Message("ping"))}, max_connections=3, key=None)
    server.start()
    context = zmq.Context.instance()
    idle = []
    try:
        for _ in range(3):  # idle connections, as a crowd of stray clients leaves them
            socket = context.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(server.address)
            socket.send_multipart(encode_frames(Message("ping"), 1))
            assert socket.poll(5000)
            idle.append(socket)
        began = time.monotonic()
        with Client(server.address, timeout=10, retries=2) as late:
            with pytest.raises(ServerFull, match="serves as many connections as it may.*--max-connections"):
                late.request("ping", idempotent=True)
        assert time.monotonic() - began < 8  # refused at the handshake, not after the timeouts
        idle.pop().close()
        deadline = time.monotonic() + 10
        while True:  # a freed place is taken by the next client
            try:
                with Client(server.address, timeout=2, retries=0) as next_one:
                    next_one.request("ping")
                break
            except (ServerFull, TimeoutError):
                assert time.monotonic() < deadline, "a freed connection place was never given again"
    finally:
        for socket in idle:
            socket.close()
        assert server.stop(timeout=5)


def test_failures_of_the_machine_are_one_line_and_every_failure_is_rate_limited(caplog):
    def too_long(request):
        os.stat("x" * 5000)  # ENAMETOOLONG, as a too long checkpoint path gives

    def bug(request):
        return {}["missing"] if request.meta.get("key") else 1 / 0

    server = Server({"too_long": Operation(too_long), "bug": Operation(bug)}, key=None)
    server.start()
    try:
        with caplog.at_level(logging.WARNING, logger="hybridrec.comm"), Client(server.address, timeout=5) as client:
            for op in ["too_long"] * 300 + ["bug"] * 300:
                with pytest.raises(Exception, match="File name too long|division by zero"):
                    client.request(op)
    finally:
        assert server.stop(timeout=5)
    records = [r for r in caplog.records if r.name.startswith("hybridrec.comm")]
    assert 1 <= len(records) <= 20, len(records)  # two limits of 10 lines a minute: the machine's and bugs
    machine = [r for r in records if "too_long" in r.getMessage()]
    assert machine and all(r.exc_info is None and "\n" not in r.getMessage() for r in machine)
    assert len(caplog.text) < 20_000
