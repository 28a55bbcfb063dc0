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

from hybridrec.benchmarks import e2e
from hybridrec.benchmarks.e2e import FixedEmbeddings
from hybridrec.benchmarks.peers import SYSTEM_CLASSES
from hybridrec.benchmarks.workload import parse_benchmark_arguments

DEFAULT_SYSTEMS = ("hybridrec", "torchrec")


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
