"""PICASSO (Zhang et al., ICDE 2022): every trainer owns a shard of every table and looks rows
up over AllToAll; packing, interleaving and the hot/cold HybridHash.

    packing.py   the packed operations of a lookup and an update (dedupe, route, stitch, apply)

The `sharded` placement (hybridrec.strategy.placement.sharded) and the `hot_cold` consistency
(hybridrec.strategy.consistency.hot_cold) plug it into the training loop.
"""
