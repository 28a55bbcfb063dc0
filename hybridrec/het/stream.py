"""HET's stream of ready batches (Algorithm 1): Het.Read of a batch's distinct keys, the step,
Het.Write of its gradients (into the cache; nothing is sent).

A loader thread reads the next batches and deduplicates their keys (the batch layout) while the
current one trains, and a reader thread runs the next batch's read (its write-backs, fetches and
clock checks: one request per PS shard, two when a clock check failed) while the current one
trains, as HET's prefetch does (`HetWorker.begin`); the training thread only gathers the rows
from the cache, after the previous batch's write. When the next batch's keys do not fit a cache
beside the training batch's rows, or s = 0, its read waits for the write instead.

The cache lives as long as the job (`HetTrainer`): `drain` (before every evaluation and
checkpoint, and at the end of each epoch) waits for the read in flight, then flushes the cache,
writing every accumulated gradient back, so a checkpoint holds every update and nothing is lost
(the batch read ahead is read again after the flush). A trainer that
dies loses only what its cache held unflushed; the restarted group resumes from the last
checkpoint, which has it all.

`table_specs` sizes each table's cache from the config's strategy.het; `combine` makes the job's
cache figures from every trainer's counts: hit rate (distinct keys read from the cache without a
fetch, over all reads), misses, invalidations (entries that failed a bound and synchronised),
evictions, write-backs, payload bytes of vectors and of clocks, embedding bytes per sample, and
the clock gaps the servers saw between two trainers' copies as the job's staleness (the largest,
`max_staleness`, and the mean, `mean_staleness`, the names every strategy uses), with the histogram
of every gap (`clock_gaps`).
"""
from __future__ import annotations

import math
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from typing import Callable, Iterator

from hybridrec.data.loader import PrefetchLoader
from hybridrec.embedding.inputs import Pulled
from hybridrec.embedding.optim import P_LR
from hybridrec.embedding.stream import ReadyBatch
from hybridrec.errors import UserError
from hybridrec.het.worker import HetRead, HetWorker, TableSpec
from hybridrec.metrics import StalenessHistogram

SUMMED = ("reads", "hits", "misses", "invalidations", "evictions", "dirty_evictions", "write_backs", "fetches",
          "checks", "flushed", "pins", "vector_bytes", "clock_bytes", "dropped_updates", "requests")


def table_specs(tables: dict, het) -> dict[str, TableSpec]:
    """Each table's cache (rows, dim, local learning rate) from the config's strategy.het."""
    rows = het.cache_rows
    if isinstance(rows, dict):
        unknown = sorted(set(rows) - set(tables))
        if unknown:
            raise UserError(f"strategy.het.cache_rows names tables {unknown}, which this job does not have; "
                            f"its tables: {sorted(tables)}")
    specs = {}
    for name, table in tables.items():
        capacity = table.capacity
        given = rows.get(name) if isinstance(rows, dict) else rows
        count = given if given is not None else max(1, math.ceil(het.cache_fraction * capacity))
        specs[name] = TableSpec(int(min(count, capacity)), table.dim, float(table.optimizer.packed()[P_LR]))
    return specs


def combine(every: list[dict]) -> dict:
    """The job's figures from every trainer's counts."""
    total = {key: sum(one.get(key, 0) for one in every) for key in SUMMED}
    samples = sum(one.get("samples", 0) for one in every)
    wire = total["vector_bytes"] + total["clock_bytes"]
    return {"cache_hit_rate": total["hits"] / total["reads"] if total["reads"] else None,
            **{f"cache_{key}": total[key] for key in ("reads", "hits", "misses", "invalidations", "evictions",
                                                      "dirty_evictions", "write_backs", "fetches", "checks",
                                                      "flushed", "pins")},
            "cache_miss_rate": total["misses"] / total["reads"] if total["reads"] else None,
            "embedding_vector_bytes": total["vector_bytes"], "embedding_clock_bytes": total["clock_bytes"],
            "embedding_bytes_per_sample": wire / samples if samples else None,
            "het_requests": total["requests"],
            **_staleness(every)}


def _staleness(every: list[dict]) -> dict:
    """The clock gaps as the job's staleness (the one name every strategy reports it by, see
    hybridrec.train.summary: the updates a cached read missed), with their histogram."""
    gaps = _merged([one["clock_gaps"] for one in every if "clock_gaps" in one])
    return {"max_staleness": max((one.get("max_clock_gap", 0) for one in every), default=0),
            "mean_staleness": gaps["mean"], "clock_gaps": gaps}


def _merged(histograms: list[dict]) -> dict:
    """One histogram of every trainer's (the gaps each trainer's exchanges were answered with)."""
    total = StalenessHistogram()
    for histogram in histograms:
        total.merge(StalenessHistogram.from_dict(histogram))
    return total.as_dict()


class HetTrainer:
    """A trainer's HET worker for the whole job (its cache lives across epochs) with the samples
    it trained: `stream()` gives an epoch's stream, `counts()` what `combine` adds up."""

    def __init__(self, worker: HetWorker, layout: Callable):
        self.worker, self.layout = worker, layout  # layout(sparse features): the batch's keys deduplicated
        self.samples = 0

    def stream(self, batches, skip: int = 0, limit: int | None = None, prefetch: int = 0) -> "HetStream":
        return HetStream(self, batches, skip, limit, prefetch)

    def counts(self) -> dict:
        return {**self.worker.stats(), "samples": self.samples}


class HetStream:
    """The training loop's stream of ready batches under HET (see the module doc)."""

    tau = 0

    def __init__(self, owner: HetTrainer, batches, skip: int = 0, limit: int | None = None, prefetch: int = 0):
        self._owner, self._worker = owner, owner.worker
        self._skip, self._limit = skip, limit
        layout = owner.layout

        def laid_out():  # runs in the loader thread: the next batches' keys deduplicated ahead
            for index, batch in enumerate(batches):
                yield index, batch, (None if index < skip else layout(batch.sparse))

        self._loader = PrefetchLoader(laid_out(), depth=max(prefetch, 1))
        self._start = self._worker.stats()
        self.staleness: list[int] = []
        self.figures: dict = {}
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="het-read")
        self._pending: Future | None = None

    def _batches(self) -> Iterator[tuple]:
        """(index, batch, the distinct keys per table) of the batches to train."""
        looked_up = 0
        for index, batch, layout in self._loader:
            if index < self._skip:
                continue
            if self._limit is not None and looked_up >= self._limit:
                return
            looked_up += 1
            yield index, batch, layout, {table: layout.unique[table] for table in layout.tables()}

    def _begin(self, keys: dict, training: HetRead | None) -> Future:
        """The read of `keys` in the reader thread while `training`'s batch trains when both fit
        the caches together; else a finished future that `_read` completes after the write."""
        if training is not None and self._worker.can_read_ahead(keys, training):
            return self._reader.submit(self._worker.begin, keys, 1)
        done = Future()
        done.set_result(None)
        return done

    def _read(self, pending: Future, keys: dict) -> HetRead:
        """The gathered read of `keys`: the reader's, or a fresh one when it could not run ahead or
        a flush has emptied the caches it read into since."""
        read = pending.result()
        if read is None or read.generation != self._worker.generation:
            read = self._worker.begin(keys)
        return self._worker.gather(read)

    def __iter__(self) -> Iterator[ReadyBatch]:
        batches = self._batches()
        current = next(batches, None)
        pending = self._begin(current[3], None) if current is not None else None
        while current is not None:
            index, batch, layout, keys = current
            read = self._read(pending, keys)
            self._pending = None
            current = next(batches, None)
            if current is not None:  # the next batch's read runs while this one trains
                pending = self._pending = self._begin(current[3], read)
            looked = Pulled("unique", read.values, layout.batch_size, layout.num_features, batch_layout=layout,
                            handle=read)
            self.staleness.append(0)
            yield ReadyBatch(index, batch, looked, 0)

    def push(self, ready: ReadyBatch, grads: dict) -> None:
        self._worker.write(ready.looked.handle, grads)
        self._owner.samples += ready.batch.batch_size

    def skip(self, ready: ReadyBatch) -> None:
        """`ready` will not be trained: its entries were read, nothing was written."""

    def _settle(self) -> None:
        """Wait for the read in flight (its rows are in the caches; an error it met is raised
        when its batch is read)."""
        if self._pending is not None:
            wait([self._pending])

    def drain(self, timeout: float | None = None) -> None:
        """Flush the caches: every accumulated gradient reaches the servers (a read in flight
        ends first; its batch is read again after the flush)."""
        self._settle()
        self._worker.flush()

    @contextmanager
    def held(self) -> Iterator[None]:
        # the next batch's read may be in flight: it inserts that batch's keys on the servers and
        # writes back earlier updates only; `drain` waits for it before the flush
        yield

    def stats(self) -> dict:
        now = self._worker.stats()
        delta = {key: now[key] - self._start[key] for key in ("bytes_sent", "bytes_received", "dropped_updates")}
        return {"lost_batches": 0, "unacknowledged_updates": 0, **delta}

    def close(self) -> None:
        self._settle()
        self._reader.shutdown(wait=True)
        self._loader.close()
