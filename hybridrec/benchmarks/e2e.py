"""`hybridrec bench e2e`: DLRM end-to-end training samples/s against the peers.

The same dense DLRM (`hybridrec.models.build_model("dlrm", ...)`: bottom MLP
n_dense-64-dim, dot interaction, top MLP 256-128 + one logit; same seed, so the same initial
weights) is trained with BCE loss and a dense Adagrad, fed pooled embeddings by each system
of `peers.py` in turn: hybridrec EmbeddingCollection, torch.nn.EmbeddingBag + sparse Adagrad,
TorchRec FusedEmbeddingBagCollection. Synthetic Criteo-like batches are made up front (not
timed); one thread. `--json` prints one JSON line with `hybridrec_samples_per_s`,
`torch_samples_per_s`, `torchrec_samples_per_s` (null when absent), the hybridrec/peer
ratios and the DLRM's `top_mlp_input` size (dim + (F+1)F/2 with dot interaction).
"""
from __future__ import annotations

import argparse
from typing import Callable

import torch

from hybridrec.benchmarks.peers import (ADAGRAD_EPS, ADAGRAD_LR, SYSTEM_NAMES, EmbeddingSystem,
                                        benchmark_parser, compare_systems)
from hybridrec.benchmarks.timing import TimingPlan, positive_int
from hybridrec.benchmarks.workload import (DenseBatch, SparseBatch, WorkloadShape,
                                           make_dense_batches, make_sparse_batches,
                                           parse_benchmark_arguments)
from hybridrec.models import build_model

UNIT = "samples_per_s"
BOTTOM_HIDDEN = 64
TOP_MLP = (256, 128)


def build_parser(prog: str = "hybridrec bench e2e",
                 description: str = "DLRM training samples/s with hybridrec, torch.nn.EmbeddingBag "
                                    "and TorchRec embeddings under the same dense model, one thread.",
                 systems: tuple[str, ...] = SYSTEM_NAMES) -> argparse.ArgumentParser:
    parser = benchmark_parser(prog, description, systems)
    parser.add_argument("--num-dense", type=positive_int, default=13,
                        help="continuous features per sample (default 13)")
    return parser


def build_dlrm(shape: WorkloadShape, num_dense: int) -> torch.nn.Module:
    """The DLRM every system trains, with weights fixed by the workload seed."""
    torch.manual_seed(shape.seed)
    return build_model("dlrm", num_sparse=shape.fields, embedding_dim=shape.dim,
                       num_dense=num_dense, bottom_mlp=(BOTTOM_HIDDEN, shape.dim),
                       top_mlp=TOP_MLP)


def training_step_runner(system: EmbeddingSystem, sparse: list[SparseBatch],
                         dense: list[DenseBatch], shape: WorkloadShape,
                         num_dense: int) -> Callable[[int], None]:
    """`run(i)`: one DLRM training step on batch i, embeddings from `system` (each system
    gets its own copy of the model, built with the same seed)."""
    prepared = [system.prepare(batch) for batch in sparse]  # untimed input conversion
    features = [torch.from_numpy(batch.dense) for batch in dense]
    labels = [torch.from_numpy(batch.labels) for batch in dense]
    model = build_dlrm(shape, num_dense)
    dense_optimizer = torch.optim.Adagrad(model.parameters(), lr=ADAGRAD_LR, eps=ADAGRAD_EPS)
    loss_function = torch.nn.BCEWithLogitsLoss()

    def train_step(index: int) -> None:
        logits = model(system.pooled(prepared[index]), None, features[index])
        loss = loss_function(logits, labels[index])
        dense_optimizer.zero_grad(set_to_none=True)
        loss.backward()
        dense_optimizer.step()
        system.step()

    return train_step


def compare(args: argparse.Namespace, shape: WorkloadShape, plan: TimingPlan, *,
            classes: dict[str, Callable[[WorkloadShape], EmbeddingSystem]] | None = None,
            title: str = "DLRM training") -> dict:
    """Trains the DLRM fed by each of `args.systems` (built from `classes`, by default hybridrec
    and the peers), interleaved, and prints and returns the summary."""
    sparse = make_sparse_batches(shape, plan.total_batches)
    dense = make_dense_batches(shape.batch_size, args.num_dense, plan.total_batches,
                               seed=shape.seed)
    top_mlp_input = build_dlrm(shape, args.num_dense).interaction_dim
    return compare_systems(
        args, shape, plan, unit=UNIT, items_per_batch=shape.batch_size,
        make_runner=lambda system: training_step_runner(system, sparse, dense, shape,
                                                        args.num_dense),
        settings={"num_dense": args.num_dense, "model": "dlrm",
                  "bottom_mlp": [args.num_dense, BOTTOM_HIDDEN, shape.dim],
                  "top_mlp": [top_mlp_input, *TOP_MLP, 1]},
        title=f"{title}, top MLP {top_mlp_input}-256-128-1, one thread",
        extra_keys={"top_mlp_input": top_mlp_input}, classes=classes)


def main(argv: list[str] | None = None) -> dict:
    args, shape, plan = parse_benchmark_arguments(build_parser(), argv)
    return compare(args, shape, plan)
