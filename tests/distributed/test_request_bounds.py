"""Every request field that sizes work or memory is bounded by what the job declared: the
reported `worker_clock` hole reproduced, then a fuzz of every such field of the PS (HET clocks,
dense ops), the embedding worker and a group PS, each request answered within the client's
timeout and the servers' memory bounded."""

import resource

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from hybridrec.comm.transport import Client, RemoteError
from hybridrec.config import parse_config
from hybridrec.data.batch import JaggedFeatures
from hybridrec.het.clocks import HetBackend, TableSync
from hybridrec.hierarchical.group_ps import GroupPS, Unit
from hybridrec.job.tables import job_tables
from hybridrec.persia.embedding_worker import EmbeddingWorker
from hybridrec.persia.embedding_worker_client import EmbeddingWorkerClient
from hybridrec.ps import PSClient, serve
from helpers import raw_request

TABLES = {"user": {"dim": 8, "capacity": 1_000, "optimizer": {"name": "sgd", "lr": 0.5}}}
DENSE = {"mlp.weight": (4, 2), "mlp.bias": (4,)}
ANSWER_SECONDS = 30  # a request not answered by then held a worker thread for too long
HUGE = [2**31, 2**32 + 1, 10**15, 2**63 - 1, 2**63, 2**64 + 5, 10**30, -(2**63) - 1]
numbers = st.one_of(st.integers(-(2**70), 2**70), st.sampled_from(HUGE), st.integers(-3, 70))
JOB = {"strategy": {"preset": "persia"}, "data": {"format": "synthetic", "batch_size": 32,
       "synthetic": {"n_categorical": 2, "n_dense": 2, "vocab_size": 50, "train_rows": 100, "test_rows": 20}},
       "model": {"name": "lr"}, "embedding": {"default": {"capacity": 500}}}


def test_two_worker_clock_requests_with_a_huge_world_leave_the_server_answering(started_ps):
    header = b'{"op":"worker_clock","id":1,"meta":{"rank":0,"world":1000000000000000,"clock":1,"generation":0}}'
    for _ in range(2):  # 80 bytes each; the server used to loop over range(world) under its lock
        reply = raw_request(started_ps.address, [header], timeout_ms=ANSWER_SECONDS * 1000)
        assert reply["ok"] is False and "this server serves at most 65536 trainers" in reply["error"]
    with Client(started_ps.address, timeout=ANSWER_SECONDS, retries=0) as client:
        assert client.request("ping").meta["pid"] > 0
        for rank in (0, 1):  # the job's own clocks still work
            client.request("worker_clock", meta={"rank": rank, "world": 2, "clock": 3 + rank, "generation": 0})
        assert client.request("worker_clock", meta={"rank": 0, "world": 2, "clock": -1, "generation": 0}).meta == \
            {"min": 3}
        with pytest.raises(RemoteError, match="generation 0 started with 2 trainers"):
            client.request("worker_clock", meta={"rank": 2, "world": 3, "clock": 1, "generation": 0})


@pytest.fixture(scope="module")
def started_ps(tmp_path_factory):
    server = serve(tables=TABLES, block=False, dense_params=DENSE, key=None,
                   checkpoint_root=tmp_path_factory.mktemp("root"))
    yield server
    assert server.stop(timeout=10)


@pytest.fixture(scope="module")
def servers(started_ps):
    """A PS, an embedding worker over it and a group PS with one unit, all on loopback."""
    cfg = parse_config(JOB)
    tables = job_tables(cfg)
    ps = serve(tables=tables.all_tables(), block=False, key=None)
    worker = EmbeddingWorker(tables, [ps.address], rank=0, max_batch_size=cfg.data.batch_size)
    worker.start()
    group = GroupPS([Unit("fc", "mlp", torch.nn.Linear(2, 4))], {"name": "sgd", "lr": 0.1, "weight_decay": 0.0},
                    callers=2, max_rows=32)
    group.start()
    clients = {name: Client(server.address, timeout=ANSWER_SECONDS, retries=0)
               for name, server in (("ps", started_ps), ("ew", worker), ("group", group))}
    _warm_up(started_ps, worker, clients["group"])
    yield clients
    for client in clients.values():
        client.close()
    for server in (worker, group, ps):
        assert server.stop(timeout=10)


def _warm_up(ps, worker, group: Client) -> None:
    """One good request of each kind first, so that the fuzz does not time the kernels' first
    compilation (a fresh checkout has no numba cache)."""
    keys = np.arange(4, dtype=np.uint64)
    with PSClient([ps.address]) as client:
        client.push("user", keys, np.ones((4, 8), np.float32))
        HetBackend.over(client, worker=0).sync({"user": TableSync(keys, np.zeros(4, np.int64),
                                                                  np.ones((4, 8), np.float32), keys, keys,
                                                                  np.zeros(4, np.int64))}, staleness=1)
    features = JaggedFeatures(["C1", "C2"], np.arange(8, dtype=np.uint64), np.arange(9, dtype=np.int64))
    client = EmbeddingWorkerClient([worker.address], put_to=0)
    try:
        client.pull(client.put(features), train=False)
    finally:
        client.close()
    group.request("forward", {"in0.values": np.ones(6, np.float32)},
                  {"unit": "fc", "caller": 0, "call": 0, "train": False,
                   "inputs": {"slots": [{"codec": "none", "shape": [3, 2]}]}})


def _answered(client: Client, op: str, arrays: dict, meta: dict) -> None:
    """The request gets a reply (an error is fine) within the client's timeout."""
    try:
        client.request(op, arrays, meta)
    except RemoteError:
        pass


def _keys(n: int) -> np.ndarray:
    return np.arange(max(0, min(n, 64)), dtype=np.uint64)


@st.composite
def ps_requests(draw):
    """A PS request whose size-giving fields are drawn (arrays stay small: the fields lie)."""
    op = draw(st.sampled_from(["worker_clock", "het_sync", "lookup_many", "push_many", "dense_pull", "push",
                               "lookup", "dense_init", "dense_push", "expire", "checkpoint", "load"]))
    n = draw(numbers)
    if op in ("checkpoint", "load"):
        directory = draw(st.one_of(st.text(max_size=40), st.just("a/" * 3000), st.just("x" * 300)))
        return op, {}, {"directory": directory, "token": draw(st.one_of(st.none(), st.text(max_size=200))),
                        "wait": draw(st.one_of(numbers, st.floats(allow_nan=True)))}
    if op in ("dense_init", "dense_push"):
        shape = [draw(st.integers(0, 5)) for _ in range(draw(st.integers(0, 3)))]
        arrays = {draw(st.sampled_from(["mlp.weight", "mlp.bias", "other"])): np.ones(shape, np.float32)}
        return op, arrays, {"optimizer": {"name": "sgd", "lr": draw(st.one_of(numbers, st.floats()))}}
    if op == "expire":
        return op, {}, {"step": draw(numbers), "now": draw(st.one_of(numbers, st.floats()))}
    if op == "worker_clock":
        return op, {}, {k: draw(numbers) for k in ("rank", "world", "clock", "generation")}
    if op == "het_sync":
        counts = [[draw(numbers) for _ in range(3)] for _ in range(draw(st.integers(1, 3)))]
        shapes = [{"values": [draw(numbers), draw(numbers)]} for _ in counts]
        arrays = {"w": _keys(n), "wc": np.zeros(len(_keys(n)), np.int32), "f": _keys(n), "c": _keys(0),
                  "cc": np.zeros(0, np.int32), "g.values": np.zeros(8, np.float32)}
        return op, arrays, {"tables": ["user"] * len(counts), "counts": counts, "g_shapes": shapes,
                            "codec_meta": [{}] * len(counts), "staleness": draw(st.one_of(st.none(), numbers)),
                            "worker": draw(numbers), "codec": "none"}
    if op in ("lookup_many", "push_many"):
        tables = ["user"] * draw(st.integers(0, 2000))
        return op, {"keys.0": _keys(n)}, {"tables": tables, "codec_meta": [{}] * draw(st.integers(0, 3))}
    if op == "dense_pull":
        return op, {}, {"names": ["mlp.weight"] * draw(st.integers(0, 20_000))}
    if op == "push":
        return op, {"keys": _keys(n), "values": np.zeros((1, 8), np.float32)}, \
            {"table": "user", "codec": draw(st.sampled_from(["none", "fp16", "bf16"])),
             "codec_meta": {"block_size": draw(numbers), "rows": [draw(numbers), draw(numbers)]}}
    return op, {"keys": _keys(n)}, {"table": "user", "insert": draw(st.booleans())}


@st.composite
def ew_requests(draw):
    op = draw(st.sampled_from(["put", "put", "pull", "push"]))
    if op == "put":
        names = draw(st.sampled_from([["C1", "C2"], ["C1"] * 100, []]))
        batch = draw(st.one_of(numbers, st.sampled_from([10**9, 2**31, 3 * 65535])))
        sub = draw(st.one_of(numbers, st.just(65535)))
        codec_meta = {"names": names, "batch_size": batch, "max_sub_batch": sub}
        k = draw(st.integers(0, 16))
        groups = -(-batch // sub) * len(names) if isinstance(batch, int) and batch > 0 and sub > 0 else 1
        groups = groups if 0 < groups <= 200_000 else draw(st.integers(1, 5))  # arrays that fit the meta's lie
        arrays = {"keys": np.arange(k, dtype=np.uint64), "key_counts": np.ones(k, np.uint32),
                  "group_sizes": np.array([k] + [0] * (groups - 1), np.int64), "positions": np.zeros(k, np.uint16)}
        return op, arrays, {"codec": "unique", "codec_meta": codec_meta}
    return op, {}, {"first_sample_id": draw(numbers), "train": draw(st.booleans())}


@st.composite
def group_requests(draw):
    op = draw(st.sampled_from(["forward", "backward"]))
    shape = [draw(numbers) for _ in range(draw(st.integers(0, 4)))]
    codec = draw(st.sampled_from(["none", "topk", "int8", "bf16"]))
    about = {"codec": codec, "shape": shape}
    arrays = {"in0.values": np.zeros(4, np.float32)} if op == "forward" else \
        {"grad0.indices": np.zeros(1, np.int64), "grad0.values": np.zeros(1, np.float32)}
    meta = {"unit": "fc", "caller": draw(numbers), "call": draw(numbers), "train": True}
    meta["inputs" if op == "forward" else "grad"] = {"slots": [about]}
    return op, arrays, meta


FUZZ = settings(max_examples=120, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def peak_rss():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    yield
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 2 << 20, f"the servers' process peaked {grown_kib >> 10} MiB higher during the fuzz"


@FUZZ
@given(ps_requests())
def test_fuzzed_sizes_of_ps_requests_are_answered_in_bounded_time(servers, peak_rss, request):
    _answered(servers["ps"], *request)


@FUZZ
@given(ew_requests())
def test_fuzzed_sizes_of_embedding_worker_requests_are_answered_in_bounded_time(servers, peak_rss, request):
    _answered(servers["ew"], *request)


@FUZZ
@given(group_requests())
def test_fuzzed_sizes_of_group_ps_requests_are_answered_in_bounded_time(servers, peak_rss, request):
    _answered(servers["group"], *request)


def test_after_the_fuzz_every_server_still_serves_the_job(servers):
    assert servers["ps"].request("lookup", {"keys": np.arange(3, dtype=np.uint64)}, {"table": "user"}).arrays
    assert servers["ew"].request("ping").meta["rank"] == 0
    reply = servers["group"].request("forward", {"in0.values": np.ones(6, np.float32)},
                                     {"unit": "fc", "caller": 1, "call": 1, "train": False,
                                      "inputs": {"slots": [{"codec": "none", "shape": [3, 2]}]}})
    assert reply.meta["output"]["slots"][0]["shape"] == [3, 4]


def test_sizes_a_request_declares_are_checked_against_the_job_before_any_work(servers):
    big_batch = {"names": ["C1", "C2"], "batch_size": 10**9, "max_sub_batch": 65535}
    groups = np.zeros(2 * -(-10**9 // 65535), np.int64)  # 240 KiB that used to size 16 GB of offsets
    with pytest.raises(RemoteError, match="'batch_size' is 1000000000; this job's batches have at most 32"):
        servers["ew"].request("put", {"keys": np.zeros(0, np.uint64), "key_counts": np.zeros(0, np.uint32),
                                      "group_sizes": groups, "positions": np.zeros(0, np.uint16)},
                              {"codec": "unique", "codec_meta": big_batch})
    meta = {"unit": "fc", "caller": 0, "call": 7, "train": True,
            "inputs": {"slots": [{"codec": "none", "shape": [3, 2]}]}}
    servers["group"].request("forward", {"in0.values": np.ones(6, np.float32)}, meta)
    huge = {"slots": [{"codec": "none", "shape": [10**6, 10**6]}]}  # a top-k gradient of it would be 4 TB zeros
    with pytest.raises(RemoteError, match=r"grad0: shape \[1000000, 1000000\] is not the output's shape \[3, 4\]"):
        servers["group"].request("backward", {"grad0.values": np.ones(1, np.float32)}, {**meta, "grad": huge})
    with pytest.raises(RemoteError, match=r"codec 'topk' is not this job's wire codec \['none'\]"):
        servers["group"].request("backward", {"grad0.indices": np.zeros(1, np.int64),
                                              "grad0.values": np.ones(1, np.float32)},
                                 {**meta, "grad": {"slots": [{"codec": "topk", "shape": [3, 4]}]}})
    with pytest.raises(RemoteError, match=r"meta caller must be an int in \[0, 1\]"):
        servers["group"].request("forward", {"in0.values": np.ones(6, np.float32)}, {**meta, "caller": 2})
    with pytest.raises(RemoteError, match="more rows than the job's batches"):
        servers["group"].request("forward", {"in0.values": np.ones(66, np.float32)},
                                 {**meta, "inputs": {"slots": [{"codec": "none", "shape": [33, 2]}]}})
    with pytest.raises(RemoteError, match="meta 'staleness' must be an int in"):
        servers["ps"].request("het_sync", {}, {"tables": [], "counts": [], "staleness": 10**30})
    good = {name: np.ones(shape, np.float32) for name, shape in DENSE.items()}
    servers["ps"].request("dense_init", good, {"optimizer": {"name": "sgd", "lr": 0.1}})
    pulled = servers["ps"].request("dense_pull", meta={"names": ["mlp.weight"] * 60_000})  # one copy, not 60,000
    assert list(pulled.arrays) == ["mlp.weight"]
