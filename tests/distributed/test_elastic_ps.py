"""Elastic PS servers in one process: buckets move between servers while a client pulls and
pushes, and no update is lost or applied twice (plain SGD, lr 1: a row is its first value minus
the sum of every gradient pushed to it)."""
import contextlib
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from hybridrec.comm.transport import Client, RemoteError
from hybridrec.embedding.buckets import bucket_of
from hybridrec.embedding.hashing import table_route_id
from hybridrec.ps import PSClient, serve
from hybridrec.ps.migration import Coordinator

SGD = {"name": "sgd", "lr": 1.0}
TABLES = {"user": {"dim": 4, "capacity": 50_000, "optimizer": SGD, "seed": 1},
          "item": {"dim": 2, "capacity": 50_000, "optimizer": SGD, "seed": 2}}
KEYS = 3000


@pytest.fixture(scope="module")
def servers():
    running = [serve(tables=TABLES, block=False, key=None) for _ in range(3)]
    try:
        yield running
    finally:
        for server in running:
            server.stop(timeout=5)


class Ledger:
    """The client's side of the sums: every gradient it pushed, per table and key."""

    def __init__(self, client, base):
        self.client, self.base = client, base
        self.keys = base + np.arange(KEYS, dtype=np.uint64)
        self.first = {t: client.lookup(t, self.keys) for t in TABLES}
        self.sums = {t: np.zeros_like(rows) for t, rows in self.first.items()}

    def push(self, seed):
        rng = np.random.default_rng(seed)
        picked = rng.integers(0, KEYS, 200)
        grads = {t: rng.integers(-3, 4, (200, spec["dim"])).astype(np.float32) for t, spec in TABLES.items()}
        self.client.push_tables({t: (self.keys[picked], g) for t, g in grads.items()})
        for t, g in grads.items():
            np.add.at(self.sums[t], picked, g)

    def check(self):
        """Every row is its first value minus its gradients' sum (a key never pushed is made again
        with its first value where a backup took over: a row's first value depends on the key alone)."""
        for t in TABLES:
            np.testing.assert_allclose(self.client.lookup(t, self.keys), self.first[t] - self.sums[t],
                                       atol=1e-4, err_msg=f"table {t}: an update was lost or applied twice")


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(client_ops=st.lists(st.tuples(st.sampled_from(["push", "lookup"]), st.integers(0, 2**16)), min_size=4,
                           max_size=25),
       moves=st.lists(st.sets(st.integers(0, 2), min_size=1), min_size=1, max_size=4),
       batch=st.sampled_from([16, 256, 4096]))
def test_random_interleavings_of_pulls_pushes_and_bucket_moves_never_lose_or_double_an_update(
        servers, client_ops, moves, batch):
    addresses = [s.address for s in servers]
    coordinator = Coordinator(addresses, list(TABLES), key=None, batch=batch)
    coordinator.table = coordinator.newest() or coordinator.table
    coordinator.start()
    base = np.uint64(np.random.default_rng().integers(1, 2**40)) << np.uint64(16)
    with PSClient(coordinator.table.addresses, key=None) as client:
        ledger = Ledger(client, base)
        errors = []

        def run_client():
            try:
                for op, seed in client_ops:
                    ledger.push(seed) if op == "push" else client.lookup("user", ledger.keys[seed % KEYS:][:50])
            except BaseException as error:  # reported by the test thread
                errors.append(error)

        thread = threading.Thread(target=run_client)
        thread.start()
        for chosen in moves:
            coordinator.scale_to([addresses[i] for i in sorted(chosen)])
        thread.join(60)
        assert not thread.is_alive() and not errors, errors
        ledger.check()
        assert client.routing.version <= coordinator.table.version
    coordinator.close()


def test_a_server_refuses_a_bucket_it_does_not_own_with_its_newer_table_and_survives_bad_moves(servers):
    addresses = [s.address for s in servers]
    coordinator = Coordinator(addresses[:1], list(TABLES), key=None)
    coordinator.table = coordinator.newest(addresses) or coordinator.table
    coordinator.start()
    coordinator.scale_to(addresses[:1])
    with PSClient(addresses, key=None) as stale:
        keys = np.arange(500, dtype=np.uint64)
        stale.lookup("user", keys)  # it learns the table of one server
        final = coordinator.scale_to(addresses[:2])  # half the buckets move: its table is stale
        stale.lookup("user", keys)
        assert stale.routing.version == final.version and stale.redirects > 0
    with Client(addresses[0], key=None) as raw:
        with pytest.raises(RemoteError, match="bucket"):
            raw.request("bucket_import", {"buckets": np.array([1, 1])}, {"tables": ["user"]})
        with pytest.raises(RemoteError, match="rows"):
            raw.request("bucket_import", {"buckets": np.array([1]), "0.rows": np.zeros((1, 3), np.float32)},
                        {"tables": ["user"]})
        good = {"stream": ["s", 1], "entries": [[None, ["user"]]]}
        for meta, match in (({**good, "stream": ["s", 0]}, "stream"), ({**good, "entries": []}, "entries"),
                            ({**good, "entries": [[None, ["nope"]]]}, "table names"),
                            (good, "rows")):  # the rows are missing
            with pytest.raises(RemoteError, match=match):
                raw.request("replica_put", {}, meta)
        assert raw.request("ping").meta["pid"]
    coordinator.close()


def test_a_checkpoint_taken_mid_migration_loads_into_any_server_count(tmp_path):
    root = tmp_path / "ckpt"
    running = [serve(tables=TABLES, block=False, key=None, checkpoint_root=root) for _ in range(3)]
    addresses = [s.address for s in running]
    coordinator = Coordinator(addresses[:2], list(TABLES), key=None, batch=8)
    coordinator.start()
    keys = np.arange(4000, dtype=np.uint64)
    try:
        with PSClient(addresses[:2], key=None) as client:
            client.lookup_tables({t: keys for t in TABLES})
            client.push_tables({t: (keys, np.ones((len(keys), spec["dim"]), np.float32)) for t, spec in TABLES.items()})
            expected = {t: client.lookup(t, keys, insert=False) for t in TABLES}
            mover = threading.Thread(target=coordinator.scale_to, args=(addresses,))
            mover.start()
            while coordinator.metrics.buckets_moved == 0:
                mover.join(0.01)
            client.refresh_routing()
            client.checkpoint(root / "mid")
            assert mover.is_alive() or coordinator.metrics.buckets_moved < 1365  # taken while buckets moved
            mover.join(60)
        for count in (1, 2, 4):
            fresh = [serve(tables=TABLES, block=False, key=None, checkpoint_root=root) for _ in range(count)]
            try:
                with PSClient([s.address for s in fresh], key=None) as loader:
                    loader.load(root / "mid")
                    for t in TABLES:
                        np.testing.assert_array_equal(loader.lookup(t, keys, insert=False), expected[t])
                    assert sum(len(s.stores["user"]) for s in fresh) == len(keys)
            finally:
                for server in fresh:
                    server.stop(timeout=5)
    finally:
        coordinator.close()
        for server in running:
            server.stop(timeout=5)


def test_with_replicas_a_lost_server_fails_over_to_the_backups_and_loses_no_acknowledged_push():
    running = [serve(tables=TABLES, block=False, key=None, routed=True) for _ in range(3)]
    addresses = [s.address for s in running]
    coordinator = Coordinator(addresses, list(TABLES), replicas=2, key=None)
    try:
        coordinator.start()
        with PSClient(addresses, key=None, timeout=600) as client:  # a lost server is noticed, not waited out
            ledger = Ledger(client, np.uint64(0))
            for seed in range(5):
                ledger.push(seed)
            errors = []

            def keep_pushing():
                try:
                    for seed in range(5, 25):
                        ledger.push(seed)
                except BaseException as error:
                    errors.append(error)

            pusher = threading.Thread(target=keep_pushing)
            pusher.start()
            running[1].stop(timeout=5)  # the server and its memory are gone
            final = coordinator.fail_over(addresses[1])
            pusher.join(60)
            assert not pusher.is_alive() and not errors, errors
            assert addresses[1] not in final.addresses and (final.backups >= 0).all()
            assert coordinator.metrics.failovers == 1 and coordinator.metrics.backups_rebuilt > 0
            ledger.check()
            running[2].stop(timeout=5)  # the rebuilt backups hold every update too
            coordinator.fail_over(addresses[2])
            ledger.check()
    finally:
        coordinator.close()
        for server in running:
            server.stop(timeout=5)


@contextlib.contextmanager
def replicated_pair(clients):
    """Two routed servers, each the other's backup, a started coordinator and `clients` PSClients."""
    running = [serve(tables=TABLES, block=False, key=None, routed=True) for _ in range(2)]
    addresses = [s.address for s in running]
    coordinator = Coordinator(addresses, list(TABLES), replicas=2, key=None)
    made = [PSClient(addresses, key=None, timeout=600) for _ in range(clients)]  # a lost server is noticed
    try:
        coordinator.start()
        yield running, coordinator, made
    finally:
        for client in made:
            client.close()
        coordinator.close()
        for server in running:
            server.stop(timeout=5)


def test_concurrent_pushes_on_replicated_servers_reach_their_backups_without_waiting_on_each_other():
    """Two servers, each the other's backup, with more pushers than worker threads: every forward
    arrives (on the backup's own forwarding port, so a forward never waits for a worker that
    waits on a forward the other way), and after a failover every row still holds every update."""
    with replicated_pair(clients=4) as (running, coordinator, clients):
        ledgers = [Ledger(client, np.uint64(i) << np.uint64(40)) for i, client in enumerate(clients)]
        errors = []

        def push(ledger):
            try:
                for seed in range(6):
                    ledger.push(seed)
            except BaseException as error:
                errors.append(error)

        pushers = [threading.Thread(target=push, args=(ledger,)) for ledger in ledgers]
        for pusher in pushers:
            pusher.start()
        for pusher in pushers:
            pusher.join(120)
        assert not errors and not any(p.is_alive() for p in pushers), errors
        counts = [server["replication"] for server in clients[0].stats()]
        assert [c["forward_failures"] for c in counts] == [0, 0] and all(c["forwarded"] > 0 for c in counts)
        running[0].stop(timeout=5)
        coordinator.fail_over(running[0].address)
        for ledger in ledgers:
            ledger.check()


def test_two_pushes_of_one_key_reach_the_backup_in_the_order_the_primary_applied_them():
    """Two clients push the same key at once. The first push's forward is held at the backup
    until the second push's forward has arrived there too, or waits behind the first at the
    primary: the backup must end with the row read after both pushes, so that after a failover
    the key holds both acknowledged updates (an older forward delivered last would undo one)."""
    with replicated_pair(clients=2) as (running, coordinator, clients):
        key = np.array([12345], np.uint64)
        first = clients[0].lookup("user", key)
        bucket = bucket_of(key, table_route_id("user"))[0]
        primary, backup = running[coordinator.table.owners[bucket]], running[coordinator.table.backups[bucket]]
        store = backup.stores["user"]
        insert_rows, held, second = store.insert_rows, threading.Event(), threading.Event()

        def hold_the_first(rows, meta):
            if held.is_set():
                insert_rows(rows, meta)
                second.set()
                return
            held.set()
            bound = time.monotonic() + 60  # a bound for a broken server only
            while not second.is_set() and not primary.replication.waiting() and time.monotonic() < bound:
                time.sleep(0.005)
            insert_rows(rows, meta)

        store.insert_rows = hold_the_first
        grads = [np.array([[1, 2, 3, 4]], np.float32), np.array([[10, 20, 30, 40]], np.float32)]
        pushes = [threading.Thread(target=client.push_tables, args=({"user": (key, g)},))
                  for client, g in zip(clients, grads)]
        pushes[0].start()
        assert held.wait(60)
        pushes[1].start()
        for push in pushes:
            push.join(60)
        assert not any(push.is_alive() for push in pushes)
        primary.stop(timeout=5)
        coordinator.fail_over(primary.address)
        np.testing.assert_allclose(clients[0].lookup("user", key), first - grads[0] - grads[1], atol=1e-5)
