"""Paired A/B of hybridrec's embedding step between two checkouts, for engine work on a noisy host.

A developer tool, not a `hybridrec bench` mode: it compares two versions of hybridrec with each
other (no peer), and each side must import hybridrec from its own checkout, so it runs as a
script from this one. The workload and the step are those of `hybridrec bench embedding`
(`hybridrec.benchmarks.embedding.embedding_step_runner`).

Two worker processes, one importing hybridrec from each checkout, are pinned to the same CPU and
take turns, one batch each (the order alternates every batch). Both therefore see the same spells
of host noise, and the median of the per-batch time ratios (candidate / baseline) is far steadier
than two separate runs. `--capacity` below the workload's distinct keys per field (about 41,000
for 70 batches) makes every table full, so each batch evicts.

Example (a second checkout made with `git worktree add /tmp/base <commit>`):
    python scripts/dev/ab_step.py --baseline /tmp/base --candidate . --batches 60
"""
import argparse
import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import time

_WORKER = "--worker"


def _worker(checkout: str, cpu: int, shape_fields: dict, n_batches: int) -> None:
    """Builds the system from `checkout`, then times one step per batch index read from stdin."""
    os.sched_setaffinity(0, {cpu})
    sys.path.insert(0, checkout)
    from hybridrec.benchmarks.embedding import embedding_step_runner
    from hybridrec.benchmarks.peers import HybridrecSystem
    from hybridrec.benchmarks.timing import single_thread
    from hybridrec.benchmarks.workload import WorkloadShape, make_sparse_batches

    single_thread()
    shape = WorkloadShape(**shape_fields)
    # the keys fit the peers' 1M-row default whatever the capacity under test
    batches = make_sparse_batches(dataclasses.replace(shape, capacity=max(shape.capacity, 1_000_000)), n_batches)
    step = embedding_step_runner(HybridrecSystem(shape), batches, shape)
    print("ready", flush=True)
    for line in sys.stdin:
        start = time.perf_counter()
        step(int(line))
        print(time.perf_counter() - start, flush=True)


def _checkout(text: str) -> str:
    """argparse type: a directory holding a hybridrec package."""
    path = pathlib.Path(text).resolve()
    if not (path / "hybridrec" / "__init__.py").is_file():
        raise argparse.ArgumentTypeError(f"{text!r} is not a checkout: it has no hybridrec/__init__.py")
    return str(path)


def main(argv=None) -> dict:
    # here, not at the top: a worker must import hybridrec from its own checkout, not this one
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
    from hybridrec.benchmarks.timing import positive_int

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", type=_checkout, required=True, help="checkout A (the reference)")
    parser.add_argument("--candidate", type=_checkout, required=True, help="checkout B (the change)")
    parser.add_argument("--batches", type=positive_int, default=60, help="timed batches (default 60)")
    parser.add_argument("--warmup", type=positive_int, default=10, help="untimed batches first (default 10)")
    parser.add_argument("--batch-size", type=positive_int, default=4096, help="samples per batch (default 4096)")
    parser.add_argument("--capacity", type=positive_int, default=1_000_000, help="rows per table (default 1000000)")
    parser.add_argument("--cpu", type=int, default=max(os.sched_getaffinity(0)),
                        help="the CPU both workers are pinned to (default the highest allowed)")
    args = parser.parse_args(argv)
    if args.cpu not in os.sched_getaffinity(0):
        parser.error(f"--cpu: {args.cpu} is not one of this process's CPUs {sorted(os.sched_getaffinity(0))}")
    shape = {"batch_size": args.batch_size, "fields": 26, "dim": 16, "capacity": args.capacity}
    total = args.warmup + args.batches
    workers = [subprocess.Popen([sys.executable, __file__, _WORKER, checkout, str(args.cpu), json.dumps(shape),
                                 str(total)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
               for checkout in (args.baseline, args.candidate)]
    try:
        for worker in workers:
            if worker.stdout.readline().strip() != "ready":
                raise RuntimeError(f"a worker failed to start (exit code {worker.wait(timeout=60)})")
        times = ([], [])
        for i in range(total):
            for k in ((0, 1) if i % 2 == 0 else (1, 0)):
                workers[k].stdin.write(f"{i}\n")
                workers[k].stdin.flush()
                times[k].append(float(workers[k].stdout.readline()))
    finally:
        for worker in workers:
            worker.stdin.close()
            worker.wait(timeout=60)
    import numpy as np

    base, cand = (np.array(t[args.warmup:]) for t in times)
    ratios = cand / base
    lookups = args.batch_size * 26
    result = {"baseline_ns_per_lookup_median": float(np.median(base)) / lookups * 1e9,
              "candidate_ns_per_lookup_median": float(np.median(cand)) / lookups * 1e9,
              "candidate_over_baseline_median": float(np.median(ratios)),
              "candidate_over_baseline_q25": float(np.quantile(ratios, 0.25)),
              "candidate_over_baseline_q75": float(np.quantile(ratios, 0.75)),
              # what the median hides: costs paid in a few batches only (index growth, a first eviction)
              "candidate_over_baseline_total": float(cand.sum() / base.sum()),
              "batches": args.batches, "capacity": args.capacity, "batch_size": args.batch_size}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == _WORKER:
        _worker(sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4]), int(sys.argv[5]))
    else:
        main()
