"""EmbeddingPipeline over the ps placement against real PS servers, through an embedding worker
and directly: staleness never exceeds tau (and reaches it when the dense step is the bottleneck);
tau = 0 sees every earlier update, as the local placement does."""

import time

import numpy as np
import pytest
import torch

from hybridrec.config import parse_config
from hybridrec.job.sources import build_sources
from hybridrec.job.tables import job_tables
from hybridrec.persia.embedding_worker import EmbeddingWorker
from hybridrec.ps.server import serve
from hybridrec.persia.pipeline import EmbeddingPipeline
from hybridrec.persia.embedding_worker_client import EmbeddingWorkerClient
from hybridrec.strategy.placement.local import LocalPlacement
from hybridrec.strategy.placement.ps import PSPlacement
from hybridrec.strategy.world import World

CONFIG = {
    "strategy": {"preset": "persia"},
    "data": {"format": "synthetic", "batch_size": 32,
             "synthetic": {"n_categorical": 4, "n_dense": 1, "vocab_size": 20, "train_rows": 640, "test_rows": 32}},
    "model": {"name": "deepfm", "embedding_dim": 4, "hparams": {"hidden": [8]}},
    "embedding": {"default": {"capacity": 1000, "optimizer": {"name": "sgd", "lr": 0.5}}},
}


@pytest.fixture(params=["embedding_workers", "direct"])
def job(request):
    """(cfg, placement, the embedding worker's stats or None) for each route to the PS servers."""
    cfg = parse_config(CONFIG)
    tables = job_tables(cfg)
    servers = [serve(tables=tables.all_tables(), block=False) for _ in range(2)]
    worker = EmbeddingWorker(tables, [s.address for s in servers], rank=0)
    worker.start()
    through_worker = request.param == "embedding_workers"
    placement = PSPlacement(cfg, tables, World(), {"ps": [s.address for s in servers],
                                                   "embedding_workers": [worker.address] if through_worker else []})
    stats = (lambda: EmbeddingWorkerClient([worker.address], 0).stats()[0]) if through_worker else None
    try:
        yield cfg, placement, stats
    finally:
        placement.close()
        worker.stop()
        for server in servers:
            server.stop()


def zeros(ready) -> dict:
    return {name: np.zeros_like(part) for name, part in ready.looked.parts.items()}


def batches(cfg):
    return build_sources(cfg.data, cfg.seed, with_best_auc=False).train


@pytest.mark.parametrize("tau", [0, 1, 3])
def test_staleness_never_exceeds_tau_and_reaches_it_when_the_dense_step_is_slow(job, tau):
    cfg, placement, _ = job
    with EmbeddingPipeline(batches(cfg), placement.connect, tau) as pipeline:
        for handed, ready in enumerate(pipeline, start=1):
            # a dense step slower than the lookups: it ends once the feeder has looked up as far
            # ahead as tau lets it (or the data ends), however slow the machine is
            ahead = min(tau, 20 - handed)
            deadline = time.monotonic() + 30
            while pipeline._ready.qsize() < ahead and time.monotonic() < deadline:
                time.sleep(0.005)
            pipeline.push(ready, zeros(ready))
        pipeline.drain(60)
    assert len(pipeline.staleness) == 20
    assert max(pipeline.staleness) == tau
    assert pipeline.staleness[0] == 0


@pytest.mark.parametrize("tau", [0, 2])
def test_tau_zero_sees_every_earlier_update_and_tau_two_does_not(job, tau):
    cfg, placement, _ = job
    local = LocalPlacement(cfg, job_tables(cfg), World())  # the synchronous reference
    generator = torch.Generator().manual_seed(1)
    largest_gap = 0.0
    with EmbeddingPipeline(batches(cfg), placement.connect, tau) as pipeline:
        for ready, batch in zip(pipeline, batches(cfg)):
            assert ready.batch.sample_ids.tolist() == batch.sample_ids.tolist()
            reference = local.inputs(batch, batch, requires_grad=True)
            deep, wide = reference.deep, reference.wide
            inputs = placement.inputs(ready.looked, ready.batch, requires_grad=True)
            largest_gap = max(largest_gap, float((inputs.deep - deep).abs().max().detach()))
            grad_deep, grad_wide = torch.randn(deep.shape, generator=generator), torch.randn(wide.shape, generator=generator)
            ((deep * grad_deep).sum() + (wide * grad_wide).sum()).backward()
            ((inputs.deep * grad_deep).sum() + (inputs.wide * grad_wide).sum()).backward()
            time.sleep(0.005)
            pipeline.push(ready, inputs.gradients())
        pipeline.drain(60)
    if tau == 0:
        assert largest_gap < 1e-5
    else:
        assert largest_gap > 1e-3  # some lookups ran ahead of earlier updates


def test_with_an_across_barrier_no_lookup_is_sent_before_every_trainers_update_of_the_step_before(job):
    """Sync with several trainers: `across` (the trainers' barrier) runs after this trainer's update
    was acknowledged, and the next lookup waits for it to return (each trainer's update of the
    step before is in by then), not for this trainer's acknowledgement alone."""
    cfg, placement, _ = job
    returned = []

    def across():
        time.sleep(0.01)  # another trainer's update still in flight
        returned.append(time.time())

    with EmbeddingPipeline(batches(cfg), placement.connect, 0, across=across) as pipeline:
        for ready in pipeline:
            pipeline.push(ready, zeros(ready))
        pipeline.drain(60)
    sent = [lookup[0] for lookup in pipeline.timeline.lookups]
    assert len(sent) == len(returned) == 20
    assert all(sent[t + 1] >= returned[t] for t in range(19))


def test_a_failing_pipeline_raises_in_the_training_thread(job):
    cfg, placement, _ = job
    pipeline = EmbeddingPipeline(batches(cfg), placement.connect, 1)
    try:
        ready = next(iter(pipeline))
        pipeline.push(ready, {name: np.zeros((1, 1), np.float32) for name in ready.looked.parts})  # wrong shapes
        with pytest.raises(RuntimeError, match="embedding pipeline failed"):
            pipeline.drain(60)
    finally:
        pipeline.close()


@pytest.mark.parametrize("job", ["embedding_workers"], indirect=True)  # counts the embedding worker's pulls
def test_no_batch_beyond_the_limit_is_looked_up(job):
    """A run's last steps: a lookup inserts keys, so batches past the limit must not reach the PS."""
    cfg, placement, stats = job
    with EmbeddingPipeline(batches(cfg), placement.connect, 2, skip=1, limit=3) as pipeline:
        trained = []
        for ready in pipeline:
            trained.append(ready.index)
            pipeline.push(ready, zeros(ready))
        pipeline.drain(60)
    assert trained == [1, 2, 3]
    assert stats()["pulls"] == 3 and stats()["buffered"] == 0


@pytest.mark.parametrize("job", ["embedding_workers"], indirect=True)  # counts the embedding worker's pulls
def test_no_lookup_runs_while_held_even_after_the_update_it_waited_for(job):
    """An evaluation or checkpoint inside `held()` sees the PS as the trained steps left it."""
    cfg, placement, stats = job
    with EmbeddingPipeline(batches(cfg), placement.connect, 0) as pipeline:
        stream = iter(pipeline)
        ready = next(stream)
        with pipeline.held():
            pipeline.push(ready, zeros(ready))
            pipeline.drain(60)  # the feeder may now look up batch 1 (sync) ... but not while held
            time.sleep(0.3)
            assert stats()["pulls"] == 1
        assert next(stream).index == 1  # and it goes on afterwards
        assert stats()["pulls"] == 2


def test_tau_must_be_a_non_negative_int(job):
    cfg, placement, _ = job
    with pytest.raises(ValueError, match="tau"):
        EmbeddingPipeline(batches(cfg), placement.connect, -1)
