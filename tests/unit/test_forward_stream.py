"""A primary's forwards reach its backup in the order their rows were read
(`hybridrec.ps.forward_stream`): whatever the pushers' interleaving and the requests' delays,
the backup ends with the primary's row of every key, also when the primary evicts rows and
makes them again (a fresh row: its clock and count say nothing about which forward is newer)."""
import threading
import time

import numpy as np
from hypothesis import HealthCheck, given, settings, strategies as st

from hybridrec.embedding import EmbeddingStore, TableConfig
from hybridrec.ps.forward_stream import Forward, ForwardStream

ADAGRAD = {"name": "adagrad", "lr": 0.5}


def rows_by_key(store, keys):
    """The keys of `keys` that `store` holds, sorted, and their rows (embedding and optimizer state)."""
    rows, meta = store.rows_of(keys)
    held = meta.view(np.uint64)[:, 0]
    order = np.argsort(held)
    return held[order], rows[order]


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**16), pushers=st.integers(2, 4), key_space=st.sampled_from([40, 400]),
       max_rows=st.sampled_from([1, 16, 1 << 16]))
def test_the_backup_keeps_the_newest_read_row_of_every_key_whatever_the_interleaving(seed, pushers, key_space,
                                                                                    max_rows):
    # 64 rows for up to 400 keys: the primary evicts keys and makes them again while the pushers run
    primary = EmbeddingStore(TableConfig(dim=4, capacity=64, optimizer=ADAGRAD, seed=3))
    backup = EmbeddingStore(TableConfig(dim=4, capacity=4096, optimizer=ADAGRAD, seed=3))
    in_flight, overlapped, sequences = [0], [], []
    delays = np.random.default_rng(seed).random(10_000) * 2e-3

    def send(stream, sequence, forwards):
        in_flight[0] += 1
        overlapped.append(in_flight[0] > 1)
        sequences.append(sequence)
        time.sleep(delays[sequence % len(delays)])  # a slow request: a later one would overtake it if allowed
        for forward in forwards:
            for _, rows, meta in forward.parts:
                backup.insert_rows(rows, meta)
        in_flight[0] -= 1
        return True

    stream = ForwardStream(send, max_rows=max_rows, max_parts=512)
    errors = []

    def push(worker):
        rng = np.random.default_rng([seed, worker])
        try:
            for _ in range(25):
                keys = rng.integers(1, key_space + 1, 6).astype(np.uint64)
                primary.lookup(keys, insert=True)
                primary.push(keys, rng.standard_normal((len(keys), 4)).astype(np.float32))
                assert stream.forward(lambda: Forward(None, [("t", *primary.rows_of(keys))]))
        except BaseException as error:  # reported by the test thread
            errors.append(error)

    threads = [threading.Thread(target=push, args=(w,)) for w in range(pushers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors and not any(t.is_alive() for t in threads), errors
    assert not any(overlapped) and sequences == list(range(1, len(sequences) + 1))
    held = primary.r64[primary.live_rows(), 0].copy()
    primary_keys, primary_rows = rows_by_key(primary, held)
    backup_keys, backup_rows = rows_by_key(backup, held)
    np.testing.assert_array_equal(backup_keys, primary_keys)
    np.testing.assert_array_equal(backup_rows, primary_rows)  # embedding and optimizer state

def test_pushers_waiting_behind_a_request_in_flight_share_the_next_one():
    release, entered = threading.Event(), threading.Event()
    sent = []

    def send(stream, sequence, forwards):
        sent.append([f.pushed for f in forwards])
        entered.set()
        release.wait(30)
        return sequence != 2  # the second request is lost: its forwards are not delivered

    stream = ForwardStream(send, max_rows=100, max_parts=512)
    results = {}

    def push(n):
        results[n] = stream.forward(lambda: Forward(("c", n), [("t", np.zeros((1, 8), np.float32),
                                                                np.zeros((1, 8), np.int32))]))

    first = threading.Thread(target=push, args=(0,))
    first.start()
    assert entered.wait(30)
    others = [threading.Thread(target=push, args=(n,)) for n in (1, 2, 3)]
    for thread in others:
        thread.start()
    while stream.waiting() < 3:  # the three queue behind the request in flight
        time.sleep(0.005)
    release.set()
    for thread in [first, *others]:
        thread.join(30)
    assert sent[0] == [("c", 0)] and sorted(sent[1]) == [("c", 1), ("c", 2), ("c", 3)] and len(sent) == 2
    assert results == {0: True, 1: False, 2: False, 3: False}


def test_a_request_the_backup_missed_is_carried_again_read_anew_by_the_next_one():
    """The first request fails (the backup timed out): its pushes were acknowledged alone, and the
    next request carries their keys' rows as they are then, after its own forward."""
    sent, now = [], {"t": 1.0}

    def send(stream, sequence, forwards):
        sent.append([(f.pushed, f.parts[0][2].view(np.uint64)[:, 0].tolist(), float(f.parts[0][1][0, 0]))
                     for f in forwards])
        return sequence != 1

    def part(keys):
        meta = np.zeros((len(keys), 8), np.int32)
        meta.view(np.uint64)[:, 0] = keys
        return ("t", np.full((len(keys), 2), now["t"], np.float32), meta)

    def reread(keys):
        return Forward(None, [part(keys["t"])])

    counts = {}
    stream = ForwardStream(send, max_rows=100, max_parts=512, reread=reread, counts=counts)
    assert not stream.forward(lambda: Forward(("c", 1), [part(np.array([5, 7], np.uint64))]))
    now["t"] = 2.0  # the rows changed since the failed request read them
    assert stream.forward(lambda: Forward(("c", 2), [part(np.array([9], np.uint64))]))
    assert sent == [[(("c", 1), [5, 7], 1.0)], [(("c", 2), [9], 2.0), (None, [5, 7], 2.0)]]
    assert counts == {"resent_rows": 2, "resends_given_up": 0}
    assert stream.forward(lambda: Forward(("c", 3), [part(np.array([9], np.uint64))]))
    assert len(sent[-1]) == 1  # nothing is missed any more
