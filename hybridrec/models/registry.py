"""Build a model by name, and list each model's hyper-parameters for config validation.

    build_model("dlrm", num_sparse=26, embedding_dim=16, num_dense=13, top_mlp=[512, 256])
    model_hparams("dcn")  # {"cross_layers": 3, "structure": "parallel", ...}

The hyper-parameters are read from the model constructors' keyword-only arguments (plus
the `TaskHead` options for models that forward them), so the constructor signatures are
the one place where names and defaults are written down; `HPARAM_HELP` says what each one
does (`hybridrec models` prints both). A bad value given to `build_model` is a `UserError`
naming the config key, e.g. `model.hparams.hidden`.
"""

from __future__ import annotations

import difflib
import inspect
import re
from typing import Any

from hybridrec.errors import UserError

from hybridrec.models.base import CTRModel
from hybridrec.models.custom import OBJECT, CustomModel, factory_hparams, is_custom, is_import_path
from hybridrec.models.dcn import DCN
from hybridrec.models.deepfm import DeepFM
from hybridrec.models.dlrm import DLRM
from hybridrec.models.fm import FactorizationMachine
from hybridrec.models.lr import LogisticRegression
from hybridrec.models.multitask import TaskHead
from hybridrec.models.wide_deep import WideAndDeep

MODELS: dict[str, type[CTRModel]] = {
    "lr": LogisticRegression,
    "fm": FactorizationMachine,
    "wide_deep": WideAndDeep,
    "deepfm": DeepFM,
    "dcn": DCN,
    "dlrm": DLRM,
}

# Arguments of TaskHead that the model sets itself rather than taking from the user.
_HEAD_ARGS_SET_BY_MODEL = {"dropout"}

# What each hyper-parameter does (every model's hyper-parameters must have an entry).
HPARAM_HELP = {
    "hidden": "sizes of the deep MLP's ReLU layers (DCN: may be empty for a cross-only model)",
    "dropout": "dropout probability after every hidden layer, in [0, 1)",
    "cross_layers": "number of full-rank cross layers (DCN-v2)",
    "structure": "'parallel' (cross network beside the MLP) or 'stacked' (MLP on the cross network)",
    "bottom_mlp": "layer sizes of the MLP on the dense features; the last must equal model.embedding_dim "
                  "(null: [64, embedding_dim])",
    "top_mlp": "layer sizes of the MLP on the interactions",
    "multitask": "output head: 'shared_bottom' (one tower per task) or 'mmoe' (experts mixed by per-task gates)",
    "tower_hidden": "layer sizes of each task's tower before its logit (empty: one linear layer)",
    "num_experts": "mmoe: number of expert MLPs",
    "expert_hidden": "mmoe: layer sizes of each expert MLP",
}


class HyperParameterError(UserError):
    """A hyper-parameter value a model refuses; the message starts with `model.hparams.<name>`."""


def _keyword_defaults(function: Any) -> dict[str, Any]:
    parameters = inspect.signature(function).parameters.values()
    return {p.name: p.default for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY}


def _did_you_mean(value: str, allowed: list[str]) -> str:
    close = difflib.get_close_matches(value, allowed, n=1)
    return f"did you mean {close[0]!r}? " if close else ""


def model_class(name: str) -> type[CTRModel]:
    """The model class registered under `name` (`CustomModel` for a model of the user's: an import
    path or `object`); ValueError naming the closest name otherwise."""
    if is_custom(name):
        return CustomModel
    if not isinstance(name, str) or name not in MODELS:
        names = sorted(MODELS)
        hint = _did_you_mean(name, names) if isinstance(name, str) else ""
        raise ValueError(f"unknown model name {name!r}; {hint}valid names: {names}")
    return MODELS[name]


def model_hparams(name: str) -> dict[str, Any] | None:
    """Every hyper-parameter model `name` accepts, mapped to its default value; for a model of the
    user's, its factory's keyword arguments (None: any, the factory takes **kwargs)."""
    if is_import_path(name):
        return factory_hparams(name)
    if name == OBJECT:
        return {}
    cls = model_class(name)
    hparams = _keyword_defaults(cls.__init__)
    takes_head_options = any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(cls.__init__).parameters.values()
    )
    if takes_head_options:
        head_defaults = _keyword_defaults(TaskHead.__init__)
        hparams.update({k: v for k, v in head_defaults.items() if k not in _HEAD_ARGS_SET_BY_MODEL})
    return hparams


def build_model(
    name: str, num_sparse: int, embedding_dim: int, num_dense: int, num_tasks: int = 1, **hparams: Any
) -> CTRModel:
    """Construct model `name`; unknown hyper-parameters raise ValueError naming the closest valid one."""
    accepted = model_hparams(name)
    for key in hparams:
        if key not in accepted:
            hint = _did_you_mean(key, list(accepted))
            raise ValueError(
                f"unknown hyper-parameter {key!r} for model {name!r}; {hint}"
                f"accepted: {sorted(accepted) if accepted else 'none (this model has no hyper-parameters)'}"
            )
    try:
        return model_class(name)(num_sparse, embedding_dim, num_dense, num_tasks, **hparams)
    except (TypeError, ValueError) as exc:
        key = re.match(r"(\w+) ", str(exc))
        if key is None or key.group(1) not in accepted or isinstance(exc, UserError):
            raise
        # keep the original class too (TypeError or ValueError) for callers that catch it
        error_type = type("HyperParameterError", (HyperParameterError, type(exc)), {})
        raise error_type(f"model.hparams.{exc}") from None


def describe_models() -> str:
    """Every model with its hyper-parameters, their defaults and what they do (what
    `hybridrec models` prints)."""
    lines = []
    for name, cls in MODELS.items():
        lines.append(f"{name}: {(cls.__doc__ or '').strip().splitlines()[0]}")
        hparams = model_hparams(name)
        if not hparams:
            lines.append("  (no hyper-parameters)")
        for key, default in hparams.items():
            shown = list(default) if isinstance(default, tuple) else default
            lines.append(f"  {key} = {shown!r}: {HPARAM_HELP[key]}")
    return "\n".join(lines)
