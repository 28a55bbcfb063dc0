"""Thread-CPU pairing of an evicting store against one that never evicts, for engine work on the
eviction path on a noisy host.

A developer tool, not a `hybridrec bench` mode: `hybridrec bench tiers` gives the recorded
eviction figure in wall-clock segments; this gives a steadier one for comparing kernel changes.
Both stores live in this process and take turns batch by batch on the stream of `bench tiers`
(`tiers.batch_keys`: Zipf keys hashed over 2^64, pull + push of a fixed gradient, dim 16,
Adagrad, one thread, prefaulted tables). The CPU time of this thread (not wall-clock: time the
host gives to other processes does not count) of each store's batch is taken, and the figure
is the median over the steady-state batches (`--from` on: every batch of the evicting store
evicts) of never evicting / evicting, as `bench tiers` defines its ratio.

Example: nice -n 10 taskset -c 1 python scripts/dev/eviction_cpu.py --batches 400 --from 200
"""
import argparse
import json
import pathlib
import statistics
import sys
import time

import numpy as np


def main(argv=None) -> dict:
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
    from hybridrec.benchmarks.tiers import batch_keys
    from hybridrec.embedding import EmbeddingStore

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, default=400)
    p.add_argument("--from", dest="first", type=int, default=200, help="first batch counted (default 200)")
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--capacity", type=int, default=200_000, help="rows of the evicting store (default 200000)")
    p.add_argument("--zipf", type=float, default=1.05)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    batches = [batch_keys(args.seed, i, args.batch_size, args.zipf) for i in range(args.batches)]
    distinct = int(np.unique(np.concatenate(batches)).shape[0])
    grads = np.random.default_rng(1).standard_normal((args.batch_size, 16)).astype(np.float32) * 0.1
    fields = {"dim": 16, "optimizer": {"name": "adagrad", "lr": 0.05}, "prefault": True}
    stores = {"in_memory": EmbeddingStore(**fields, capacity=int(distinct * 1.05) + 1024),
              "evicting": EmbeddingStore(**fields, capacity=args.capacity)}
    for store in stores.values():  # the kernels from numba's cache before any batch counts
        store.pull(batches[0][:16], insert=False)
    cpu = {name: [] for name in stores}
    pull_cpu = {name: [] for name in stores}
    evicted_before = 0
    for i, keys in enumerate(batches):
        if i == args.first:
            evicted_before = stores["evicting"].stats()["evicted"]
        for name in (stores if i % 2 == 0 else reversed(list(stores))):
            start = time.thread_time()
            stores[name].pull(keys)
            pulled = time.thread_time()
            stores[name].push(keys, grads)
            cpu[name].append(time.thread_time() - start)
            pull_cpu[name].append(pulled - start)
    steady = range(args.first, args.batches)
    median_ms = lambda seconds: 1e3 * statistics.median(seconds[i] for i in steady)
    report = {"ratio": statistics.median(cpu["in_memory"][i] / cpu["evicting"][i] for i in steady),
              "in_memory_ms": median_ms(cpu["in_memory"]), "evicting_ms": median_ms(cpu["evicting"]),
              "in_memory_pull_ms": median_ms(pull_cpu["in_memory"]), "evicting_pull_ms": median_ms(pull_cpu["evicting"]),
              "evicted_per_batch": (stores["evicting"].stats()["evicted"] - evicted_before) / len(steady),
              "distinct_keys": distinct}
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
