"""Where hybridrec's embedding step spends its time: ns per lookup of the probe + pool phase and
of the scatter + update phase, on the `hybridrec bench embedding` workload (fresh batches, one
thread), and again on a batch whose rows all sit in cache (the compute floor).

A developer tool, not a `hybridrec bench` mode: it times hybridrec alone (no peer, no ratio) and
calls the collection's internals (`_group_for`, `_positions`) to split the step into its two
kernel calls, which no peer has.

Example: python scripts/dev/embedding_phases.py --batches 40"""
import argparse
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # run from a checkout

import numpy as np  # noqa: E402

from hybridrec.benchmarks.peers import HybridrecSystem  # noqa: E402
from hybridrec.benchmarks.timing import non_negative_int, positive_int, single_thread  # noqa: E402
from hybridrec.benchmarks.workload import WorkloadShape, make_sparse_batches  # noqa: E402


def phase_times(system, prepared, grad):
    """(probe + pool seconds, scatter + update seconds) for each prepared batch."""
    coll = system.collection
    names = tuple(coll.feature_names)
    group = coll._group_for(names)
    times = []
    for features in prepared:
        bsz, positions = coll._positions(features, names)
        start = time.perf_counter()
        _, group_pass = group.forward(features, positions, bsz, grad.shape[2], True)
        middle = time.perf_counter()
        group_pass.backward(grad)
        times.append((middle - start, time.perf_counter() - middle))
    return np.array(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=positive_int, default=40, help="timed fresh batches (default 40)")
    parser.add_argument("--warmup", type=non_negative_int, default=20, help="untimed batches first (default 20)")
    parser.add_argument("--batch-size", type=positive_int, default=4096, help="samples per batch (default 4096)")
    parser.add_argument("--capacity", type=positive_int, default=1_000_000, help="rows per table (default 1000000)")
    args = parser.parse_args(argv)
    single_thread()
    shape = WorkloadShape(batch_size=args.batch_size, fields=26, dim=16, capacity=args.capacity, zipf_exponent=1.2, seed=0)
    batches = make_sparse_batches(shape, args.warmup + args.batches)
    system = HybridrecSystem(shape)
    prepared = [system.prepare(b) for b in batches]
    grad = np.random.default_rng(0).standard_normal((shape.batch_size, shape.fields, shape.dim)).astype(np.float32)
    phase_times(system, prepared[:args.warmup], grad)
    fresh = phase_times(system, prepared[args.warmup:], grad) / shape.lookups_per_batch * 1e9
    hot = phase_times(system, [prepared[-1]] * 10, grad) / shape.lookups_per_batch * 1e9
    result = {
        f"{label}_{phase}_ns_per_lookup_{stat}": float(fn(times[:, i]))
        for label, times in (("fresh", fresh), ("cached", hot))
        for i, phase in enumerate(("probe_pool", "scatter_update"))
        for stat, fn in (("min", np.min), ("median", np.median))
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
