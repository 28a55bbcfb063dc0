"""PICASSO (Zhang et al., ICDE 2022): every trainer owns a shard of every table and looks rows
up over AllToAll; packing, interleaving and the hot/cold HybridHash.

    sharded_tables.py   a trainer's shards of every table: lookups, updates, checkpoints (§III-A)
    lookup_rounds.py    a lookup round: keys to their owners over AllToAll, rows back, pooled
    gradient_rounds.py  the backward: each key's gradient to its owner, the hot rows' AllReduce
    collectives.py      AllToAll / AllReduce on the tables' own group, bytes and operations counted
    packs.py            D-packing: tables of one side and dim looked up together, Eq. 1 and Eq. 3 (§III-B)
    packing.py          K-packing: the fused kernels of a lookup and an update (dedupe, route, stitch, apply)
    interleaving.py     D-interleaving: micro-batches whose lookups run beside the dense part (§III-C)
    hot_rows.py         the hot storage: the hottest rows copied to every trainer (§III-D)
    hybrid_hash.py      HybridHash: which rows are hot, chosen again every flush_iters steps (§III-D)

The `sharded` placement (hybridrec.strategy.placement.sharded) and the `hot_cold` consistency
(hybridrec.strategy.consistency.hot_cold) plug it into the training loop.
"""
