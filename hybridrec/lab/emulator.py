"""`emulate`: W workers of one job in this process, on the real engine, under one discipline, with
the reads and updates interleaved as a seeded schedule says; deterministic, so a seed replays.

What is the job's and what is the emulator's: the data readers (each worker reads rank w of W
of the training rows, as a trainer does), the stores, kernels and optimizers of the local
placement, the dense model and its optimizer, the loop's forward and backward
(hybridrec.train.step.forward_backward) and evaluation are the engine's, built from the config
as `hybridrec train` builds them (seeded the same way, so one worker under sync trains exactly
the local strategy's model). The emulator decides only what the distributed system leaves to
chance: in which order the workers step, and which of the updates computed so far each read
sees (hybridrec.lab.schedule), within the discipline's bound (hybridrec.lab.disciplines).

The three shapes of run:
* lockstep (sync, hybrid, het): round t, every worker reads (its required updates applied
  first), forward and backward of every worker, one averaged dense step, then the embedding
  updates wait (`SharedEmbeddings`) or accumulate in the caches (`HetCaches`);
* free-running (async, ssp): one worker step at a time (rounds in a random order for async,
  speeds for SSP), each computing on the dense version its bound lets it read and pushing its
  gradient to the central copy; a recorded async job is replayed on its PS shards' own order of
  pushes, each step on the versions its pull read (`ReplayedDense`);
* groups (ht, easgd): rounds; within a group its members' reads and writes of the group's copy
  interleave (Hogwild), the copy syncs with the centre every `period` writes.

A recorded job whose PS stores numbered its embedding updates (sync, hybrid, async) is replayed on
them: each store's share of each update lands in that store's order and each read is made on
what every store held when it served the job's lookup, the reads in an order no store's count
falls back in (`ReplayedEmbeddings`, hybridrec.lab.replayed_embeddings).
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from hybridrec.config import JobConfig, StrategyConfig
from hybridrec.errors import UserError
from hybridrec.job.sources import build_sources
from hybridrec.job.tables import job_tables
from hybridrec.lab.dense import AveragedDense, CentralDense, GroupCopies, ReplayedDense, gradients
from hybridrec.lab.disciplines import Discipline
from hybridrec.lab.embeddings import SharedEmbeddings
from hybridrec.lab.het_caches import HetCaches
from hybridrec.lab.replayed_embeddings import ReplayedEmbeddings
from hybridrec.lab.schedule import Schedule
from hybridrec.embedding.stream import ReadyBatch
from hybridrec.strategy.placement.local import LocalPlacement
from hybridrec.strategy.world import World
from hybridrec.train.evaluation import evaluate
from hybridrec.train.setup import dense_model, seed_everything
from hybridrec.train.step import forward_backward
from hybridrec.train.threads import thread_split


def local_view(cfg: JobConfig) -> JobConfig:
    """The job with the local strategy: the config `emulate` builds the engine from (the
    strategy section's own bounds are the disciplines' defaults, read by the caller)."""
    if cfg.data.stream is not None:
        raise UserError("data.stream: the staleness lab emulates runs over files or synthetic rows; "
                        "a stream cannot be dealt to emulated workers")
    return cfg.model_copy(update={"strategy": StrategyConfig()})


@dataclass
class _Module:
    """What the loop's forward_backward calls forward on (a dense sync's `module`)."""

    module: torch.nn.Module


class _Job:
    """The engine of one emulated run, built as the training loop builds a local run's."""

    def __init__(self, cfg: JobConfig, workers: int):
        self.cfg = view = local_view(cfg)
        seed_everything(view.seed, thread_split(view.train, "local").dense, view.train.deterministic)
        self.tables = job_tables(view)
        self.placement = LocalPlacement(view, self.tables, World())
        self.sources = [build_sources(view.data, view.seed, w, workers, with_best_auc=w == 0) for w in range(workers)]
        self.model = dense_model(view, self.tables)
        self.model.train()
        self.device = next(self.model.parameters(), torch.empty(0)).device
        self.loss_fn = torch.nn.BCEWithLogitsLoss()
        self.workers = workers

    def rounds(self):
        """Per epoch, the workers' next batches while every worker has one (lockstep training:
        one worker out of data ends the epoch, as `world.all_have` ends it in the loop)."""
        for _ in range(self.cfg.train.epochs):
            readers = [iter(source.train) for source in self.sources]
            while True:
                batches = [next(reader, None) for reader in readers]
                if any(batch is None for batch in batches):
                    break
                yield batches

    def stream(self, worker: int):
        """One worker's batches over every epoch (free-running: no worker waits for another)."""
        for _ in range(self.cfg.train.epochs):
            yield from self.sources[worker].train

    def step(self, side, model: torch.nn.Module, step: int, batch, looked):
        """The loop's forward and backward of one worker's batch on `model`; the inputs."""
        inputs, _, _ = forward_backward(side, _Module(model), ReadyBatch(step, batch, looked, 0), self.loss_fn,
                                        self.device)
        return inputs

    def evaluate(self, model: torch.nn.Module, batches: int | None = None, split: str = "test") -> dict:
        """Metrics on the test rows (or the validation rows) as the loop's `evaluate` gives them."""
        held_out = self.sources[0].test if split == "test" else self.sources[0].valid
        if held_out is None:
            raise UserError("evaluate_on valid: the config has no validation rows (data.valid_fraction or "
                            "data.valid_path)")
        source = held_out if batches is None else itertools.islice(held_out, batches)
        return evaluate(model, self.placement, source, self.sources[0].label_names, World())


class _Progress:
    """Samples trained, and the evaluations of the curve every `every` samples."""

    def __init__(self, job: _Job, every: int | None, batches: int | None, current: Callable):
        self.job, self.every, self.batches, self.current = job, every, batches, current
        self.samples = 0
        self.steps = 0
        self.curve: list[dict] = []
        self._next = every

    def trained(self, samples: int) -> None:
        self.samples += samples
        self.steps += 1
        if self._next is not None and self.samples >= self._next:
            metrics = self.job.evaluate(self.current(), self.batches)
            self.curve.append({"samples": self.samples, "auc": metrics["auc"], "logloss": metrics["logloss"]})
            while self._next <= self.samples:
                self._next += self.every


def _required(step: int, bound: int, workers: int) -> np.ndarray:
    """Per worker, the updates a read at `step` must see: every one of steps before step - bound."""
    return np.full(workers, max(0, step - bound), np.int64)


def _round(job: _Job, side, dense: AveragedDense, step: int, order: list[int], batches, looked: dict,
           progress: _Progress) -> None:
    """A lockstep round on the workers' reads: forward and backward of each, one averaged dense
    step, then each worker's embedding update waits (or, under het, accumulates)."""
    dense.begin_round()
    inputs = {w: job.step(side, dense.model, step, batches[w], looked[w]) for w in order}
    dense.finish_round(job.workers)
    for w in order:
        side.after_backward(w, step, looked[w], inputs[w])
    progress.trained(sum(batch.batch_size for batch in batches))


def _lockstep(job: _Job, side, dense: AveragedDense, schedule: Schedule, bound: int, progress: _Progress) -> None:
    events = schedule.timeline()
    if events is not None:
        _lockstep_in_time(job, side, dense, schedule, events, bound, progress)
        return
    workers = job.workers
    for step, batches in enumerate(job.rounds()):
        order = schedule.order(range(workers), step)
        looked = {}
        for w in order:
            side.prepare_read(w, step, _required(step, bound, workers), schedule)
            looked[w] = side.read(w, step, batches[w])
        _round(job, side, dense, step, order, batches, looked, progress)


def _lockstep_in_time(job: _Job, side: SharedEmbeddings, dense: AveragedDense, schedule, events: list, bound: int,
                      progress: _Progress) -> None:
    """A recorded lockstep job replayed in the order its reads and updates happened: each read
    when the job made it, ahead of its round's dense step (and of other workers' reads of earlier
    rounds) as far as the job's was; each update when it landed, its round's dense step run
    first (a job's update follows every read of its round). Rounds the events leave untrained run
    at the end. A read the bound requires more of sees those updates applied first; a read the
    job made too late for the replay (after its round's dense step had to run) is made at that
    round; both count in the schedule's departures."""
    workers = job.workers
    rounds = job.rounds()
    batches: list = []  # per round, the workers' batches (None once trained)
    looked: dict = {}  # (worker, step) -> its read, until its round trains
    trained = 0
    planned = isinstance(side, ReplayedEmbeddings)

    def round_of(step: int):
        while len(batches) <= step:
            following = next(rounds, None)
            if following is None:
                return None
            batches.append(following)
        return batches[step]

    reading: set = set()  # planned reads in progress (one the job made out of order never waits for itself)

    def read(w: int, step: int) -> None:
        if planned:  # the stores land what the job's lookup read, the rounds it needs trained first
            reading.add((w, step))
            for earlier in side.due_before(w, step):
                if earlier[1] >= trained and earlier not in looked and earlier not in reading \
                        and round_of(earlier[1]) is not None:
                    read(*earlier)
            needed = [i for _, i in side.missing(w, step) if i < step]
            if needed:
                train_through(max(needed))
            reading.discard((w, step))
            looked[w, step] = side.read(w, step, batches[step][w])
            return
        required = _required(step, bound, workers)
        if required[0] > trained:  # updates the bound requires must have been computed first
            train_through(int(required[0]) - 1)
        if (side.applied < required).any():
            side.catch_up(required, schedule)
        schedule.note_applied(schedule.seen(w, step, workers), side.applied)
        looked[w, step] = side.read(w, step, batches[step][w])

    def train_through(last: int | None) -> None:
        nonlocal trained
        while (last is None or trained <= last) and round_of(trained) is not None:
            order = schedule.order(range(workers), trained)
            if any((w, trained) in reading for w in order):
                return  # a read of this round is being made: the round trains after it
            for w in order:
                if (w, trained) not in looked:
                    read(w, trained)
            _round(job, side, dense, trained, order, batches[trained],
                   {w: looked.pop((w, trained)) for w in order}, progress)
            batches[trained] = None
            trained += 1

    if planned:  # the reads in the plan's order; each update lands when a read or the end needs it
        events = [("read", w, i) for w, i in side.plan.read_order]
    for kind, w, index in events:
        if kind == "read":
            if index >= trained and (w, index) not in looked and round_of(index) is not None:
                read(w, index)
        elif kind == "apply":
            train_through(index)
            if side.applied[w] == index < side.computed[w]:  # not applied earlier for a bound
                side.apply(w)
    train_through(None)


def _free_step(job: _Job, side: SharedEmbeddings, dense: CentralDense, schedule, w: int, c: int, batch, looked,
               dense_bound: int, oldest: int, progress: _Progress) -> None:
    """Worker w's step c of a free-running run: its gradient on the dense version the schedule
    lets it read, applied to the central copy (versions no later step may read dropped, `oldest`:
    the lowest iteration a step may still take), then its embedding update waits."""
    required = dense.required_version(c - dense_bound)
    dense.begin_step(schedule.dense_version(required, dense.version, w, c))
    inputs = job.step(side, dense.model, c, batch, looked)
    dense.finish_step(c, dense.required_version(oldest - dense_bound))
    side.after_backward(w, c, looked, inputs)
    progress.trained(batch.batch_size)


def _free_running(job: _Job, side: SharedEmbeddings, dense: CentralDense, schedule: Schedule, bound: int,
                  dense_bound: int, speeds: bool, progress: _Progress) -> None:
    """async (`speeds` False: rounds, each worker once in a random order) and SSP (`speeds`: one
    step at a time of a worker chosen by speed among those within the bound)."""
    events = schedule.timeline()
    if events is not None and not speeds:
        _free_running_in_time(job, side, dense, schedule, events, bound, progress)
        return
    workers = job.workers
    streams = [job.stream(w) for w in range(workers)]
    iteration = np.zeros(workers, np.int64)
    active = list(range(workers))
    round_index = 0
    while active:
        if speeds:
            slowest = min(iteration[w] for w in active)
            steps = [schedule.next_worker([w for w in active if iteration[w] - slowest <= bound], workers)]
        else:
            steps = schedule.order(active, round_index)
            round_index += 1
        for w in steps:
            batch = next(streams[w], None)
            if batch is None:
                active.remove(w)
                continue
            c = int(iteration[w])
            side.prepare_read(w, c, _required(c, bound, workers), schedule)
            looked = side.read(w, c, batch, expected=np.minimum(side.computed, c))
            oldest = min((int(iteration[a]) + (a == w) for a in active), default=c + 1)
            _free_step(job, side, dense, schedule, w, c, batch, looked, dense_bound, oldest, progress)
            iteration[w] += 1


def _free_running_in_time(job: _Job, side: SharedEmbeddings, dense: ReplayedDense, schedule, events: list,
                          bound: int, progress: _Progress) -> None:
    """A recorded async job replayed in the order its events happened: each embedding read when
    the job's lookup was served (ahead of the worker's step, as far as the job's pipeline ran), each
    step when its dense pull was made, on the versions of the dense shards that pull read (the
    pushes they hold applied first, in each shard's order), each dense push when it was made (in
    its shard's order: the pushes before it applied with it), each embedding update when it landed
    (its step computed first). Steps the events leave untrained run at the end, the workers in
    turn, on the latest versions; departures as in `_lockstep_in_time`."""
    workers = job.workers
    plan = schedule.dense_plan()
    streams = [job.stream(w) for w in range(workers)]
    batches: list[dict] = [{} for _ in range(workers)]  # per worker, step -> batch, read from its stream ahead
    looked: dict = {}  # (worker, step) -> its read, until the step runs
    iteration = np.zeros(workers, np.int64)
    ended = [None] * workers  # per worker, its number of steps once its stream ran out
    position = [{key: n for n, key in enumerate(order)} for order in plan.order] if plan else []
    planned = isinstance(side, ReplayedEmbeddings)

    def batch_of(w: int, c: int):
        while ended[w] is None and c not in batches[w] and len(batches[w]) + int(iteration[w]) <= c:
            following = next(streams[w], None)
            if following is None:
                ended[w] = len(batches[w]) + int(iteration[w])
            else:
                batches[w][len(batches[w]) + int(iteration[w])] = following
        return batches[w].get(c)

    reading: set = set()  # reads in progress (a read the plan needs done first never waits for them)

    def read(w: int, c: int) -> None:
        if planned:  # the stores land what the job's lookup read, its steps computed first
            reading.add((w, c))
            for earlier in side.due_before(w, c):
                if earlier[1] >= iteration[earlier[0]] and earlier not in looked and earlier not in reading \
                        and batch_of(*earlier) is not None:
                    read(*earlier)
            for other, step in side.missing(w, c):
                if (other, step) not in reading and not (other == w and step >= c):
                    run_through(other, step)
            reading.discard((w, c))
            looked[w, c] = side.read(w, c, batches[w][c], expected=np.minimum(side.computed, c))
            return
        required = _required(c, bound, workers)
        if (side.applied < np.minimum(required, side.computed)).any():
            side.catch_up(required, schedule)
        schedule.note_applied(schedule.seen(w, c, workers), side.applied)
        looked[w, c] = side.read(w, c, batches[w][c], expected=np.minimum(side.computed, c))

    def land(shard: int, count: int) -> None:
        """Shard `shard` applies its pushes, in the job's order, until it holds `count`."""
        while dense.applied[shard] < count:
            key = plan.order[shard][dense.applied[shard]]
            run_through(*key)
            if not dense.computed(key):
                raise UserError(f"{schedule.describe()['source']}: the job's dense push of worker {key[0]} step "
                                f"{key[1]} has no such step in this config's data; replay a job with its own config")
            dense.push(shard, key)

    def take(w: int, c: int, batch, read_rows) -> None:
        recorded = plan.reads.get((w, c)) if plan else None
        counts = recorded if recorded is not None else [len(order) for order in (plan.order if plan else [])]
        for shard, count in enumerate(counts):  # a step the job did not record: after every recorded push
            land(shard, count)
        dense.begin_step((w, c), recorded or list(dense.applied))
        inputs = job.step(side, dense.model, c, batch, read_rows)
        dense.finish_step((w, c))
        if recorded is None:  # a step the job did not record: its push lands at once
            for shard in dense.holding:
                dense.push(shard, (w, c))
        side.after_backward(w, c, read_rows, inputs)
        progress.trained(batch.batch_size)

    def run_through(w: int, last: int | None) -> None:
        while (last is None or iteration[w] <= last) and batch_of(w, int(iteration[w])) is not None:
            c = int(iteration[w])
            if (w, c) in reading:
                return
            if (w, c) not in looked:
                read(w, c)
            batch = batches[w].pop(c)
            iteration[w] += 1  # taken: a push its pull waits for may run this worker's earlier steps only
            take(w, c, batch, looked.pop((w, c)))

    for kind, w, index in events:
        if kind == "read":
            if index >= iteration[w] and (w, index) not in looked and batch_of(w, index) is not None:
                read(w, index)
        elif kind == "step":
            run_through(w, index)
        elif kind == "push":
            for shard, order in enumerate(position):
                if (w, index) in order:
                    land(shard, order[w, index] + 1)
        elif not planned:  # an embedding update: lands when it landed (planned: when a read needs it)
            run_through(w, index)
            if side.applied[w] == index < side.computed[w]:
                side.apply(w)
    for shard, order in enumerate(plan.order if plan else []):
        land(shard, len(order))
    while any(batch_of(w, int(iteration[w])) is not None for w in range(workers)):
        for w in range(workers):
            run_through(w, int(iteration[w]))


def _groups(job: _Job, side: SharedEmbeddings, dense: GroupCopies, schedule: Schedule, bound: int,
            progress: _Progress) -> None:
    workers, groups = job.workers, dense.groups
    members = workers // groups
    streams = [job.stream(w) for w in range(workers)]
    active = set(range(workers))
    step = 0
    while active:
        batches = {w: next(streams[w], None) for w in sorted(active)}
        active -= {w for w, batch in batches.items() if batch is None}
        for g in schedule.order(range(groups), step):
            in_flight = {}
            for kind, m in schedule.hogwild([m for m in range(members) if g * members + m in active]):
                w = g * members + m
                if kind == "read":
                    side.prepare_read(w, step, _required(step, bound, workers), schedule)
                    looked = side.read(w, step, batches[w], expected=np.minimum(side.computed, step))
                    model, mark = dense.read(g)
                    inputs = job.step(side, model, step, batches[w], looked)
                    in_flight[w] = (looked, inputs, gradients(model), mark)
                else:
                    looked, inputs, grads, mark = in_flight.pop(w)
                    dense.write(g, m, grads, mark)
                    side.after_backward(w, step, looked, inputs)
                    progress.trained(batches[w].batch_size)
        step += 1


def emulate(cfg: JobConfig, discipline: Discipline, workers: int, schedule: Schedule | None = None, *,
            curve_every: int | None = None, curve_batches: int | None = None,
            observer: Callable | None = None, evaluate_on: str = "test") -> "Emulation":
    """Train `cfg`'s job as `workers` workers under `discipline`, interleaved by `schedule`
    (default: seed 0, the bound's worst case); its `Emulation` (test metrics, run facts, model).

    `curve_every`: evaluate every that many samples (on the first `curve_batches` test batches,
    all by default) for the curve of AUC against samples seen. `observer(event, **facts)` sees
    every embedding read, enqueue and apply (under het: every read, with the caches).
    `evaluate_on`: "test", or "valid" for the validation rows (tuning learning rates)."""
    discipline.check(workers)
    schedule = schedule if schedule is not None else Schedule(0)
    started = time.perf_counter()
    job = _Job(cfg, workers)
    name = discipline.name
    if name == "het":
        if schedule.timeline() is not None:
            raise UserError("het: a recorded schedule replays sync, hybrid and async jobs; HET's caches decide "
                            "themselves what a read sees")
        side = HetCaches(job.placement, job.tables, cfg.strategy.het, discipline.bound, workers, observer)
    elif schedule.embedding_plan() is not None and (discipline.lockstep or name == "async"):  # replayed in time
        side = ReplayedEmbeddings(job.placement, workers, schedule.embedding_plan(), observer)
    else:
        side = SharedEmbeddings(job.placement, workers, observer)
    if discipline.lockstep:
        dense = AveragedDense(job.model, job.cfg)
        progress = _Progress(job, curve_every, curve_batches, lambda: dense.model)
        _lockstep(job, side, dense, schedule, discipline.bound, progress)
    elif name == "async" and schedule.timeline() is not None:
        plan = schedule.dense_plan()
        dense = ReplayedDense(job.model, job.cfg, plan.shards if plan else 1,
                              [set(v[k] for v in plan.reads.values()) for k in range(plan.shards)] if plan else None)
        progress = _Progress(job, curve_every, curve_batches, dense.current_model)
        _free_running(job, side, dense, schedule, discipline.bound, discipline.tau_dense, False, progress)
    elif name in ("async", "ssp"):
        dense = CentralDense(job.model, job.cfg)
        progress = _Progress(job, curve_every, curve_batches, dense.current_model)
        dense_bound = discipline.tau_dense if name == "async" else discipline.bound
        _free_running(job, side, dense, schedule, discipline.bound, dense_bound, name == "ssp", progress)
    else:
        dense = GroupCopies(job.model, job.cfg, discipline.copies(workers), workers // discipline.copies(workers),
                            discipline.alpha, discipline.period)
        progress = _Progress(job, curve_every, curve_batches, dense.current_model)
        _groups(job, side, dense, schedule, discipline.bound, progress)
    if progress.steps == 0:
        raise UserError(f"{workers} emulated workers took no step: some worker got no training batch (rows are "
                        f"dealt to workers in blocks); use more rows or fewer workers")
    side.finish()
    model = dense.final_model()
    trained = time.perf_counter() - started
    metrics = job.evaluate(model, split=evaluate_on)
    result = {**discipline.record(), "label": discipline.label(), "workers": workers, "seed": job.cfg.seed,
              "schedule": schedule.describe(), "evaluated_on": evaluate_on,
              "samples": progress.samples, "steps": progress.steps, "auc": metrics["auc"],
              "logloss": metrics["logloss"], "best_auc": job.sources[0].best_auc, "curve": progress.curve,
              "seconds": trained, "samples_per_s": progress.samples / trained if trained else None,
              **side.facts(), **dense.facts()}
    return Emulation(result, model, job.placement, dense, side)


@dataclass
class Emulation:
    """One emulated run: `result` (JSON: metrics and run facts), the trained dense `model` and the
    `placement` holding the trained tables, and the run's dense and embedding sides (`dense`,
    `embeddings`)."""

    result: dict
    model: torch.nn.Module
    placement: LocalPlacement
    dense: object
    embeddings: object = None
