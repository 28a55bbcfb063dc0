"""The het consistency (HET, preset `het`): each trainer reads its embedding rows through a cache
of its own with per-embedding clock-bounded consistency (hybridrec.het: the cache, the servers'
clocks, Algorithms 1-3 and the stream that runs them in the training thread), over the PS
servers the ps placement offers (its `ps` service), on the direct route: HET's workers talk to
the PS servers, no embedding workers.

`facts` adds the job's cache figures to final_metrics.json (hybridrec.het.stream.combine).
"""
from __future__ import annotations

from hybridrec.errors import UserError
from hybridrec.het.clocks import HetBackend
from hybridrec.het.stream import HetStream, HetTrainer, combine, table_specs
from hybridrec.het.worker import HetWorker
from hybridrec.strategy.consistency import Consistency


class Het(Consistency):
    tau = 0

    def __init__(self, cfg, tables, world, services):
        super().__init__(cfg, tables, world, services)
        self.servers = services.ps_endpoints("consistency het")
        self.trainer: HetTrainer | None = None  # made at the first epoch, once the PS servers hold the tables
        self._client = None

    def open(self, placement, batches, skip: int = 0, limit: int | None = None, prefetch: int = 0,
             lockstep: bool = False) -> HetStream:
        if self.servers.route != "direct":
            raise UserError("consistency het: HET's trainers talk to the PS servers directly, but this job has "
                            "embedding workers; run it with none (strategy.roles.embedding_workers: 0, "
                            "or hybridrec launch --embedding-workers 0)")
        if self.trainer is None:
            self._client = self.servers.client()
            het = self.cfg.strategy.het
            worker = HetWorker(table_specs(self.tables.all_tables(), het), HetBackend.over(self._client, self.world.rank),
                               het.s, het.policy, het.light_lfu_threshold)
            self.trainer = HetTrainer(worker, self.tables.layout)
        return self.trainer.stream(batches, skip, limit, prefetch)

    def facts(self, world) -> dict:
        mine = self.trainer.counts() if self.trainer is not None else {"samples": 0}
        return combine(world.gather(mine))

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


CONSISTENCY = Het
