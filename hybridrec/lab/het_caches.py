"""HET's embedding side for the emulated workers: each worker reads and writes through a cache of
its own (`HetWorker`, hybridrec.het.worker: Algorithms 1-3 over `CacheTable`), and the workers'
exchanges go to one in-process server shard whose clock operations (`ClockOps`,
hybridrec.het.clocks: write-backs, fetches, clock checks, clock gaps) serve the local placement's
stores. The same requests and replies as over the wire (`in_process_exchange`), so the cache
semantics are `consistency: het`'s exactly; the schedule only decides the order of the workers'
exchanges within a round. The stores then hold what the servers hold, and the job is evaluated
on them once every cache is flushed.
"""
from __future__ import annotations

import numpy as np

from hybridrec.embedding.inputs import EmbeddingInputs, Pulled
from hybridrec.het.clocks import HetBackend, clock_ops_of, in_process_exchange
from hybridrec.het.worker import HetWorker
from hybridrec.strategy.consistency.het import combine, table_specs


class HetCaches:
    def __init__(self, placement, tables, het_section, staleness: int | None, workers: int, observer=None):
        self.placement, self.tables, self.observer = placement, tables, observer
        self.stores = stores = {name: store for collection in placement.collections.values()
                                for name, store in collection.stores.items()}
        self.server = clock_ops_of(stores)
        exchange = in_process_exchange([self.server])
        dims = {name: store.dim for name, store in stores.items()}
        specs = table_specs(tables.all_tables(), het_section)
        self.workers = [HetWorker(specs, HetBackend(exchange, 1, dims, worker=w), staleness, het_section.policy,
                                  het_section.light_lfu_threshold) for w in range(workers)]
        self.samples = [0] * workers

    def prepare_read(self, worker: int, step: int, required: np.ndarray, schedule) -> None:
        """Nothing: HET's bound is per embedding, checked by the cache at the read itself."""

    def read(self, worker: int, step: int, batch) -> Pulled:
        """Het.Read of the batch's distinct keys (HetStream's read, in the emulator's thread)."""
        layout = self.tables.layout(batch.sparse)
        keys = {table: layout.unique[table] for table in layout.tables()}
        read = self.workers[worker].read(keys)
        if self.observer is not None:
            self.observer("read", worker=worker, step=step, keys=keys, read=read, cache=self.workers[worker].caches,
                          stores=self.stores)
        return Pulled("unique", read.values, layout.batch_size, layout.num_features, batch_layout=layout, handle=read)

    def micro_batches(self, looked: Pulled, batch) -> list:
        return [(looked, batch)]

    def inputs(self, looked: Pulled, batch, requires_grad: bool) -> EmbeddingInputs:
        """The dense model's inputs of the rows a read gave (as the ps placement makes them)."""
        return EmbeddingInputs.from_pulled(looked, lambda: self.tables.layout(batch.sparse), self.tables.deep_dim,
                                           requires_grad)

    def after_backward(self, worker: int, step: int, looked: Pulled, inputs: EmbeddingInputs) -> None:
        """Het.Write: the gradients accumulate in the worker's cache (nothing reaches the server)."""
        self.workers[worker].write(looked.handle, inputs.gradients())
        self.samples[worker] += looked.batch_size

    def finish(self) -> None:
        """Every cache flushed, in worker order: the stores hold every update."""
        for worker in self.workers:
            worker.flush()

    def facts(self) -> dict:
        """The job's cache figures as a real HET job reports them, with the clock-gap histogram."""
        return combine([{**worker.stats(), "samples": samples} for worker, samples in zip(self.workers, self.samples)])
