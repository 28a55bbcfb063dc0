"""`hybridrec bench e2e-floor`: how fast could any embedding engine make `bench e2e`?

Times, interleaved in one run, the DLRM training step of `hybridrec bench e2e` fed by the
systems of `--systems` (default hybridrec and TorchRec) and the same step fed by `dense_only`:
one fixed leaf tensor of pooled embeddings, no lookup and no update. `dense_only` is the dense
part alone, an upper bound for every embedding system on this model and thread count, so
`dense_only_over_torchrec` bounds what `hybridrec_over_torchrec` in `bench e2e` can reach.
Same workload, timing and report as `bench e2e` (`--json`: one JSON line with
`<system>_samples_per_s` medians and every `<a>_over_<b>` paired ratio).
"""
from __future__ import annotations

import torch

from hybridrec.benchmarks import e2e
from hybridrec.benchmarks.peers import SYSTEM_CLASSES, SystemBase
from hybridrec.benchmarks.workload import WorkloadShape, parse_benchmark_arguments

DEFAULT_SYSTEMS = ("hybridrec", "torchrec")


class FixedEmbeddings(SystemBase):
    """An 'embedding system' that costs nothing: the same leaf tensor every step."""

    name = "dense_only"

    def __init__(self, shape: WorkloadShape) -> None:
        super().__init__(shape)
        self.table = torch.randn(shape.batch_size, shape.fields, shape.dim,
                                 generator=torch.Generator().manual_seed(shape.seed),
                                 requires_grad=True)

    def prepare(self, batch) -> None:
        return None

    def pooled(self, prepared) -> torch.Tensor:
        return self.table

    def step(self) -> None:
        self.table.grad = None


def main(argv: list[str] | None = None) -> dict:
    parser = e2e.build_parser(
        "hybridrec bench e2e-floor",
        "DLRM training samples/s fed by no embedding engine at all (dense_only, the floor of "
        "bench e2e) against the same step fed by the --systems, one thread.",
        DEFAULT_SYSTEMS)
    args, shape, plan = parse_benchmark_arguments(parser, argv)
    args.systems = (FixedEmbeddings.name, *args.systems)
    return e2e.compare(args, shape, plan,
                       classes={FixedEmbeddings.name: FixedEmbeddings, **SYSTEM_CLASSES},
                       title="DLRM training, dense-only floor vs embedding engines")
