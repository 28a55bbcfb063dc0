"""The strategy matrix as data: the axes a training strategy is made of, the values each axis
offers (with the module that implements it), the presets named after the papers, and the
combinations that cannot work.

This module is a leaf: the config validates `strategy` against it at load time, and the
`hybridrec.strategy` package builds each axis's implementation from the module named here.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass


@dataclass(frozen=True)
class AxisValue:
    module: str | None  # implementing module under hybridrec.strategy; None: not built yet
    summary: str
    issue: int | None = None  # the issue that builds it, while module is None
    servers: tuple[str, ...] = ()  # placement: the server roles (strategy.roles keys) it runs besides trainers


# axis -> value -> implementation. Codecs are the wire formats of hybridrec.comm.codec.
AXES: dict[str, dict[str, AxisValue]] = {
    "placement": {
        "local": AxisValue("placement.local", "in-process stores, one fused native call per phase"),
        "ps": AxisValue("placement.ps", "remote PS shards, through embedding workers or (none given) directly",
                        servers=("ps_servers", "embedding_workers")),
        "sharded": AxisValue("placement.sharded", "every trainer owns a shard of every table; AllToAll (PICASSO)"),
        "field_sharded": AxisValue("placement.field_sharded", "fields split among trainers, each holding its "
                                   "fields' tables; every trainer reads every row (DES)"),
    },
    "consistency": {
        "sync": AxisValue("consistency.sync", "a lookup sees every earlier update (staleness 0)"),
        "bounded": AxisValue("consistency.bounded", "at most strategy.tau updates in flight (Persia's hybrid)"),
        "het": AxisValue("consistency.het", "a cache per trainer with a per-embedding clock bound s and stale "
                         "writes (HET; strategy.het)"),
        "asp": AxisValue("consistency.asp", "no cache, no waiting: lookups never wait for any update "
                         "(strategy.asp.read_ahead batches looked up ahead)"),
        "ssp": AxisValue("consistency.ssp", "worker clocks: no trainer more than strategy.ssp.staleness "
                         "iterations ahead of the slowest one's acknowledged updates (classic SSP)"),
        "hot_cold": AxisValue("consistency.hot_cold", "sync, with HybridHash: the hottest rows copied to every "
                              "trainer, their gradients AllReduced (PICASSO)"),
    },
    "dense": {
        "allreduce": AxisValue("dense.allreduce", "DDP AllReduce of dense gradients (plain with one trainer)"),
        "ps_async": AxisValue("dense.ps_async", "dense parameters on the PS, pushed and pulled without barriers"),
        "easgd": AxisValue("dense.easgd", "a replica per trainer, elastic averaging with a centre on the PS (HT's baseline)"),
        "groups": AxisValue("dense.groups", "a Hogwild copy per group of trainers, elastic averaging between groups (HT)"),
        "des": AxisValue("dense.des", "distributed equivalent substitution of the first layers: one AllReduce "
                     "of partial results, replicated upper layers (DES)"),
    },
    "id_codec": {
        "none": AxisValue("comm.codec", "ID features as they are"),
        "unique": AxisValue("comm.codec", "unique IDs + uint16 positions; the trainer pools unique rows"),
    },
    "value_codec": {
        "none": AxisValue("comm.codec", "float32 rows and gradients"),
        "fp16": AxisValue("comm.codec", "fp16 with per-block L-infinity scaling"),
        "bf16": AxisValue("comm.codec", "bfloat16 rounded to nearest even, no scale (HT §4.2)"),
    },
}

# preset -> the axis values it expands to; None: the paper is not built yet (issue in PRESET_ISSUES)
PRESETS: dict[str, dict[str, str] | None] = {
    "local": {"placement": "local", "consistency": "sync", "dense": "allreduce",
              "id_codec": "none", "value_codec": "none"},
    "persia": {"placement": "ps", "consistency": "bounded", "dense": "allreduce",
               "id_codec": "unique", "value_codec": "none"},
    "het": {"placement": "ps", "consistency": "het", "dense": "allreduce",
            "id_codec": "none", "value_codec": "none"},
    "picasso": {"placement": "sharded", "consistency": "hot_cold", "dense": "allreduce",
                "id_codec": "none", "value_codec": "none"},
    "des": {"placement": "field_sharded", "consistency": "sync", "dense": "des",
            "id_codec": "none", "value_codec": "none"},
    "ht": {"placement": "ps", "consistency": "bounded", "dense": "groups",
           "id_codec": "unique", "value_codec": "none"},
}
PRESET_ISSUES: dict[str, int] = {}  # preset -> the issue that builds it, while PRESETS holds None
DEFAULT_PRESET = "local"


class AxisError(ValueError):
    """A preset, axis value or combination that cannot run; the message says why."""


def _hint(value: str, choices) -> str:
    close = difflib.get_close_matches(str(value), list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def check_value(axis: str, value: str) -> None:
    """AxisError when `value` is not a built value of `axis`."""
    values = AXES[axis]
    if value not in values:
        raise AxisError(f"strategy.{axis}: unknown value {value!r}{_hint(value, values)}; "
                        f"allowed: {sorted(n for n, v in values.items() if v.module)}")
    if values[value].module is None:
        raise AxisError(f"strategy.{axis}: {value!r} ({values[value].summary}) is not built yet "
                        f"(issue #{values[value].issue})")


def resolve(preset: str | None, chosen: dict[str, str | None]) -> dict[str, str]:
    """The axis values of `preset` (default: local) with those in `chosen` (not None) overriding;
    AxisError for an unknown or unbuilt preset or value, or a combination that cannot work."""
    name = DEFAULT_PRESET if preset is None else preset
    if name not in PRESETS:
        raise AxisError(f"strategy.preset: unknown preset {name!r}{_hint(name, PRESETS)}; "
                        f"allowed: {sorted(p for p, v in PRESETS.items() if v)}")
    if PRESETS[name] is None:
        raise AxisError(f"strategy.preset: {name!r} is not built yet (issue #{PRESET_ISSUES[name]}); "
                        f"built: {sorted(p for p, v in PRESETS.items() if v)}")
    axes = dict(PRESETS[name])
    for axis, value in chosen.items():
        if value is not None:
            check_value(axis, value)
            axes[axis] = value
    reason = impossible(axes)
    if reason:
        raise AxisError(f"placement={axes['placement']}, consistency={axes['consistency']}, "
                        f"dense={axes['dense']} cannot work: {reason}")
    return axes


def impossible(axes: dict[str, str]) -> str | None:
    """Why this combination of axis values cannot run, or None."""
    placement, consistency, dense = axes["placement"], axes["consistency"], axes["dense"]
    if dense in ("easgd", "groups") and placement != "ps":
        return f"{dense} keeps the centre copy of the dense parameters on PS servers; allowed with placement ps"
    if consistency == "hot_cold" and placement != "sharded":
        return ("hot_cold keeps a copy of the hottest rows on every trainer beside the owners' shards, which the "
                "sharded placement holds; allowed with placement sharded")
    if placement == "sharded":
        if consistency not in ("sync", "hot_cold"):
            return f"{consistency} lets lookups run ahead of updates; the sharded placement's AllToAll is synchronous"
        if dense != "allreduce":
            return f"the sharded placement trains the dense part data-parallel (allreduce), not {dense}"
        if axes["id_codec"] != "none" or axes["value_codec"] != "none":
            return "the sharded placement sends keys and float32 rows between trainers; the wire codecs are not used"
    if placement == "local":
        if dense == "ps_async":
            return "ps_async keeps the dense parameters on the PS servers, and the local placement has none"
        if consistency != "sync":
            return (f"{consistency} overlaps lookups with training in background threads, which needs a remote "
                    "placement (ps); the local step looks up inside autograd")
        if axes["id_codec"] != "none" or axes["value_codec"] != "none":
            return "wire codecs need a remote placement: the local placement sends nothing over a wire"
    if (placement == "field_sharded") != (dense == "des"):
        return ("DES needs both: the field_sharded placement gives each trainer its fields' tables and the des "
                "dense sync computes the first layers from them (strategy.preset: des)")
    if placement == "field_sharded":
        if consistency != "sync":
            return "DES is fully synchronous (consistency sync): its lookups run inside autograd, like the local one's"
        if axes["id_codec"] != "none" or axes["value_codec"] != "none":
            return ("the field_sharded placement sends no IDs or rows over a wire (only the partial results of "
                    "the first layers), so the wire codecs do not apply")
    return None


def server_roles(axes: dict[str, str]) -> tuple[str, ...]:
    """The server roles (keys of strategy.roles) the placement runs besides its trainers; a
    placement whose trainers hold the tables themselves runs none."""
    return AXES["placement"][axes["placement"]].servers


def is_distributed(axes: dict[str, str]) -> bool:
    """Whether the strategy runs as several processes (PS servers, trainers under torchrun)."""
    return axes["placement"] != "local"
