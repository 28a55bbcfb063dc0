"""The disciplines the staleness lab emulates, and their bounds, as data.

Staleness bounds count steps of every worker (one step = one batch of each worker; a round of
lockstep training):

* `sync`: every read sees every earlier update; the dense step averages the W gradients. DES is
  synchronous and trains the one-process model, so it is this row.
* `hybrid` (Persia): an embedding read may miss the updates of the last `tau` steps of every
  worker, its own included; the dense part synchronous, as sync's.
* `async`: embeddings as hybrid; each worker's dense gradient is computed on a copy that may miss
  the dense updates of the last `tau_dense` steps of every worker, and applied on its own, one by
  one, to the central copy (the PS's dense store).
* `het`: HET's caches with per-embedding clock bound `s` (hybridrec.het); dense synchronous.
* `ssp`: iteration bound `s`: no worker starts iteration c before every worker finished c - s;
  a read at iteration c (embeddings and dense, the whole model as in SSP) sees every update of
  every iteration before c - s. Workers run at different speeds (schedule.next_worker).
* `ht` (Hierarchical Training): `groups` dense copies, each stepped by its members in a Hogwild
  interleaving and pulled toward a centre by elastic averaging (`alpha`) every `period` writes;
  embeddings bounded by `tau` as in hybrid. `easgd` is ht with one worker per group.

`parse("hybrid:tau=4")` reads a discipline from the command line.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hybridrec.errors import UserError

NAMES = ("sync", "hybrid", "async", "het", "ssp", "ht", "easgd")
LOCKSTEP = ("sync", "hybrid", "het")  # the dense part averaged over the workers every step
# the parameters each discipline takes on the command line (the bound's name first)
PARAMETERS = {"sync": (), "hybrid": ("tau",), "async": ("tau", "tau_dense"), "het": ("s",), "ssp": ("s",),
              "ht": ("groups", "tau", "alpha", "period"), "easgd": ("tau", "alpha", "period")}


@dataclass(frozen=True)
class Discipline:
    name: str
    bound: int = 0  # tau (hybrid, async, ht, easgd) or s (het, ssp); 0 for sync
    tau_dense: int = 1  # async: steps of every worker the dense copy may miss
    groups: int | None = None  # ht: dense copies (the workers divide among them); easgd: one per worker
    alpha: float = 0.1  # ht, easgd: elastic averaging rate
    period: int = 4  # ht, easgd: writes of a copy between two elastic syncs

    def __post_init__(self) -> None:
        if self.name not in NAMES:
            raise UserError(f"discipline {self.name!r}; allowed: {', '.join(NAMES)}")
        for field, low in (("bound", 0), ("tau_dense", 0), ("period", 1)):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise UserError(f"discipline {self.name}: {field} {value!r}; allowed: an int >= {low}")
        if self.name == "sync" and self.bound:
            raise UserError(f"discipline sync: bound {self.bound}; sync reads every earlier update (bound 0)")
        if not 0.0 < self.alpha <= 1.0:
            raise UserError(f"discipline {self.name}: alpha {self.alpha!r}; allowed: 0 < alpha <= 1")
        if self.groups is not None and (not isinstance(self.groups, int) or self.groups < 1):
            raise UserError(f"discipline {self.name}: groups {self.groups!r}; allowed: an int >= 1")

    @property
    def lockstep(self) -> bool:
        return self.name in LOCKSTEP

    def copies(self, workers: int) -> int:
        """ht and easgd: the dense copies (groups) for `workers` workers."""
        return workers if self.name == "easgd" or self.groups is None else self.groups

    def check(self, workers: int) -> None:
        """UserError when the discipline cannot run with `workers` workers."""
        if not isinstance(workers, int) or workers < 1:
            raise UserError(f"workers {workers!r}; allowed: an int >= 1")
        if self.name == "ht":
            groups = self.copies(workers)
            if groups > workers or workers % groups:
                raise UserError(f"discipline ht: groups {groups} do not divide {workers} workers into groups of "
                                f"equal size; allowed: a divisor of {workers}")

    @property
    def bound_name(self) -> str:
        return "s" if self.name in ("het", "ssp") else "tau"

    def label(self, workers: int | None = None) -> str:
        if self.name == "sync":
            return "sync"
        text = f"{self.name} {self.bound_name}={self.bound}"
        if self.name == "async":
            text += f" tau_dense={self.tau_dense}"
        if self.name == "ht":
            text += f" G={self.groups if self.groups is not None else 'W'}"
        return text

    def record(self) -> dict:
        return {"discipline": self.name, self.bound_name: self.bound,
                **({"tau_dense": self.tau_dense} if self.name == "async" else {}),
                **({"groups": self.groups, "alpha": self.alpha, "period": self.period}
                   if self.name in ("ht", "easgd") else {})}


def parse(spec: str, **defaults) -> Discipline:
    """`name[:key=value,...]`, e.g. `hybrid:tau=4`, `ht:groups=2,tau=4`, `het:s=16`; `defaults`
    fill the parameters the spec leaves out (tau, s, tau_dense, groups, alpha, period)."""
    name, _, rest = spec.strip().partition(":")
    if name not in NAMES:
        raise UserError(f"discipline {spec!r}: unknown name {name!r}; allowed: {', '.join(NAMES)}")
    allowed = PARAMETERS[name]
    values = {key: value for key, value in defaults.items() if key in allowed and value is not None}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or key not in allowed:
            raise UserError(f"discipline {spec!r}: {item!r}; {name} takes "
                            f"{', '.join(k + '=...' for k in allowed) or 'no parameters'}")
        try:
            values[key] = float(value) if key == "alpha" else int(value)
        except ValueError:
            raise UserError(f"discipline {spec!r}: {key}={value!r} is not a number") from None
    bound = values.pop("s", values.pop("tau", 0))
    fields = {f.name for f in dataclasses.fields(Discipline)}
    return Discipline(name, bound=bound, **{k: v for k, v in values.items() if k in fields})
