"""Dense models and losses of the user's own, named by an import path in the config.

A TorchRec user writes the part above the embedding tables as an `nn.Module` that takes the
dense features and the pooled embeddings (TorchRec's `KeyedTensor`) and returns logits. hybridrec
keeps the tables (every strategy's placement looks rows up and applies their gradients); the
module is the dense model:

    model:
      name: mypkg.ranking:OverArch      # or path/to/file.py:OverArch; called as OverArch(inputs, **hparams)
      hparams: {hidden: [64, 32]}
      embedding_dim: 16
      loss: mypkg.ranking:focal_loss    # loss(logits [B, T], labels [B, T]) -> scalar; default: bce

The factory (a class or a function) is called with `ModelInputs` (the sparse feature names, the
embedding dim, the dense feature and task counts) and `model.hparams` as keyword arguments; the
module's `forward(dense [B, n_dense], sparse: PooledEmbeddings) -> logits [B, T] (or [B] for one
task)`. `PooledEmbeddings` answers what a `KeyedTensor` answers (`keys()`, `values()` [B, F*D],
`to_dict()`, `["feature"]` [B, D], `length_per_key()`, `offset_per_key()`) and `stacked()`
[B, F, D]. `CustomModel` wraps the module in the contract every strategy calls
(`hybridrec.models.base`), so checkpoints, resume, evaluation and export handle it as any model.

Every process of a job builds the model from the config, so the import path must import there
(the package on PYTHONPATH, or a file path). `object` is the name of a model handed to
`hybridrec.api` as an `nn.Module` instance, which only that Python process can build.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor, nn

from hybridrec.errors import UserError
from hybridrec.models.base import CTRModel

OBJECT = "object"  # model.name of an nn.Module instance given in Python (hybridrec.api)
BCE = "bce"  # model.loss: binary cross-entropy on the logits, what the built-in models train with
_PATH = re.compile(r"^(?P<module>[^:]+):(?P<attr>[A-Za-z_]\w*(\.[A-Za-z_]\w*)*)$")
_KNOWN: dict[str, Any] = {}  # import path -> the object this process already holds under it


class ImportPathError(UserError):
    """An import path in the config that does not name an importable object."""


@dataclass(frozen=True)
class ModelInputs:
    """What a custom model's factory is told about its inputs (all from the config)."""

    feature_names: tuple[str, ...]  # the sparse features, in the order of `PooledEmbeddings.keys()`
    embedding_dim: int
    num_dense: int
    num_tasks: int = 1

    @property
    def num_sparse(self) -> int:
        return len(self.feature_names)

    @property
    def pooled_width(self) -> int:
        """Columns of `PooledEmbeddings.values()`: num_sparse * embedding_dim."""
        return self.num_sparse * self.embedding_dim


class PooledEmbeddings:
    """One pooled embedding per sparse feature, as TorchRec's `KeyedTensor` gives them: features
    `keys()`, each `embedding_dim` wide; `values()` is [B, F*D], feature f's columns at
    `offset_per_key()[f]`."""

    def __init__(self, keys: tuple[str, ...], stacked: Tensor):
        self._keys = keys
        self._stacked = stacked  # [B, F, D]

    def keys(self) -> list[str]:
        return list(self._keys)

    def values(self) -> Tensor:
        return self._stacked.flatten(1)

    def stacked(self) -> Tensor:
        """[B, F, D]: feature f's pooled embedding at [:, f]."""
        return self._stacked

    def key_dim(self) -> int:
        return 1

    def length_per_key(self) -> list[int]:
        return [self._stacked.shape[2]] * len(self._keys)

    def offset_per_key(self) -> list[int]:
        dim = self._stacked.shape[2]
        return [dim * f for f in range(len(self._keys) + 1)]

    def to_dict(self) -> dict[str, Tensor]:
        return {key: self._stacked[:, f] for f, key in enumerate(self._keys)}

    def __getitem__(self, key: str) -> Tensor:
        try:
            return self._stacked[:, self._keys.index(key)]
        except ValueError:
            raise KeyError(f"{key!r} is not a sparse feature; the features are {list(self._keys)}") from None

    def __repr__(self) -> str:
        return f"PooledEmbeddings(keys={list(self._keys)}, shape={list(self._stacked.shape)})"


def is_custom(name: str) -> bool:
    """Whether model.name names a model of the user's (an import path, or `object`)."""
    return name == OBJECT or is_import_path(name)


def is_import_path(name: str) -> bool:
    return isinstance(name, str) and ":" in name


def remember(path: str, obj: Any) -> None:
    """Let `resolve(path)` answer `obj` in this process without importing (hybridrec.api records
    the import path of a class it was handed, which may be the running script itself)."""
    _KNOWN[path] = obj


def resolve(path: str, key: str = "model.name") -> Any:
    """The object an import path names: `package.module:attr` (imported as Python imports it) or
    `path/to/file.py:attr` (the file loaded as a module of its own); ImportPathError naming `key`."""
    if path in _KNOWN:
        return _KNOWN[path]
    match = _PATH.match(path) if isinstance(path, str) else None
    if match is None:
        raise ImportPathError(f"{key}: {path!r} is not an import path; write 'package.module:name' or "
                              f"'path/to/file.py:name'")
    module_name, attr = match.group("module"), match.group("attr")
    try:
        module = _load_file(Path(module_name)) if module_name.endswith(".py") else importlib.import_module(module_name)
    except ImportPathError:
        raise
    except Exception as exc:  # the user's module failed to import: say which and why, in one line
        raise ImportPathError(f"{key}: cannot import {module_name!r} for {path!r}: {type(exc).__name__}: {exc} "
                              f"(every process of the job imports it: put its package on PYTHONPATH, or give "
                              f"a file path, 'path/to/file.py:{attr}')") from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ImportPathError(f"{key}: {module_name!r} has no {attr!r} (import path {path!r})")
        obj = getattr(obj, part)
    return obj


def _load_file(path: Path):
    """A Python file as a module named after its absolute path (loaded once per process)."""
    path = path.resolve()
    if not path.is_file():
        raise ImportPathError(f"model: file {str(path)!r} of an import path does not exist")
    name = f"hybridrec_user_{path.stem}_{hashlib.blake2b(str(path).encode(), digest_size=4).hexdigest()}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def factory_hparams(path: str) -> dict[str, Any] | None:
    """The keyword arguments a factory accepts beyond its inputs, with their defaults (None: any,
    it takes **kwargs)."""
    factory = resolve(path)
    if not callable(factory):
        raise ImportPathError(f"model.name: {path!r} is a {type(factory).__name__}, not a class or function that "
                              f"makes the model")
    try:
        parameters = list(inspect.signature(factory).parameters.values())
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    return {p.name: p.default for p in parameters[1:]
            if p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)}


class CustomModel(CTRModel):
    """A module of the user's as a hybridrec dense model: (deep, wide, dense) -> module(dense,
    PooledEmbeddings) -> logits [B, num_tasks]. Its parameters are the module's, under `net.`."""

    needs_deep = True
    needs_wide = False

    def __init__(self, inputs: ModelInputs, module: nn.Module, name: str = OBJECT):
        super().__init__(max(inputs.num_sparse, 1), inputs.embedding_dim, inputs.num_dense, inputs.num_tasks)
        if not isinstance(module, nn.Module):
            raise UserError(f"model.name: {name!r} made a {type(module).__name__}, not a torch.nn.Module")
        self.inputs = inputs
        self.name = name
        self.net = module

    def forward(self, deep: Tensor, wide: Tensor | None, dense: Tensor | None) -> Tensor:
        dense = self.check_inputs(deep, None, dense)
        logits = self.net(dense, PooledEmbeddings(self.inputs.feature_names, deep))
        if not isinstance(logits, Tensor):
            raise UserError(f"model {self.name!r}: forward returned a {type(logits).__name__}; it must return "
                            f"the logits as a tensor [B, {self.num_tasks}]")
        if logits.dim() == 1 and self.num_tasks == 1:
            logits = logits.unsqueeze(1)
        if tuple(logits.shape) != (deep.shape[0], self.num_tasks):
            raise UserError(f"model {self.name!r}: forward returned shape {list(logits.shape)}; it must return "
                            f"logits [B, num_tasks] = [{deep.shape[0]}, {self.num_tasks}] (or [B] for one task)")
        return logits

    def extra_repr(self) -> str:
        return f"name={self.name!r}, features={self.inputs.num_sparse}, dim={self.inputs.embedding_dim}"


def build_custom_model(name: str, inputs: ModelInputs, hparams: dict, module: nn.Module | None = None) -> CustomModel:
    """The dense model of a config whose model.name is an import path (its factory called with
    `inputs` and `hparams`), or of `module` itself (model.name `object`)."""
    if module is not None:
        return CustomModel(inputs, module, name)
    if name == OBJECT:
        raise UserError("model.name: object is a model handed to hybridrec.api as an nn.Module instance, and this "
                        "process has none: build it from an import path instead (model.name: "
                        "'package.module:Factory' or 'path/to/file.py:Factory', called as Factory(inputs, "
                        "**model.hparams); docs/python-api.md)")
    factory = resolve(name)
    try:
        made = factory(inputs, **hparams)
    except TypeError as exc:
        raise UserError(f"model.name: {name!r} could not be called as {name.rpartition(':')[2]}(inputs, "
                        f"**model.hparams) with hparams {sorted(hparams)}: {exc}") from None
    return CustomModel(inputs, made, name)


def resolve_loss(name: str) -> Callable[[Tensor, Tensor], Tensor]:
    """model.loss as a callable loss(logits, labels) -> scalar: `bce`, or an import path to a
    function or to an nn.Module class (made with no arguments)."""
    if name == BCE:
        return nn.BCEWithLogitsLoss()
    if name == OBJECT:
        raise UserError("model.loss: object is a loss handed to hybridrec.api as a Python object, and this process "
                        "has none: name it by an import path instead (model.loss: 'package.module:loss' or "
                        "'path/to/file.py:loss'; docs/python-api.md)")
    loss = resolve(name, key="model.loss")
    if isinstance(loss, type):
        loss = loss()
    if not callable(loss):
        raise ImportPathError(f"model.loss: {name!r} is a {type(loss).__name__}, not a callable "
                              f"loss(logits, labels) -> scalar tensor")
    return loss


def check_loss_value(value: Any, name: str) -> Tensor:
    """The loss a custom loss returned, checked to be a scalar tensor that has a gradient."""
    if not isinstance(value, Tensor) or value.numel() != 1:
        shown = f"shape {list(value.shape)}" if isinstance(value, Tensor) else type(value).__name__
        raise UserError(f"model.loss {name!r} returned {shown}; it must return one number as a tensor "
                        f"(e.g. a mean over the batch)")
    return value.reshape(())


def torch_loss(loss: Callable, name: str) -> Callable[[Tensor, Tensor], Tensor]:
    """`loss` with its result checked (`check_loss_value`)."""
    def checked(logits: Tensor, labels: Tensor) -> Tensor:
        return check_loss_value(loss(logits, labels), name)

    return checked
