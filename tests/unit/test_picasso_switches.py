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


def test_auto_counts_the_trainers_sharing_the_machine_as_the_launcher_tells_them(monkeypatch):
    # one trainer per emulated host: torchrun says 1 local trainer, the launcher says 2 on this machine
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv(switches.MACHINE_TRAINERS_ENV, "2")
    on, why = switches.interleaving("auto", 2, world_size=2, cores=2)
    assert not on and "2 cores for 2 trainers" in why and switches.MACHINE_TRAINERS_ENV in why
    assert switches.interleaving("auto", 2, world_size=2, cores=4)[0]
    monkeypatch.delenv(switches.MACHINE_TRAINERS_ENV)  # torchrun's count when no launcher gave one
    on, why = switches.interleaving("auto", 2, world_size=2, cores=2)
    assert on and "LOCAL_WORLD_SIZE" in why


def test_the_launcher_tells_every_trainer_the_jobs_trainers_on_this_machine():
    from hybridrec.parallel.roles import build_roles

    plan = build_roles("configs/persia_synthetic.yaml", ps=1, embedding_workers=1, trainers=3, job_key=False)
    trainers = [role for role in plan.roles if role.main]
    assert trainers and all(role.env[switches.MACHINE_TRAINERS_ENV] == "3" for role in trainers)
    assert all(switches.MACHINE_TRAINERS_ENV not in (role.env or {}) for role in plan.roles if not role.main)
