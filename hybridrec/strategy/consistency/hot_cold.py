"""The hot_cold consistency (PICASSO, preset `picasso`): synchronous like `sync` (a lookup sees
every earlier update), with PICASSO's HybridHash cache of the hottest rows (hybridrec.picasso.
hybrid_hash) attached from outside to the owners' shards that the sharded placement offers (its
`shards` service)."""
from __future__ import annotations

from hybridrec.picasso.hybrid_hash import HybridHash
from hybridrec.strategy.consistency import Consistency


class HotCold(Consistency):
    tau = 0

    def __init__(self, cfg, tables, world, services):
        super().__init__(cfg, tables, world, services)
        shards = services.shard_map("consistency hot_cold")
        if not shards.packing:
            raise ValueError("strategy.consistency hot_cold: the hot rows are looked up inside the packed "
                             "kernels; set strategy.picasso.packing true")
        options = cfg.strategy.picasso
        shards.attach_hot_rows(HybridHash(shards, options.hot_rows, options.warmup_iters, options.flush_iters))


CONSISTENCY = HotCold
