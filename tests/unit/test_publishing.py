"""Delta publishing: the versions a training job publishes hold exactly its tables; a publisher
killed at any moment leaves only complete versions, and a server follows them, swapping versions
under load without a failed request, and rolls back to an older one."""
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import PredictionServer, PublishingJob, write_test_rows

from hybridrec.bundle import chain
from hybridrec.bundle.format import complete_versions, read_manifest
from hybridrec.embedding import EmbeddingStore
from hybridrec.embedding.changes import ChangeTracker

TESTS = Path(__file__).resolve().parents[1]


def _as_dict(keys, weights) -> dict:
    return {int(k): w.tolist() for k, w in zip(keys, weights)}


def test_marks_give_exactly_the_rows_changed_and_the_keys_removed():
    rng = np.random.default_rng(1)
    store = EmbeddingStore(dim=4, capacity=256, num_threads=2, optimizer={"name": "adagrad", "lr": 0.1},
                           expire_after={"steps": 3})
    tracker = ChangeTracker(store)
    mirror = {}
    for step in range(1, 40):
        keys = rng.integers(0, 600, size=120).astype(np.uint64)  # more keys than rows: evictions
        store.pull(keys)
        store.push(keys[:60], rng.normal(size=(60, 4)).astype(np.float32))
        if step % 7 == 0:
            store.expire(step)
        changes = tracker.take(store, full=step % 10 == 1)
        if changes.full:
            mirror = {}
        for key in changes.deleted.tolist():
            mirror.pop(key)
        mirror.update(_as_dict(changes.keys, changes.weights))
        exported = store.export()
        assert mirror == _as_dict(exported["keys"], exported["weights"][:, :4]), step


def test_published_versions_hold_the_tables_and_old_ones_are_pruned(tmp_path):
    job = PublishingJob(tmp_path, **{"train.publish_full_every": 3, "train.publish_keep_full": 2})
    for _ in range(8):
        job.train()
        job.publish()
    job.publisher.wait()
    versions = complete_versions(job.publisher.root)
    kinds = {n: read_manifest(p)["kind"] for n, p in versions.items()}
    assert kinds == {4: "full", 5: "delta", 6: "delta", 7: "full", 8: "delta"}
    assert read_manifest(versions[8])["base"] == 7 and read_manifest(versions[8])["step"] == 8
    latest = chain.load(versions[8])
    for name, store in job.placement.stores().items():
        exported = store.export()
        table = latest.tables[name]
        assert _as_dict(table.keys, table.weights()) == _as_dict(exported["keys"], exported["weights"]), name
    full = sum(p.stat().st_size for p in versions[7].rglob("*.bin"))
    delta = sum(p.stat().st_size for p in versions[8].rglob("*.bin"))
    assert delta < full


def test_a_publisher_killed_at_random_moments_leaves_only_complete_versions(tmp_path):
    root = tmp_path / "job"
    published = root / "published"
    rng = random.Random(7)
    for attempt in range(3):
        process = subprocess.Popen([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(TESTS)!r}); "
                                    f"from helpers import publish_forever; publish_forever({str(root)!r})"],
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            assert process.stdout.readline().strip() == "started", process.stdout.read()
            before = max(complete_versions(published), default=0)
            deadline = time.monotonic() + 120
            while max(complete_versions(published), default=0) <= before and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(rng.uniform(0.0, 0.6))
        finally:
            process.send_signal(signal.SIGKILL)
            process.wait(30)
            process.stdout.close()
        versions = complete_versions(published)
        assert max(versions) > before
        for entry in published.iterdir():  # a version is whole or invisible (a temporary name)
            assert entry.name.startswith(".") or entry.name in {p.name for p in versions.values()}, entry
        newest = chain.load(versions[max(versions)])  # the chain of the newest reads whole
        assert newest.number == max(versions) and newest.tables
    assert max(complete_versions(published)) >= 3


@pytest.mark.skipif(not __import__("importlib").util.find_spec("uvicorn"), reason="needs hybridrec[serve]")
def test_versions_swap_under_concurrent_requests_and_rollback_serves_the_older_scores(tmp_path):
    job = PublishingJob(tmp_path, **{"train.publish_full_every": 4})
    job.train(4)
    job.publish()
    job.publisher.wait()
    lines = write_test_rows(job.cfg, tmp_path / "rows.tsv").read_text().splitlines()[:64]
    server = PredictionServer(job.publisher.root, "--poll-seconds", "0.05")
    failures, answers, stop = [], [], threading.Event()

    def client(offset: int) -> None:
        seen = 0
        while not stop.is_set():
            status, body = server.post("/predict", {"lines": lines[offset:offset + 8]})
            if status != 200 or body["version"] < seen:
                failures.append((status, body))
                return
            seen = body["version"]
            answers.append(seen)

    try:
        status, first = server.post("/predict", {"lines": lines})
        assert status == 200 and first["version"] == 1
        clients = [threading.Thread(target=client, args=(8 * i,)) for i in range(4)]
        for thread in clients:
            thread.start()
        for _ in range(6):
            job.train(2, scale=5.0)  # large steps: every version scores differently
            job.publish()
            job.publisher.wait()
            time.sleep(0.3)
        deadline = time.monotonic() + 30
        while server.get("/version")[1]["version"] < 7 and time.monotonic() < deadline:
            time.sleep(0.1)
        stop.set()
        for thread in clients:
            thread.join(60)
        assert not failures, failures[:3]
        assert len(set(answers)) >= 3 and max(answers) == 7
        status, newest = server.post("/predict", {"lines": lines})
        assert newest["version"] == 7 and np.abs(np.array(newest["scores"]) - first["scores"]).max() > 1e-3
        assert server.post("/rollback", {"version": 1}) == (200, {"version": 1, "pinned": True})
        status, again = server.post("/predict", {"lines": lines})
        assert again["version"] == 1 and np.abs(np.array(again["scores"]) - first["scores"]).max() <= 1e-6
        assert server.post("/rollback", {"version": 99})[0] == 400
        assert server.post("/follow")[1] == {"version": 7, "pinned": False}
    finally:
        stop.set()
        server.stop()


def test_a_training_job_publishes_versions_ending_with_the_model_it_checkpoints(tmp_path):
    from helpers import small_config

    from hybridrec.serving.export import export
    from hybridrec.train.trainer import train

    cfg = small_config(tmp_path, **{"data.synthetic.train_rows": 6_000, "train.publish_dir": str(tmp_path / "pub"),
                                    "train.publish_every": 3, "train.publish_full_every": 3})
    result = train(cfg)
    versions = complete_versions(tmp_path / "pub")
    kinds = [read_manifest(p)["kind"] for p in versions.values()]
    assert kinds[:4] == ["full", "delta", "delta", "full"]
    newest = chain.load(versions[max(versions)])
    assert newest.step == result["step"]  # the last version is the model training ended with
    exported = chain.load(export(cfg.train.output_dir, tmp_path / "bundle"))
    for name, table in exported.tables.items():
        assert _as_dict(table.keys, table.weights()) == _as_dict(newest.tables[name].keys,
                                                                  newest.tables[name].weights()), name
    for key, value in exported.dense_state.items():
        assert (value == newest.dense_state[key]).all(), key
