"""What bounds the pipelined local step of `hybridrec bench e2e` on N cores: its CPU budget.

The pipelined step hides the embedding work behind the dense step only where the dense step
leaves a core idle. On N cores, a step cannot take less than the CPU time of all its work spread
over them: (dense step on 1 thread + embedding work on 1 thread) / N. Against the dense-only
floor (the dense step on N threads) that gives the best `hybridrec_over_dense_only` any
scheduling can reach:

    bound = min(1, dense_N / ((dense_1 + embedding) / N))

This script measures the three terms on the bench's workload and model (medians over
`--batches`, after `--warmup`): the dense-only step on 1 and on N threads, and hybridrec's
embedding work per batch on one thread, split into its phases (lookup ahead: dedupe, probe,
insert; the update; the pooling after it). It measures them `--rounds` times in turn, since the
host's noise comes in spells, and reports the median of each term and of the rounds' bounds.

A developer tool, not a `hybridrec bench` mode: it times parts of hybridrec's step alone, with no
peer and no ratio against one.

Example: python scripts/dev/e2e_cpu_budget.py --model wide --threads 2"""
import argparse
import dataclasses
import json
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # run from a checkout

import numpy as np  # noqa: E402
import torch  # noqa: E402

from hybridrec.benchmarks import e2e  # noqa: E402
from hybridrec.benchmarks.timing import non_negative_int, positive_int  # noqa: E402
from hybridrec.benchmarks.workload import WorkloadShape, make_dense_batches, make_sparse_batches  # noqa: E402


def dense_step_seconds(shape, build, dense, threads: int, warmup: int) -> float:
    """Median seconds of the dense-only training step on `threads` torch threads."""
    e2e.set_threads(threads)
    fixed = e2e.FixedEmbeddings(shape)
    model = build(shape, dense[0].dense.shape[1])
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.05)
    loss_function = torch.nn.BCEWithLogitsLoss()
    times = []
    for batch in dense:
        start = time.perf_counter()
        loss = loss_function(model(fixed.pooled(None), None, torch.from_numpy(batch.dense)),
                             torch.from_numpy(batch.labels))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        fixed.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[warmup:])


def embedding_phase_seconds(shape, sparse, warmup: int) -> dict:
    """Median seconds per batch of each phase of the pipelined step's embedding work, one thread,
    in the pipeline's order (look batch t+1 up, apply batch t's update, pool batch t+1)."""
    e2e.set_threads(1)
    system = e2e.PipelinedHybridrec(shape)
    collection = system.collection
    times = {"lookup": [], "update": [], "pool": []}
    previous = None
    for index, batch in enumerate(sparse):
        start = time.perf_counter()
        looked = collection.look_ahead(system.prepare(batch))
        looked_up = time.perf_counter()
        if previous is not None:
            collection.apply_ahead(previous)
        updated = time.perf_counter()
        collection.pool_ahead(looked, previous)
        pooled = time.perf_counter()
        times["lookup"].append(looked_up - start)
        times["update"].append(updated - looked_up)
        times["pool"].append(pooled - updated)
        looked.grads = [np.random.default_rng(index).standard_normal(looked.outputs[0].shape)
                        .astype(np.float32) * 1e-3]  # what a backward would record
        previous = looked
    return {phase: statistics.median(values[warmup + 1:]) for phase, values in times.items()}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("dlrm", "wide"), default="dlrm",
                        help="bench e2e's DLRM (26 fields) or its wide model (208 fields)")
    parser.add_argument("--threads", type=positive_int, default=2, help="cores N (default 2)")
    parser.add_argument("--batch-size", type=positive_int, default=4096, help="samples per batch (default 4096)")
    parser.add_argument("--batches", type=positive_int, default=30, help="timed batches (default 30)")
    parser.add_argument("--warmup", type=non_negative_int, default=5, help="untimed batches first (default 5)")
    parser.add_argument("--rounds", type=positive_int, default=3, help="measurements of each term, in turn (default 3)")
    args = parser.parse_args(argv)
    shape = WorkloadShape(batch_size=args.batch_size, fields=26, dim=16, capacity=1_000_000, zipf_exponent=1.2)
    build = e2e.build_dlrm
    if args.model == "wide":
        shape = dataclasses.replace(shape, fields=208, capacity=50_000)
        build = e2e.build_wide
    total = args.batches + args.warmup
    sparse = make_sparse_batches(shape, total)
    dense = make_dense_batches(shape.batch_size, 13, total, seed=shape.seed)
    rounds = []
    for _ in range(args.rounds):
        embedding = embedding_phase_seconds(shape, sparse, args.warmup)
        dense_1 = dense_step_seconds(shape, build, dense, 1, args.warmup)
        dense_n = dense_step_seconds(shape, build, dense, args.threads, args.warmup)
        rounds.append({"dense_1_thread_ms": 1e3 * dense_1, f"dense_{args.threads}_threads_ms": 1e3 * dense_n,
                       **{f"embedding_{phase}_ms": 1e3 * value for phase, value in embedding.items()},
                       "bound_over_dense_only": min(1.0, dense_n / ((dense_1 + sum(embedding.values())) / args.threads))})
    report = {"model": args.model, "threads": args.threads, "rounds": args.rounds,
              **{key: round(statistics.median(r[key] for r in rounds), 3) for key in rounds[0]}}
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
