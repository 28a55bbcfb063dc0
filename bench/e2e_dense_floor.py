"""How fast can any embedding engine make `bench e2e`? Times, interleaved in one run, the DLRM
training step of `hybridrec bench e2e` fed by TorchRec and by hybridrec, and the same step fed by
a fixed embedding tensor (no lookup, no update): the dense part alone, an upper bound for every
embedding system on this model and thread count. Prints samples/s medians and ratios as JSON.

Example: python bench/e2e_dense_floor.py --repeats 5"""
import argparse
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from a checkout

import torch  # noqa: E402

from hybridrec.benchmarks.e2e import training_step_runner  # noqa: E402
from hybridrec.benchmarks.peers import HybridrecSystem, TorchRecSystem  # noqa: E402
from hybridrec.benchmarks.timing import (TimingPlan, measure_interleaved, paired_ratio, single_thread,  # noqa: E402
                                         warm_up)
from hybridrec.benchmarks.workload import WorkloadShape, make_dense_batches, make_sparse_batches  # noqa: E402


class FixedEmbeddings:
    """An 'embedding system' that costs nothing: the same leaf tensor every step."""

    name = "dense_only"

    def __init__(self, shape):
        self.table = torch.randn(shape.batch_size, shape.fields, shape.dim, requires_grad=True)

    def prepare(self, batch):
        return None

    def pooled(self, prepared):
        return self.table

    def step(self):
        self.table.grad = None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batches", type=int, default=5)
    args = parser.parse_args(argv)
    single_thread()
    shape = WorkloadShape(batch_size=4096, fields=26, dim=16, capacity=1_000_000, zipf_exponent=1.2, seed=0)
    plan = TimingPlan(warmup=5, batches=args.batches, repeats=args.repeats)
    total = plan.warmup + plan.batches * plan.repeats
    sparse = make_sparse_batches(shape, total)
    dense = make_dense_batches(shape.batch_size, 13, total, seed=shape.seed)
    runners = {}
    for system in (FixedEmbeddings(shape), HybridrecSystem(shape), TorchRecSystem(shape)):
        runners[system.name] = training_step_runner(system, sparse, dense, shape, 13)
        warm_up(runners[system.name], plan)
    rates = measure_interleaved(runners, plan, shape.batch_size)
    result = {f"{name}_samples_per_s": r.median for name, r in rates.items()}
    result["dense_only_over_torchrec"] = paired_ratio(rates["dense_only"], rates["torchrec"])
    result["hybridrec_over_torchrec"] = paired_ratio(rates["hybridrec"], rates["torchrec"])
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
