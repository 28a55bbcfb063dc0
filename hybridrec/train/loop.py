"""The one training loop of every strategy: read ready batches from the strategy's embedding
stream, forward, loss, backward, hand the embedding gradients back, dense step; evaluate on
held-out data, log, checkpoint, resume.

A local run is a world of one trainer; under torchrun each rank runs this same loop. What
differs between strategies sits behind the axes (hybridrec.strategy): the placement makes the
embedding inputs and applies their gradients, the consistency decides how far lookups run ahead
of updates, the dense sync wraps the model.
"""
from __future__ import annotations

import contextlib
import json
import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from hybridrec.config import ConfigError, JobConfig
from hybridrec.job.sources import build_sources
from hybridrec.job.tables import job_dense_model, job_tables
from hybridrec.strategy import build_strategy
from hybridrec.strategy.world import World
from hybridrec.comm.transport import RemoteError
from hybridrec.train.checkpoint import (CheckpointError, CheckpointTimer, checkpoint_root, complete_checkpoints, config_for_checkpoint,
                                        latest_checkpoint, model_state, read_dense, read_progress, remove_interrupted_writes,
                                        save_checkpoint)
from hybridrec.metrics import MetricAccumulator
from hybridrec.train.best import BestKeeper
from hybridrec.train.expiry import ExpirySchedule
from hybridrec.train.stream import StreamTraining
from hybridrec.train.local_pipeline import LocalPipeline
from hybridrec.train.divergence import checked_loss
from hybridrec.train.reporting import Reporter, json_text
from hybridrec.train.threads import ThreadSplit, thread_split


def seed_everything(seed: int, threads: int, deterministic: bool) -> None:
    """Seed every random generator training may use and set the torch and numba thread counts."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    try:
        import numba

        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    except (ImportError, ValueError):
        pass
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)


def resolve_device(name: str) -> torch.device:
    """'auto' = CUDA when available, else CPU; asking for CUDA without it is an error."""
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("train.device: 'cuda' was asked for but torch.cuda.is_available() is False; "
                         "use 'auto' or 'cpu'")
    return torch.device("cuda" if name == "cuda" or (name == "auto" and torch.cuda.is_available()) else "cpu")


def dense_model(cfg: JobConfig, tables) -> torch.nn.Module:
    return job_dense_model(cfg, tables).to(resolve_device(cfg.train.device))


def logits_of(module, inputs, batch, device: torch.device) -> torch.Tensor:
    inputs = inputs.to(device)
    dense = torch.from_numpy(batch.dense).to(device) if batch.dense.shape[1] else None
    return module(inputs.deep, inputs.wide, dense)


def _lookup_for_evaluation(connection, batch, attempts: int = 3):
    """A test batch's rows; a batch lost on the way (its embedding worker restarted between the
    put and the pull) is sent again."""
    for _ in range(attempts):
        looked = connection.lookup(connection.prepare(batch), train=False)
        if looked is not None:
            return looked
    raise RuntimeError(f"evaluation: the rows of a test batch were lost {attempts} times in a row")


class _Alone(World):
    """This trainer as a world of one, even inside a process group: collectives answered in process."""

    @property
    def grouped(self) -> bool:
        return False


def reading_world(placement, world: World) -> World:
    """The trainers as the rows are dealt to them: each reads its share of the training rows and
    scores its share of the held-out ones (`world`), or, when the placement's trainers each
    compute a part of every sample (`whole_batches`: DES's field_sharded), every trainer reads and
    scores every row, all together (a world of one)."""
    return _Alone() if placement.whole_batches else world


def dense_precision(precision: str, device: torch.device):
    """The context the dense forward runs in: torch autocast to bfloat16 for `bf16`, else nothing."""
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def batch_loss(loss_fn, logits: torch.Tensor, labels: np.ndarray, device) -> torch.Tensor:
    """The loss of a batch; an empty one (a lockstep trainer whose stream had nothing, an empty
    micro-batch) has loss 0 with zero gradients, not the NaN a mean over no rows would be."""
    if not len(labels):
        return logits.sum() * 0.0
    return loss_fn(logits, torch.from_numpy(labels).to(device))


def forward_backward(placement, dense, ready, loss_fn, device, precision: str = "fp32"):
    """(inputs, logits, loss) of a step's forward and backward passes. The placement's
    `micro_batches(looked, batch)` (PICASSO's D-interleaving) may cut the batch into parts: one
    pass per part, each part's loss weighted by its share of the rows and the dense gradients
    accumulated unsynchronised (DDP's no_sync) until the last part, so the step's gradients are
    the whole batch's; the placement updates its embeddings once, in the push."""
    batch = ready.batch
    parts = placement.micro_batches(ready.looked, batch)
    if len(parts) == 1:
        inputs = placement.inputs(parts[0][0], batch, requires_grad=True)
        with dense_precision(precision, device):
            logits = logits_of(dense.module, inputs, batch, device).float()
        loss = batch_loss(loss_fn, logits, batch.labels, device)
        loss.backward()
        return inputs, logits, loss
    outputs, total = [], 0.0
    for index, (looked, part) in enumerate(parts):
        last = index + 1 == len(parts)
        with contextlib.nullcontext() if last else getattr(dense.module, "no_sync", contextlib.nullcontext)():
            inputs = placement.inputs(looked, part, requires_grad=True)
            with dense_precision(precision, device):
                logits = logits_of(dense.module, inputs, part, device).float()
            loss = batch_loss(loss_fn, logits, part.labels, device)
            (loss * (part.batch_size / max(batch.batch_size, 1))).backward()
        outputs.append(logits.detach())
        total = total + loss.detach() * part.batch_size
    return inputs, torch.cat(outputs), total / max(batch.batch_size, 1)


@torch.no_grad()
def evaluate(model: torch.nn.Module, placement, source, label_names, world: World) -> dict:
    """Exact AUC, logloss and normalised entropy per task on every row of `source`: trainer r
    scores batches r, r+W, ... (all of them with a whole-batches placement); every trainer gets the
    metrics of all of them."""
    world = reading_world(placement, world)
    was_training = model.training
    model.eval()
    device = next(model.parameters(), torch.empty(0)).device
    connection = placement.connect()
    scored = []
    try:
        for index, batch in enumerate(source):
            if index % world.size != world.rank:
                continue
            looked = _lookup_for_evaluation(connection, batch)
            logits = logits_of(model, placement.inputs(looked, batch, requires_grad=False), batch, device)
            scored.append((torch.sigmoid(logits).cpu().numpy(), batch.labels))
    finally:
        connection.close()
        model.train(was_training)
    acc = MetricAccumulator(len(label_names), label_names if len(label_names) > 1 else None)
    for part in world.gather(scored):
        for probs, labels in part:
            acc.update(probs, labels)
    return acc.compute()


def open_checkpoint(out_dir: Path, resume: bool, overwrite: bool):
    """The checkpoint to resume from (None for a fresh run); refuses to mix two runs in one dir
    unless `overwrite`, which deletes the old run's checkpoints."""
    if resume and overwrite:
        raise ValueError("resume and overwrite exclude each other: continue a run or start it over")
    found = latest_checkpoint(out_dir)
    if resume and found is None:
        raise FileNotFoundError(f"--resume: no checkpoint under {out_dir / 'checkpoints'}")
    if not resume and found is not None:
        if not overwrite:
            raise FileExistsError(f"train.output_dir {str(out_dir)!r} already holds a run's checkpoints "
                                  f"({found.name}); pass --resume to continue it, --overwrite to start over "
                                  f"(deleting them), or choose another train.output_dir (--set train.output_dir=...)")
        shutil.rmtree(checkpoint_root(out_dir))
        return None
    return found


def restore(cfg: JobConfig, world: World, placement, resume: bool, overwrite: bool) -> tuple[dict, dict | None]:
    """(progress, dense state or None): fresh, or the newest checkpoint that reads whole, its
    embeddings loaded. The leader chooses and loads; the others follow its choice or its error."""
    found, chosen = None, None
    if world.leader:
        try:
            found = _load_newest_valid(cfg, world, placement, resume, overwrite)
            chosen = ("ok", None if found is None else str(found[0]))
        except Exception as exc:
            chosen = ("error", exc)
    outcome, value = world.broadcast(chosen)
    if outcome == "error":
        raise value
    if value is None:
        return {"step": 0, "epoch": 0, "next_batch": 0, "samples": 0}, None
    record, state = found[1:] if found is not None else (read_progress(value, cfg), read_dense(value))
    if not world.leader and placement.tables_on_trainers:
        _load_embeddings(placement, Path(value))  # each trainer holds (and loads) its own tables
    world.barrier()
    positions = record.pop("next_batch_by_rank")
    streams = record.pop("stream_by_rank", None)
    if cfg.data.stream is not None:  # a stream has no epochs: each run reads on from the stream's position
        return {**record, "epoch": 0, "next_batch": 0, "stream": streams[world.rank] if streams else None}, state
    return {**record, "next_batch": positions[world.rank]}, state


def _load_newest_valid(cfg: JobConfig, world: World, placement, resume: bool,
                       overwrite: bool) -> tuple[Path, dict, dict] | None:
    """(path, progress record, dense state) of the checkpoint to resume from, its tables loaded into
    `placement`, skipping damaged ones with a word on each; None for a fresh run. Half-written
    checkpoints of dead runs are removed."""
    out_dir = Path(cfg.train.output_dir)
    for removed in remove_interrupted_writes(out_dir):
        print(f"trainer: removed {removed}, a checkpoint whose writing was interrupted", flush=True)
    newest = open_checkpoint(out_dir, resume, overwrite)
    if newest is None:
        return None
    damaged = []
    for path in complete_checkpoints(out_dir):
        try:
            record = read_progress(path, cfg)
            if len(record["next_batch_by_rank"]) != world.size:
                raise ConfigError(f"resume: {path} was written by {len(record['next_batch_by_rank'])} trainers; "
                                  f"this job has {world.size}")
            state = read_dense(path)
            _load_embeddings(placement, path)
        except CheckpointError as exc:
            damaged.append(str(exc))
            print(f"trainer: {exc}", flush=True)
            continue
        if damaged or world.grouped:
            print(f"trainer: resumed from checkpoint {path} at step {record['step']}", flush=True)
        return path, record, state
    raise CheckpointError(f"resume: no checkpoint under {checkpoint_root(out_dir)} reads whole; start over with "
                          f"--overwrite. " + " ".join(damaged))


def _load_embeddings(placement, path: Path) -> None:
    """The placement's tables from checkpoint `path`; CheckpointError naming the file when they are
    damaged (a PS server reports that as a remote error)."""
    try:
        placement.load(path / "embeddings")
    except (ValueError, OSError, RemoteError) as exc:
        raise CheckpointError(f"{exc}; resume from an older checkpoint or start over (--overwrite)") from None


def save(cfg: JobConfig, world: World, placement, dense, progress: dict) -> None:
    """Every trainer's updates are acknowledged (the caller drained its stream), then the leader
    writes the checkpoint: dense state, the placement's tables, each trainer's data position."""
    positions = world.gather(progress["next_batch"])
    streams = world.gather(progress.get("stream"))  # each trainer's place in a stream (None without one)
    state = dense.state()  # on every trainer: a dense sync may gather its parts (DES: the first-layer blocks)
    if placement.tables_on_trainers:  # each trainer writes its own tables for the leader
        placement.stage(checkpoint_root(cfg.train.output_dir), progress["step"])
    world.barrier()
    if world.leader:
        record = {k: v for k, v in progress.items() if k != "stream"}
        if any(s is not None for s in streams):
            record["stream_by_rank"] = streams
        save_checkpoint(cfg.train.output_dir, state, placement.save, {**record, "next_batch_by_rank": positions},
                        cfg, cfg.train.keep_checkpoints)
    world.barrier()


def save_and_commit(cfg: JobConfig, world: World, placement, dense, progress: dict, streaming) -> None:
    """`save` a checkpoint of the run, with each trainer's place in its stream; once it is
    complete the streams may forget what it covers (Redis: acknowledge it)."""
    if streaming is None:
        save(cfg, world, placement, dense, progress)
        return
    progress["stream"] = streaming.state()
    streaming.before_checkpoint(progress["step"])
    save(cfg, world, placement, dense, progress)
    streaming.committed(progress["stream"])


def stream_reader(cfg: JobConfig, world: World, placement) -> dict | None:
    """Which trainer reads a stream, for its source (None without data.stream): with a placement
    whose trainers each compute a part of every sample, every trainer reads the whole stream."""
    if cfg.data.stream is None:
        return None
    import os

    return {"rank": world.rank, "trainers": world.size, "whole_stream": placement.whole_batches,
            "job": f"hybridrec:{os.path.abspath(cfg.train.output_dir)}"}


def drain_seconds(cfg: JobConfig) -> float:
    """How long the updates in flight may take: each push may wait out its PS retries."""
    s = cfg.strategy
    return s.request_timeout * (s.retries + 2) * (s.effective_tau + 2)


def _due(every: int | None, step: int) -> bool:
    return bool(every) and step % every == 0


def open_stream(strategy, placement, split: ThreadSplit, batches, skip: int, limit: int | None, prefetch: int,
                pause):
    """The stream of ready batches of an epoch: the pipelined local step's (`split.pipelined`), else
    the consistency's over the placement. `pause(k)`: the k-th batch of the stream is followed by
    an evaluation or a checkpoint."""
    if split.pipelined:
        return LocalPipeline(placement, batches, skip, limit, prefetch, pause, split.embedding)
    return strategy.consistency.open(placement, batches, skip, limit, prefetch)


def _total_steps(cfg: JobConfig, sources, world: World) -> int | None:
    """Steps the run will take, for the progress bar (None when the data's size is unknown)."""
    by_data = (cfg.train.epochs * -(-sources.train_rows // (cfg.data.batch_size * world.size))
               if sources.train_rows is not None else None)
    limits = [n for n in (by_data, cfg.train.max_steps) if n is not None]
    return min(limits) if limits else None


def train(cfg: JobConfig, resume: bool = False, on_step=None, overwrite: bool = False,
          endpoints: dict | None = None) -> dict:
    """Train as the config says, as this process's part of the job; returns the final test metrics
    and run facts. `endpoints` holds the addresses of a remote placement's services. A fresh run
    refuses an output_dir that holds checkpoints unless `overwrite`; `resume` continues from the
    latest one and ends exactly as an uninterrupted run would. `on_step(step, model)` is called
    after every training step."""
    world = World.current()
    split = thread_split(cfg.train, cfg.strategy.resolved["placement"])
    seed_everything(cfg.seed, split.dense, cfg.train.deterministic)
    tables = job_tables(cfg)
    strategy = build_strategy(cfg, tables, world, endpoints)
    placement, dense = strategy.placement, None
    try:
        readers = reading_world(placement, world)
        sources = build_sources(cfg.data, cfg.seed, readers.rank, readers.size, with_best_auc=world.leader,
                                stream=stream_reader(cfg, world, placement))
        streaming = None if sources.stream is None else StreamTraining(cfg, world, sources.stream)
        model = dense_model(cfg, tables)
        device = next(model.parameters(), torch.empty(0)).device
        progress, state = restore(cfg, world, placement, resume, overwrite)
        dense = strategy.dense(model)
        model = getattr(dense, "model", model)  # what the loop evaluates (DES: this trainer's substituted model)
        if state is not None:
            dense.load(state)
        if streaming is not None:
            streaming.start(progress, fresh=state is None, lockstep=dense.lockstep)
        expiry = ExpirySchedule(tables, placement)
        checkpoint_timer = CheckpointTimer(cfg.train.checkpoint_every_s)
        loss_fn = checked_loss(torch.nn.BCEWithLogitsLoss(), cfg, lambda: progress["step"] + 1)
        max_steps = cfg.train.max_steps
        done = max_steps is not None and progress["step"] >= max_steps
        lockstep = dense.lockstep  # trainers that do not step together run no collective mid-run
        if not lockstep and world.leader and (cfg.train.eval_every or cfg.train.checkpoint_every):
            print(f"trainer: dense {strategy.axes['dense']}: train.eval_every / train.checkpoint_every are not used; "
                  "evaluation and checkpoint happen at the end", flush=True)
        seconds, samples, staleness, pipeline = 0.0, 0, [], {}
        wire = dict.fromkeys(("bytes_sent", "bytes_received", "lost_batches", "dropped_updates",
                              "unacknowledged_updates"), 0)
        reporter = contextlib.nullcontext()
        if world.leader:  # a launcher prefixes log lines, which a progress bar's carriage returns garble
            reporter = Reporter(cfg.train.output_dir, cfg.train.model_copy(update={"progress": cfg.train.progress
                                                                                  and not world.grouped}),
                                total_steps=_total_steps(cfg, sources, readers), resumed_step=progress["step"],
                                append=progress["step"] > 0)
        model.train()
        best = None if sources.valid is None else BestKeeper(cfg.train.output_dir, world, progress["step"] > 0)
        agree = world.broadcast if lockstep and world.grouped else None  # trainers in step follow the leader's clock
        with reporter, streaming.stop_on_signals() if streaming is not None else contextlib.nullcontext():
            for epoch in range(progress["epoch"], cfg.train.epochs):
                if done:
                    break
                skip = progress["next_batch"] if epoch == progress["epoch"] else 0
                remaining = None if max_steps is None else max_steps - progress["step"]
                base = progress["step"]
                stream = open_stream(strategy, placement, split, sources.train, skip, remaining, cfg.data.prefetch,
                                     lambda k: lockstep and (_due(cfg.train.eval_every, base + k)
                                                             or _due(cfg.train.checkpoint_every, base + k)))
                try:
                    batches, tick = iter(stream), time.perf_counter()
                    while True:
                        ready = next(batches, None)
                        # with AllReduce every trainer takes the same steps: one out of data ends the epoch
                        have, rows = (world.all_have_any_rows(ready is not None, ready is not None and
                                                              ready.batch.batch_size > 0)
                                      if lockstep else (ready is not None, True))
                        if not have:
                            if ready is not None:
                                stream.skip(ready)
                            break
                        if not rows:  # every trainer's stream is dry for now: no step, not even an empty one
                            stream.skip(ready)
                            if streaming is not None:
                                streaming.trained(ready.batch, None)  # an empty span: the position stays
                            continue
                        batch = ready.batch
                        dense.begin_step()
                        # the local placement applies its embedding updates in backward
                        inputs, logits, loss = forward_backward(placement, dense, ready, loss_fn, device,
                                                                cfg.train.precision)
                        step = progress["step"] + 1
                        evaluate_now = lockstep and _due(cfg.train.eval_every, step)
                        save_now = lockstep and (_due(cfg.train.checkpoint_every, step)
                                                 | checkpoint_timer.due(agree))
                        expire_now = expiry.due(step, agree)
                        # no lookup between this update and the evaluation, checkpoint or expiry (a
                        # lookup inserts keys): held before the push, so with sync they are deterministic
                        with stream.held() if evaluate_now or save_now or expire_now else contextlib.nullcontext():
                            stream.push(ready, inputs.gradients())
                            dense.finish_step()
                            seconds += time.perf_counter() - tick
                            samples += batch.batch_size
                            progress.update(step=step, epoch=epoch, next_batch=ready.index + 1,
                                            samples=progress["samples"] + batch.batch_size * readers.size)
                            probs = torch.sigmoid(logits.detach()).cpu().numpy()
                            if world.leader:
                                reporter.train_step(step, loss.item(), probs, batch.labels, batch.batch_size)
                            if streaming is not None:  # scored before its update: progressive validation
                                streaming.trained(batch, probs)
                                if world.leader and step % cfg.train.log_every == 0:
                                    reporter.progressive(step, {**streaming.report(), "expired_rows": expiry.expired})
                            if expire_now:
                                stream.drain(drain_seconds(cfg))
                                expiry.sweep(step)
                            if on_step is not None:
                                on_step(step, model)
                            if evaluate_now:
                                stream.drain(drain_seconds(cfg))
                                world.barrier()
                                if best is not None:  # with validation rows the test rows wait for the end
                                    validate(cfg, world, model, placement, dense, sources, reporter, best, progress)
                                else:
                                    metrics = evaluate(model, placement, sources.test, sources.label_names, world)
                                    if world.leader:
                                        reporter.eval_result(step, metrics)
                            if save_now:
                                stream.drain(drain_seconds(cfg))
                                save_and_commit(cfg, world, placement, dense, progress, streaming)
                                checkpoint_timer.reset()
                        if max_steps is not None and step >= max_steps:
                            done = True
                            break
                        tick = time.perf_counter()
                    stream.drain(drain_seconds(cfg))
                finally:
                    stream.close()
                    staleness.extend(stream.staleness)
                    for key, value in stream.stats().items():
                        if key in wire:
                            wire[key] += value
                    for key, value in getattr(stream, "figures", {}).items():
                        pipeline[key] = pipeline.get(key, 0) + value
                if not done:
                    progress.update(epoch=epoch + 1, next_batch=0)
            if progress["step"] == 0:
                raise sources.no_training_rows(world.rank, world.size)
            dense.finish_training()
            # checkpoint before the final evaluation: evaluating reads the tables, and a resumed run
            # must start from the state training left, whatever was evaluated in between
            save_and_commit(cfg, world, placement, dense, progress, streaming)
            if best is not None and best.validated_step != progress["step"]:  # the last step's, unless done
                validate(cfg, world, model, placement, dense, sources, reporter, best, progress)
            metrics = evaluate(model, placement, sources.test, sources.label_names, world)
            result = {**metrics, **_run_facts(cfg, world, progress, seconds, samples, staleness, wire, readers),
                      "best_auc": sources.best_auc, "bad_rows": sources.bad_rows(), **placement.facts(),
                      "threads": {"dense": split.dense, "embedding": split.embedding},
                      **({"pipeline": pipeline} if pipeline else {}),
                      **dense.facts(world),
                      **strategy.consistency.facts(world),
                      **({} if streaming is None else {"stream": streaming.facts()}),
                      **({"expired_rows": sum(world.gather(expiry.expired))} if expiry.active else {}),
                      **({} if best is None else {"best_valid": best.record})}
            if world.leader:
                reporter.final(progress["step"], result)
                Path(cfg.train.output_dir, "final_metrics.json").write_text(json_text(result, indent=1))
        return result
    finally:
        if dense is not None:
            dense.close()
        strategy.close()


def validate(cfg: JobConfig, world: World, model, placement, dense, sources, reporter, best: BestKeeper,
             progress: dict) -> None:
    """Validation metrics of the current step to the reporter; a step better than every one before
    it is saved as the best checkpoint (hybridrec.train.best)."""
    metrics = evaluate(model, placement, sources.valid, sources.label_names, world)
    if world.leader:
        reporter.eval_result(progress["step"], metrics, split="valid")
    in_best = lambda directory: cfg.model_copy(update={"train": cfg.train.model_copy(
        update={"output_dir": str(directory), "keep_checkpoints": 1})})
    best.consider(progress["step"], metrics, lambda directory: save(in_best(directory), world, placement, dense,
                                                                   progress))


def _run_facts(cfg: JobConfig, world: World, progress: dict, seconds: float, samples: int, staleness: list,
               wire: dict, readers: World | None = None) -> dict:
    """Speed, staleness and wire figures of the whole job, from every trainer's own. `readers`: the
    trainers as the rows are dealt to them (reading_world); where each reads every row, a sample
    trained by all of them counts once."""
    facts = world.gather({"samples": samples, "seconds": seconds,
                          "staleness": [max(staleness, default=0), sum(staleness), len(staleness)], **wire})
    total = sum(f["samples"] for f in facts) // (world.size // (readers or world).size)
    slowest = max(f["seconds"] for f in facts)
    looked_up = sum(f["staleness"][2] for f in facts)
    return {"step": progress["step"], "samples": progress["samples"], "strategy": cfg.strategy.record(),
            "trainers": world.size, "train_samples_per_s": total / slowest if slowest else None,
            "max_staleness": max(f["staleness"][0] for f in facts),
            "mean_staleness": sum(f["staleness"][1] for f in facts) / looked_up if looked_up else 0.0,
            "bytes_per_sample": (sum(f["bytes_sent"] + f["bytes_received"] for f in facts) / total
                                 if total else None),
            **{key: sum(f[key] for f in facts) for key in ("lost_batches", "dropped_updates",
                                                             "unacknowledged_updates")}}


def checkpoint_directory(checkpoint) -> Path:
    """A step-N checkpoint directory, or the latest one of a run's output dir."""
    path = Path(checkpoint)
    if (path / "progress.json").is_file():
        return path
    found = latest_checkpoint(path)
    if found is None:
        raise FileNotFoundError(f"--checkpoint: {path} holds no training checkpoint")
    return found


def load_local(cfg: JobConfig, checkpoint):
    """(dense model, local placement, progress) of a checkpoint of any strategy (a step-N
    directory or an output dir, whose latest checkpoint is taken), in this process: the model's
    weights as `model_state` reads them (HT's centre copy where the PS servers hold it) and every
    table, from the local layout (local, DES) or merged from the shards the PS servers (persia,
    het, ht) or PICASSO's trainers wrote."""
    from hybridrec.strategy.placement.local import LocalPlacement

    path = checkpoint_directory(checkpoint)
    tables = job_tables(cfg)
    model = dense_model(cfg, tables)
    placement = LocalPlacement(cfg, tables, World())
    progress = read_progress(path, cfg)
    model.load_state_dict(model_state(path))
    _load_embeddings(placement, path)
    return model, placement, {**progress, "checkpoint": str(path)}


def evaluate_checkpoint(cfg: JobConfig | None, checkpoint, config_name: str = "the config") -> dict:
    """Test metrics of a saved checkpoint of a local run, with the config saved in it, or `cfg`
    when that agrees with it on the model's shape."""
    cfg = config_for_checkpoint(checkpoint_directory(checkpoint), cfg, config_name)
    seed_everything(cfg.seed, thread_split(cfg.train, cfg.strategy.resolved["placement"]).dense,
                    cfg.train.deterministic)
    sources = build_sources(cfg.data, cfg.seed, with_best_auc=False)
    model, placement, progress = load_local(cfg, checkpoint)
    return {**evaluate(model, placement, sources.test, sources.label_names, World()), "step": progress["step"],
            "checkpoint": progress["checkpoint"]}
