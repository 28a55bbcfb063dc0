"""`hybridrec bench e2e`: end-to-end training samples/s of two models against the peers.

The same dense model (same seed, so the same initial weights) is trained with BCE loss and a
dense Adagrad, fed pooled embeddings by each system in turn: hybridrec EmbeddingCollection,
torch.nn.EmbeddingBag + sparse Adagrad, TorchRec FusedEmbeddingBagCollection (`peers.py`), and
`dense_only`, one fixed leaf tensor of pooled embeddings (no lookup, no update: the floor of any
embedding engine on that model and thread count). Two models:

* DLRM (`hybridrec.models.build_model("dlrm", ...)`): bottom MLP n_dense-64-dim, dot
  interaction, top MLP 256-128 + one logit, on `--fields` one-hot fields (default 26);
* `wide`: an MLP 512-256-1 on the concatenated embeddings of `--wide-fields` one-hot fields
  (default 208, PICASSO's scale; 0 skips it) and the dense features, tables of
  `--wide-capacity` rows.

`--threads N` gives every system N threads (torch intra-op and numba). `hybridrec` is the step
`hybridrec train` runs by default: lookup in the forward, update in the backward, its kernels on
the N numba threads. With N >= 2, `hybridrec_pipelined` is the pipelined local step
(`train.pipeline: true`, `hybridrec/train/local_pipeline.py`): the next batch's lookup and this
batch's update on one thread beside the dense step, which keeps the N torch threads.
`hybridrec_bf16` is `hybridrec` with the dense part under bfloat16 autocast. Synthetic Criteo-like
batches are made up front (not timed). `--json` prints one JSON line: `<system>_samples_per_s`
medians (null when absent), every `<a>_over_<b>` paired ratio, `threads`, the DLRM's
`top_mlp_input` size (dim + (F+1)F/2), and `wide`, the same keys for the wide model.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
from dataclasses import asdict
from typing import Callable

import torch

from hybridrec.benchmarks.peers import (ADAGRAD_EPS, ADAGRAD_LR, SYSTEM_CLASSES, EmbeddingSystem, HybridrecSystem,
                                        SystemBase, benchmark_parser, measure_systems)
from hybridrec.benchmarks.results import pick
from hybridrec.benchmarks.timing import TimingPlan, non_negative_int, positive_int, print_summary, summarize
from hybridrec.benchmarks.workload import (DenseBatch, SparseBatch, WorkloadShape,
                                           make_dense_batches, make_sparse_batches,
                                           parse_benchmark_arguments)
from hybridrec.models import build_model
from hybridrec.models.mlp import MLP

UNIT = "samples_per_s"
BOTTOM_HIDDEN = 64
TOP_MLP = (256, 128)
WIDE_MLP = (512, 256)
E2E_NAMES = ("hybridrec", "hybridrec_pipelined", "hybridrec_bf16", "torch", "torchrec", "dense_only")


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


class HybridrecBf16(HybridrecSystem):
    """hybridrec with the dense part under bfloat16 autocast (`train.precision: bf16`)."""

    name = "hybridrec_bf16"
    precision = "bf16"


class PipelinedHybridrec(HybridrecSystem):
    """hybridrec as the pipelined local step runs it: `training_step_runner` takes each batch's
    rows from a `LocalPipeline` over this system (which serves as its placement: `look_ahead`,
    `apply_ahead`, `pool_ahead`), whose thread looks the next batch up and applies the updates."""

    name = "hybridrec_pipelined"

    def look_ahead(self, features):
        return self.collection.look_ahead(features)

    def apply_ahead(self, looked) -> bool:
        return self.collection.apply_ahead(looked)

    def pool_ahead(self, looked, previous) -> tuple[int, int]:
        return self.collection.pool_ahead(looked, previous), looked.unique_rows


def build_parser() -> argparse.ArgumentParser:
    parser = benchmark_parser("hybridrec bench e2e",
                              "End-to-end training samples/s of DLRM and a wide model with hybridrec, "
                              "torch.nn.EmbeddingBag and TorchRec embeddings under the same dense model, "
                              "and of that model alone (dense_only).", E2E_NAMES, allowed=E2E_NAMES)
    parser.add_argument("--num-dense", type=positive_int, default=13,
                        help="continuous features per sample (default 13)")
    parser.add_argument("--threads", type=positive_int, default=1,
                        help="threads every system gets (torch intra-op and numba; default 1); with 2 or "
                             "more hybridrec runs the pipelined local step")
    parser.add_argument("--wide-fields", type=non_negative_int, default=208,
                        help="one-hot fields of the wide model (default 208; 0 skips it)")
    parser.add_argument("--wide-capacity", type=positive_int, default=50_000,
                        help="rows per table of the wide model for every system (default 50000)")
    return parser


def build_dlrm(shape: WorkloadShape, num_dense: int) -> torch.nn.Module:
    """The DLRM every system trains, with weights fixed by the workload seed."""
    torch.manual_seed(shape.seed)
    return build_model("dlrm", num_sparse=shape.fields, embedding_dim=shape.dim,
                       num_dense=num_dense, bottom_mlp=(BOTTOM_HIDDEN, shape.dim),
                       top_mlp=TOP_MLP)


class WideModel(torch.nn.Module):
    """An MLP 512-256-1 on the concatenated embeddings and dense features."""

    def __init__(self, fields: int, dim: int, num_dense: int) -> None:
        super().__init__()
        self.mlp = MLP(fields * dim + num_dense, WIDE_MLP, 0.0)
        self.out = torch.nn.Linear(self.mlp.out_dim, 1)

    def forward(self, deep: torch.Tensor, wide, dense: torch.Tensor) -> torch.Tensor:
        return self.out(self.mlp(torch.cat([deep.flatten(1), dense], dim=1)))


def build_wide(shape: WorkloadShape, num_dense: int) -> torch.nn.Module:
    torch.manual_seed(shape.seed)
    return WideModel(shape.fields, shape.dim, num_dense)


def _precision(system) -> contextlib.AbstractContextManager:
    if getattr(system, "precision", "fp32") == "bf16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def training_step_runner(system: EmbeddingSystem, sparse: list[SparseBatch],
                         dense: list[DenseBatch], shape: WorkloadShape,
                         num_dense: int, build: Callable = build_dlrm, plan: TimingPlan | None = None,
                         pipelines: list | None = None) -> Callable[[int], None]:
    """`run(i)`: one training step on batch i, embeddings from `system` (each system gets its own
    copy of the model, built with the same seed). A `PipelinedHybridrec` gets its rows from a
    `LocalPipeline` (appended to `pipelines`, for the caller to close), drained at the end of
    each timed repetition of `plan` so that a repetition's time holds its own updates."""
    prepared = [system.prepare(batch) for batch in sparse]  # untimed input conversion
    features = [torch.from_numpy(batch.dense) for batch in dense]
    labels = [torch.from_numpy(batch.labels) for batch in dense]
    model = build(shape, num_dense)
    dense_optimizer = torch.optim.Adagrad(model.parameters(), lr=ADAGRAD_LR, eps=ADAGRAD_EPS)
    loss_function = torch.nn.BCEWithLogitsLoss()

    if not isinstance(system, PipelinedHybridrec):
        def train_step(index: int) -> None:
            with _precision(system):
                logits = model(system.pooled(prepared[index]), None, features[index]).float()
            loss = loss_function(logits, labels[index])
            dense_optimizer.zero_grad(set_to_none=True)
            loss.backward()
            dense_optimizer.step()
            system.step()

        return train_step

    from hybridrec.train.local_pipeline import LocalPipeline

    stream = LocalPipeline(system, prepared)
    if pipelines is not None:
        pipelines.append(stream)
    ready_batches = iter(stream)
    warmup, batches = (plan.warmup, plan.batches) if plan is not None else (0, 1)

    def pipelined_step(index: int) -> None:
        ready = next(ready_batches)
        if ready.index != index:
            raise RuntimeError(f"the pipeline holds batch {ready.index}, the bench asked for {index}")
        logits = model(system.collection.attach(ready.looked), None, features[index])
        loss = loss_function(logits, labels[index])
        dense_optimizer.zero_grad(set_to_none=True)
        loss.backward()
        stream.push(ready, {})  # the update runs on the pipeline's thread beside the dense step
        dense_optimizer.step()
        if index >= warmup and (index - warmup + 1) % batches == 0:
            stream.drain()

    return pipelined_step


def set_threads(threads: int) -> None:
    """torch intra-op and numba threads of this (the training) thread."""
    torch.set_num_threads(threads)
    try:
        import numba

        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    except (ImportError, ValueError):
        pass


def system_classes() -> dict[str, Callable[[WorkloadShape], EmbeddingSystem]]:
    """Every system of this bench, in report order."""
    classes = {**SYSTEM_CLASSES, "hybridrec_pipelined": PipelinedHybridrec, "hybridrec_bf16": HybridrecBf16,
               "dense_only": FixedEmbeddings}
    return {name: classes[name] for name in E2E_NAMES}


def measure_model(args: argparse.Namespace, shape: WorkloadShape, plan: TimingPlan, build: Callable,
                  names: tuple[str, ...], classes: dict, settings: dict, extra_keys: dict) -> dict:
    """Trains the model `build` makes fed by each of `names`, interleaved; the summary."""
    sparse = make_sparse_batches(shape, plan.total_batches)
    dense = make_dense_batches(shape.batch_size, args.num_dense, plan.total_batches, seed=shape.seed)
    pipelines: list = []
    try:
        results = measure_systems(
            names, shape, plan, shape.batch_size,
            lambda system: training_step_runner(system, sparse, dense, shape, args.num_dense, build, plan, pipelines),
            {name: classes[name] for name in names})
    finally:
        for stream in pipelines:
            stream.close()
    settings = {**asdict(shape), **asdict(plan), "threads": args.threads, "optimizer": "adagrad", **settings}
    summary = {**summarize(results, UNIT, tuple(classes), settings), "threads": args.threads, **extra_keys}
    if pipelines:
        f = pipelines[0].figures
        summary["pipeline"] = {"shared_row_fraction": f["shared_rows"] / max(f["unique_rows"], 1)}
    return summary


def compare(args: argparse.Namespace, shape: WorkloadShape, plan: TimingPlan) -> dict:
    """Trains the DLRM (and, unless `--wide-fields 0`, the wide model) fed by each of
    `args.systems`, interleaved, and prints and returns the summary."""
    set_threads(args.threads)
    classes = system_classes()
    names = tuple(name for name in E2E_NAMES if name in args.systems
                  and (name != "hybridrec_pipelined" or args.threads >= 2))  # it needs a thread of its own
    top_mlp_input = build_dlrm(shape, args.num_dense).interaction_dim
    summary = measure_model(args, shape, plan, build_dlrm, names, classes,
                            {"num_dense": args.num_dense, "model": "dlrm",
                             "bottom_mlp": [args.num_dense, BOTTOM_HIDDEN, shape.dim],
                             "top_mlp": [top_mlp_input, *TOP_MLP, 1]},
                            {"top_mlp_input": top_mlp_input})
    if args.wide_fields:
        wide_shape = dataclasses.replace(shape, fields=args.wide_fields, capacity=args.wide_capacity)
        summary["wide"] = measure_model(args, wide_shape, plan, build_wide, names, classes,
                                        {"num_dense": args.num_dense, "model": "wide",
                                         "mlp": [args.wide_fields * shape.dim + args.num_dense, *WIDE_MLP, 1]}, {})
    else:
        summary["wide"] = None
    if args.json:
        print_summary(summary, UNIT, tuple(classes), as_json=True, title="")
        return summary
    for label, part in (("DLRM", summary), (f"wide, {args.wide_fields} fields", summary["wide"])):
        if part is not None:
            print_summary(part, UNIT, tuple(classes), as_json=False,
                          title=f"training ({label}), {args.threads} thread(s)")
    return summary


E2E_HEADLINE = {"hybridrec / dense-only floor": "hybridrec_over_dense_only",
                "hybridrec / TorchRec": "hybridrec_over_torchrec", "hybridrec / torch": "hybridrec_over_torch",
                "TorchRec / floor": "torchrec_over_dense_only",
                "hybridrec / pipelined": "hybridrec_over_hybridrec_pipelined",
                "hybridrec / bf16": "hybridrec_over_hybridrec_bf16", "bf16 / dense-only floor": "hybridrec_bf16_over_dense_only"}


def headline(report: dict) -> dict:
    """The figures of the results table: the paired ratios measured, for DLRM and the wide model."""
    return {**pick(report, E2E_HEADLINE, "DLRM "), **pick(report["wide"], E2E_HEADLINE, "wide ")}


def main(argv: list[str] | None = None) -> dict:
    args, shape, plan = parse_benchmark_arguments(build_parser(), argv)
    return compare(args, shape, plan)
