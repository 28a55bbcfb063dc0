"""The embedding systems the benchmarks compare, behind one small interface, and the
harness that builds them, warms them up and times them side by side.

* `hybridrec`: one `hybridrec.embedding.EmbeddingStore` per field through
  `EmbeddingCollection`, raw uint64 keys, Adagrad fused into backward, `prefault` on (its
  memory committed at creation, as the peers' dense tables are by their initialisation).
* `torch`: `torch.nn.EmbeddingBag(sparse=True)` per field + `torch.optim.Adagrad`, fed keys
  pre-mapped to [0, n_distinct) (a perfect dictionary: no hashing, no collisions).
* `torchrec`: TorchRec `FusedEmbeddingBagCollection` (FBGEMM table-batched kernels, EXACT
  Adagrad fused into backward, CPU), fed the same pre-mapped ids. Imported lazily; any
  failure to import, build or warm it up is reported instead of raised.

Every system turns a `SparseBatch` into its own input once, untimed (`prepare`), then gives
pooled embeddings `[B, F, D]` inside autograd (`pooled`) and applies its sparse update after
backward (`step`, a no-op for the fused ones). All use the same Adagrad learning rate and eps.
"""
from __future__ import annotations

import argparse
import gc
from dataclasses import asdict
from typing import Any, Callable, Protocol

import numpy as np
import torch

from hybridrec.benchmarks.timing import (SystemResult, TimingPlan, add_timing_arguments,
                                         measure_interleaved, print_summary, single_thread,
                                         summarize, warm_up)
from hybridrec.benchmarks.workload import SparseBatch, WorkloadShape, add_workload_arguments

ADAGRAD_LR = 0.05
ADAGRAD_EPS = 1e-8
SYSTEM_NAMES = ("hybridrec", "torch", "torchrec")


class EmbeddingSystem(Protocol):
    name: str

    def prepare(self, batch: SparseBatch) -> Any: ...

    def pooled(self, prepared: Any) -> torch.Tensor: ...

    def step(self) -> None: ...

    def bytes_per_row(self) -> float: ...


class SystemBase:
    """Defaults shared by the systems: the update is fused into backward (nothing to do in
    `step`) and a row holds a float32 weight vector plus a float32 Adagrad accumulator."""

    name = ""

    def __init__(self, shape: WorkloadShape) -> None:
        self.shape = shape

    def step(self) -> None:
        pass

    def bytes_per_row(self) -> float:
        return 2 * self.shape.dim * 4.0


class TorchEmbeddingBagSystem(SystemBase):
    """One `torch.nn.EmbeddingBag(mode="sum", sparse=True)` per field + sparse Adagrad."""

    name = "torch"

    def __init__(self, shape: WorkloadShape) -> None:
        super().__init__(shape)
        self.bags = torch.nn.ModuleList(
            torch.nn.EmbeddingBag(shape.capacity, shape.dim, mode="sum", sparse=True)
            for _ in range(shape.fields))
        self.optimizer = torch.optim.Adagrad(self.bags.parameters(), lr=ADAGRAD_LR,
                                             eps=ADAGRAD_EPS)

    def prepare(self, batch: SparseBatch) -> torch.Tensor:
        return torch.from_numpy(batch.dense_ids).unsqueeze(-1)  # [F, B, 1]: one-ID bags

    def pooled(self, prepared: torch.Tensor) -> torch.Tensor:
        return torch.stack([bag(prepared[field]) for field, bag in enumerate(self.bags)],
                           dim=1)

    def step(self) -> None:
        # torch's default, said explicitly: sparse Adagrad builds sparse tensors, and left implicit
        # torch warns about unchecked invariants on every run
        with torch.sparse.check_sparse_tensor_invariants(enable=False):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


class TorchRecSystem(SystemBase):
    """TorchRec `FusedEmbeddingBagCollection` on CPU, one table per field, fused Adagrad."""

    name = "torchrec"

    def __init__(self, shape: WorkloadShape) -> None:
        from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
        from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        super().__init__(shape)
        self._keyed_jagged_tensor = KeyedJaggedTensor
        tables = [
            EmbeddingBagConfig(name=f"table_{name}", embedding_dim=shape.dim,
                               num_embeddings=shape.capacity, feature_names=[name],
                               pooling=PoolingType.SUM)
            for name in shape.feature_names]
        self.collection = FusedEmbeddingBagCollection(
            tables=tables, optimizer_type=torch.optim.Adagrad,
            optimizer_kwargs={"lr": ADAGRAD_LR, "eps": ADAGRAD_EPS},
            device=torch.device("cpu"))
        self._lengths = torch.ones(shape.lookups_per_batch, dtype=torch.int32)

    def prepare(self, batch: SparseBatch) -> Any:
        return self._keyed_jagged_tensor(
            keys=self.shape.feature_names,
            values=torch.from_numpy(batch.dense_ids.reshape(-1)),
            lengths=self._lengths)

    def pooled(self, prepared: Any) -> torch.Tensor:
        keyed = self.collection(prepared)  # KeyedTensor: values() is [B, F*D] in key order
        return keyed.values().view(self.shape.batch_size, self.shape.fields, self.shape.dim)


class HybridrecSystem(SystemBase):
    """hybridrec `EmbeddingCollection`: one `EmbeddingStore` per field, fused Adagrad."""

    name = "hybridrec"

    def __init__(self, shape: WorkloadShape) -> None:
        from hybridrec.data.batch import JaggedFeatures
        from hybridrec.embedding import EmbeddingCollection, OptimizerConfig, TableConfig

        super().__init__(shape)
        self._jagged_features = JaggedFeatures
        adagrad = OptimizerConfig("adagrad", lr=ADAGRAD_LR, eps=ADAGRAD_EPS)
        tables = {f"table_{name}": TableConfig(dim=shape.dim, capacity=shape.capacity,
                                               optimizer=adagrad, num_threads=1, prefault=True)
                  for name in shape.feature_names}
        self.collection = EmbeddingCollection(
            tables, {name: f"table_{name}" for name in shape.feature_names})
        self._offsets = np.arange(shape.lookups_per_batch + 1, dtype=np.int64)

    def prepare(self, batch: SparseBatch) -> Any:
        return self._jagged_features(self.shape.feature_names, batch.keys.reshape(-1),
                                     self._offsets)

    def pooled(self, prepared: Any) -> torch.Tensor:
        return self.collection.forward_stacked(prepared)  # [B, F, D] in feature order

    def bytes_per_row(self) -> float:
        store = self.collection.stores[f"table_{self.shape.feature_names[0]}"]
        return float(store.stats()["bytes_per_row"])


SYSTEM_CLASSES: dict[str, Callable[[WorkloadShape], EmbeddingSystem]] = {
    "hybridrec": HybridrecSystem,
    "torch": TorchEmbeddingBagSystem,
    "torchrec": TorchRecSystem,
}


def parse_system_names(text: str, allowed: tuple[str, ...] = SYSTEM_NAMES) -> tuple[str, ...]:
    """Comma-separated subset of `allowed`, e.g. "torch,torchrec"."""
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in allowed]
    if not names or unknown:
        raise ValueError(f"systems must be a comma-separated subset of {list(allowed)}, "
                         f"got {text!r}")
    return names


def benchmark_parser(prog: str, description: str,
                     systems: tuple[str, ...] = SYSTEM_NAMES,
                     allowed: tuple[str, ...] = SYSTEM_NAMES) -> argparse.ArgumentParser:
    """A parser with the options every benchmark shares: workload, timing, --systems (a subset of
    `allowed`, default `systems`), --json."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_workload_arguments(parser)
    add_timing_arguments(parser, warmup=5, batches=10, repeats=5)
    add_system_arguments(parser, systems, allowed)
    return parser


def add_system_arguments(parser: argparse.ArgumentParser, default: tuple[str, ...] = SYSTEM_NAMES,
                         allowed: tuple[str, ...] = SYSTEM_NAMES) -> None:
    """Adds --systems, a comma-separated subset of `allowed` (default `default`)."""

    def system_names(text: str) -> tuple[str, ...]:
        try:
            return parse_system_names(text, allowed)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    parser.add_argument("--systems", type=system_names, default=default,
                        help="comma-separated systems to measure, of " + ",".join(allowed)
                             + " (default " + ",".join(default) + ")")


def _unavailable(name: str, error: Exception) -> SystemResult:
    """Turns an optional system's failure into a result, or re-raises a hybridrec bug.

    TorchRec is optional: any failure to import, build or warm it up is reported. hybridrec is
    reported as unavailable only when its modules cannot be imported; its other errors
    propagate, since hiding them would hide our own bugs.
    """
    if name == "torchrec" or isinstance(error, ImportError):
        return SystemResult(name, error=f"{type(error).__name__}: {error}")
    raise error


def measure_systems(names: tuple[str, ...], shape: WorkloadShape, plan: TimingPlan,
                    items_per_batch: int,
                    make_runner: Callable[[EmbeddingSystem], Callable[[int], None]],
                    classes: dict[str, Callable[[WorkloadShape], EmbeddingSystem]] | None = None,
                    ) -> list[SystemResult]:
    """Builds the named systems (from `classes`, by default hybridrec and the peers), warms
    each up with `make_runner(system)`, then times them interleaved (`measure_interleaved`).
    All tables are alive at once (about 2 x 1.7 GB per peer at the default 26 x 1M x 16) so
    every repetition compares the systems under the same machine load."""
    classes = SYSTEM_CLASSES if classes is None else classes
    failed: dict[str, SystemResult] = {}
    systems: dict[str, EmbeddingSystem] = {}
    runners: dict[str, Callable[[int], None]] = {}
    for name in names:
        try:
            systems[name] = classes[name](shape)
            runners[name] = make_runner(systems[name])
            warm_up(runners[name], plan)
        except Exception as error:  # noqa: BLE001 - filtered by _unavailable
            failed[name] = _unavailable(name, error)
            systems.pop(name, None)
            runners.pop(name, None)
            gc.collect()
    throughputs = measure_interleaved(runners, plan, items_per_batch)
    return [failed[name] if name in failed else
            SystemResult(name, throughputs[name], systems[name].bytes_per_row())
            for name in names]


def compare_systems(args: argparse.Namespace, shape: WorkloadShape, plan: TimingPlan, *,
                    unit: str, items_per_batch: int,
                    make_runner: Callable[[EmbeddingSystem], Callable[[int], None]],
                    settings: dict, title: str, extra_keys: dict | None = None,
                    classes: dict[str, Callable[[WorkloadShape], EmbeddingSystem]] | None = None,
                    ) -> dict:
    """The common tail of every benchmark: one thread, measure `args.systems`, then print
    and return the summary (see `timing.summarize`) with `extra_keys` added at top level.
    `classes` replaces the systems compared (default hybridrec and the peers, SYSTEM_NAMES);
    their names, in order, are the report's."""
    single_thread()
    all_names = SYSTEM_NAMES if classes is None else tuple(classes)
    results = measure_systems(args.systems, shape, plan, items_per_batch, make_runner, classes)
    settings = {**asdict(shape), **asdict(plan), "threads": 1, "optimizer": "adagrad",
                **settings}
    summary = {**summarize(results, unit, all_names, settings), **(extra_keys or {})}
    print_summary(summary, unit, all_names, as_json=args.json, title=title)
    return summary
