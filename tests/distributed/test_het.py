"""HET (issue 18): the servers' clocks, the clock operations, the protocol of two trainers under
random interleavings (both CheckValid bounds at every read, Lemma 1's 2s), nothing lost by stale
writes and eviction, s = 0 against the sync consistency, and the asp / ssp baselines."""
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridrec.comm.transport import Client, RemoteError
from hybridrec.config import parse_config
from hybridrec.embedding import EmbeddingStore, route
from hybridrec.embedding.hashing import table_route_id
from hybridrec.ps.client import PSClient
from hybridrec.het.clocks import HetBackend, TableSync, clock_ops_of, in_process_exchange
from hybridrec.ps.server import serve
from hybridrec.het.worker import HetWorker, TableSpec

TABLES = {"deep": 3, "wide": 1}


# ---------------------------------------------------------------- the servers' clocks

def test_a_rows_clock_counts_its_updates_and_a_write_back_sets_the_max():
    store = EmbeddingStore(dim=2, capacity=100, optimizer={"name": "sgd", "lr": 1.0}, init="zeros")
    keys = np.array([5, 6], np.uint64)
    _, clocks, _ = store.pull_clocked(keys)
    assert clocks.tolist() == [0, 0]
    store.push(keys, np.ones((2, 2), np.float32))
    store.push(keys[:1], np.ones((1, 2), np.float32))
    assert store.clocks(keys)[0].tolist() == [2, 1]
    dropped = store.push_clocked(np.array([5, 6, 7], np.uint64), np.ones((3, 2), np.float32), np.array([9, 0, 4]))
    assert dropped == 1  # key 7 is not in the store
    assert store.clocks(np.array([5, 6, 7], np.uint64))[0].tolist() == [9, 1, -1]  # max(c_g, c_c)
    values, clocks, _ = store.pull_clocked(keys, insert=False)
    np.testing.assert_array_equal(values, [[-3, -3], [-2, -2]])
    assert clocks.tolist() == [9, 1]


def test_clocks_persist_in_checkpoints_and_shared_memory(tmp_path):
    name = f"hybridrec-test-het-clocks-{tmp_path.name}"
    EmbeddingStore.unlink_shared(name)
    try:
        store = EmbeddingStore(dim=2, capacity=64, shm_name=name)
        keys = np.arange(10, dtype=np.uint64)
        store.pull(keys)
        store.push_clocked(keys, np.zeros((10, 2), np.float32), np.arange(10) * 3)
        store.save(tmp_path / "ckpt")
        store.close()
        again = EmbeddingStore.attach(name)  # the process that held it is gone
        assert again.clocks(keys)[0].tolist() == (np.arange(10) * 3).tolist()
        loaded = EmbeddingStore.load(tmp_path / "ckpt", num_threads=2, capacity=32)  # re-inserted rows
        assert loaded.clocks(keys)[0].tolist() == (np.arange(10) * 3).tolist()
    finally:
        EmbeddingStore.unlink_shared(name)


def test_the_server_answers_fetches_writes_and_clock_only_checks_in_one_request():
    server = serve(tables={"t": {"dim": 2, "capacity": 100, "optimizer": {"name": "sgd", "lr": 1.0},
                                 "init": "zeros"}}, block=False)
    try:
        with PSClient([server.address]) as client:
            backend = HetBackend.over(client, worker=0)
            keys = np.array([1, 2, 3], np.uint64)
            got = backend.sync({"t": TableSync(keys[:0], np.zeros(0, np.int64), np.zeros((0, 2), np.float32), keys,
                                               keys[:0], np.zeros(0, np.int64))}, staleness=2)["t"]
            assert got.clocks.tolist() == [0, 0, 0] and (got.values == 0).all()
            before = backend.counts.vector_bytes_sent
            got = backend.sync({"t": TableSync(keys[:1], np.array([7]), np.ones((1, 2), np.float32), keys[:1],
                                               keys[1:], np.array([0, 0]))}, staleness=2)["t"]
            # the write-back was applied before the fetch of the same key: its new value and c_g = 7
            np.testing.assert_array_equal(got.values, [[-1, -1]])
            assert got.clocks.tolist() == [7] and got.stale.tolist() == [False, False]
            assert backend.counts.vector_bytes_sent - before == 8 + 8 + 8  # w key, its grads, f key
            got = backend.sync({"t": TableSync(keys[:0], np.zeros(0, np.int64), np.zeros((0, 2), np.float32),
                                               keys[:0], keys, np.array([4, 0, 0]))}, staleness=2)["t"]
            assert got.stale.tolist() == [True, False, False]  # c_g 7 > 4 + 2
            assert backend.counts.clock_bytes_sent >= 3 * 12 and backend.counts.dropped == 0
            with pytest.raises(RemoteError, match="staleness"):
                Client(server.address).request("het_sync", meta={"tables": ["t"], "staleness": -1})
            assert client.shards[0].request("worker_clock", meta={"rank": 1, "world": 2, "clock": 5,
                                                                  "generation": 0}).meta["min"] == 0
            assert client.shards[0].request("worker_clock", meta={"rank": 0, "world": 2, "clock": 3,
                                                                  "generation": 0}).meta["min"] == 3
            # a restarted group (a higher generation) starts the clocks afresh
            assert client.shards[0].request("worker_clock", meta={"rank": 0, "world": 2, "clock": 1,
                                                                  "generation": 1}).meta["min"] == 0
    finally:
        server.stop()


# ---------------------------------------------------------------- the protocol, two trainers

def _job(shards, staleness, capacity, policies, lr=1.0, seed=11):
    stores = [{t: EmbeddingStore(dim=d, capacity=10_000, optimizer={"name": "sgd", "lr": lr}, seed=seed)
               for t, d in TABLES.items()} for _ in range(shards)]
    ops = [clock_ops_of(s) for s in stores]
    workers = [HetWorker({t: TableSpec(capacity, d, lr) for t, d in TABLES.items()},
                         HetBackend(in_process_exchange(ops), shards, TABLES, worker=w, max_keys_per_request=7),
                         staleness, policy)
               for w, policy in enumerate(policies)]
    return stores, workers


def _global_clocks(stores, table, keys):
    shard = route(keys, table_route_id(table), len(stores))
    clocks = np.empty(len(keys), np.int64)
    for s, shard_stores in enumerate(stores):
        picked = shard == s
        clocks[picked] = shard_stores[table].clocks(keys[picked])[0]
    return clocks


def _entries(worker, table, keys):
    cache = worker.caches[table]
    return [cache.entry(int(k)) for k in keys]


steps = st.lists(st.tuples(st.integers(0, 1), st.lists(st.integers(0, 30), min_size=1, max_size=8, unique=True),
                           st.booleans()), min_size=1, max_size=40)


@settings(max_examples=20, deadline=None)
@given(sequence=steps, staleness=st.sampled_from([0, 1, 3, 10]), capacity=st.integers(8, 20),
       shards=st.integers(1, 2), policies=st.sampled_from([("lru", "lfu"), ("light_lfu", "lfu")]))
def test_every_read_is_within_both_bounds_and_replicas_within_2s(sequence, staleness, capacity, shards, policies):
    """Random interleavings of two trainers' reads and writes (and flushes), in process: at each
    read every key satisfies c_c <= c_s + s and c_g <= c_c + s, and any other trainer's copy of it
    that is itself within the bounds is within 2s of this one (Lemma 1)."""
    stores, workers = _job(shards, staleness, capacity, policies)
    rng = np.random.default_rng(len(sequence))
    s = staleness
    for who, keys, flush in sequence:
        worker, other = workers[who], workers[1 - who]
        keys = np.array(keys, np.uint64)
        read = worker.read({t: keys for t in TABLES})
        for table in TABLES:
            c_g = _global_clocks(stores, table, keys)
            mine = _entries(worker, table, keys)
            for (c_s, c_c), g in zip(mine, c_g):
                assert c_c <= c_s + s and g <= c_c + s, (c_s, c_c, g, s)
            for (_, c_c), theirs, g in zip(mine, _entries(other, table, keys), c_g):
                if theirs is not None and theirs[1] <= theirs[0] + s and g <= theirs[1] + s:
                    assert abs(c_c - theirs[1]) <= 2 * s
        worker.write(read, {t: rng.normal(size=(len(keys), d)).astype(np.float32) for t, d in TABLES.items()})
        if flush:
            worker.flush()
    assert max(w.backend.counts.max_gap for w in workers) <= 2 * s + 1


@settings(max_examples=15, deadline=None)
@given(sequence=steps, staleness=st.sampled_from([0, 2, 100, None]), capacity=st.integers(8, 14))
def test_with_sgd_every_gradient_reaches_the_servers(sequence, staleness, capacity):
    """Stale writes, evictions and invalidations lose nothing: after the final flush each row is
    its initial value minus lr times the sum of every gradient either trainer produced for it."""
    lr = 0.5
    stores, workers = _job(2, staleness, capacity, ("lfu", "light_lfu"), lr=lr)
    fresh = {t: EmbeddingStore(dim=d, capacity=10_000, seed=11) for t, d in TABLES.items()}
    produced = {t: {} for t in TABLES}
    rng = np.random.default_rng(7)
    for who, keys, _ in sequence:
        keys = np.array(keys, np.uint64)
        read = workers[who].read({t: keys for t in TABLES})
        grads = {t: rng.normal(size=(len(keys), d)).astype(np.float32) for t, d in TABLES.items()}
        for t in TABLES:
            for k, g in zip(keys.tolist(), grads[t].astype(np.float64)):
                produced[t][k] = produced[t].get(k, 0.0) + g
        workers[who].write(read, grads)
    for worker in workers:
        worker.flush()
    for t in TABLES:
        keys = np.array(sorted(produced[t]), np.uint64)
        shard = route(keys, table_route_id(t), 2)
        for s in range(2):
            picked = keys[shard == s]
            want = fresh[t].pull(picked) - lr * np.array([produced[t][int(k)] for k in picked]).reshape(-1, TABLES[t])
            np.testing.assert_allclose(stores[s][t].pull(picked, insert=False), want, atol=2e-5)
    assert sum(w.backend.counts.dropped for w in workers) == 0


@pytest.mark.parametrize("staleness", [1, 3])
def test_a_read_ahead_of_the_training_batchs_write_sees_and_keeps_that_write(staleness):
    """HET's prefetch (the stream's reader thread): the next batch's read begins before the
    current batch's write, which lands while that read's exchange is in flight (the refill path),
    and its rows are gathered after the write. With one trainer and sgd every read then gives
    exactly what reads one after another give, each gathered row within the first bound, and after
    the flush the servers hold every gradient; the training batch's rows are never evicted by the
    read ahead. With s = 0 (BSP) no read runs ahead."""
    lr = 0.5
    rng = np.random.default_rng(5)
    batches = [np.unique(rng.zipf(1.3, 10) % 40).astype(np.uint64) for _ in range(40)]
    grads = [{t: rng.normal(size=(len(k), d)).astype(np.float32) for t, d in TABLES.items()} for k in batches]
    (seq_stores,), (sequential,) = _job(1, staleness, 20, ("lfu",), lr=lr)
    stores, (ahead,) = _job(1, staleness, 20, ("lfu",), lr=lr)
    inner, due = ahead.backend._exchange, []

    def exchange(requests, idempotent):  # the training thread's write lands mid-exchange
        while due:
            ahead.write(*due.pop())
        return inner(requests, idempotent)

    ahead.backend._exchange = exchange
    current = ahead.gather(ahead.begin({t: batches[0] for t in TABLES}))
    for step, keys in enumerate(batches):
        expected = sequential.read({t: keys for t in TABLES})
        for t in TABLES:
            np.testing.assert_allclose(current.values[t], expected.values[t], atol=1e-5)
        sequential.write(expected, grads[step])
        if step + 1 == len(batches):
            ahead.write(current, grads[step])
            break
        following = {t: batches[step + 1] for t in TABLES}
        if ahead.can_read_ahead(following, current):
            due.append((current, grads[step]))
            pending = ahead.begin(following, keep=1)
            assert not due  # the write went in while the read was in flight
        else:
            ahead.write(current, grads[step])
            pending = ahead.begin(following)
        current = ahead.gather(pending)
        for t in TABLES:
            assert all(c_c <= c_s + staleness for c_s, c_c in _entries(ahead, t, batches[step + 1]))
    sequential.flush()
    ahead.flush()
    keys = np.unique(np.concatenate(batches))
    for t in TABLES:
        np.testing.assert_allclose(stores[0][t].pull(keys, insert=False), seq_stores[t].pull(keys, insert=False),
                                   atol=1e-5)
    assert ahead.stats()["invalidations"] > 0 and ahead.stats()["evictions"] > 0
    _, (bsp,) = _job(1, 0, 20, ("lfu",))
    assert not bsp.can_read_ahead({t: batches[1] for t in TABLES}, bsp.read({t: batches[0] for t in TABLES}))


def test_with_sgd_over_the_wire_two_trainers_lose_nothing():
    """The same with real PS servers (two shards over loopback) and small caches, so that reads
    evict, entries fail the bounds, and several requests are needed per exchange."""
    table = {"t": {"dim": 4, "capacity": 5000, "optimizer": {"name": "sgd", "lr": 0.1}, "seed": 5}}
    servers = [serve(tables=table, block=False) for _ in range(2)]
    fresh = EmbeddingStore(dim=4, capacity=5000, seed=5)
    try:
        clients = [PSClient([s.address for s in servers], max_keys_per_request=32) for _ in range(2)]
        workers = [HetWorker({"t": TableSpec(40, 4, 0.1)}, HetBackend.over(c, worker=w), 3, policy)
                   for w, (c, policy) in enumerate(zip(clients, ("lru", "light_lfu")))]
        rng = np.random.default_rng(3)
        produced = np.zeros((500, 4))
        for step in range(120):
            who = int(rng.integers(2))
            keys = np.unique(rng.zipf(1.3, 30) % 500).astype(np.uint64)
            read = workers[who].read({"t": keys})
            grads = rng.normal(size=(len(keys), 4)).astype(np.float32)
            np.add.at(produced, keys.astype(np.int64), grads)
            workers[who].write(read, {"t": grads})
        for worker in workers:
            worker.flush()
        seen = np.flatnonzero(np.abs(produced).sum(axis=1) > 0).astype(np.uint64)
        got = clients[0].lookup("t", seen, insert=False)
        np.testing.assert_allclose(got, fresh.pull(seen) - 0.1 * produced[seen.astype(np.int64)], atol=1e-4)
        stats = [w.stats() for w in workers]
        assert all(s["evictions"] > 0 and s["invalidations"] > 0 and s["hits"] > 0 for s in stats), stats
        assert all(s["requests"] > 120 for s in stats)  # past 32 keys an exchange takes several requests
        for c in clients:
            c.close()
    finally:
        for server in servers:
            server.stop()


# ---------------------------------------------------------------- in the training loop

def _config(out, consistency, **section):
    return parse_config({
        "seed": 3,
        "data": {"format": "synthetic", "batch_size": 256,
                 "synthetic": {"vocab_size": 300, "zipf_exponent": 1.05, "train_rows": 12_000, "test_rows": 4_000,
                               "n_dense": 4, "n_categorical": 8, "id_weight_std": 0.6}},
        "model": {"name": "deepfm", "embedding_dim": 4, "hparams": {"hidden": [16]}},
        "embedding": {"default": {"capacity": 10_000, "optimizer": {"name": "adagrad", "lr": 0.1}},
                      "wide": {"optimizer": {"lr": 0.3}}},
        "train": {"epochs": 1, "dense_optimizer": {"name": "adam", "lr": 0.02}, "progress": False,
                  "output_dir": str(out), "checkpoint_every": 20},
        "strategy": {"preset": "het", "consistency": consistency, "roles": {"embedding_workers": 0},
                     **({consistency: section} if section else {})}})


def _train_in_process(cfg, root):
    from hybridrec.job.tables import job_dense_model, job_tables
    from hybridrec.train.trainer import train

    tables = job_tables(cfg)
    dense = {n: tuple(p.shape) for n, p in job_dense_model(cfg, tables).named_parameters()}
    servers = [serve(tables=tables.all_tables(), block=False, checkpoint_root=root, dense_params=dense)
               for _ in range(2)]
    try:
        result = train(cfg, overwrite=True, endpoints={"ps": [s.address for s in servers], "embedding_workers": []})
        with PSClient([s.address for s in servers]) as client:
            keys = np.arange(300, dtype=np.uint64)
            rows = {t: client.lookup(t, keys, insert=False) for t in ("C1", "C1:wide")}
        return result, rows
    finally:
        for server in servers:
            server.stop()


def test_s0_trains_the_same_model_as_the_sync_consistency(tmp_path):
    """One trainer, two PS shards, Adagrad: with s = 0 each entry is written back before it is
    read again, so the servers apply the same gradients in the same order as sync does."""
    sync, sync_rows = _train_in_process(_config(tmp_path / "sync", "sync"), tmp_path)
    het, het_rows = _train_in_process(_config(tmp_path / "het", "het", staleness=0, cache_rows=400), tmp_path)
    assert het["auc"] == pytest.approx(sync["auc"], abs=1e-6)
    assert het["logloss"] == pytest.approx(sync["logloss"], abs=1e-6)
    for table in sync_rows:
        np.testing.assert_allclose(het_rows[table], sync_rows[table], atol=1e-6)
    assert het["cache_invalidations"] > 0 and het["cache_hits"] == 0  # s = 0: every cached entry synchronises
    assert het["max_staleness"] == 0 and het["mean_staleness"] == 0  # the clock gaps, by the one name
    final = json.loads((tmp_path / "het" / "final_metrics.json").read_text())
    assert final["strategy"]["het"]["staleness"] == 0 and final["cache_reads"] > 0
    logged = [json.loads(line) for line in (tmp_path / "het" / "metrics.jsonl").read_text().splitlines()]
    assert "cache_hit_rate" in logged[-1] and logged[-1]["split"] == "final"


def test_a_large_s_reads_from_the_cache_and_sends_fewer_bytes(tmp_path):
    cfg = _config(tmp_path / "het", "het", staleness=100, cache_fraction=0.1, policy="light_lfu")
    het, _ = _train_in_process(cfg, tmp_path)
    assert het["cache_hit_rate"] > 0.8 and het["auc"] > 0.7
    assert het["embedding_bytes_per_sample"] == pytest.approx(het["bytes_per_sample"])
    assert het["embedding_clock_bytes"] > 0 and het["cache_pins"] > 0


@pytest.mark.parametrize("consistency,section", [("ssp", {"staleness": 1}), ("asp", {"read_ahead": 3})])
def test_the_ssp_and_asp_baselines_train(tmp_path, consistency, section):
    result, _ = _train_in_process(_config(tmp_path / consistency, consistency, **section), tmp_path)
    assert result["auc"] > 0.7 and result["strategy"]["consistency"] == consistency
    if consistency == "ssp":
        assert result["max_staleness"] <= 1
