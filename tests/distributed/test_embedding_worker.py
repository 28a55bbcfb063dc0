"""Embedding worker: put/pull/push against real PS servers equals the local EmbeddingCollection;
lost and dropped batches are counted, sample ids carry the rank, bad requests leave it serving."""

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from hybridrec.comm.transport import Client, RemoteError
from hybridrec.config import parse_config
from hybridrec.job.sources import build_sources
from hybridrec.job.tables import job_tables
from hybridrec.persia.embedding_worker import EmbeddingWorker, worker_of
from hybridrec.ps.server import serve
from hybridrec.embedding.inputs import EmbeddingInputs
from hybridrec.persia.embedding_worker_client import EmbeddingWorkerClient
from hybridrec.strategy.placement.local import LocalPlacement
from hybridrec.strategy.world import World

# multi-hot features, a table shared by two features, mean and sqrt-n pooling, deep and wide sides
CONFIG = {
    "strategy": {"preset": "persia"},
    "data": {"format": "synthetic", "batch_size": 48,
             "synthetic": {"n_categorical": 3, "n_multi_hot": 2, "multi_hot_max_length": 4, "n_dense": 2,
                           "vocab_size": 200, "train_rows": 500, "test_rows": 100}},
    "model": {"name": "deepfm", "embedding_dim": 4, "hparams": {"hidden": [8]}},
    "embedding": {"default": {"capacity": 5000, "optimizer": {"name": "adagrad", "lr": 0.1}},
                  "shared": {"both": {"features": ["C1", "C2"], "pooling": "mean"}},
                  "per_feature": {"M1": {"pooling": "sqrtn", "optimizer": {"name": "sgd", "lr": 0.3}}}},
}


@pytest.fixture(params=["unique", "none"])
def job(request):
    """A 2-shard job whose embedding worker sends unique rows (id codec "unique") or pooled rows."""
    cfg = parse_config({**CONFIG, "strategy": {"preset": "persia", "id_codec": request.param}})
    tables = job_tables(cfg)
    servers = [serve(tables=tables.all_tables(), block=False) for _ in range(2)]
    worker = EmbeddingWorker(tables, [s.address for s in servers], rank=5, max_buffered=3,
                             id_codec=request.param)
    worker.start()
    client = EmbeddingWorkerClient([worker.address] * 6, put_to=5, id_codec=request.param)
    try:
        yield cfg, tables, worker, client
    finally:
        client.close()
        worker.stop()
        for server in servers:
            server.stop()


def test_config_has_the_features_this_test_relies_on(job):
    cfg, tables, _, _ = job
    assert {"C1", "M1"} <= set(tables.sparse_names)
    assert tables.deep_map["C1"] == tables.deep_map["C2"] == "both"


def test_pull_and_push_equal_the_local_collection_step_by_step(job):
    cfg, tables, _, client = job
    sources = build_sources(cfg.data, cfg.seed, with_best_auc=False)
    local = LocalPlacement(cfg, tables, World())
    generator = torch.Generator().manual_seed(0)
    applied: dict = {}  # (table, PS server) -> the updates its store applied
    for step, batch in zip(range(4), sources.train):
        reference = local.inputs(batch, batch, requires_grad=True)
        deep, wide = reference.deep, reference.wide
        first = client.put(batch.sparse)
        pulled = client.pull(first)
        inputs = EmbeddingInputs.from_pulled(pulled, lambda: tables.layout(batch.sparse),
                                             tables.deep_dim, requires_grad=True)
        np.testing.assert_allclose(inputs.deep.detach(), deep.detach(), rtol=0, atol=1e-6, err_msg=f"step {step}")
        np.testing.assert_allclose(inputs.wide.detach(), wide.detach(), rtol=0, atol=1e-6, err_msg=f"step {step}")
        # both wire modes give the dense model [B, F, D] in memory order: with another layout its
        # reductions add in another order, and the lossless mode would no longer train bit-identically
        assert inputs.deep.is_contiguous() and inputs.wide.is_contiguous()
        grad_deep = torch.randn(deep.shape, generator=generator)
        grad_wide = torch.randn(wide.shape, generator=generator)
        ((deep * grad_deep).sum() + (wide * grad_wide).sum()).backward()  # local optimizers run here
        ((inputs.deep * grad_deep).sum() + (inputs.wide * grad_wide).sum()).backward()
        reply = client.push(first, inputs.gradients())
        assert (reply["lost"], reply["dropped"]) == (False, 0)
        # each table's store on each PS server reached numbers the updates it applied: the pull read
        # the step's earlier ones, the push is the next
        assert set(pulled.versions) == set(reply["versions"]) == set(tables.all_tables())
        for table, numbers in reply["versions"].items():
            for server, number in enumerate(numbers):
                held = applied.get((table, server), 0)
                assert pulled.versions[table][server] in (-1, held) and number in (-1, held + 1), (table, server)
                applied[table, server] = max(number, held)


def test_unique_rows_carry_each_key_once(job):
    cfg, tables, _, client = job
    batch = next(iter(build_sources(cfg.data, cfg.seed, with_best_auc=False).train))
    pulled = client.pull(client.put(batch.sparse))
    if client.id_codec.name == "none":
        assert pulled.layout == "pooled" and pulled.parts["deep"].shape == (batch.batch_size, 5 * 4)
        return
    assert pulled.layout == "unique" and set(pulled.parts) == set(tables.all_tables())
    c1, _ = batch.sparse.feature("C1")
    c2, _ = batch.sparse.feature("C2")
    assert len(pulled.parts["both"]) == len(np.unique(np.concatenate([c1, c2])))  # the shared table


def test_sample_ids_start_with_the_rank_and_do_not_overlap(job):
    cfg, _, _, client = job
    batch = next(iter(build_sources(cfg.data, cfg.seed, with_best_auc=False).train))
    first, second = client.put(batch.sparse), client.put(batch.sparse)
    assert worker_of(first) == worker_of(second) == 5
    assert second - first >= batch.batch_size


def test_lost_and_dropped_batches_are_counted_not_fatal(job):
    cfg, _, worker, client = job
    batches = list(zip(range(5), build_sources(cfg.data, cfg.seed, with_best_auc=False).train))
    ids = [client.put(batch.sparse) for _, batch in batches]  # the buffer holds 3: the first 2 drop
    assert client.pull(ids[0]) is None
    zeros = {name: np.zeros_like(part) for name, part in client.pull(ids[4]).parts.items()}
    assert client.push(ids[0], zeros)["lost"] is True
    assert client.push(ids[4], zeros)["lost"] is False
    assert client.push(ids[4], zeros)["lost"] is True  # gone
    stats = client.stats()[5]
    assert stats["dropped_batches"] == 2 and stats["lost_pulls"] == 1 and stats["lost_pushes"] == 2
    assert stats["buffered"] == 2


def test_evaluation_pulls_do_not_insert_and_leave_the_buffer(job):
    cfg, _, worker, client = job
    batch = next(iter(build_sources(cfg.data, cfg.seed, with_best_auc=False).test))
    first = client.put(batch.sparse)
    pulled = client.pull(first, train=False)
    assert not any(part.any() for part in pulled.parts.values())  # unseen keys read as zeros, not initialised
    assert client.stats()[5]["buffered"] == 0


def test_malformed_requests_get_errors_and_the_worker_keeps_serving(job):
    cfg, _, worker, client = job
    raw = Client(worker.address, timeout=10)
    try:
        with pytest.raises(RemoteError, match="codec"):
            raw.request("put", {"keys": np.zeros(3, np.uint64)}, {"codec": "zip"})
        with pytest.raises(RemoteError, match="first_sample_id"):
            raw.request("pull", meta={"first_sample_id": "seven"})
        batch = next(iter(build_sources(cfg.data, cfg.seed, with_best_auc=False).train))
        first = client.put(batch.sparse)
        parts = client.pull(first).parts
        name = sorted(parts)[0]
        with pytest.raises(RemoteError, match="shape"):
            client.push(first, {**parts, name: parts[name][:, :1].copy()})
        with pytest.raises(RemoteError, match="NaN"):
            client.push(first, {**parts, name: np.full_like(parts[name], np.nan)})
        with pytest.raises(RemoteError, match="lacks"):
            client.push(first, {n: p for n, p in parts.items() if n != name})
        # the rejected pushes changed nothing and the batch is still there
        assert client.push(first, {n: np.zeros_like(p) for n, p in parts.items()})["lost"] is False
    finally:
        raw.close()


def test_rank_must_fit_in_a_byte():
    tables = job_tables(parse_config(CONFIG))
    with pytest.raises(ValueError, match="rank"):
        EmbeddingWorker(tables, ["tcp://127.0.0.1:1"], rank=256)


@pytest.mark.parametrize("argv, message", [
    (["--rank", "300", "--ps", "tcp://127.0.0.1:1"], "rank must be an int in \\[0, 255\\]"),
    (["--rank", "0", "--ps", "127.0.0.1:1"], "--ps entry must look like 'tcp://host:port', got '127.0.0.1:1'"),
    (["--rank", "0", "--ps", ","], "--ps must be a non-empty list"),
])
def test_the_command_line_refuses_bad_arguments_before_serving(argv, message, capsys):
    from hybridrec.persia.embedding_worker import main

    with pytest.raises(SystemExit) as stopped:
        main([str(Path(__file__).parents[2] / "configs" / "quickstart.yaml"), *argv])
    assert stopped.value.code == 2
    assert re.search(message, capsys.readouterr().err)
