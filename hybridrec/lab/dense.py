"""The dense part of the emulated workers under each discipline, on the real optimizers and stores:

* `AveragedDense` (sync, hybrid, HET): one model; every worker's gradient of a round is computed
  on it, the gradients are averaged (DDP's AllReduce) and the job's dense optimizer takes one step
  (hybridrec.strategy.dense.dense_optimizer, as the allreduce dense sync builds it).
* `CentralDense` (async, SSP): the dense parameters in a `DenseStore` (hybridrec.ps.dense, the PS's
  own), which applies each worker's gradient on its own, one by one, with the job's optimizer. A
  worker computes on the version the schedule lets it read, so every version the bound allows is
  kept until no read can ask for it.
* `ReplayedDense` (a recorded async job): the dense parameters split as the job's PS shards held
  them, one `DenseStore` per shard, each applying the pushes in the order that shard applied them
  (hybridrec.lab.trace.DensePlan); a step computes on the versions its pull read, and its
  gradient waits until each shard's turn to apply it comes.
* `GroupCopies` (Hierarchical Training; EASGD is one worker per group): one dense copy per group,
  every member stepping it with an optimizer state of its own (Hogwild: a member's gradient is
  computed on the copy as it was at its read, and applied to the copy as it is at its write), and
  each copy pulled toward a centre in a `DenseStore` by `ElasticSync.sync_once`
  (hybridrec.hierarchical.elastic_averaging) every `period` writes of the copy; the result is the
  centre, after each copy's last sync.
"""
from __future__ import annotations

import copy

import numpy as np
import torch

from hybridrec.hierarchical.elastic_averaging import CENTRE_OPTIMIZER, ElasticSync
from hybridrec.metrics import StalenessHistogram
from hybridrec.ps.client import dense_shard
from hybridrec.ps.dense import DenseStore
from hybridrec.strategy.dense import dense_optimizer


def gradients(model: torch.nn.Module) -> dict[str, np.ndarray]:
    """Each parameter's gradient as float32 numpy (zeros where backward did not reach it)."""
    return {name: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().numpy().copy()
            for name, p in model.named_parameters()}


def assign(model: torch.nn.Module, values: dict[str, np.ndarray]) -> None:
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in values.items():
            params[name].copy_(torch.from_numpy(np.asarray(value)))


class AveragedDense:
    def __init__(self, model: torch.nn.Module, cfg):
        self.model = model
        self.optimizer = dense_optimizer(cfg, model.parameters())

    def begin_round(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def finish_round(self, workers: int) -> None:
        """One optimizer step on the average of the `workers` gradients accumulated since `begin_round`."""
        if workers > 1:
            with torch.no_grad():
                for p in self.model.parameters():
                    if p.grad is not None:
                        p.grad.div_(workers)
        self.optimizer.step()

    def current_model(self) -> torch.nn.Module:
        return self.model

    def final_model(self) -> torch.nn.Module:
        return self.model

    def facts(self) -> dict:
        return {}


class _InProcessDenseClient:
    """A `DenseStore` behind the calls a PS client offers for dense parameters."""

    def __init__(self, store: DenseStore):
        self.store = store

    def dense_pull(self, names):
        return self.store.pull(names)

    def dense_push(self, grads) -> None:
        self.store.push(grads)


def _declared(model: torch.nn.Module) -> dict:
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def _values(model: torch.nn.Module) -> dict[str, np.ndarray]:
    return {name: p.detach().numpy().copy() for name, p in model.named_parameters()}


class _PushedOneByOne:
    """What `CentralDense` and `ReplayedDense` share: every step's gradient is applied on its own,
    `lags` holds per step the pushes applied that its read had missed, and the result is the
    latest values (`current_model`)."""

    lags: list[int]

    def final_model(self) -> torch.nn.Module:
        return self.current_model()  # each subclass's latest values

    def facts(self) -> dict:
        """The dense staleness of every step: pushes its gradient's version had missed."""
        lags = StalenessHistogram()
        lags.add(self.lags)
        return {"dense_staleness": lags.as_dict()}


class CentralDense(_PushedOneByOne):
    """Versions 0, 1, ...: version v holds the first v pushes; `push_iteration[v]` is the
    iteration of the worker step that made version v + 1."""

    def __init__(self, model: torch.nn.Module, cfg):
        self.model = model  # the model each step computes on (loaded with the version it reads)
        opt = cfg.train.dense_optimizer
        self.store = DenseStore(_declared(model))
        self.names = [name for name, _ in model.named_parameters()]
        self.store.init(_values(model), {"name": opt.name, "lr": opt.lr, "weight_decay": opt.weight_decay})
        self.versions: dict[int, dict[str, np.ndarray]] = {0: self.store.pull(self.names)}
        self.push_iteration: list[int] = []
        self.lags: list[int] = []

    @property
    def version(self) -> int:
        return len(self.push_iteration)

    def required_version(self, before_iteration: int) -> int:
        """The first version holding every push of a step with iteration < `before_iteration`."""
        late = [v for v, it in enumerate(self.push_iteration) if it < before_iteration]
        return late[-1] + 1 if late else 0

    def begin_step(self, version: int) -> None:
        """The model holds `version`'s values, its gradients cleared (ParameterServerDense.begin_step)."""
        assign(self.model, self.versions[version])
        for p in self.model.parameters():
            p.grad = None
        self.lags.append(self.version - version)

    def finish_step(self, iteration: int, oldest_readable: int) -> None:
        """The step's gradient applied by the store; versions older than `oldest_readable` dropped."""
        self.store.push(gradients(self.model))
        self.push_iteration.append(iteration)
        self.versions[self.version] = self.store.pull(self.names)
        for v in [v for v in self.versions if v < oldest_readable]:
            del self.versions[v]

    def current_model(self) -> torch.nn.Module:
        """The model with the latest values (the next step loads the version it reads anyway)."""
        assign(self.model, self.store.pull(self.names))
        return self.model



class ReplayedDense(_PushedOneByOne):
    """`shards` stores: shard k holds the parameters a job's k-th PS shard held (hybridrec.ps's
    dense_shard), `applied[k]` pushes applied; the versions a step may still read (`keep[k]`, all
    when None) and the latest are kept; each step's gradient waits in `pending` until every shard
    applied it."""

    def __init__(self, model: torch.nn.Module, cfg, shards: int = 1, keep: list[set[int]] | None = None):
        self.model = model
        opt = cfg.train.dense_optimizer
        declared, values = _declared(model), _values(model)
        self.names = [[n for n in declared if dense_shard(n, shards) == k] for k in range(shards)]
        self.stores = []
        for names in self.names:
            store = DenseStore({n: declared[n] for n in names})
            if names:
                store.init({n: values[n] for n in names}, {"name": opt.name, "lr": opt.lr,
                                                           "weight_decay": opt.weight_decay})
            self.stores.append(store)
        self.holding = [k for k, names in enumerate(self.names) if names]  # the shards a push reaches
        self.keep = keep
        self.history = [{0: store.pull(names)} for store, names in zip(self.stores, self.names)]
        self.applied = [0] * shards
        # (worker, step) -> its gradient, the shards still to apply it, its lag so far
        self.pending: dict[tuple[int, int], tuple[dict[str, np.ndarray], set[int], list[int]]] = {}
        self.lags: list[int] = []
        self.reads: dict[tuple[int, int], tuple[int, ...]] = {}  # (worker, step) -> the versions it read
        self.pushed: list[list[tuple[int, int]]] = [[] for _ in range(shards)]  # per shard, in the order applied

    def begin_step(self, key: tuple[int, int], versions) -> None:
        """The model holds each shard's version `versions[k]` (applied already), gradients cleared."""
        for k, version in enumerate(versions):
            assign(self.model, self.history[k][version])
        for p in self.model.parameters():
            p.grad = None
        self.reads[key] = tuple(int(v) for v in versions)

    def finish_step(self, key: tuple[int, int]) -> None:
        """The step's gradient, kept until every shard applied it."""
        self.pending[key] = (gradients(self.model), set(self.holding), [0])

    def computed(self, key: tuple[int, int]) -> bool:
        return key in self.reads

    def push(self, shard: int, key: tuple[int, int]) -> None:
        """Shard `shard` applies the gradient of step `key` (its next push)."""
        grads, waiting, lag = self.pending[key]
        lag[0] = max(lag[0], self.applied[shard] - self.reads[key][shard])  # pushes applied that its read missed
        names = self.names[shard]
        self.stores[shard].push({n: grads[n] for n in names})
        self.pushed[shard].append(key)
        self.applied[shard] += 1
        done = self.applied[shard]
        history = self.history[shard]
        history[done] = self.stores[shard].pull(names)
        if self.keep is not None and done - 1 not in self.keep[shard]:
            del history[done - 1]
        waiting.discard(shard)
        if not waiting:
            del self.pending[key]
            self.lags.append(lag[0])

    def current_model(self) -> torch.nn.Module:
        """The model with every shard's latest values."""
        for store, names in zip(self.stores, self.names):
            assign(self.model, store.pull(names))
        return self.model


class GroupCopies:
    def __init__(self, model: torch.nn.Module, cfg, groups: int, members: int, alpha: float, period: int):
        self.groups, self.members, self.period = groups, members, period
        self.centre = DenseStore(_declared(model))
        self.centre.init(_values(model), CENTRE_OPTIMIZER)  # every copy starts at the centre
        self.copies = [model] + [copy.deepcopy(model) for _ in range(groups - 1)]
        # member m of group g steps copy g with an optimizer state of its own
        self.optimizers = [[dense_optimizer(cfg, self.copies[g].parameters()) for _ in range(members)]
                           for g in range(groups)]
        self.syncs = [ElasticSync(dict(c.named_parameters()), _InProcessDenseClient(self.centre), alpha, lambda: False)
                      for c in self.copies]
        self.writes = [0] * groups
        self.synced_at = [0] * groups
        self.staleness: list[int] = []  # per write: the other members' writes since its read
        self._centre_model: torch.nn.Module | None = None

    def read(self, group: int) -> tuple[torch.nn.Module, int]:
        """The copy to compute on now, gradients cleared, and its write count (the read's mark)."""
        model = self.copies[group]
        for p in model.parameters():
            p.grad = None
        return model, self.writes[group]

    def write(self, group: int, member: int, grads: dict[str, np.ndarray], mark: int) -> None:
        """Member `member`'s optimizer step with `grads` on the copy as it is now; an elastic sync
        when the copy's writes since the last one reach `period`."""
        model = self.copies[group]
        for name, p in model.named_parameters():
            p.grad = torch.from_numpy(grads[name])
        self.optimizers[group][member].step()
        for p in model.parameters():
            p.grad = None
        self.staleness.append(self.writes[group] - mark)
        self.writes[group] += 1
        if self.writes[group] - self.synced_at[group] >= self.period:
            self.synced_at[group] = self.writes[group]
            self.syncs[group].sync_once()

    def current_model(self) -> torch.nn.Module:
        """A model with the centre's values (for evaluations during the run)."""
        if self._centre_model is None:
            self._centre_model = copy.deepcopy(self.copies[0])
        assign(self._centre_model, self.centre.pull([name for name, _ in self._centre_model.named_parameters()]))
        return self._centre_model

    def facts(self) -> dict:
        """Dense copies, the Hogwild staleness of every write, and the elastic syncs."""
        staleness = StalenessHistogram()
        staleness.add(self.staleness)
        return {"dense_replicas": self.groups, "trainers_per_group": self.members,
                "dense_staleness": staleness.as_dict(), "elastic_syncs": sum(sync.syncs for sync in self.syncs)}

    def final_model(self) -> torch.nn.Module:
        """Each copy's last sync, then a model with the centre's values (what an HT job evaluates
        and saves). `trained_copies` keeps each copy's values from before those syncs."""
        self.trained_copies = [_values(c) for c in self.copies]
        for sync in self.syncs:
            sync.sync_once()
        model = copy.deepcopy(self.copies[0])
        assign(model, self.centre.pull([name for name, _ in model.named_parameters()]))
        return model

