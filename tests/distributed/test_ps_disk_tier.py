"""A PS server with a disk tier (`serve-ps --tier-path DIR --tier-capacity N`): rows its memory
cannot hold go to disk, and after a kill -9 and a restart on the same directories (memory tier in
shared memory, disk tier in files) the server serves every row again, the cold ones from disk,
and loading a checkpoint brings back the rows it holds; an embedding worker has such servers read
the cold rows of the batch after each pull ahead, and pulls the rows a local store would."""
import os
import signal

import numpy as np
import torch

from hybridrec.embedding.inputs import EmbeddingInputs
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


def test_an_embedding_worker_has_tiered_servers_read_the_next_batch_ahead_and_pulls_the_same_rows(tmp_path):
    from hybridrec.config import parse_config
    from hybridrec.job.sources import build_sources
    from hybridrec.job.tables import job_tables
    from hybridrec.persia.embedding_worker import EmbeddingWorker
    from hybridrec.persia.embedding_worker_client import EmbeddingWorkerClient
    from hybridrec.ps.server import serve
    from hybridrec.strategy.placement.local import LocalPlacement
    from hybridrec.strategy.world import World

    def config(tiers):
        return parse_config({
            "strategy": {"preset": "persia"},
            "data": {"format": "synthetic", "batch_size": 64,
                     "synthetic": {"n_categorical": 2, "vocab_size": 3000, "zipf_exponent": 1.1, "train_rows": 1280,
                                   "test_rows": 64}},
            "model": {"name": "deepfm", "embedding_dim": 4, "hparams": {"hidden": [8]}},
            "embedding": {"default": {"capacity": 100, "optimizer": {"name": "adagrad", "lr": 0.1},
                                      "tier": {"path": str(tmp_path / tiers), "capacity_rows": 5000}}}})

    cfg = config("ps")
    tables = job_tables(cfg)
    server = serve(tables=tables.all_tables(), block=False)
    worker = EmbeddingWorker(tables, [server.address], rank=0, max_buffered=32)
    worker.start()
    client = EmbeddingWorkerClient([worker.address], put_to=0)
    local = LocalPlacement(config("local"), job_tables(config("local")), World())
    try:
        batches = list(build_sources(cfg.data, cfg.seed, with_best_auc=False).train)
        firsts = [client.put(batch.sparse) for batch in batches]  # all buffered: each pull has a next batch
        for first, batch in zip(firsts, batches):
            reference = local.inputs(batch, batch, requires_grad=True)
            pulled = client.pull(first)
            inputs = EmbeddingInputs.from_pulled(pulled, lambda: tables.layout(batch.sparse), tables.deep_dim,
                                                 requires_grad=True)
            for ours, want in ((inputs.deep, reference.deep), (inputs.wide, reference.wide)):
                np.testing.assert_allclose(ours.detach(), want.detach(), rtol=0, atol=1e-6)
            grads = torch.full(inputs.deep.shape, 0.01), torch.full(inputs.wide.shape, -0.02)
            ((reference.deep * grads[0]).sum() + (reference.wide * grads[1]).sum()).backward()
            ((inputs.deep * grads[0]).sum() + (inputs.wide * grads[1]).sum()).backward()
            client.push(first, inputs.gradients())
        worker._read_ahead.wait()
        stats = worker.counters
        assert 0 < stats["read_aheads"] <= len(batches) - 1 and stats["read_ahead_records"] > 0
        assert stats["lost_read_aheads"] == 0
    finally:
        client.close()
        worker.stop()
        server.stop()
        local.close()
