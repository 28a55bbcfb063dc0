"""The ps placement: the tables live on standalone PS servers, sharded by the global route hash.

Two routes to them, chosen by whether the job has embedding workers:
- through the embedding-worker tier (Persia): the trainer puts a batch's IDs on its embedding
  worker ahead of time, pulls the batch's rows (unique rows with `id_codec: unique`, pooled rows
  otherwise) and pushes their gradients back; the embedding worker talks to the PS servers;
- directly (HET's workers talk to the servers): the trainer makes the batch's layout itself
  (each table's keys deduplicated once), looks the unique keys up on the PS shards, pools them
  here, and pushes one summed gradient per unique key.
Checkpoints are written by the servers themselves into the checkpoint's `embeddings` directory.
It offers the other axes the PS servers (`ps`: their endpoints and clients, for HET's cache, SSP's
clocks and the dense parameters of ps_async and HT), lookups off the training thread and a wire
the codecs encode.
"""
from __future__ import annotations

from pathlib import Path

from hybridrec.embedding.inputs import EmbeddingInputs, Pulled
from hybridrec.persia.embedding_worker_client import EmbeddingWorkerClient
from hybridrec.ps.client import PSClient
from hybridrec.strategy.placement import PlacementDefaults
from hybridrec.strategy.services import PSEndpoints, Services


class _Connection:
    """A connection whose wire bytes are its client's (each client counts what it sends)."""

    client: EmbeddingWorkerClient | PSClient

    @property
    def bytes_sent(self) -> int:
        return self.client.bytes_sent

    @property
    def bytes_received(self) -> int:
        return self.client.bytes_received

    def close(self) -> None:
        self.client.close()


class _ThroughEmbeddingWorker(_Connection):
    def __init__(self, client: EmbeddingWorkerClient):
        self.client = client

    def prepare(self, batch) -> int:
        return self.client.put(batch.sparse)

    def lookup(self, first_sample_id: int, train: bool) -> Pulled | None:
        pulled = self.client.pull(first_sample_id, train=train)
        if pulled is not None:
            pulled.handle = first_sample_id
        return pulled

    def update(self, looked: Pulled, grads: dict) -> dict:
        try:
            return self.client.push(looked.handle, grads)
        except TimeoutError:  # the embedding worker died under the push: not retried, it may have been applied
            return {"unacknowledged": True}

class _Direct(_Connection):
    def __init__(self, client: PSClient, tables):
        self.client, self.tables = client, tables

    def prepare(self, batch):
        return self.tables.layout(batch.sparse)

    def lookup(self, layout, train: bool) -> Pulled:
        keys = {table: layout.unique[table] for table in layout.tables()}
        versions: dict = {}
        rows = self.client.lookup_tables(keys, insert=train, unique=True, versions=versions)  # deduplicated already
        return Pulled("unique", rows, layout.batch_size, layout.num_features, batch_layout=layout, versions=versions)

    def update(self, looked: Pulled, grads: dict) -> dict:
        layout = looked.batch_layout
        pairs = {table: (layout.unique[table], grads[table]) for table in layout.tables()}
        versions: dict = {}
        try:
            return {"dropped": self.client.push_tables(pairs, unique=True, versions=versions), "versions": versions}
        except TimeoutError:  # a shard died mid-push: not retried, it may have been applied
            return {"unacknowledged": True}


class PSPlacement(PlacementDefaults):
    def __init__(self, cfg, tables, world, endpoints):
        s = cfg.strategy
        self.cfg, self.tables, self.world = cfg, tables, world
        self.servers = PSEndpoints(tuple(endpoints["ps"]), tuple(endpoints.get("embedding_workers") or ()),
                                   s.request_timeout, s.retries, s.resolved["value_codec"],
                                   tuple(endpoints.get("group_ps") or ()))
        self.services = Services(ps=self.servers, background_lookups=True, wire=True)
        self.embedding_workers = list(self.servers.embedding_workers)
        self.ps = self.servers.client()  # checkpoints

    def connect(self):
        if not self.embedding_workers:
            return _Direct(self.servers.client(), self.tables)
        s = self.cfg.strategy
        # an embedding worker's answer may wait for its own PS retries: give it that long
        return _ThroughEmbeddingWorker(EmbeddingWorkerClient(
            self.embedding_workers, self.world.rank % len(self.embedding_workers), id_codec=s.resolved["id_codec"],
            value_codec=s.resolved["value_codec"], timeout=s.request_timeout * (s.retries + 2), retries=s.retries))

    def inputs(self, looked: Pulled, batch, requires_grad: bool) -> EmbeddingInputs:
        return EmbeddingInputs.from_pulled(looked, lambda: self.tables.layout(batch.sparse), self.tables.deep_dim,
                                           requires_grad)

    def save(self, directory: Path) -> None:
        self.ps.checkpoint(directory)

    def load(self, directory: Path) -> None:
        self.ps.load(directory)

    def expire(self, step: int, now: float) -> int:
        return self.ps.expire(step, now) if self.world.leader else 0  # the leader sweeps the servers

    def facts(self) -> dict:
        """The route, and the elastic PS tier's figures (`PSClient.job_metrics`) as ps_* numbers."""
        return {"route": self.servers.route, **{f"ps_{name}": value for name, value in self.ps.job_metrics().items()}}

    def close(self) -> None:
        self.ps.close()


PLACEMENT = PSPlacement
