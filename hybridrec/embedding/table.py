"""Per-table settings of an embedding store, validated once and packed for the kernels.

`TableConfig` holds everything that decides how one table behaves: dimension, capacity,
optimizer, initialiser, eviction and admission policies, weight bound and decay, pooling, and
threads. Every bad value is refused here with the parameter's name, the value and what is
allowed, so that nothing fails later inside a kernel.
"""
from __future__ import annotations

import dataclasses
import difflib
import math

import numpy as np

from . import kernels as K
from .optim import OptimizerConfig

POOLING_MODES = {"sum": 0, "mean": 1, "sqrtn": 2}
EVICTION_POLICIES = {"lru": K.POLICY_LRU, "lfu": K.POLICY_LFU}
INIT_KINDS = {"uniform": K.INIT_UNIFORM, "normal": K.INIT_NORMAL, "zeros": K.INIT_ZEROS}
_INIT_PARAMS = {"uniform": ("low", "high"), "normal": ("mean", "std", "bound"), "zeros": ()}
_INIT_DEFAULTS = {"low": -0.05, "high": 0.05, "mean": 0.0, "std": 0.02, "bound": 0.04}
MAX_CAPACITY = 2**31 - 2  # rows are addressed by int32


def closest_hint(name, choices) -> str:
    """' (did you mean X?)' for the closest valid choice, or ''."""
    close = difflib.get_close_matches(str(name), [str(c) for c in choices], n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _choice(param, value, allowed):
    if value not in allowed:
        raise ValueError(f"{param}: {value!r} is not allowed; choose one of {sorted(allowed)}{closest_hint(value, allowed)}")
    return value


def _number(param, value, low=None, high=None, low_open=False):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{param}: must be a finite number, got {value!r}")
    if low is not None and (value <= low if low_open else value < low):
        raise ValueError(f"{param}: must be {'>' if low_open else '>='} {low}, got {value!r}")
    if high is not None and value > high:
        raise ValueError(f"{param}: must be <= {high}, got {value!r}")
    return value


def _integer(param, value, low, high):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not low <= value <= high:
        raise ValueError(f"{param}: must be an integer in [{low}, {high}], got {value!r}")
    return int(value)


def parse_init(spec) -> dict:
    """Accept 'uniform' / 'normal' / 'zeros' or a dict {kind: ..., low/high | mean/std/bound}."""
    spec = {"kind": spec} if isinstance(spec, str) else dict(spec)
    kind = _choice("init.kind", spec.pop("kind", "uniform"), INIT_KINDS)
    allowed = _INIT_PARAMS[kind]
    for key in spec:
        if key not in allowed:
            raise ValueError(f"init ({kind}): unknown parameter {key!r}; allowed: {list(allowed)}{closest_hint(key, allowed)}")
    out = {"kind": kind, **{k: float(_number(f"init.{k}", spec.get(k, _INIT_DEFAULTS[k]))) for k in allowed}}
    if kind == "uniform" and not out["low"] < out["high"]:
        raise ValueError(f"init (uniform): low must be < high, got low={out['low']}, high={out['high']}")
    if kind == "normal":
        if out["std"] <= 0 or out["bound"] <= 0:
            raise ValueError(f"init (normal): std and bound must be > 0, got std={out['std']}, bound={out['bound']}")
    return out


def parse_expire_after(spec) -> dict | None:
    """None, or {"steps": N} / {"seconds": S}: how long a row may go unseen before it is dropped."""
    if spec is None:
        return None
    if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in ("steps", "seconds"):
        raise ValueError(f"expire_after: must be {{steps: N}} or {{seconds: S}} (how long a row may go unseen by "
                         f"training before it is dropped), or null; got {spec!r}")
    (unit, value), = spec.items()
    if unit == "steps":
        return {"steps": _integer("expire_after.steps", value, 1, 2**62)}
    return {"seconds": float(_number("expire_after.seconds", value, 0.0, low_open=True))}


def parse_tier(spec) -> dict | None:
    """None, or {"path": directory, "capacity_rows": N}: the disk tier under the table's memory
    (disk_tier.py), which keeps up to N rows evicted from memory in files under `path`."""
    if spec is None:
        return None
    if not isinstance(spec, dict) or set(spec) != {"path", "capacity_rows"}:
        raise ValueError(f"tier: must be {{path: DIR, capacity_rows: N}} (a directory of its own for this table's "
                         f"rows evicted from memory, and how many it may hold), or null; got {spec!r}")
    path = spec["path"]
    if not isinstance(path, str) or not path.strip():
        raise ValueError(f"tier.path: must be a non-empty directory path, got {path!r}")
    return {"path": path, "capacity_rows": _integer("tier.capacity_rows", spec["capacity_rows"], 1, 2**40)}


@dataclasses.dataclass(frozen=True)
class TableConfig:
    """How one embedding table stores, initialises and updates its rows."""

    dim: int
    capacity: int
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    init: dict = dataclasses.field(default_factory=lambda: parse_init("uniform"))
    seed: int = 0
    eviction: str = "lru"
    admit_probability: float = 1.0
    admit_min_frequency: int = 1
    weight_bound: float | None = None
    weight_decay: float = 0.0
    pooling: str = "sum"
    num_threads: int = 1
    prefault: bool = False  # commit the rows' memory at creation instead of at each page's first use
    expire_after: dict | None = None  # {"steps": N} or {"seconds": S} unseen by training: `EmbeddingStore.expire`
    tier: dict | None = None  # {"path": DIR, "capacity_rows": N}: rows evicted from memory go to disk (disk_tier.py)

    def __post_init__(self):
        _integer("dim", self.dim, 1, 65536)
        _integer("capacity", self.capacity, 1, MAX_CAPACITY)
        object.__setattr__(self, "optimizer", OptimizerConfig.parse(self.optimizer))
        object.__setattr__(self, "init", parse_init(self.init))
        _integer("seed", self.seed, 0, 2**63 - 1)
        _choice("eviction", self.eviction, EVICTION_POLICIES)
        _number("admit_probability", self.admit_probability, 0.0, 1.0, low_open=True)
        _integer("admit_min_frequency", self.admit_min_frequency, 1, 65535)
        if self.weight_bound is not None:
            _number("weight_bound", self.weight_bound, 0.0, low_open=True)
        _number("weight_decay", self.weight_decay, 0.0)
        _choice("pooling", self.pooling, POOLING_MODES)
        _integer("num_threads", self.num_threads, 1, 256)
        if not isinstance(self.prefault, bool):
            raise ValueError(f"prefault: must be true or false, got {self.prefault!r}")
        object.__setattr__(self, "expire_after", parse_expire_after(self.expire_after))
        object.__setattr__(self, "tier", parse_tier(self.tier))
        if self.num_threads > self.capacity:
            raise ValueError(f"num_threads: {self.num_threads} is more than capacity {self.capacity}")

    @classmethod
    def from_dict(cls, d: dict) -> "TableConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        for key in d:
            if key not in names:
                raise ValueError(f"table config: unknown key {key!r}{closest_hint(key, names)}; allowed: {sorted(names)}")
        return cls(**d)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["optimizer"] = self.optimizer.to_dict()
        d["init"] = dict(self.init)
        if d["expire_after"] is None:  # absent, as in checkpoints of releases before expiry
            del d["expire_after"]
        if d["tier"] is None:
            del d["tier"]
        return d

    # --------------------------------------------------------------- layout and kernel packing
    @property
    def state_width(self) -> int:
        return self.optimizer.state_width(self.dim)

    @property
    def row_width(self) -> int:
        """float32 values per row: embedding then optimizer state (metadata lives apart)."""
        return self.dim + self.state_width

    def kernel_config(self, nparts: int):
        icfg = np.zeros(K.ICFG_WIDTH, dtype=np.int64)
        icfg[K.IC_DIM] = self.dim
        icfg[K.IC_STATE] = self.state_width
        icfg[K.IC_META] = 0  # metadata columns start at 0 of the separate meta array
        icfg[K.IC_POLICY] = EVICTION_POLICIES[self.eviction]
        icfg[K.IC_MIN_FREQ] = self.admit_min_frequency
        icfg[K.IC_INIT_KIND] = INIT_KINDS[self.init["kind"]]
        icfg[K.IC_NPARTS] = nparts
        icfg[K.IC_ROW_BITS] = max(1, (self.capacity - 1).bit_length())  # index entries: tag | row
        fcfg = np.zeros(K.FCFG_WIDTH, dtype=np.float64)
        fcfg[K.FC_ADMIT_PROB] = self.admit_probability
        init = self.init
        if init["kind"] == "uniform":
            fcfg[K.FC_INIT_A], fcfg[K.FC_INIT_B] = init["low"], init["high"]
        elif init["kind"] == "normal":
            fcfg[K.FC_INIT_A], fcfg[K.FC_INIT_B], fcfg[K.FC_INIT_BOUND] = init["mean"], init["std"], init["bound"]
        fcfg[K.FC_STATE_INIT] = self.optimizer.state_init()
        fcfg[K.FC_WEIGHT_DECAY] = self.weight_decay
        fcfg[K.FC_WEIGHT_BOUND] = np.inf if self.weight_bound is None else self.weight_bound
        return icfg, fcfg
