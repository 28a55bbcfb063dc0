"""HET (Miao et al., VLDB 2022): a cache of embedding rows on every worker, kept within a
per-embedding clock bound of the servers' clocks.

    cache.py    the worker's cache table (numba): keys, vectors, clocks, accumulated gradients
    clocks.py   the servers' side: per-row clocks, the `het_sync` request, SSP's worker clocks
    worker.py   Algorithms 1-3 of the paper over the cache (read, update, write back on eviction)
    stream.py   the training loop's stream under HET (read, step, write in the training thread),
                each table's cache size, the job's cache figures

The `het` consistency (hybridrec.strategy.consistency.het) plugs it into the training loop.
"""
