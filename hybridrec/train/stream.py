"""What training on a stream (`data.stream`) adds to the loop: the source's place in every
checkpoint and its acknowledgement once the checkpoint is durable, progressive validation,
checkpoints by time, a clean stop on SIGTERM / SIGINT, and the trained sample ids for audits.

Checkpoints: `progress.json` holds `stream_by_rank`, each trainer's `StreamSource.state()`
(`{"backend", "position", "records", "bad_records"}`, a small JSON record: files
`{"file", "row"}`, Redis `{"stream", "group", "consumer", "last_id"}`). The position covers
exactly the batches whose updates the checkpoint's tables and dense state hold, so `--resume`
reads on from there; `commit` (Redis: XACK) runs only after the checkpoint is complete on disk,
and a crash in between leaves the entries pending, to be skipped as covered on resume.

Progressive validation: the forward pass of a training step runs before the step's update, so its
scores are predictions on unseen records. Every `train.log_every` steps the leader writes a
`progressive` record to metrics.jsonl (and TensorBoard): the AUC and logloss of its last
`train.window` samples, the cumulative ones of this run, samples/s and its lag behind the head of
the stream (records or files, and seconds).
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np

from hybridrec.data.stream import StreamSource
from hybridrec.train.progressive import ProgressiveMetrics

SAMPLE_IDS = "sample_ids"  # <output_dir>/sample_ids/rank-<r>/step-<N>.npy with record_sample_ids


class StreamTraining:
    """One trainer's stream: its source, the progressive metrics, the time of the last checkpoint."""

    def __init__(self, cfg, world, source: StreamSource) -> None:
        self.cfg, self.world, self.source = cfg, world, source
        self.metrics = ProgressiveMetrics(cfg.train.window)
        self._last_checkpoint = time.monotonic()
        self._started = time.monotonic()
        self._samples = 0
        self._last_log = (time.monotonic(), 0)

    # ------------------------------------------------------------------ start and checkpoints
    def start(self, progress: dict, fresh: bool, lockstep: bool) -> None:
        """The leader prepares the stream (a fresh run starts the job's consumer group over), then
        every trainer's source continues after its recorded state."""
        self.source.step_when_dry(lockstep and self.world.size > 1 and not self.source.context.whole_stream)
        if self.world.leader:
            self.source.prepare(fresh=fresh)
        self.world.barrier()
        self.source.start(progress.get("stream"))
        if self.source.common.record_sample_ids:
            self._forget_ids_after(progress["step"])

    def checkpoint_due(self, lockstep: bool) -> bool:
        """train.checkpoint_every_s has passed since the last checkpoint; lockstep trainers all
        follow the leader's clock (a checkpoint is a collective)."""
        every = self.cfg.train.checkpoint_every_s
        if every is None:
            return False
        due = time.monotonic() - self._last_checkpoint >= every
        return self.world.broadcast(due) if lockstep and self.world.grouped else due

    def state(self) -> dict:
        """This trainer's stream state for the checkpoint about to be written (the caller drained
        the updates in flight, so the position covers exactly what the tables hold)."""
        return self.source.state()

    def before_checkpoint(self, step: int) -> None:
        """With record_sample_ids: this trainer's ids trained since the last checkpoint, written
        before the checkpoint itself, so every complete checkpoint has its file."""
        if not self.source.common.record_sample_ids:
            return
        directory = Path(self.cfg.train.output_dir, SAMPLE_IDS, f"rank-{self.world.rank}")
        directory.mkdir(parents=True, exist_ok=True)
        ids = self.source.take_trained_ids()
        final = directory / f"step-{step:09d}.npy"
        if final.is_file():  # a second checkpoint of one step (the last step's, at the end): add to it
            ids = np.concatenate([np.load(final), ids])
        tmp = directory / f".step-{step:09d}.npy.tmp"
        with open(tmp, "wb") as handle:  # np.save on a path would add a second suffix
            np.save(handle, ids)
        os.replace(tmp, final)

    def committed(self, state: dict) -> None:
        """The checkpoint holding `state` is complete: the source may forget what it covers."""
        self._last_checkpoint = time.monotonic()
        self.source.commit(state)

    def _forget_ids_after(self, step: int) -> None:
        """Sample-id files of steps after the checkpoint this run resumed from belong to updates
        the restore undid; they go (their records are trained again)."""
        directory = Path(self.cfg.train.output_dir, SAMPLE_IDS, f"rank-{self.world.rank}")
        for path in directory.glob("step-*.npy") if directory.is_dir() else []:
            if int(path.stem.removeprefix("step-")) > step:
                path.unlink()

    # ------------------------------------------------------------------ steps
    def trained(self, batch, probs: np.ndarray | None) -> None:
        """A step's update is applied: the position may move past its batch; its scores (taken
        before the update) feed the progressive metrics."""
        self.source.trained(batch)
        self._samples += len(batch)
        if probs is not None and len(batch):
            self.metrics.update(probs, batch.labels)

    def report(self) -> dict:
        """The progressive record of this trainer: windowed and cumulative metrics, samples/s since
        the last report, lag behind the stream's head."""
        now = time.monotonic()
        then, samples = self._last_log
        self._last_log = (now, self._samples)
        return {**self.metrics.windowed(), **self.metrics.cumulative(),
                "samples_per_s": (self._samples - samples) / (now - then) if now > then else None,
                "stream_records": self.source.records, "bad_records": self.source.bad_records,
                **self.source.lag()}

    def facts(self) -> dict:
        """The run's stream figures, every trainer's together (a collective)."""
        gathered = self.world.gather({"metrics": self.metrics.state(), "facts": self.source.facts(),
                                      "bad_examples": self.source.bad_examples, "lag": self.source.lag()})
        whole = self.source.context.whole_stream  # every trainer read every record: count them once
        parts = gathered[:1] if whole else gathered
        out = {**ProgressiveMetrics.merged([g["metrics"] for g in parts]), **self.metrics.windowed()}
        for key in gathered[0]["facts"]:
            out[key] = sum(g["facts"][key] for g in parts)
        out["bad_record_examples"] = [e for g in parts for e in g["bad_examples"]][:20]
        out["lag"] = [g["lag"] for g in gathered]
        return out

    @contextlib.contextmanager
    def stop_on_signals(self):
        """SIGTERM and SIGINT end the stream at its next look for data, so the run ends as at an
        idle timeout: a last checkpoint, then the final metrics (main thread only)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {}

        def stop(signum, frame):
            print(f"trainer: signal {signum}: stopping the stream; a checkpoint follows", flush=True)
            self.source.stop()

        for signum in (signal.SIGTERM, signal.SIGINT):
            previous[signum] = signal.signal(signum, stop)
        try:
            yield
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
