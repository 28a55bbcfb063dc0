"""`hybridrec bench embedding`: embedding training throughput against the peers.

Measures, in one run and on the same generated batches, one training step of the embedding
layer alone: lookup + pooled forward + backward of a fixed upstream gradient + fused Adagrad
update, for hybridrec, torch.nn.EmbeddingBag and TorchRec (see `peers.py`). One thread.
Reports the median lookups/s (IDs per second) of several timed repetitions per system and
the hybridrec/peer ratios; `--json` prints exactly one JSON line with the keys
`hybridrec_lookups_per_s`, `torch_lookups_per_s`, `torchrec_lookups_per_s` (null when a
system is absent), `bytes_per_row`, `hybridrec_over_torch`, `hybridrec_over_torchrec`.
"""
from __future__ import annotations

import argparse
from typing import Callable

import torch

from hybridrec.benchmarks.peers import EmbeddingSystem, benchmark_parser, compare_systems
from hybridrec.benchmarks.results import pick
from hybridrec.benchmarks.workload import (SparseBatch, WorkloadShape, make_sparse_batches,
                                           parse_benchmark_arguments)

UNIT = "lookups_per_s"


def build_parser() -> argparse.ArgumentParser:
    return benchmark_parser(
        "hybridrec bench embedding",
        "Embedding lookup + backward + fused Adagrad throughput, hybridrec vs "
        "torch.nn.EmbeddingBag and TorchRec, one thread.")


def embedding_step_runner(system: EmbeddingSystem, batches: list[SparseBatch],
                          shape: WorkloadShape) -> Callable[[int], None]:
    """`run(i)`: forward, backward and update of `system` on batch i."""
    prepared = [system.prepare(batch) for batch in batches]  # untimed input conversion
    upstream = torch.Generator().manual_seed(shape.seed)
    upstream_gradient = torch.randn(shape.batch_size, shape.fields, shape.dim,
                                    generator=upstream)

    def train_step(index: int) -> None:
        system.pooled(prepared[index]).backward(upstream_gradient)
        system.step()

    return train_step


def headline(report: dict) -> dict:
    """The figures of the results table (docs/benchmarks.md): the paired ratios and the memory per row."""
    return pick(report, {"hybridrec / torch": "hybridrec_over_torch", "hybridrec / TorchRec": "hybridrec_over_torchrec",
                         "bytes per row": "bytes_per_row"})


def main(argv: list[str] | None = None) -> dict:
    args, shape, plan = parse_benchmark_arguments(build_parser(), argv)
    batches = make_sparse_batches(shape, plan.total_batches)
    return compare_systems(
        args, shape, plan, unit=UNIT, items_per_batch=shape.lookups_per_batch,
        make_runner=lambda system: embedding_step_runner(system, batches, shape),
        settings={}, title="embedding lookup + backward + Adagrad, one thread")
