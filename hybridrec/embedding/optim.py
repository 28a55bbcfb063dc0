"""Sparse optimizer descriptions for the embedding store.

An `OptimizerConfig` says which fused update the store applies to a row and with which
hyper-parameters. The numbers are packed into a small float64 vector that the numba update
kernel (`kernels.apply_updates`) reads; the optimizer state lives in the row itself, right after
the embedding (Persia: `[embedding | optimizer state]`).

Semantics follow torch.optim where a sparse equivalent exists:
- sgd: torch.optim.SGD (momentum buffers are lazy: only rows present in a step decay);
- adagrad: torch.optim.Adagrad (elementwise accumulator, lr_decay, initial_accumulator_value);
- adam: torch.optim.SparseAdam (lazy moments, one global step count for bias correction);
- ftrl: FTRL-Proximal (McMahan et al. 2013), per-coordinate z and n.
weight_decay is L2 added to the gradient, as torch does; FTRL also has its own l1/l2.
"""
from __future__ import annotations

import dataclasses
import difflib
import math

import numpy as np

OPT_SGD, OPT_ADAGRAD, OPT_ADAM, OPT_FTRL = 0, 1, 2, 3
_CODES = {"sgd": OPT_SGD, "adagrad": OPT_ADAGRAD, "adam": OPT_ADAM, "ftrl": OPT_FTRL}

# Hyper-parameters each optimizer accepts, with defaults (torch's where torch has the optimizer).
_DEFAULTS = {
    "sgd": {"lr": 0.01, "momentum": 0.0, "nesterov": False},
    "adagrad": {"lr": 0.01, "eps": 1e-10, "lr_decay": 0.0, "initial_accumulator_value": 0.0},
    "adam": {"lr": 0.001, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8},
    "ftrl": {"lr": 0.05, "l1": 0.0, "l2": 0.0, "beta": 1.0},
}

# Slots of the packed parameter vector read by the kernel.
P_LR, P_A, P_B, P_C, P_D = 0, 1, 2, 3, 4
NUM_PARAMS = 8


def _closest(name, choices):
    close = difflib.get_close_matches(str(name), list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """A sparse optimizer by name plus its hyper-parameters.

    >>> OptimizerConfig("adagrad", lr=0.05)
    """

    name: str = "adagrad"
    lr: float | None = None
    params: dict = dataclasses.field(default_factory=dict)

    def __init__(self, name: str = "adagrad", lr: float | None = None, **params):
        if name not in _CODES:
            raise ValueError(f"optimizer: unknown name {name!r}; allowed: {sorted(_CODES)}{_closest(name, _CODES)}")
        allowed = _DEFAULTS[name]
        for key in params:
            if key == "lr" or key not in allowed:
                raise ValueError(
                    f"optimizer {name!r}: unknown parameter {key!r}; allowed: {sorted(allowed)}{_closest(key, allowed)}"
                )
        merged = {k: v for k, v in allowed.items() if k != "lr"}
        merged.update(params)
        lr = allowed["lr"] if lr is None else lr
        if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
            raise ValueError(f"optimizer {name!r}: lr must be a finite number > 0, got {lr!r}")
        for key, value in merged.items():
            if isinstance(allowed[key], bool):
                if not isinstance(value, bool):
                    raise ValueError(f"optimizer {name!r}: {key} must be true or false, got {value!r}")
            elif not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"optimizer {name!r}: {key} must be a finite number >= 0, got {value!r}")
        if name == "adam":
            for key in ("beta1", "beta2"):
                if not merged[key] < 1:
                    raise ValueError(f"optimizer 'adam': {key} must be in [0, 1), got {merged[key]!r}")
        if name == "sgd" and merged["nesterov"] and merged["momentum"] <= 0:
            raise ValueError("optimizer 'sgd': nesterov=True needs momentum > 0")
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "lr", float(lr))
        object.__setattr__(self, "params", merged)

    @classmethod
    def parse(cls, spec) -> "OptimizerConfig":
        """Accept an OptimizerConfig, a name, or a dict {"name": ..., "lr": ..., ...}."""
        if isinstance(spec, OptimizerConfig):
            return spec
        if isinstance(spec, str):
            return cls(spec)
        if isinstance(spec, dict):
            spec = dict(spec)
            return cls(spec.pop("name", "adagrad"), **spec)
        raise TypeError(f"optimizer: expected a name, a dict or an OptimizerConfig, got {type(spec).__name__}")

    @property
    def code(self) -> int:
        return _CODES[self.name]

    def state_width(self, dim: int) -> int:
        """Number of float32 optimizer-state values stored per row."""
        if self.name == "sgd":
            return dim if self.params["momentum"] > 0 else 0
        if self.name == "adagrad":
            return dim
        return 2 * dim  # adam (m, v) and ftrl (z, n)

    def state_init(self) -> float:
        """Initial value of every state slot of a new row."""
        return float(self.params["initial_accumulator_value"]) if self.name == "adagrad" else 0.0

    def packed(self) -> np.ndarray:
        """The float64 parameter vector the update kernel reads."""
        p = np.zeros(NUM_PARAMS, dtype=np.float64)
        p[P_LR] = self.lr
        q = self.params
        if self.name == "sgd":
            p[P_A], p[P_B] = q["momentum"], float(q["nesterov"])
        elif self.name == "adagrad":
            p[P_A], p[P_B] = q["eps"], q["lr_decay"]
        elif self.name == "adam":
            p[P_A], p[P_B], p[P_C] = q["beta1"], q["beta2"], q["eps"]
        else:
            p[P_A], p[P_B], p[P_C] = q["l1"], q["l2"], q["beta"]
        return p

    def to_dict(self) -> dict:
        return {"name": self.name, "lr": self.lr, **self.params}
