"""The NN worker of a Persia-style job: one process per rank, started by torchrun.

Each rank reads its shard of the training data, sends the ID features to an embedding worker,
trains the dense model on the pooled embeddings it pulls back (EmbeddingPipeline: sync, or at
most `strategy.tau` batches stale) and hands the embeddings' gradients back; dense parameters
are synchronised by DDP AllReduce (sync, hybrid) or live on the PS (async). All ranks take the
same number of steps (an epoch ends for everyone when one rank's shard runs out).

Checkpoints (`train.checkpoint_every`, and at the end) hold the dense state, the PS tables
(written by the servers into the checkpoint directory, so it must be a path they can write)
and each rank's position in its data; a restarted worker group (torchrun --max-restarts) or
`--resume` continues from the newest one. Rank 0 writes metrics.jsonl and final_metrics.json.

    python -m torch.distributed.run --nproc-per-node 2 -m hybridrec.parallel.nn_worker CONFIG \\
        --ps tcp://127.0.0.1:7001,tcp://127.0.0.1:7002 --embedding-workers tcp://127.0.0.1:7101
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import faulthandler
import gc
import json
import os
import signal
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from hybridrec.comm.transport import check_addresses
from hybridrec.config import ConfigError, JobConfig, load_config
from hybridrec.models import build_model
from hybridrec.parallel.dense_sync import make_dense, model_device
from hybridrec.parallel.embedding_client import EmbeddingWorkerClient
from hybridrec.parallel.embedding_inputs import EmbeddingInputs
from hybridrec.parallel.pipeline import EmbeddingPipeline
from hybridrec.parallel.tables import job_tables
from hybridrec.ps.client import PSClient
from hybridrec.train.checkpoint import latest_checkpoint, read_dense, read_progress, save_checkpoint
from hybridrec.train.data import build_sources
from hybridrec.train.loop import open_checkpoint, seed_everything
from hybridrec.train.metrics import MetricAccumulator
from hybridrec.train.recmodel import resolve_device
from hybridrec.train.reporting import Reporter


class _Job:
    """What one rank holds for the run: config, data, dense model, clients."""

    def __init__(self, cfg: JobConfig, ps_addresses: list[str], ew_addresses: list[str]):
        self.cfg = cfg
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        s = cfg.strategy
        self.tables = job_tables(cfg)
        self.sources = build_sources(cfg.data, cfg.seed, self.rank, self.world, with_best_auc=self.rank == 0)
        m = cfg.model
        self.model = build_model(m.name, num_sparse=len(self.tables.sparse_names), embedding_dim=m.embedding_dim,
                                 num_dense=self.tables.num_dense, num_tasks=self.tables.num_tasks, **m.hparams)
        self.model.to(resolve_device(cfg.train.device))
        self.ps = PSClient(ps_addresses, timeout=s.request_timeout, retries=s.retries, value_codec=s.value_codec)
        self.ew_addresses = ew_addresses
        self.dense = None  # made after a checkpoint was loaded (async: the PS must hold it first)

    def embedding_client(self) -> EmbeddingWorkerClient:
        s = self.cfg.strategy
        # an embedding worker's answer may wait for its own PS retries: give it that long
        return EmbeddingWorkerClient(self.ew_addresses, self.rank % len(self.ew_addresses), id_codec=s.id_codec,
                                     value_codec=s.value_codec, timeout=s.request_timeout * (s.retries + 2),
                                     retries=s.retries)

    def logits(self, module, deep, wide, batch) -> torch.Tensor:
        device = model_device(self.model)
        dense = torch.from_numpy(batch.dense).to(device) if batch.dense.shape[1] else None
        return module(None if deep is None else deep.to(device), None if wide is None else wide.to(device), dense)


@torch.no_grad()
def evaluate(job: _Job) -> dict:
    """Exact test metrics: rank r scores test batches r, r+W, ...; rank 0 computes the metrics."""
    model = job.model
    was_training = model.training
    model.eval()
    client = job.embedding_client()
    probs, labels = [], []
    try:
        for index, batch in enumerate(job.sources.test):
            if index % job.world != job.rank:
                continue
            pulled = client.pull(client.put(batch.sparse), train=False)
            if pulled is None:
                raise RuntimeError("evaluation: an embedding worker lost a test batch (was it restarted?)")
            inputs = EmbeddingInputs(pulled, batch.sparse, job.tables, requires_grad=False)
            logits = job.logits(model, inputs.deep, inputs.wide, batch)
            probs.append(torch.sigmoid(logits).cpu().numpy())
            labels.append(batch.labels)
    finally:
        client.close()
        model.train(was_training)
    gathered = [None] * job.world
    dist.all_gather_object(gathered, (probs, labels))
    names = job.sources.label_names
    acc = MetricAccumulator(len(names), names if len(names) > 1 else None)
    for rank_probs, rank_labels in gathered:
        for p, y in zip(rank_probs, rank_labels):
            acc.update(p, y)
    return acc.compute()


def _save(job: _Job, progress: dict, pipeline: EmbeddingPipeline | None) -> None:
    """Every rank's updates acknowledged, then rank 0 writes the checkpoint (PS tables included)."""
    if pipeline is not None:
        pipeline.drain(drain_seconds(job.cfg))
    positions = [None] * job.world
    dist.all_gather_object(positions, progress["next_batch"])
    dist.barrier()
    if job.rank == 0:
        record = {**progress, "next_batch_by_rank": positions}
        save_checkpoint(job.cfg.train.output_dir, job.dense.state(),
                        lambda directory: job.ps.checkpoint(directory), record, job.cfg,
                        job.cfg.train.keep_checkpoints)
    dist.barrier()


def _restore(job: _Job, resume: bool, overwrite: bool) -> dict:
    """Fresh progress, or the newest checkpoint's (PS tables loaded by rank 0, dense by all)."""
    found = [None]
    if job.rank == 0:
        checkpoint = open_checkpoint(Path(job.cfg.train.output_dir), resume, overwrite)
        found = [None if checkpoint is None else str(checkpoint)]
    dist.broadcast_object_list(found, src=0)
    progress = {"step": 0, "epoch": 0, "next_batch": 0, "samples": 0}
    state = None
    if found[0] is not None:
        path = Path(found[0])
        record = read_progress(path, job.cfg)
        if len(record["next_batch_by_rank"]) != job.world:
            raise ConfigError(f"resume: {path} was written by {len(record['next_batch_by_rank'])} NN workers; "
                              f"this job has {job.world}")
        progress = {**record, "next_batch": record["next_batch_by_rank"][job.rank]}
        if job.rank == 0:
            job.ps.load(path / "embeddings")
            print(f"nn worker: resumed from checkpoint {path} at step {progress['step']}", flush=True)
        state = read_dense(path)
    dist.barrier()
    job.dense = make_dense(job.cfg.strategy.discipline, job.model, job.cfg, job.ps)
    if state is not None:
        job.dense.load(state)
    return progress


def effective_tau(cfg: JobConfig) -> int:
    """Batches allowed between a lookup and its update: 0 for sync, `strategy.tau` otherwise."""
    return 0 if cfg.strategy.discipline == "sync" else cfg.strategy.tau


def drain_seconds(cfg: JobConfig) -> float:
    """How long the updates in flight may take: each push may wait out its PS retries."""
    s = cfg.strategy
    return s.request_timeout * (s.retries + 2) * (effective_tau(cfg) + 2)


def _due(every: int | None, step: int) -> bool:
    """Whether a periodic action (every `every` steps; None or 0: never) falls on `step`."""
    return bool(every) and step % every == 0


def _all_have(flag: bool) -> bool:
    have = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(have, op=dist.ReduceOp.MIN)
    return bool(have.item())


def train(cfg: JobConfig, ps_addresses: list[str], ew_addresses: list[str], *, resume: bool = False,
          overwrite: bool = False) -> dict:
    """Run this rank's part of the job; returns the final test metrics and run facts (all ranks)."""
    seed_everything(cfg.seed, cfg.train.threads, cfg.train.deterministic)
    job = _Job(cfg, ps_addresses, ew_addresses)
    progress = _restore(job, resume, overwrite)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    max_steps = cfg.train.max_steps
    done = max_steps is not None and progress["step"] >= max_steps
    train_seconds, samples_this_run = 0.0, 0
    staleness: list[int] = []
    wire = {"bytes_sent": 0, "bytes_received": 0, "lost_batches": 0, "dropped_updates": 0,
            "unacknowledged_updates": 0}
    out_dir = Path(cfg.train.output_dir)
    # the launcher prefixes log lines, which a progress bar's carriage returns would garble
    reporter = Reporter(out_dir, cfg.train.model_copy(update={"progress": False}), resumed_step=progress["step"],
                        append=progress["step"] > 0) if job.rank == 0 else None
    # async ranks never wait for each other, so nothing collective may happen mid-epoch there:
    # periodic evaluations and checkpoints are for sync and hybrid; async has the final ones
    lockstep = cfg.strategy.discipline != "async"
    if not lockstep and job.rank == 0 and (cfg.train.eval_every or cfg.train.checkpoint_every):
        print("nn worker: async discipline: train.eval_every / train.checkpoint_every are not used; "
              "evaluation and checkpoint happen at the end", flush=True)
    job.model.train()
    try:
        for epoch in range(progress["epoch"], cfg.train.epochs):
            if done:
                break
            skip = progress["next_batch"] if epoch == progress["epoch"] else 0
            remaining = None if max_steps is None else max_steps - progress["step"]
            pipeline = EmbeddingPipeline(job.sources.train, job.embedding_client, effective_tau(cfg), skip=skip,
                                         limit=remaining)
            try:
                stream = iter(pipeline)
                tick = time.perf_counter()
                while True:
                    ready = next(stream, None)
                    # with AllReduce every rank must take the same steps: when one rank is out of
                    # data the epoch ends for all; async ranks run on their own (no collective here)
                    if not (_all_have(ready is not None) if lockstep else ready is not None):
                        if ready is not None:
                            pipeline.skip(ready)
                        break
                    batch = ready.batch
                    job.dense.begin_step()
                    # torch work stays in this thread, out of the pipeline's feeder and pusher threads
                    inputs = EmbeddingInputs(ready.embeddings, batch.sparse, job.tables, requires_grad=True)
                    logits = job.logits(job.dense.module, inputs.deep, inputs.wide, batch)
                    loss = loss_fn(logits, torch.from_numpy(batch.labels).to(logits.device))
                    loss.backward()
                    step = progress["step"] + 1
                    evaluate_now = lockstep and _due(cfg.train.eval_every, step)
                    save_now = lockstep and _due(cfg.train.checkpoint_every, step)
                    # no lookup between this update and the evaluation or checkpoint (a lookup
                    # inserts keys): held before the push, so with sync they are deterministic
                    with pipeline.held() if evaluate_now or save_now else contextlib.nullcontext():
                        pipeline.push(ready, inputs.gradients())
                        job.dense.finish_step()
                        train_seconds += time.perf_counter() - tick
                        samples_this_run += batch.batch_size
                        progress.update(step=step, epoch=epoch, next_batch=ready.index + 1,
                                        samples=progress["samples"] + batch.batch_size * job.world)
                        if reporter is not None:
                            reporter.train_step(step, loss.item(), torch.sigmoid(logits.detach()).cpu().numpy(),
                                                batch.labels, batch.batch_size)
                        if evaluate_now:
                            pipeline.drain()
                            dist.barrier()
                            metrics = evaluate(job)
                            if reporter is not None:
                                reporter.eval_result(step, metrics)
                        if save_now:
                            _save(job, progress, pipeline)
                    if max_steps is not None and step >= max_steps:
                        done = True
                        break
                    tick = time.perf_counter()
                pipeline.drain(drain_seconds(cfg))
            finally:
                pipeline.close()
                staleness.extend(pipeline.staleness)
                for key, value in pipeline.stats().items():
                    if key in wire:
                        wire[key] += value
            if not done:
                progress.update(epoch=epoch + 1, next_batch=0)
        if progress["step"] == 0:
            raise ValueError(f"rank {job.rank} of {job.world}: no training step was taken; some rank got no "
                             "training batch (the rows are dealt to ranks in blocks, so a small data set may leave "
                             "a rank with none): use more rows or fewer NN workers")
        _save(job, progress, None)
        metrics = evaluate(job)
        facts = [None] * job.world
        dist.all_gather_object(facts, {"samples": samples_this_run, "seconds": train_seconds,
                                       "staleness": [max(staleness, default=0), sum(staleness), len(staleness)],
                                       **wire})
        total_samples = sum(f["samples"] for f in facts)
        slowest = max(f["seconds"] for f in facts)
        looked_up = sum(f["staleness"][2] for f in facts)
        result = {**metrics, "step": progress["step"], "samples": progress["samples"],
                  "discipline": cfg.strategy.discipline, "tau": effective_tau(cfg), "nn_workers": job.world,
                  "train_samples_per_s": total_samples / slowest if slowest else None,
                  "max_staleness": max(f["staleness"][0] for f in facts),
                  "mean_staleness": sum(f["staleness"][1] for f in facts) / looked_up if looked_up else 0.0,
                  "bytes_per_sample": (sum(f["bytes_sent"] + f["bytes_received"] for f in facts) / total_samples
                                       if total_samples else None),
                  "lost_batches": sum(f["lost_batches"] for f in facts),
                  "dropped_updates": sum(f["dropped_updates"] for f in facts),
                  "unacknowledged_updates": sum(f["unacknowledged_updates"] for f in facts),
                  "best_auc": job.sources.best_auc}
        if reporter is not None:
            reporter.final(progress["step"], result)
            (out_dir / "final_metrics.json").write_text(json.dumps(result, indent=1))
        return result
    finally:
        if reporter is not None:
            reporter.close()
        job.ps.close()


def join_process_group(backend: str) -> None:
    """`init_process_group` for a worker started by torchrun, in a key space of its own per restart.

    With torchrun's default env:// rendezvous, a worker group restarted after a failure
    (--max-restarts) failed here to connect its gloo pairs or hung in init (torch 2.13: the same
    happens with a ten-line script). Joining through the agent's store under a prefix named after
    the restart count works every time, so that is what NN workers do.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend)  # not under a torchrun agent: the usual env:// setup
        return
    timeout = datetime.timedelta(minutes=10)  # how long a collective may wait for a slow rank
    world = int(os.environ["WORLD_SIZE"])
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, False, timeout=timeout)
    store = dist.PrefixStore(f"hybridrec/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", base)
    dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]), world_size=world, timeout=timeout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybridrec.parallel.nn_worker", description=__doc__.split("\n")[0])
    parser.add_argument("config")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    parser.add_argument("--ps", required=True, help="PS addresses, comma-separated, in shard order")
    parser.add_argument("--embedding-workers", required=True, help="embedding worker addresses, in rank order")
    again = parser.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    again.add_argument("--overwrite", action="store_true", help="start over, deleting an earlier run's checkpoints")
    args = parser.parse_args(argv)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID` prints every thread's stack
    try:
        cfg = load_config(args.config, args.set)
        ps_addresses = check_addresses([a for a in args.ps.split(",") if a], "--ps")
        ew_addresses = check_addresses([a for a in args.embedding_workers.split(",") if a], "--embedding-workers")
    except ValueError as error:  # ConfigError too
        parser.error(str(error))
    if cfg.strategy.name != "persia":
        parser.error(f"{args.config}: strategy.name is {cfg.strategy.name!r}; NN workers run 'persia' jobs "
                     "(--set strategy.name=persia)")
    # after a failure torchrun restarts the whole group: continue from the newest checkpoint
    # (none yet: start over, keeping what the PS tables learnt)
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    if restarted and latest_checkpoint(cfg.train.output_dir) is None:
        args.overwrite, args.resume = True, False
    elif restarted:
        args.overwrite, args.resume = False, True
    backend = "nccl" if torch.cuda.is_available() and cfg.train.device != "cpu" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    # DDP warns that the multi-task head's [T, H, 1] weight gets a gradient whose strides differ
    # from its bucket's in a size-1 dimension: the same memory order, nothing to fix
    warnings.filterwarnings("ignore", message="Grad strides do not match bucket view strides")
    join_process_group(backend)
    try:
        result = train(cfg, ps_addresses, ew_addresses, resume=args.resume, overwrite=args.overwrite)
        if dist.get_rank() == 0:
            print("final " + json.dumps({k: v for k, v in result.items() if not isinstance(v, dict)}), flush=True)
    finally:
        # DDP's reducer sits in reference cycles: collect it (and the gloo work it holds) while the
        # interpreter is alive; freed during finalisation, its tensors take the GIL and the process
        # aborts ("terminate called without an active exception", SIGABRT after a finished job)
        gc.collect()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # the job is done and every file is written and closed: skip interpreter finalisation, where
    # torch's C++ teardown has aborted finished NN workers now and then
    os._exit(exit_code)
