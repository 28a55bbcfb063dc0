"""Dense parameters kept on a PS shard, for the fully asynchronous discipline.

When NN workers do not AllReduce, every worker pushes its dense gradients to the PS and pulls
the current values back. A `DenseStore` holds named float32 tensors and one torch optimizer
(adam, adagrad or sgd with lr and weight_decay) per tensor; every init, pull, push, save and
load runs under one lock, so concurrent requests see whole steps. The first value given for a
name wins (every worker initialises the same model; only one initialisation may count). Only
the parameters the store was declared with (the job's dense model: names and shapes) may be
initialised or loaded, so no client can make it hold more than that model.

A checkpoint is a directory with `meta.json` (optimizer, version, names, state keys),
`params.npz` and `state.npz` (the optimizer state of each tensor, keyed by position).
"""

from __future__ import annotations

import json
import math
import threading
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import torch

from hybridrec.embedding.dir_handle import open_directory

OPTIMIZERS = {"adam": torch.optim.Adam, "adagrad": torch.optim.Adagrad, "sgd": torch.optim.SGD}
META_FILE, PARAMS_FILE, STATE_FILE = "meta.json", "params.npz", "state.npz"


def check_optimizer(optimizer: Any) -> dict[str, Any]:
    """{"name", "lr", "weight_decay"} checked and completed (weight_decay defaults to 0)."""
    if not isinstance(optimizer, Mapping):
        raise ValueError(f"optimizer must be a dict with 'name' and 'lr', got {optimizer!r}")
    unknown = sorted(set(optimizer) - {"name", "lr", "weight_decay"})
    if unknown:
        raise ValueError(f"optimizer has unknown keys {unknown}; allowed: name, lr, weight_decay")
    name = optimizer.get("name")
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer 'name' must be one of {sorted(OPTIMIZERS)}, got {name!r}")
    lr, decay = optimizer.get("lr"), optimizer.get("weight_decay", 0.0)
    for key, value in (("lr", lr), ("weight_decay", decay)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or value < 0 or (key == "lr" and value == 0):
            allowed = "a number > 0" if key == "lr" else "a number >= 0"
            raise ValueError(f"optimizer {key!r} must be {allowed}, got {value!r}")
    return {"name": name, "lr": float(lr), "weight_decay": float(decay)}


def check_tensors(arrays: Mapping[str, Any], what: str) -> dict[str, np.ndarray]:
    """Named finite float32 numpy arrays, or a ValueError/TypeError naming the first bad one."""
    if not isinstance(arrays, Mapping):
        raise TypeError(f"{what} must be a dict of name -> float32 array, got {type(arrays).__name__}")
    checked = {}
    for name, array in arrays.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"{what} names must be non-empty strings, got {name!r}")
        if not isinstance(array, np.ndarray) or array.dtype != np.float32:
            raise TypeError(f"{what}[{name!r}] must be a float32 numpy array, got "
                            f"{type(array).__name__} {getattr(array, 'dtype', '')}")
        if not np.isfinite(array).all():
            raise ValueError(f"{what}[{name!r}] holds NaN or inf; nothing was applied")
        checked[name] = array
    return checked


def _some(names: Iterable[str], most: int = 8) -> str:
    names = sorted(names)
    return str(names[:most])[:-1] + (f", ... ({len(names)} in all)]" if len(names) > most else "]")


class DenseStore:
    """Named float32 tensors, each with its own torch optimizer, behind one lock.

    `declared`: name -> shape of every parameter the store may hold (none by default)."""

    def __init__(self, declared: Mapping[str, Sequence[int]] | None = None) -> None:
        self.declared = {name: tuple(int(n) for n in shape) for name, shape in (declared or {}).items()}
        self._lock = threading.Lock()
        self._params: dict[str, torch.Tensor] = {}
        self._optimizers: dict[str, torch.optim.Optimizer] = {}
        self.optimizer: dict[str, Any] | None = None  # set by the first init
        self.version = 0  # pushes applied

    def __len__(self) -> int:
        return len(self._params)

    def shapes(self) -> dict[str, list[int]]:
        with self._lock:
            return {name: list(p.shape) for name, p in self._params.items()}

    def check_declared(self, shapes: Mapping[str, Sequence[int]], what: str) -> None:
        """ValueError unless every name of `shapes` is declared with that shape."""
        undeclared = [name for name in shapes if name not in self.declared]
        if undeclared:
            known = (f"its {len(self.declared)} params are {_some(self.declared)}" if self.declared else
                     "this server declares none (it is started with the job's --config for that)")
            raise ValueError(f"{what} {_some(undeclared)} are not parameters of this job's dense model; {known}")
        wrong = {name: (list(shape), list(self.declared[name])) for name, shape in shapes.items()
                 if tuple(shape) != self.declared[name]}
        if wrong:
            raise ValueError(f"{what} {_some(wrong)} do not have the shapes of this job's dense model "
                             f"(given, declared): {dict(list(wrong.items())[:8])}")

    def _add(self, name: str, value: np.ndarray) -> None:
        param = torch.nn.Parameter(torch.tensor(value, dtype=torch.float32), requires_grad=True)
        config = self.optimizer
        self._params[name] = param
        self._optimizers[name] = OPTIMIZERS[config["name"]]([param], lr=config["lr"],
                                                            weight_decay=config["weight_decay"])

    def init(self, values: Mapping[str, np.ndarray], optimizer: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """Add the names not held yet (the first value wins); returns the current values of `values`' names.

        The optimizer is fixed by the first init; a later init must name the same one.
        """
        values = check_tensors(values, "params")
        config = check_optimizer(optimizer)
        self.check_declared({name: value.shape for name, value in values.items()}, "params")
        with self._lock:
            if self.optimizer is not None and config != self.optimizer:
                raise ValueError(f"optimizer {config} differs from the one the dense store was "
                                 f"initialised with, {self.optimizer}")
            self.optimizer = config
            for name, value in values.items():
                if name not in self._params:
                    self._add(name, value)
            return self._values(values)

    def _values(self, names: Iterable[str]) -> dict[str, np.ndarray]:
        missing = [n for n in names if n not in self._params]
        if missing:
            raise ValueError(f"dense params {missing} are not initialised; held: {sorted(self._params)}")
        return {n: self._params[n].detach().numpy().copy() for n in names}

    def pull(self, names: Iterable[str]) -> dict[str, np.ndarray]:
        """Copies of the current values of `names` (each once, however often it is named)."""
        return self.snapshot(names)[0]

    def snapshot(self, names: Iterable[str]) -> tuple[dict[str, np.ndarray], int]:
        """`pull(names)` and the number of pushes those values hold, read together."""
        names = list(dict.fromkeys(names))
        with self._lock:
            return self._values(names), self.version

    def push(self, grads: Mapping[str, np.ndarray]) -> int:
        """One optimizer step on each named tensor; returns the number of pushes applied so far.

        Every gradient is checked (known name, same shape, finite) before any tensor changes.
        """
        grads = check_tensors(grads, "grads")
        with self._lock:
            self._values(grads)  # every name is held
            wrong = {n: (list(g.shape), list(self._params[n].shape)) for n, g in grads.items()
                     if tuple(g.shape) != tuple(self._params[n].shape)}
            if wrong:
                raise ValueError(f"grads {sorted(wrong)} do not have their param's shape (given, held): {wrong}")
            for name, grad in grads.items():
                self._params[name].grad = torch.tensor(grad, dtype=torch.float32)
                self._optimizers[name].step()
                self._params[name].grad = None
            self.version += 1
            return self.version

    # ---------------------------------------------------------------- checkpoints
    def save(self, directory) -> None:
        """Write params and optimizer state under `directory` (a path, or an `Entry` of an open
        directory: then nothing is written through a symlink); nothing when the store is empty."""
        with self._lock:
            if not self._params:  # an older checkpoint's dense params there no longer count
                try:
                    with open_directory(directory) as handle:
                        handle.remove(META_FILE)
                except (FileNotFoundError, NotADirectoryError):
                    pass
                return
            names = list(self._params)
            params, state, state_keys = {}, {}, []
            for i, name in enumerate(names):
                params[str(i)] = self._params[name].detach().numpy()
                tensors = self._optimizers[name].state_dict()["state"].get(0, {})
                keys = sorted(k for k, v in tensors.items() if isinstance(v, torch.Tensor))
                state.update({f"{i}.{k}": tensors[k].numpy() for k in keys})
                state_keys.append(keys)
            meta = {"optimizer": self.optimizer, "version": self.version, "names": names,
                    "state_keys": state_keys}
            with open_directory(directory, create=True) as handle:
                handle.remove(META_FILE)  # written last: marks a whole checkpoint
                for file_name, arrays in ((PARAMS_FILE, params), (STATE_FILE, state)):
                    with handle.open_file(file_name, "wb") as file:
                        np.savez(file, **arrays)
                handle.write_durably(META_FILE, json.dumps(meta).encode())

    @classmethod
    def load(cls, directory, declared: Mapping[str, Sequence[int]] | None = None) -> "DenseStore":
        """The store `save(directory)` wrote; an empty store when `directory` holds none. Each
        saved parameter must be one of `declared` (name -> shape), with its shape."""
        store = cls(declared)
        try:
            handle = open_directory(directory)
        except (FileNotFoundError, NotADirectoryError):
            return store
        with handle:
            if not handle.is_file(META_FILE):
                return store
            try:
                meta = json.loads(handle.read_bytes(META_FILE))
                store.optimizer = check_optimizer(meta["optimizer"])
                store.version = int(meta["version"])
                with handle.open_file(PARAMS_FILE) as params_file, handle.open_file(STATE_FILE) as state_file, \
                        np.load(params_file) as params, np.load(state_file) as state:
                    names = [str(name) for name in meta["names"]]
                    store.check_declared({name: params[str(i)].shape for i, name in enumerate(names)},
                                         "saved params")
                    for i, (name, keys) in enumerate(zip(names, meta["state_keys"], strict=True)):
                        store._add(name, params[str(i)].astype(np.float32))
                        if keys:
                            optimizer = store._optimizers[name]
                            saved = optimizer.state_dict()
                            saved["state"] = {0: {k: torch.from_numpy(state[f"{i}.{k}"].copy()) for k in keys}}
                            optimizer.load_state_dict(saved)
            except (OSError, KeyError, ValueError, TypeError) as error:
                raise ValueError(f"dense checkpoint {str(directory)!r} is unreadable: "
                                 f"{type(error).__name__}: {error}") from None
        return store
