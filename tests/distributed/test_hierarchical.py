"""Hierarchical Training's dense syncs: Hogwild inside a group (one shared copy), elastic averaging
with a centre on a real PS, the config's checks, and a 2-group job on loopback."""
import json
import multiprocessing
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from hybridrec.config import ConfigError, load_config
from hybridrec.ps import PSClient, serve
from hybridrec.hierarchical.elastic_averaging import CENTRE_OPTIMIZER, ElasticSync, elastic_delta
from hybridrec.strategy.dense.groups import group_shape
from hybridrec.hierarchical.shared_copy import SHM_DIRECTORY, SharedCopy
from helpers import LEARNT_GAP, launch_ht_job


DIM, STEPS, LR = 8, 400, 0.05
JOB_SECONDS = 420


def _problem():
    rng = np.random.default_rng(7)
    w_star = rng.standard_normal(DIM).astype(np.float32)
    return torch.from_numpy(w_star)


def _hogwild_member(prefix: str, member: int, members: int) -> None:
    """One trainer of the group: SGD on a least-squares problem, on the group's shared copy."""
    torch.manual_seed(100 + member)
    model = torch.nn.Linear(DIM, 1, bias=False)
    shared = SharedCopy(model, prefix, member, members, create=False)
    shared.attach()
    w_star = _problem()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for _ in range(STEPS):
        x = torch.randn(16, DIM)
        y = x @ w_star
        optimizer.zero_grad()
        mark = shared.read_mark()
        loss = ((model(x).squeeze(1) - y) ** 2).mean()
        loss.backward()
        shared.write_mark(mark)
        optimizer.step()


def test_hogwild_members_on_one_shared_copy_reach_the_optimum(tmp_path):
    model = torch.nn.Linear(DIM, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    prefix = f"hybridrec-test-{tmp_path.name}"
    shared = SharedCopy(model, prefix, 0, 3, create=True)
    try:
        context = multiprocessing.get_context("spawn")
        members = [context.Process(target=_hogwild_member, args=(prefix, m, 3)) for m in (1, 2)]
        for process in members:
            process.start()
        for process in members:
            process.join(120)
            assert process.exitcode == 0
    finally:
        shared.unlink()
    shared.attach()
    assert not any(SHM_DIRECTORY.glob(f"{prefix}*"))
    assert shared.total_writes == 2 * STEPS  # every member's writes counted, none lost
    w = model.weight.detach().reshape(-1)
    start = torch.linalg.norm(_problem())
    assert torch.linalg.norm(w - _problem()) < 0.01 * start  # the members' steps all landed on one copy


@pytest.fixture
def centre_server(tmp_path):
    tables = {"user": {"dim": 4, "capacity": 100, "optimizer": {"name": "sgd", "lr": 0.5}}}
    server = serve(tables=tables, block=False, dense_params={"w": (4,)}, checkpoint_root=tmp_path)
    try:
        yield server.address
    finally:
        assert server.stop(timeout=5)


def test_elastic_averaging_moves_replica_and_centre_alpha_of_the_way(centre_server):
    alpha = 0.25
    with PSClient([centre_server]) as client:
        centre0 = np.zeros(4, np.float32)
        client.dense_init({"w": centre0}, CENTRE_OPTIMIZER)
        replicas = [torch.full((4,), 4.0), torch.full((4,), -2.0)]
        syncs = [ElasticSync({"w": r}, PSClient([centre_server]), alpha, due=lambda: False) for r in replicas]
        syncs[0].sync_once()  # replica 4 and centre 0: d = 1
        np.testing.assert_allclose(replicas[0].numpy(), 3.0)
        np.testing.assert_allclose(client.dense_pull(["w"])["w"], 1.0)
        syncs[1].sync_once()  # replica -2 and centre 1: d = -0.75
        np.testing.assert_allclose(replicas[1].numpy(), -1.25)
        np.testing.assert_allclose(client.dense_pull(["w"])["w"], 0.25)
        for sync in syncs:
            assert sync.syncs == 1 and sync.bytes == 2 * 4 * 4
            sync.client.close()
        # the sum of copies and centre is conserved by every sync
        assert float(replicas[0].sum() + replicas[1].sum()) + 4 * 0.25 == pytest.approx(4 * 4.0 - 4 * 2.0)


def test_elastic_delta_is_alpha_times_the_difference():
    delta = elastic_delta({"a": np.array([2.0, 0.0], np.float32)}, {"a": np.array([1.0, 1.0], np.float32)}, 0.5)
    np.testing.assert_array_equal(delta["a"], [0.5, -0.5])


def test_groups_must_divide_the_trainers():
    assert group_shape(4, 2) == 2
    with pytest.raises(ValueError, match=r"strategy.ht.groups 3: 4 trainers"):
        group_shape(4, 3)


def _config(tmp_path: Path, strategy: dict) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({"model": {"name": "lr"}, "strategy": strategy}))
    return path


@pytest.mark.parametrize("strategy, message", [
    ({"preset": "ht", "roles": {"trainers": 3}, "ht": {"groups": 2}}, r"strategy.ht.groups 2: 3 trainers"),
    ({"preset": "ht", "ht": {"wire_codec": "int8"}}, r"strategy.ht.wire_codec int8: .*group_ps is 0"),
    ({"dense": "easgd"}, r"easgd keeps the centre copy .* placement ps"),
])
def test_the_config_refuses_what_cannot_run(tmp_path, strategy, message):
    with pytest.raises(ConfigError, match=message):
        load_config(_config(tmp_path, strategy))


def test_two_groups_of_two_trainers_converge_on_loopback(tmp_path):
    before = set(SHM_DIRECTORY.glob("hybridrec-ht-*"))
    result = launch_ht_job(tmp_path, {"groups": 2, "alpha": 0.2, "period": 2})
    assert result["strategy"]["dense"] == "groups"
    assert result["dense_replicas"] == 2 and result["trainers_per_group"] == 2
    assert result["elastic_syncs"] > 0 and result["elastic_sync_bytes"] > 0
    assert result["auc"] > result["best_auc"] - LEARNT_GAP
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())  # the group's operator placement, saved
    assert set(plan["placement"]) >= {"mlp.layers.0", "head.output"} and plan["bottleneck"]
    assert set(SHM_DIRECTORY.glob("hybridrec-ht-*")) <= before  # the group copies' files are gone
