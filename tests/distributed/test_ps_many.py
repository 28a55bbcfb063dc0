"""Multi-table PS requests (lookup_many / push_many) and `serve-ps --config`."""

from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

import hybridrec.ps.client as client_module
from hybridrec.comm.transport import Client, RemoteError
from hybridrec.config import load_config
from hybridrec.job.tables import job_tables
from hybridrec.ps import PSClient, serve
from hybridrec.ps.server import launch, main as server_main

SGD = {"name": "sgd", "lr": 0.5}
TABLES = {"user": {"dim": 8, "capacity": 20_000, "optimizer": SGD, "seed": 3},
          "item": {"dim": 4, "capacity": 5_000, "optimizer": SGD, "seed": 4},
          "ad": {"dim": 3, "capacity": 5_000, "optimizer": SGD, "seed": 5}}
QUICKSTART = Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"
STARTUP_SECONDS = 120  # a cold numba cache compiles the store kernels on first start


@contextmanager
def running_servers(count):
    servers = [serve(tables=TABLES, block=False) for _ in range(count)]
    try:
        yield [server.address for server in servers]
    finally:
        assert all([server.stop(timeout=5) for server in servers])


@pytest.fixture
def shard_pairs():
    """Two independent 2-shard services with the same tables and seeds (so the same rows)."""
    with running_servers(4) as addresses:
        yield addresses[:2], addresses[2:]


@pytest.fixture
def one_shard():
    with running_servers(1) as addresses:
        yield addresses[0]


def batch(seed):
    """Keys with repeats (Zipf) and gradients for every table."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, spec in TABLES.items():
        keys = rng.zipf(1.3, size=400 + 100 * spec["dim"]).astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        out[name] = (keys, rng.standard_normal((len(keys), spec["dim"])).astype(np.float32))
    return out


def count_requests(monkeypatch):
    sizes = []
    original = client_module.PSClient._each

    def counting(self, requests, **kwargs):
        sizes.append([op for _, op, _, _ in requests])
        return original(self, requests, **kwargs)

    monkeypatch.setattr(client_module.PSClient, "_each", counting)
    return sizes


@pytest.mark.parametrize("max_keys", [16384, 37])
def test_many_table_lookups_and_pushes_equal_one_table_at_a_time(shard_pairs, monkeypatch, max_keys):
    many_addresses, one_addresses = shard_pairs
    data = batch(seed=1)
    with PSClient(many_addresses, max_keys_per_request=max_keys) as many, \
            PSClient(one_addresses, max_keys_per_request=max_keys) as one:
        for name in TABLES:
            many.dim(name), one.dim(name)  # the dim pings are not what is counted below,
        many.refresh_routing()  # nor the routing tables a client asks for before its first request
        expected = {name: one.lookup(name, keys) for name, (keys, _) in data.items()}
        sent = count_requests(monkeypatch)
        rows = many.lookup_tables({name: keys for name, (keys, _) in data.items()})
        assert list(rows) == list(TABLES)
        for name in TABLES:
            assert rows[name].dtype == np.float32
            np.testing.assert_array_equal(rows[name], expected[name])
        dropped = many.push_tables(data)
        if max_keys == 16384:  # every table in one request per shard, for lookup and push
            assert sent == [["lookup_many"] * 2, ["push_many"] * 2]
        else:
            assert len(sent[0]) > 2 and all(len(s) == len(sent[0]) for s in sent)
        assert dropped == sum(one.push(name, keys, grads) for name, (keys, grads) in data.items()) == 0
        after = many.lookup_tables({name: keys for name, (keys, _) in data.items()}, insert=False)
        for name, (keys, _) in data.items():
            np.testing.assert_allclose(after[name], one.lookup(name, keys, insert=False), atol=1e-6)
            assert not np.array_equal(after[name], expected[name])  # the push arrived


def test_empty_and_absent_keys(one_shard):
    with PSClient([one_shard]) as client:
        rows = client.lookup_tables({"user": np.array([], np.uint64), "item": np.array([5, 5], np.uint64)},
                                    insert=False)
        assert rows["user"].shape == (0, 8) and rows["item"].shape == (2, 4) and not rows["item"].any()
        assert client.lookup_tables({}) == {} and client.push_tables({}) == 0
        assert client.push_tables({"item": (np.array([5], np.uint64), np.ones((1, 4), np.float32))}) == 1


def test_fp16_many_table_rows_stay_within_the_fp16_bound(one_shard):
    data = batch(seed=2)
    keys = {name: k for name, (k, _) in data.items()}
    with PSClient([one_shard]) as exact, \
            PSClient([one_shard], value_codec="fp16") as compressed:
        rows = exact.lookup_tables(keys)
        approx = compressed.lookup_tables(keys, insert=False)
        assert compressed.push_tables(data) == 0
        for name in TABLES:
            norms = np.abs(rows[name]).max(axis=1, keepdims=True)
            assert np.all(np.abs(approx[name] - rows[name]) <= norms * 2.0**-10)
            assert not np.array_equal(exact.lookup(name, keys[name], insert=False), rows[name])


def valid_push_many():
    keys = np.array([1, 2, 3], np.uint64)
    arrays = {"keys.0": keys, "0.values": np.ones((3, 8), np.float32),
              "keys.1": keys, "1.values": np.ones((3, 4), np.float32)}
    return arrays, {"tables": ["user", "item"], "codec": "none", "codec_meta": [{}, {}]}


@pytest.mark.parametrize("spoil, error", [
    (lambda a, m: a.update({"1.values": np.ones((3, 5), np.float32)}), r"table 1 \('item'\) grads.*\(3, 4\)"),
    (lambda a, m: a.update({"1.values": np.full((3, 4), np.nan, np.float32)}), "NaN"),
    (lambda a, m: a.update({"1.values": np.ones((3, 4), np.float64)}), "float32"),
    (lambda a, m: a.pop("1.values"), "lack 'values'"),
    (lambda a, m: a.pop("keys.1"), "'keys.1' is missing"),
    (lambda a, m: a.update({"keys.1": np.array([1, 2, 3], np.int64)}), "keys.1.*uint64"),
    (lambda a, m: a.update({"7.values": np.ones((3, 4), np.float32)}), "'7.values'"),
    (lambda a, m: m.update({"tables": ["user", "nope"]}), r"\['nope'\].*holds"),
    (lambda a, m: m.update({"codec_meta": [{}]}), "codec_meta"),
])
def test_push_many_with_one_bad_table_applies_nothing(one_shard, spoil, error):
    keys = np.array([1, 2, 3], np.uint64)
    with PSClient([one_shard]) as client:
        before = client.lookup_tables({"user": keys, "item": keys})
        arrays, meta = valid_push_many()
        spoil(arrays, meta)
        with Client(one_shard, timeout=10) as raw:
            with pytest.raises(RemoteError, match=error):
                raw.request("push_many", arrays, meta)
        after = client.lookup_tables({"user": keys, "item": keys}, insert=False)
        for name in before:
            np.testing.assert_array_equal(after[name], before[name])
        with Client(one_shard, timeout=10) as raw:  # the unspoilt request applies
            assert raw.request("push_many", *valid_push_many()).meta["dropped"] == 0
        np.testing.assert_allclose(client.lookup("item", keys, insert=False), before["item"] - 0.5, atol=1e-6)


@pytest.mark.parametrize("arrays, meta, error", [
    ({"keys.0": np.array([1], np.uint64)}, {"tables": ["user", "item"]}, "'keys.1' is missing"),
    ({"keys.0": np.array([1], np.int64)}, {"tables": ["user"]}, "keys.0.*uint64"),
    ({"keys.0": np.array([[1]], np.uint64)}, {"tables": ["user"]}, "keys.0.*1-D"),
    ({"keys.0": np.array([1], np.uint64)}, {"tables": ["nope"]}, r"\['nope'\].*holds \['ad', 'item', 'user'\]"),
    ({"keys.0": np.array([1], np.uint64)}, {"tables": "user"}, "'tables' must be a list"),
    ({"keys.0": np.array([1], np.uint64), "x": np.array([1], np.uint64)}, {"tables": ["user"]}, "'x'"),
    ({"keys.0": np.array([1], np.uint64)}, {"tables": ["user"], "insert": "yes"}, "'insert' must be true"),
    ({"keys.0": np.array([1], np.uint64)}, {"tables": ["user"], "codec": "zip"}, "value codec"),
])
def test_malformed_lookup_many_gets_an_error_and_the_server_keeps_serving(one_shard, arrays, meta, error):
    with Client(one_shard, timeout=10) as raw:
        with pytest.raises(RemoteError, match=error):
            raw.request("lookup_many", arrays, meta)
        reply = raw.request("lookup_many", {"keys.0": np.array([1, 2], np.uint64)}, {"tables": ["item"]})
        assert reply.arrays["0.values"].shape == (2, 4)
    with PSClient([one_shard]) as client:  # the bad request inserted no key
        assert client.stats()[0]["tables"]["user"]["size"] == 0


def test_client_many_calls_reject_bad_arguments_before_sending(one_shard):
    keys = np.array([1, 2], np.uint64)
    with PSClient([one_shard]) as client:
        with pytest.raises(TypeError, match="keys of table 'item'.*uint64"):
            client.lookup_tables({"user": keys, "item": keys.astype(np.int64)})
        with pytest.raises(ValueError, match="'nope' is not served"):
            client.lookup_tables({"user": keys, "nope": keys})
        with pytest.raises(ValueError, match=r"grads of table 'item'.*\(2, 4\)"):
            client.push_tables({"user": (keys, np.ones((2, 8), np.float32)),
                                "item": (keys, np.ones((2, 8), np.float32))})
        with pytest.raises(TypeError, match=r"grads_by_table\['user'\]"):
            client.push_tables({"user": keys})
        assert client.stats()[0]["tables"]["user"]["size"] == 0  # nothing was sent


def test_serve_ps_config_serves_every_table_of_the_job(tmp_path):
    sets = ["model.embedding_dim=4", "embedding.default.capacity=1000"]
    expected = {name: table.dim for name, table in job_tables(load_config(QUICKSTART, sets)).all_tables().items()}
    assert len(expected) == 52
    process, address = launch(["--config", str(QUICKSTART), *[a for s in sets for a in ("--set", s)]],
                              startup_timeout=STARTUP_SECONDS)
    try:
        with PSClient([address], timeout=30) as client:
            assert client.ping()[0]["tables"] == expected
            keys = {name: np.arange(10, dtype=np.uint64) for name in expected}
            rows = client.lookup_tables(keys)
            assert all(rows[name].shape == (10, dim) for name, dim in expected.items())
            client.shutdown()
        assert process.wait(timeout=15) == 0
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(10)


def test_serve_ps_config_errors_are_reported(tmp_path, capsys):
    with pytest.raises(SystemExit):
        server_main(["--set", "model.embedding_dim=4"])  # --set without --config
    assert "--config" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        server_main(["--config", str(tmp_path / "missing.yaml")])
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        server_main(["--config", str(QUICKSTART), "--set", "model.embedding_dim=zero"])
    assert "embedding_dim" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        server_main(["--config", str(QUICKSTART), "--table", "C1:8:100"])
    assert "given twice" in capsys.readouterr().err


def test_each_store_numbers_the_updates_it_applied_and_a_lookup_says_how_many_it_held(shard_pairs):
    """Per table and server: a push_many's reply numbers the update in that store's order, a
    lookup_many's says how many updates the store had applied when it read the rows (-1: the
    request did not reach that store). The staleness lab replays a job in these orders."""
    addresses, _ = shard_pairs
    pairs = batch(1)
    with PSClient(addresses) as client:
        read: dict = {}
        client.lookup_tables({name: keys for name, (keys, _) in pairs.items()}, versions=read)
        assert read == {name: [0, 0] for name in TABLES}
        for number in (1, 2):
            pushed: dict = {}
            client.push_tables(pairs, versions=pushed)
            assert pushed == {name: [number, number] for name in TABLES}
        key = pairs["user"][0][:1]
        server = int(client._shard_of("user", key)[0])
        pushed = {}
        client.push_tables({"user": (key, np.ones((1, 8), np.float32))}, versions=pushed)
        assert pushed == {"user": [3 if s == server else -1 for s in range(2)]}
        read = {}
        client.lookup_tables({"user": pairs["user"][0]}, versions=read)
        assert read == {"user": [3 if s == server else 2 for s in range(2)]}
