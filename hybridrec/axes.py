"""The strategy matrix as data: the axes a training strategy is made of, the values each axis
offers (with the module that implements it), the presets named after the papers, and which
combinations cannot work.

Axis values are str-valued enums (`PlacementKind.PS == "ps"`), so configs, result files and
checkpoints keep plain strings. The values meet through typed services (`Service`): each value
declares what it offers the other axes and what it requires of them, and `impossible()` is
derived from those declarations alone: a combination cannot work when a value requires a service
that no chosen value offers, and the refusal names the service, the value that lacks it (and
why, where that helps) and the values that offer it. A placement's services are objects the
consistency and the dense sync use at run time (hybridrec.strategy.services; the strategy checks
that a placement offers what is declared here); the other services are promises a value keeps.

This module is a leaf: the config validates `strategy` against it at load time, and the
`hybridrec.strategy` package builds each axis's implementation from the module named here.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from enum import StrEnum


class _Named(StrEnum):
    """A str-valued enum shown as its string (`repr` too), so messages and printed records read as
    they did when the values were plain strings."""

    def __repr__(self) -> str:
        return repr(self.value)


class Axis(_Named):
    PLACEMENT = "placement"  # where embeddings live
    CONSISTENCY = "consistency"  # how stale a lookup may be
    DENSE = "dense"  # how the dense parameters stay in step
    ID_CODEC = "id_codec"  # what the wire carries of the IDs
    VALUE_CODEC = "value_codec"  # what the wire carries of rows and gradients


class PlacementKind(_Named):
    LOCAL = "local"
    PS = "ps"
    SHARDED = "sharded"
    FIELD_SHARDED = "field_sharded"


class ConsistencyKind(_Named):
    SYNC = "sync"
    BOUNDED = "bounded"
    HET = "het"
    ASP = "asp"
    SSP = "ssp"
    HOT_COLD = "hot_cold"


class DenseKind(_Named):
    ALLREDUCE = "allreduce"
    PS_ASYNC = "ps_async"
    EASGD = "easgd"
    GROUPS = "groups"
    DES = "des"


class IdCodec(_Named):
    NONE = "none"
    UNIQUE = "unique"


class ValueCodec(_Named):
    NONE = "none"
    FP16 = "fp16"
    BF16 = "bf16"


KINDS: dict[Axis, type[StrEnum]] = {Axis.PLACEMENT: PlacementKind, Axis.CONSISTENCY: ConsistencyKind,
                                    Axis.DENSE: DenseKind, Axis.ID_CODEC: IdCodec, Axis.VALUE_CODEC: ValueCodec}


class Service(_Named):
    """What a value of one axis offers the others."""

    # offered by a placement, used at run time through its `services` (hybridrec.strategy.services)
    PS_ENDPOINTS = "ps_endpoints"
    BACKGROUND_LOOKUPS = "background_lookups"
    SHARD_MAP = "shard_map"
    FIELD_MAP = "field_map"
    WHOLE_BATCHES = "whole_batches"
    WIRE = "wire"
    # promised by a consistency or a dense sync
    SYNCHRONOUS = "synchronous"
    DATA_PARALLEL = "data_parallel"
    FIELD_PARTIALS = "field_partials"


SERVICES: dict[Service, tuple[Axis, str]] = {  # service -> (the axis that offers it, what it is)
    Service.PS_ENDPOINTS: (Axis.PLACEMENT, "the PS servers' addresses and clients"),
    Service.BACKGROUND_LOOKUPS: (Axis.PLACEMENT, "a remote placement, whose lookups may run off the training thread"),
    Service.SHARD_MAP: (Axis.PLACEMENT, "every trainer owning a shard of every table by the route hash"),
    Service.FIELD_MAP: (Axis.PLACEMENT, "each trainer's fields with their tables"),
    Service.WHOLE_BATCHES: (Axis.PLACEMENT, "every trainer reading every row"),
    Service.WIRE: (Axis.PLACEMENT, "IDs and rows on a wire between trainers and remote tables"),
    Service.SYNCHRONOUS: (Axis.CONSISTENCY, "lookups that see every earlier update"),
    Service.DATA_PARALLEL: (Axis.DENSE, "a data-parallel dense part (replicas averaged by AllReduce every step)"),
    Service.FIELD_PARTIALS: (Axis.DENSE, "first layers summed from every trainer's fields"),
}


@dataclass(frozen=True)
class Requirement:
    service: Service
    why: str  # a sentence naming the value that requires it and why


@dataclass(frozen=True)
class AxisValue:
    module: str | None  # implementing module under hybridrec.strategy; None: not built yet
    summary: str
    issue: int | None = None  # the issue that builds it, while module is None
    servers: tuple[str, ...] = ()  # placement: the server roles (strategy.roles keys) it runs besides trainers
    offers: frozenset[Service] = frozenset()
    requires: tuple[Requirement, ...] = ()
    lacks: dict[Service, str] = field(default_factory=dict)  # why it does not offer a service, where that helps


_DES_PAIR = ("DES needs both: the field_sharded placement gives each trainer its fields' tables and the des dense "
             "sync computes the first layers from them (strategy.preset: des)")
_LOOKS_AHEAD = "it lets lookups run ahead of updates"


def _runs_ahead(value: str, summary: str, *more: Requirement) -> AxisValue:
    """A consistency whose lookups run ahead of the updates, on background threads."""
    return AxisValue(f"consistency.{value}", summary, requires=(
        Requirement(Service.BACKGROUND_LOOKUPS, f"{value} overlaps lookups with training in background threads"),
        *more), lacks={Service.SYNCHRONOUS: _LOOKS_AHEAD})


def _wire_codec(value: str, summary: str) -> AxisValue:
    """A codec value that changes what crosses the wire, which only a remote placement has."""
    return AxisValue("comm.codec", summary, requires=(
        Requirement(Service.WIRE, f"the wire codecs need a remote placement ({value})"),))


# axis -> value -> implementation. Codecs are the wire formats of hybridrec.comm.codec.
AXES: dict[Axis, dict[StrEnum, AxisValue]] = {
    Axis.PLACEMENT: {
        PlacementKind.LOCAL: AxisValue(
            "placement.local", "in-process stores, one fused native call per phase",
            lacks={Service.BACKGROUND_LOOKUPS: "the local step looks up inside autograd",
                   Service.WIRE: "the local placement sends nothing over a wire"}),
        PlacementKind.PS: AxisValue(
            "placement.ps", "remote PS shards, through embedding workers or (none given) directly",
            servers=("ps_servers", "embedding_workers"),
            offers=frozenset({Service.PS_ENDPOINTS, Service.BACKGROUND_LOOKUPS, Service.WIRE})),
        PlacementKind.SHARDED: AxisValue(
            "placement.sharded", "every trainer owns a shard of every table; AllToAll (PICASSO)",
            offers=frozenset({Service.SHARD_MAP}),
            requires=(Requirement(Service.SYNCHRONOUS, "the sharded placement's AllToAll is synchronous"),
                      Requirement(Service.DATA_PARALLEL, "the sharded placement trains the dense part data-parallel")),
            lacks={Service.WIRE: "the sharded placement sends keys and float32 rows between trainers; the wire "
                                 "codecs are not used",
                   Service.BACKGROUND_LOOKUPS: "its lookups are AllToAll rounds every trainer takes together"}),
        PlacementKind.FIELD_SHARDED: AxisValue(
            "placement.field_sharded", "fields split among trainers, each holding its fields' tables; every "
            "trainer reads every row (DES)",
            offers=frozenset({Service.FIELD_MAP, Service.WHOLE_BATCHES}),
            requires=(Requirement(Service.FIELD_PARTIALS, _DES_PAIR),
                      Requirement(Service.SYNCHRONOUS, "DES is fully synchronous (consistency sync): its lookups run "
                                                       "inside autograd, like the local one's")),
            lacks={Service.WIRE: "the field_sharded placement sends no IDs or rows over a wire (only the partial "
                                 "results of the first layers), so the wire codecs do not apply",
                   Service.BACKGROUND_LOOKUPS: "its lookups run inside autograd"}),
    },
    Axis.CONSISTENCY: {
        ConsistencyKind.SYNC: AxisValue("consistency.sync", "a lookup sees every earlier update (staleness 0)",
                                        offers=frozenset({Service.SYNCHRONOUS})),
        ConsistencyKind.BOUNDED: _runs_ahead("bounded", "at most strategy.tau updates in flight (Persia's hybrid)"),
        ConsistencyKind.HET: AxisValue(
            "consistency.het", "a cache per trainer with a per-embedding clock bound s and stale writes (HET; "
            "strategy.het)",
            requires=(Requirement(Service.PS_ENDPOINTS, "het reads and writes its cached rows on the PS servers "
                                                        "directly, with the servers' per-embedding clocks"),),
            lacks={Service.SYNCHRONOUS: _LOOKS_AHEAD}),
        ConsistencyKind.ASP: _runs_ahead("asp", "no cache, no waiting: lookups never wait for any update "
                                                "(strategy.asp.read_ahead batches looked up ahead)"),
        ConsistencyKind.SSP: _runs_ahead(
            "ssp", "worker clocks: no trainer more than strategy.ssp.staleness iterations ahead of the slowest one's "
            "acknowledged updates (classic SSP)",
            Requirement(Service.PS_ENDPOINTS, "ssp keeps its worker clocks on the PS servers")),
        ConsistencyKind.HOT_COLD: AxisValue(
            "consistency.hot_cold", "sync, with HybridHash: the hottest rows copied to every trainer, their "
            "gradients AllReduced (PICASSO)",
            offers=frozenset({Service.SYNCHRONOUS}),
            requires=(Requirement(Service.SHARD_MAP, "hot_cold keeps a copy of the hottest rows on every trainer "
                                                     "beside the owners' shards"),)),
    },
    Axis.DENSE: {
        DenseKind.ALLREDUCE: AxisValue("dense.allreduce", "DDP AllReduce of dense gradients (plain with one trainer)",
                                       offers=frozenset({Service.DATA_PARALLEL})),
        DenseKind.PS_ASYNC: AxisValue(
            "dense.ps_async", "dense parameters on the PS, pushed and pulled without barriers",
            requires=(Requirement(Service.PS_ENDPOINTS, "ps_async keeps the dense parameters on the PS servers"),)),
        DenseKind.EASGD: AxisValue(
            "dense.easgd", "a replica per trainer, elastic averaging with a centre on the PS (HT's baseline)",
            requires=(Requirement(Service.PS_ENDPOINTS, "easgd keeps the centre copy of the dense parameters on PS "
                                                        "servers"),)),
        DenseKind.GROUPS: AxisValue(
            "dense.groups", "a Hogwild copy per group of trainers, elastic averaging between groups (HT)",
            requires=(Requirement(Service.PS_ENDPOINTS, "groups keeps the centre copy of the dense parameters on PS "
                                                        "servers"),)),
        DenseKind.DES: AxisValue(
            "dense.des", "distributed equivalent substitution of the first layers: one AllReduce of partial "
            "results, replicated upper layers (DES)",
            offers=frozenset({Service.FIELD_PARTIALS}),
            requires=(Requirement(Service.FIELD_MAP, _DES_PAIR), Requirement(Service.WHOLE_BATCHES, _DES_PAIR))),
    },
    Axis.ID_CODEC: {
        IdCodec.NONE: AxisValue("comm.codec", "ID features as they are"),
        IdCodec.UNIQUE: _wire_codec("id_codec unique", "unique IDs + uint16 positions; the trainer pools unique rows"),
    },
    Axis.VALUE_CODEC: {
        ValueCodec.NONE: AxisValue("comm.codec", "float32 rows and gradients"),
        ValueCodec.FP16: _wire_codec("value_codec fp16", "fp16 with per-block L-infinity scaling"),
        ValueCodec.BF16: _wire_codec("value_codec bf16", "bfloat16 rounded to nearest even, no scale (HT §4.2)"),
    },
}


def _preset(placement: PlacementKind, consistency: ConsistencyKind, dense: DenseKind, id_codec: IdCodec = IdCodec.NONE,
            value_codec: ValueCodec = ValueCodec.NONE) -> dict[Axis, StrEnum]:
    return {Axis.PLACEMENT: placement, Axis.CONSISTENCY: consistency, Axis.DENSE: dense, Axis.ID_CODEC: id_codec,
            Axis.VALUE_CODEC: value_codec}


# preset -> the axis values it expands to; None: the paper is not built yet (issue in PRESET_ISSUES)
PRESETS: dict[str, dict[Axis, StrEnum] | None] = {
    "local": _preset(PlacementKind.LOCAL, ConsistencyKind.SYNC, DenseKind.ALLREDUCE),
    "persia": _preset(PlacementKind.PS, ConsistencyKind.BOUNDED, DenseKind.ALLREDUCE, IdCodec.UNIQUE),
    "het": _preset(PlacementKind.PS, ConsistencyKind.HET, DenseKind.ALLREDUCE),
    "picasso": _preset(PlacementKind.SHARDED, ConsistencyKind.HOT_COLD, DenseKind.ALLREDUCE),
    "des": _preset(PlacementKind.FIELD_SHARDED, ConsistencyKind.SYNC, DenseKind.DES),
    "ht": _preset(PlacementKind.PS, ConsistencyKind.BOUNDED, DenseKind.GROUPS, IdCodec.UNIQUE),
}
PRESET_ISSUES: dict[str, int] = {}  # preset -> the issue that builds it, while PRESETS holds None
DEFAULT_PRESET = "local"


class AxisError(ValueError):
    """A preset, axis value or combination that cannot run; the message says why."""


def _hint(value: str, choices) -> str:
    close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def check_value(axis: str, value: str) -> StrEnum:
    """The enum member of `value` on `axis`; AxisError when it is not a built value of `axis`."""
    axis = Axis(axis)
    values = AXES[axis]
    if value not in values:
        raise AxisError(f"strategy.{axis}: unknown value {str(value)!r}{_hint(value, values)}; "
                        f"allowed: {sorted(str(n) for n, v in values.items() if v.module)}")
    member = KINDS[axis](value)
    if values[member].module is None:
        raise AxisError(f"strategy.{axis}: {str(value)!r} ({values[member].summary}) is not built yet "
                        f"(issue #{values[member].issue})")
    return member


def resolve(preset: str | None, chosen: dict[str, str | None]) -> dict[Axis, StrEnum]:
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
            axes[Axis(axis)] = check_value(axis, value)
    reason = impossible(axes)
    if reason:
        raise AxisError(f"placement={axes[Axis.PLACEMENT]}, consistency={axes[Axis.CONSISTENCY]}, "
                        f"dense={axes[Axis.DENSE]} cannot work: {reason}")
    return axes


# the order requirements are checked in: the placement's first (it decides the most)
_CHECK_ORDER = (Axis.PLACEMENT, Axis.DENSE, Axis.CONSISTENCY, Axis.ID_CODEC, Axis.VALUE_CODEC)


def impossible(axes: dict[str, str]) -> str | None:
    """Why this combination of axis values cannot run, or None: the first requirement of a chosen
    value (placement first, then dense, consistency, codecs) that no chosen value offers."""
    chosen = {axis: AXES[axis][KINDS[axis](axes[axis])] for axis in Axis}
    offered = {service for value in chosen.values() for service in value.offers}
    for axis in _CHECK_ORDER:
        for need in chosen[axis].requires:
            if need.service not in offered:
                return _refusal(need, axes)
    return None


def _refusal(need: Requirement, axes: dict[str, str]) -> str:
    """The reason a requirement is not met: the service, the value lacking it and those offering it."""
    by, text = SERVICES[need.service]
    lacking = KINDS[by](axes[by])
    lack = AXES[by][lacking].lacks.get(need.service)
    allowed = " or ".join(str(name) for name, value in AXES[by].items() if need.service in value.offers and value.module)
    return (f"{need.why}; it needs {text} ({need.service}), which {by} {lacking} does not offer"
            f"{f': {lack}' if lack else ''}; allowed with {by} {allowed}")


def server_roles(axes: dict[str, str]) -> tuple[str, ...]:
    """The server roles (keys of strategy.roles) the placement runs besides its trainers; a
    placement whose trainers hold the tables themselves runs none."""
    return AXES[Axis.PLACEMENT][PlacementKind(axes["placement"])].servers


def is_distributed(axes: dict[str, str]) -> bool:
    """Whether the strategy runs as several processes (PS servers, trainers under torchrun)."""
    return axes["placement"] != PlacementKind.LOCAL
