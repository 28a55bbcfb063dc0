"""The strategy matrix as typed declarations: axis values are str-valued enums that configs and
result files read and write as plain strings; which combinations cannot work follows from what
each value offers and requires, and a refusal names the missing service, the value lacking it and
the values offering it; every placement offers at run time exactly the services declared for it."""
import dataclasses
import itertools
import json

import pytest

from hybridrec.axes import (AXES, KINDS, PRESETS, SERVICES, Axis, ConsistencyKind, PlacementKind, Requirement,
                            Service, impossible)
from hybridrec.config import ConfigError, parse_config
from hybridrec.job.tables import job_tables
from hybridrec.strategy.placement import make_placement
from hybridrec.strategy.world import World


def test_axis_values_are_enums_that_read_and_record_as_plain_strings():
    cfg = parse_config({"strategy": {"preset": "picasso"}})
    assert cfg.strategy.placement is PlacementKind.SHARDED and cfg.strategy.placement == "sharded"
    assert cfg.strategy.consistency is ConsistencyKind.HOT_COLD
    assert json.loads(json.dumps(cfg.strategy.record()))["placement"] == "sharded"
    assert cfg.model_dump(mode="json")["strategy"]["consistency"] == "hot_cold"
    assert repr(cfg.strategy.placement) == "'sharded'"  # messages read as they did with strings
    for axis, values in AXES.items():
        assert all(isinstance(value, KINDS[axis]) for value in values), axis


def combinations():
    for values in itertools.product(*(list(AXES[axis]) for axis in Axis)):
        yield dict(zip(Axis, values))


def unmet(axes: dict) -> list[Requirement]:
    offered = {s for axis in Axis for s in AXES[axis][axes[axis]].offers}
    return [need for axis in Axis for need in AXES[axis][axes[axis]].requires if need.service not in offered]


def test_a_combination_is_refused_exactly_when_a_requirement_is_unmet_and_the_refusal_names_it():
    refused = 0
    for axes in combinations():
        reason, missing = impossible(axes), unmet(axes)
        assert (reason is None) == (not missing), (axes, reason)
        if reason is None:
            continue
        refused += 1
        need = next(n for n in missing if n.why in reason)
        by = SERVICES[need.service][0]
        offering = [str(v) for v, spec in AXES[by].items() if need.service in spec.offers]
        assert f"({need.service}), which {by} {axes[by]} does not offer" in reason, reason
        assert reason.endswith(f"allowed with {by} {' or '.join(offering)}"), reason
    assert refused > 0
    for preset, axes in PRESETS.items():
        assert impossible(axes) is None, preset


def test_what_cannot_work_follows_from_the_declarations_alone(monkeypatch):
    """No rule kept by hand: a new requirement of sync makes the local preset impossible, with it named."""
    sync = AXES[Axis.CONSISTENCY][ConsistencyKind.SYNC]
    monkeypatch.setitem(AXES[Axis.CONSISTENCY], ConsistencyKind.SYNC, dataclasses.replace(
        sync, requires=(Requirement(Service.WIRE, "sync would send its lookups over a wire"),)))
    with pytest.raises(ConfigError, match=r"sync would send its lookups over a wire; it needs .* \(wire\), which "
                                          r"placement local does not offer: the local placement sends nothing"):
        parse_config({"strategy": {"preset": "local"}})
    assert parse_config({"strategy": {"preset": "persia", "consistency": "sync"}}).strategy.consistency == "sync"


SMALL = {"data": {"format": "synthetic", "synthetic": {"n_categorical": 4, "n_dense": 1, "vocab_size": 50}},
         "model": {"name": "lr"}, "embedding": {"default": {"capacity": 200}}}


@pytest.mark.parametrize("placement", list(PlacementKind))
def test_every_placement_offers_the_services_declared_for_it(placement):
    preset = {"local": "local", "ps": "persia", "sharded": "picasso", "field_sharded": "des"}[placement]
    cfg = parse_config({**SMALL, "strategy": {"preset": preset}})
    built = make_placement(placement, cfg, job_tables(cfg), World(), {"ps": ["tcp://127.0.0.1:9"]})
    try:
        assert built.services.offered() == AXES[Axis.PLACEMENT][placement].offers
    finally:
        built.close()
