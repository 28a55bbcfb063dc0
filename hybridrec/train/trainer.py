"""One trainer's part of a training job: the `Trainer` every strategy trains with, and `train()`,
which runs one from a config.

A local run is a world of one trainer; under torchrun each rank runs its own `Trainer` of the same
job. What differs between strategies sits behind the axes (hybridrec.strategy): the placement
makes the embedding inputs and applies their gradients, the consistency's stream decides how far
lookups run ahead of updates, the dense sync wraps the model, and the strategy as a whole says how
the rows are dealt (`readers`) and whether the trainers step together (`lockstep`). The Trainer
asks those interfaces and never which paper it runs.
"""
from __future__ import annotations

import contextlib
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Protocol

import torch

from hybridrec.config import JobConfig
from hybridrec.embedding.stream import EmbeddingStream, ReadyBatch
from hybridrec.job.sources import DataSources, build_sources
from hybridrec.job.tables import job_tables
from hybridrec.strategy import Strategy, build_strategy
from hybridrec.strategy.dense import model_device
from hybridrec.strategy.world import World
from hybridrec.train.best import BestKeeper
from hybridrec.train.checkpoint import CheckpointTimer
from hybridrec.train.data_defaults import resolve_defaults
from hybridrec.train.divergence import checked_loss
from hybridrec.train.early_stopping import EarlyStopping, restore_best
from hybridrec.train.evaluation import evaluate
from hybridrec.train.expiry import ExpirySchedule
from hybridrec.train.local_pipeline import LocalPipeline
from hybridrec.train.reporting import Reporter, json_text
from hybridrec.train.resume import restore, save_together
from hybridrec.train.setup import dense_model, seed_everything, training_loss
from hybridrec.train.step import forward_backward
from hybridrec.train.stream import StreamTraining
from hybridrec.train.threads import ThreadSplit, thread_split

WIRE_COUNTS = ("bytes_sent", "bytes_received", "lost_batches", "dropped_updates", "unacknowledged_updates")


@dataclass
class Progress:
    """How far the run is: what a checkpoint records and a resumed run continues from."""

    step: int = 0
    epoch: int = 0
    next_batch: int = 0  # this trainer's data position: its next batch of the epoch
    samples: int = 0  # trained by the whole job
    evaluations_since_best: int = 0  # early stopping: validations in a row without a better AUC
    stopped_early: bool = False


@dataclass(frozen=True)
class Pauses:
    """What interrupts training after a step: an expiry sweep, an evaluation, a checkpoint, a publish."""

    expire: bool = False
    evaluate: bool = False
    checkpoint: bool = False
    publish: bool = False

    def __bool__(self) -> bool:
        return self.expire or self.evaluate or self.checkpoint or self.publish


class Publisher(Protocol):
    """Where a run publishes model versions for serving while it trains (delta publishing)."""

    def due(self, step: int) -> bool: ...

    def publish(self, step: int, dense_state: dict, placement, stream_position=None) -> None: ...


@dataclass
class Figures:
    """This trainer's own speed, staleness and wire figures, summed over its epochs."""

    seconds: float = 0.0  # in training steps (waiting for a batch included, pauses not)
    samples: int = 0  # this trainer trained
    staleness: list = field(default_factory=list)
    wire: dict = field(default_factory=lambda: dict.fromkeys(WIRE_COUNTS, 0))
    pipeline: dict = field(default_factory=dict)  # figures only some streams have (the pipelined local step's)
    started: float = 0.0  # when the current step began waiting for its batch
    # wall-clock (epoch) seconds this trainer began waiting for its first batch and ended its last
    # step: when the job trained, for whoever measures the machine meanwhile (bench speedups)
    first_step_at: float | None = None
    last_step_at: float | None = None

    def closed(self, stream: EmbeddingStream) -> None:
        """Add what an epoch's stream counted."""
        self.staleness.extend(stream.staleness)
        for key, value in stream.stats().items():
            if key in self.wire:
                self.wire[key] += value
        for key, value in stream.figures.items():
            self.pipeline[key] = self.pipeline.get(key, 0) + value


@dataclass
class Run:
    """Everything one trainer's run holds from its first step to its last."""

    cfg: JobConfig
    world: World
    split: ThreadSplit
    strategy: Strategy
    sources: DataSources | None = None
    model: torch.nn.Module | None = None  # what is evaluated, saved and handed to on_step (DES: the substituted model)
    progress: Progress = field(default_factory=Progress)
    figures: Figures = field(default_factory=Figures)
    reporter: Reporter | None = None  # the leader's
    best: BestKeeper | None = None  # with validation rows: the best-by-validation checkpoint
    stopping: EarlyStopping | None = None  # with train.early_stopping
    streaming: StreamTraining | None = None  # with data.stream: the source's position, progressive validation
    expiry: ExpirySchedule | None = None  # sweeps of tables with expire_after
    checkpoint_timer: CheckpointTimer | None = None  # train.checkpoint_every_s
    publisher: Publisher | None = None  # model versions published while training
    on_step: Callable | None = None  # on_step(step, model) after every training step


class Trainer:
    """One trainer's run of a job, read top to bottom: `fit()` runs the epochs and `finish()`;
    `epoch()` opens the strategy's stream of ready batches and takes a `step()` on each; after a
    step, what is due (an expiry sweep of tables with `expire_after`, `train.eval_every`,
    `train.checkpoint_every` or `checkpoint_every_s`, the publisher's interval) runs with the
    stream held (no lookup in between) and drained (every update applied): `evaluate()`,
    `checkpoint()`, `publish()`. `finish()` ends training on every trainer,
    checkpoints, scores the test rows and writes final_metrics.json. All of the run's state is
    in `self.run` (a `Run`). Use it as a context manager, or call `close()`.

    Two extension points:

    * The data position (streams). A trainer's place in its data is `position()`, a
      dict of named parts: `next_batch` (its next batch of the current epoch, which `epoch()`
      skips to) and, on a stream (`data.stream`, `run.streaming`), `stream`: the source's state
      (a file and row, an entry ID). Every checkpoint records every trainer's parts
      (`save_together`, as `next_batch_by_rank` and `stream_by_rank`) and `restore` hands each
      trainer its own back; the stream's is committed (Redis: acknowledged) once the checkpoint
      is complete.
    * Publishing model versions (delta publishing for serving). `publish()` runs at the steps
      `run.publisher.due(step)` names, after every update is applied, and hands the publisher the
      dense state and the placement (whose tables it reads); `run.publisher` is None until a job
      configures one, and then nothing is published.
    """

    def __init__(self, cfg: JobConfig, resume: bool = False, overwrite: bool = False, endpoints: dict | None = None,
                 on_step: Callable | None = None, model: torch.nn.Module | None = None, loss: Callable | None = None):
        world = World.current()
        cfg, defaults = resolve_defaults(cfg)
        if world.leader:
            for line in defaults:
                print(f"defaults: {line}", flush=True)
        split = thread_split(cfg.train, cfg.strategy.resolved["placement"])
        seed_everything(cfg.seed, split.dense, cfg.train.deterministic)
        tables = job_tables(cfg)
        self.run = run = Run(cfg, world, split, build_strategy(cfg, tables, world, endpoints), on_step=on_step)
        try:
            readers = run.strategy.readers
            run.sources = build_sources(cfg.data, cfg.seed, readers.rank, readers.size, with_best_auc=world.leader,
                                        stream=self._stream_reader())
            model = dense_model(cfg, tables, model)
            record, state = restore(cfg, world, run.strategy.placement, resume, overwrite)
            if record is not None:
                run.progress = Progress(**{key: record.get(key, default) for key, default in asdict(Progress()).items()})
            if cfg.data.stream is not None:  # a stream has no epochs: each run reads on from the stream's position
                run.progress.epoch = run.progress.next_batch = 0
            dense = run.strategy.make_dense(model)
            run.model = dense.model
            if state is not None:
                dense.load(state)
            if run.sources.stream is not None:
                run.streaming = StreamTraining(cfg, world, run.sources.stream)
                run.streaming.start({"step": run.progress.step, "stream": (record or {}).get("stream")},
                                    fresh=state is None, lockstep=dense.lockstep)
            run.expiry = ExpirySchedule(tables, run.strategy.placement)
            run.checkpoint_timer = CheckpointTimer(cfg.train.checkpoint_every_s)
            if cfg.train.publish_dir is not None:
                from hybridrec.train.publisher import DeltaPublisher

                run.publisher = DeltaPublisher(cfg, tables, world)
            if not run.strategy.lockstep and world.leader and (cfg.train.eval_every or cfg.train.checkpoint_every):
                print(f"trainer: dense {run.strategy.axes['dense']}: train.eval_every / train.checkpoint_every are "
                      "not used; evaluation and checkpoint happen at the end", flush=True)
            if run.sources.valid is not None:
                run.best = BestKeeper(cfg.train.output_dir, world, run.progress.step > 0)
            if cfg.train.early_stopping is True:
                run.stopping = EarlyStopping(cfg.train.patience, run.progress)
        except BaseException:
            self.close()
            raise
        # a loss that is NaN or inf stops the run before its gradients apply (hybridrec.train.divergence)
        self.loss_fn = checked_loss(training_loss(cfg, loss), cfg, lambda: run.progress.step + 1)
        self.device = model_device(run.model)

    # ------------------------------------------------------------------ the run
    def fit(self) -> dict:
        """Train as the config says; the final test metrics and run facts."""
        run = self.run
        stopping = run.streaming.stop_on_signals() if run.streaming is not None else contextlib.nullcontext()
        with self._reporting(), stopping:
            run.model.train()
            for epoch in range(run.progress.epoch, run.cfg.train.epochs):
                if self.done:
                    break
                self.epoch(epoch)
            return self.finish()

    @property
    def done(self) -> bool:
        """Whether the run took `train.max_steps` steps, or early stopping ended it."""
        max_steps = self.run.cfg.train.max_steps
        return (max_steps is not None and self.run.progress.step >= max_steps) or self.run.progress.stopped_early

    def epoch(self, epoch: int) -> None:
        """One epoch of the training data from this trainer's position in it (a resumed epoch
        starts past the batches trained before)."""
        run = self.run
        stream = self._open_stream(epoch)
        try:
            for ready in self._ready_batches(stream):
                self.step(ready, epoch, stream)
                if self.done:
                    break
            stream.drain(self._drain_seconds())
        finally:
            stream.close()
            run.figures.closed(stream)
        if not self.done:
            run.progress.epoch, run.progress.next_batch = epoch + 1, 0

    def step(self, ready: ReadyBatch, epoch: int, stream: EmbeddingStream) -> None:
        """One training step on `ready`: forward and backward, the embedding gradients to the
        stream, the dense step; then what is due after it."""
        run = self.run
        dense = run.strategy.dense
        dense.begin_step()
        # the local placement applies its embedding updates in backward
        inputs, logits, loss = forward_backward(run.strategy.placement, dense, ready, self.loss_fn, self.device,
                                                run.cfg.train.precision)
        step = run.progress.step + 1
        due = self._pauses(step)
        # no lookup between this update and what is due (a lookup inserts keys): held before the
        # push, so with sync an evaluation or checkpoint is deterministic
        with stream.held() if due else contextlib.nullcontext():
            stream.push(ready, inputs.gradients())
            dense.finish_step()
            self._count(step, epoch, ready, loss, logits)
            if due:
                stream.drain(self._drain_seconds())
            if due.expire:
                run.expiry.sweep(step)
            if run.on_step is not None:
                run.on_step(step, run.model)
            if due.evaluate:
                run.world.barrier()
                self.evaluate()
            if due.checkpoint:
                self.checkpoint()
            if due.publish:
                self.publish()

    def evaluate(self) -> None:
        """The mid-run evaluation: the validation rows when the job has them (the test rows wait
        for the end, and a better step is kept as the best checkpoint), else the test rows."""
        run = self.run
        if run.best is not None:
            self.validate()
            return
        metrics = self._score(run.sources.test)
        if run.world.leader:
            run.reporter.eval_result(run.progress.step, metrics)

    def validate(self) -> None:
        """Validation metrics of the current step to the reporter; a step better than every one
        before it is saved as the best checkpoint (hybridrec.train.best)."""
        run = self.run
        metrics = self._score(run.sources.valid)
        if run.world.leader:
            run.reporter.eval_result(run.progress.step, metrics, split="valid")
        in_best = lambda directory: run.cfg.model_copy(update={"train": run.cfg.train.model_copy(
            update={"output_dir": str(directory), "keep_checkpoints": 1})})
        improved = run.best.consider(run.progress.step, metrics,
                                     lambda directory: self._save(in_best(directory), self.position()))
        if run.stopping is not None and run.stopping.validated(improved) and run.world.leader:
            best = (f"the best was step {run.best.record['step']}" if run.best.record is not None else
                    "no validation AUC was a number (do the validation rows hold both labels?)")
            print(f"trainer: early stopping at step {run.progress.step}: no better validation AUC in "
                  f"{run.stopping.patience} evaluations; {best}", flush=True)

    def checkpoint(self) -> None:
        """A checkpoint of the run as it is (every trainer calls it, its stream drained); on a
        stream, the source may forget what the complete checkpoint covers (Redis: acknowledge it)."""
        run = self.run
        position = self.position()
        if run.streaming is not None:
            run.streaming.before_checkpoint(run.progress.step)
        self._save(run.cfg, position)
        if run.streaming is not None:
            run.streaming.committed(position["stream"])
        run.checkpoint_timer.reset()

    def publish(self) -> None:
        """The model as it is now to the run's publisher (see the class doc; every update is applied)."""
        run = self.run
        run.publisher.publish(run.progress.step, run.strategy.dense.state(), run.strategy.placement,
                              self.position().get("stream"))

    def position(self) -> dict:
        """This trainer's place in its training data, as every checkpoint records it (the caller
        drained the updates in flight, so it covers exactly what the tables hold)."""
        run = self.run
        if run.streaming is None:
            return {"next_batch": run.progress.next_batch}
        return {"next_batch": run.progress.next_batch, "stream": run.streaming.state()}

    def finish(self) -> dict:
        """End training on every trainer, checkpoint, score the test rows; the final metrics and
        run facts (the leader also writes them to final_metrics.json)."""
        run = self.run
        if run.progress.step == 0:
            raise run.sources.no_training_rows(run.world.rank, run.world.size)
        run.strategy.dense.finish_training()
        if run.stopping is not None:  # the best step's model is the run's model: its checkpoint and test metrics
            self._validate_last()
            if run.best.record is not None and run.best.record["step"] != run.progress.step:
                restore_best(run.best.dir, run.world, run.strategy.placement, run.strategy.dense)
        # checkpoint before the final evaluation: evaluating reads the tables, and a resumed run
        # must start from the state training left, whatever was evaluated in between
        self.checkpoint()
        if run.publisher is not None:  # the model training ends with is the newest version
            if run.publisher.last_step != run.progress.step:
                self.publish()
            run.publisher.wait()
        self._validate_last()
        result = {**self._score(run.sources.test), **self._run_facts(), "best_auc": run.sources.best_auc,
                  "bad_rows": run.sources.bad_rows(),
                  "threads": {"dense": run.split.dense, "embedding": run.split.embedding},
                  **({"pipeline": run.figures.pipeline} if run.figures.pipeline else {}),
                  **run.strategy.facts(),
                  **({} if run.streaming is None else {"stream": run.streaming.facts()}),
                  **({"expired_rows": sum(run.world.gather(run.expiry.expired))} if run.expiry.active else {}),
                  **({} if run.best is None else {"best_valid": run.best.record}),
                  **({} if run.stopping is None else {"early_stopping": {
                      "stopped": run.progress.stopped_early, "patience": run.stopping.patience,
                      "model_of_step": (run.best.record or {}).get("step", run.progress.step)}})}
        if run.world.leader:
            run.reporter.final(run.progress.step, result)
            Path(run.cfg.train.output_dir, "final_metrics.json").write_text(json_text(result, indent=1))
        return result

    def _validate_last(self) -> None:
        """Validate the last step unless it was validated (or the job has no validation rows)."""
        run = self.run
        if run.best is not None and run.best.validated_step != run.progress.step:
            self.validate()

    def close(self) -> None:
        try:
            if self.run.publisher is not None:
                self.run.publisher.wait()  # the version being written is finished, not cut off
        finally:
            self.run.strategy.close()

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ helpers
    def _reporting(self):
        """The leader's reporter for the run (in a process group its progress goes to stdout, which
        the launcher reads and shows)."""
        run = self.run
        if not run.world.leader:
            return contextlib.nullcontext()
        run.reporter = Reporter(run.cfg.train.output_dir, run.cfg.train, total_steps=self._total_steps(),
                                resumed_step=run.progress.step, append=run.progress.step > 0,
                                launched=run.world.grouped)
        return run.reporter

    def _open_stream(self, epoch: int) -> EmbeddingStream:
        """The stream of ready batches of an epoch: the pipelined local step's (`train.pipeline`),
        else the consistency's over the placement."""
        run, cfg = self.run, self.run.cfg
        skip = run.progress.next_batch if epoch == run.progress.epoch else 0
        remaining = None if cfg.train.max_steps is None else cfg.train.max_steps - run.progress.step
        if run.split.pipelined:
            base = run.progress.step
            return LocalPipeline(run.strategy.placement, run.sources.train, skip, remaining, cfg.data.prefetch,
                                 lambda k: self._scheduled(base + k), run.split.embedding)
        return run.strategy.consistency.open(run.strategy.placement, run.sources.train, skip, remaining,
                                             cfg.data.prefetch, lockstep=run.strategy.lockstep)

    def _ready_batches(self, stream: EmbeddingStream):
        """The stream's batches while every trainer stepping with this one has one (one out of
        data ends the epoch for all), none while every one of them is empty (streams whose shares
        are all dry for now); the step's clock starts as it waits for its batch."""
        run = self.run
        batches = iter(stream)
        run.figures.started = time.perf_counter()
        while True:
            ready = next(batches, None)
            have, rows = run.strategy.all_have(ready is not None, ready is not None and ready.batch.batch_size > 0)
            if not have:
                if ready is not None:
                    stream.skip(ready)
                return
            if not rows:  # no step, not even an empty one
                stream.skip(ready)
                if run.streaming is not None:
                    run.streaming.trained(ready.batch, None)  # an empty span: the position stays
                continue
            yield ready
            run.figures.started = time.perf_counter()

    def _pauses(self, step: int) -> Pauses:
        """What is due after `step`. Evaluations and checkpoints are collectives, so only trainers
        that step together run them mid-run, and there what reads a clock (checkpoint_every_s, an
        expiry bound in seconds) follows the leader's."""
        run, train = self.run, self.run.cfg.train
        together = run.strategy.lockstep
        agree = run.world.broadcast if together and run.world.grouped else None
        return Pauses(expire=run.expiry.due(step, agree),
                      evaluate=together and _due(train.eval_every, step),
                      checkpoint=together and (_due(train.checkpoint_every, step) | run.checkpoint_timer.due(agree)),
                      publish=run.publisher is not None and run.publisher.due(step))

    def _scheduled(self, step: int) -> bool:
        """Whether an evaluation or a checkpoint is scheduled after `step` by step count, what the
        pipelined local step holds its next lookup back for."""
        train = self.run.cfg.train
        return self.run.strategy.lockstep and (_due(train.eval_every, step) or _due(train.checkpoint_every, step))

    def _count(self, step: int, epoch: int, ready: ReadyBatch, loss, logits) -> None:
        """The step's time, samples and position; its loss and AUC to the reporter; on a stream,
        the source moves past the batch and its scores (taken before the update) feed progressive
        validation."""
        run, batch = self.run, ready.batch
        now = time.perf_counter()
        run.figures.seconds += now - run.figures.started
        if run.figures.first_step_at is None:
            run.figures.first_step_at = time.time() - (now - run.figures.started)
        run.figures.last_step_at = time.time()
        run.figures.samples += batch.batch_size
        p = run.progress
        p.step, p.epoch, p.next_batch = step, epoch, ready.index + 1
        p.samples += batch.batch_size * run.strategy.readers.size
        probs = torch.sigmoid(logits.detach()).cpu().numpy()
        if run.world.leader:
            run.reporter.train_step(step, loss.item(), probs, batch.labels, batch.batch_size, p.samples)
        if run.streaming is not None:
            run.streaming.trained(batch, probs)
            if run.world.leader and step % run.cfg.train.log_every == 0:
                run.reporter.progressive(step, {**run.streaming.report(), "expired_rows": run.expiry.expired})

    def _score(self, source) -> dict:
        run = self.run
        return evaluate(run.model, run.strategy.placement, source, run.sources.label_names, run.strategy.readers)

    def _save(self, cfg: JobConfig, position: dict) -> None:
        run = self.run
        save_together(cfg, run.world, run.strategy.placement, run.strategy.dense, asdict(run.progress), position)

    def _stream_reader(self) -> dict | None:
        """Which trainer reads a stream, for its source (None without data.stream): with a placement
        whose trainers each compute a part of every sample, every trainer reads the whole stream."""
        run = self.run
        if run.cfg.data.stream is None:
            return None
        return {"rank": run.world.rank, "trainers": run.world.size,
                "whole_stream": run.strategy.placement.services.whole_batches,
                "job": f"hybridrec:{os.path.abspath(run.cfg.train.output_dir)}"}

    def _drain_seconds(self) -> float:
        """How long the updates in flight may take: each push may wait out its PS retries."""
        s = self.run.cfg.strategy
        return s.request_timeout * (s.retries + 2) * (s.effective_tau + 2)

    def _total_steps(self) -> int | None:
        """Steps the run will take, for the progress bar (None when the data's size is unknown)."""
        run, train = self.run, self.run.cfg.train
        rows = run.sources.train_rows
        by_data = (train.epochs * -(-rows // (run.cfg.data.batch_size * run.strategy.readers.size))
                   if rows is not None else None)
        limits = [n for n in (by_data, train.max_steps) if n is not None]
        return min(limits) if limits else None

    def _run_facts(self) -> dict:
        """Speed, staleness and wire figures of the whole job, from every trainer's own; where each
        trainer reads every row (`readers` is a world of one), a sample trained by all counts once."""
        run, figures, world = self.run, self.run.figures, self.run.world
        facts = world.gather({"samples": figures.samples, "seconds": figures.seconds,
                              "window": [figures.first_step_at, figures.last_step_at],
                              "staleness": [max(figures.staleness, default=0), sum(figures.staleness),
                                            len(figures.staleness)], **figures.wire})
        total = sum(f["samples"] for f in facts) // (world.size // run.strategy.readers.size)
        slowest = max(f["seconds"] for f in facts)
        looked_up = sum(f["staleness"][2] for f in facts)
        starts = [f["window"][0] for f in facts if f["window"][0] is not None]
        ends = [f["window"][1] for f in facts if f["window"][1] is not None]
        return {"step": run.progress.step, "samples": run.progress.samples, "strategy": run.cfg.strategy.record(),
                "trainers": world.size, "train_samples_per_s": total / slowest if slowest else None,
                # wall-clock seconds since the epoch: the first trainer's first step to the last one's last
                "training_window": [min(starts), max(ends)] if starts and ends else None,
                "max_staleness": max(f["staleness"][0] for f in facts),
                "mean_staleness": sum(f["staleness"][1] for f in facts) / looked_up if looked_up else 0.0,
                "bytes_per_sample": (sum(f["bytes_sent"] + f["bytes_received"] for f in facts) / total
                                     if total else None),
                **{key: sum(f[key] for f in facts) for key in ("lost_batches", "dropped_updates",
                                                                 "unacknowledged_updates")}}


def _due(every: int | None, step: int) -> bool:
    return bool(every) and step % every == 0


def train(cfg: JobConfig, resume: bool = False, on_step=None, overwrite: bool = False,
          endpoints: dict | None = None, model: torch.nn.Module | None = None, loss: Callable | None = None) -> dict:
    """Train as the config says, as this process's part of the job; returns the final test metrics
    and run facts. `endpoints` holds the addresses of a remote placement's services. A fresh run
    refuses an output_dir that holds checkpoints unless `overwrite`; `resume` continues from the
    latest one and ends exactly as an uninterrupted run would. `on_step(step, model)` is called
    after every training step. `model` (an nn.Module taking (dense, PooledEmbeddings), model.name
    `object`) and `loss` (loss(logits, labels) -> scalar) replace what the config names
    (hybridrec.models.custom; hybridrec.api is the documented way in)."""
    with Trainer(cfg, resume=resume, overwrite=overwrite, endpoints=endpoints, on_step=on_step, model=model,
                 loss=loss) as trainer:
        return trainer.fit()
