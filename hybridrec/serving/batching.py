"""Micro-batching: the requests that reach the server while the model is busy, or within a short
bounded wait, are scored by one model call.

Each request is parsed by the event loop into a `Job` (its rows, still raw) and queued. One
coroutine takes the first job, then every job already queued, and, while requests that arrived
are still being read, waits for them up to `wait_ms`; it stops at `max_rows`. The jobs go to one
worker thread, which parses them with the version being served at that moment (one version for
the whole call), scores the good ones together and hands each job its scores or its error.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from hybridrec.bundle.features import RowError
from hybridrec.data.batch import Batch


@dataclasses.dataclass
class Job:
    kind: str  # "rows" or "lines"
    items: list
    future: asyncio.Future
    scores: np.ndarray | None = None
    version: int | None = None
    error: str | None = None

    @property
    def count(self) -> int:
        return len(self.items)


def parse_job(features, job: Job) -> Batch:
    """The batch of a job's rows (RowError naming the first that cannot be scored)."""
    if job.kind == "rows":
        return features.parse_request_lines(features.rows_to_text(job.items), job.count, "rows",
                                            layout=features.feature_layout())
    for number, line in enumerate(job.items):
        if "\n" in line or "\r" in line:
            raise RowError(f"lines[{number}]: a line holds a line break")
    return features.parse_request_lines("\n".join(job.items).encode(), job.count, "lines")


def score_jobs(keeper, metrics, jobs: list[Job]) -> None:
    """Score `jobs` with the version served now, in one model call (runs in the worker thread)."""
    predictor = keeper.current
    parsed = []
    for job in jobs:
        job.version = predictor.number
        try:
            parsed.append((job, parse_job(predictor.features, job)))
        except RowError as exc:
            job.error = str(exc)
    if not parsed:
        return
    batch = Batch.concat([b for _, b in parsed])
    looked, missing = predictor.counts()
    scores = predictor.score_batch(batch)
    looked_after, missing_after = predictor.counts()
    metrics.lookups.inc(looked_after - looked)
    metrics.missing.inc(missing_after - missing)
    metrics.batch_rows.observe(len(batch))
    metrics.rows.inc(len(batch))
    start = 0
    for job, part in parsed:
        job.scores = scores[start:start + len(part)]
        start += len(part)


class MicroBatcher:
    def __init__(self, keeper, metrics, wait_ms: float, max_rows: int):
        self.keeper, self.metrics = keeper, metrics
        self.wait_s, self.max_rows = wait_ms / 1000.0, max_rows
        self.queue: asyncio.Queue | None = None
        self.reading = 0  # requests that arrived and are still being read and parsed
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="hybridrec-score")
        self._task = None

    def start(self) -> None:
        self.queue = asyncio.Queue()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._executor.shutdown(wait=False)

    async def submit(self, job: Job) -> Job:
        self.queue.put_nowait(job)
        return await job.future

    async def _collect(self) -> list[Job]:
        jobs = [await self.queue.get()]
        rows = jobs[0].count
        deadline = time.monotonic() + self.wait_s
        while rows < self.max_rows:
            if not self.queue.empty():
                jobs.append(self.queue.get_nowait())
                rows += jobs[-1].count
                continue
            remaining = deadline - time.monotonic()
            if self.reading <= 0 or remaining <= 0:
                break
            try:
                jobs.append(await asyncio.wait_for(self.queue.get(), remaining))
                rows += jobs[-1].count
            except asyncio.TimeoutError:
                break
        return jobs

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            jobs = await self._collect()
            try:
                await loop.run_in_executor(self._executor, score_jobs, self.keeper, self.metrics, jobs)
            except Exception as exc:  # noqa: BLE001 - a bug of ours answers these requests with 500
                for job in jobs:
                    if not job.future.done():
                        job.future.set_exception(exc)
                continue
            for job in jobs:
                if not job.future.done():
                    job.future.set_result(job)
