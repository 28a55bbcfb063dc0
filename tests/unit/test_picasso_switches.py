"""PICASSO's interleaving: auto switches it on only where a trainer has 2 cores of its own, and
says why in either case; an explicit setting wins."""
import pytest

from hybridrec.config import parse_config
from hybridrec.picasso import switches


def test_auto_interleaves_only_with_two_cores_per_trainer_and_says_why():
    on, why = switches.interleaving("auto", 2, world_size=2, cores=2, local_trainers=2)
    assert not on and "2 cores for 2 trainers" in why and "interleaving: true" in why
    assert switches.interleaving("auto", 2, world_size=2, cores=4, local_trainers=2)[0]
    assert not switches.interleaving("auto", 2, world_size=1, cores=64, local_trainers=1)[0]


def test_an_explicit_setting_wins_and_one_micro_batch_never_interleaves():
    assert switches.interleaving(True, 2, world_size=2, cores=1, local_trainers=2) == (
        True, "strategy.picasso.interleaving is true")
    assert not switches.interleaving(False, 2, world_size=2, cores=64, local_trainers=1)[0]
    assert not switches.interleaving(True, 1, world_size=2, cores=64, local_trainers=1)[0]
    with pytest.raises(ValueError, match="true, false or auto"):
        switches.interleaving("sometimes", 2, world_size=2)


def test_the_preset_defaults_to_auto():
    cfg = parse_config({"strategy": {"preset": "picasso"}})
    assert cfg.strategy.picasso.interleaving == "auto"
