"""Dense parameters on the PS: first-writer-wins init, optimizer steps equal torch's, checkpoints."""

import numpy as np
import pytest
import torch

from hybridrec.comm.transport import Client, RemoteError
from hybridrec.ps import PSClient, serve
from hybridrec.ps.client import dense_shard

TABLES = {"user": {"dim": 4, "capacity": 1_000, "optimizer": {"name": "sgd", "lr": 0.5}}}
ADAM = {"name": "adam", "lr": 0.01, "weight_decay": 0.0}


@pytest.fixture
def two_shards(tmp_path):
    declared = {**{name: value.shape for name, value in model_params(0).items()}, "other": (3,)}
    servers = [serve(tables=TABLES, block=False, dense_params=declared, checkpoint_root=tmp_path) for _ in range(2)]
    try:
        yield [s.address for s in servers]
    finally:
        for server in servers:
            assert server.stop(timeout=5)


def model_params(seed):
    """Params named like a torch MLP's, spread over both shards of a 2-shard service."""
    rng = np.random.default_rng(seed)
    shapes = {"mlp.0.weight": (16, 8), "mlp.0.bias": (16,), "mlp.1.weight": (1, 16), "mlp.1.bias": (1,),
              "scale": ()}
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def test_params_are_spread_over_the_shards():
    assert {dense_shard(name, 2) for name in model_params(0)} == {0, 1}


def test_dense_init_keeps_the_first_value_given_per_name(two_shards):
    first, second = model_params(0), model_params(1)
    with PSClient(two_shards) as a, PSClient(two_shards) as b:
        got = a.dense_init(first, ADAM)
        for name in first:
            np.testing.assert_array_equal(got[name], first[name])
        extra = {"other": np.ones(3, np.float32)}
        again = b.dense_init({**second, **extra}, ADAM)  # a second worker: the first values stay
        for name in first:
            np.testing.assert_array_equal(again[name], first[name])
        np.testing.assert_array_equal(again["other"], extra["other"])
        pulled = b.dense_pull(["mlp.1.bias", "other"])
        assert list(pulled) == ["mlp.1.bias", "other"]
        np.testing.assert_array_equal(pulled["mlp.1.bias"], first["mlp.1.bias"])
        with pytest.raises(RemoteError, match=r"'mlp.0.bias'.*\(given, declared\).*\[3\].*\[16\]"):
            b.dense_init({"mlp.0.bias": np.ones(3, np.float32)}, ADAM)
        with pytest.raises(RemoteError, match="optimizer.*differs"):
            b.dense_init({"mlp.0.bias": first["mlp.0.bias"]}, {**ADAM, "lr": 0.5})
        with pytest.raises(RemoteError, match=r"\['nope'\] are not initialised"):
            b.dense_pull(["nope"])


@pytest.mark.parametrize("optimizer", [
    {"name": "adam", "lr": 0.01, "weight_decay": 0.1},
    {"name": "adagrad", "lr": 0.1, "weight_decay": 0.01},
    {"name": "sgd", "lr": 0.05, "weight_decay": 0.0},
])
def test_dense_push_equals_a_torch_optimizer_step(two_shards, optimizer):
    params = model_params(2)
    reference = {name: torch.nn.Parameter(torch.tensor(value)) for name, value in params.items()}
    torch_optimizer = {"adam": torch.optim.Adam, "adagrad": torch.optim.Adagrad, "sgd": torch.optim.SGD}[
        optimizer["name"]](reference.values(), lr=optimizer["lr"], weight_decay=optimizer["weight_decay"])
    rng = np.random.default_rng(3)
    lone = dense_shard("mlp.0.weight", 2)  # pushed alone once: the other shard sees one push fewer
    with PSClient(two_shards) as client:
        client.dense_init(params, optimizer)
        for step in range(5):
            names = list(params) if step != 2 else ["mlp.0.weight"]  # a push may name some params
            grads = {name: rng.standard_normal(params[name].shape).astype(np.float32) for name in names}
            made = client.dense_push(grads)  # per shard, the push's place in its order (-1: not asked)
            assert made == [step + 1 if shard == lone else (-1 if step == 2 else step + (step < 2))
                            for shard in range(2)]
            for name, param in reference.items():
                param.grad = torch.tensor(grads[name]) if name in grads else None
            torch_optimizer.step()
        pulled, read = client.dense_pull_versions(list(params))
        for name, param in reference.items():
            np.testing.assert_allclose(pulled[name], param.detach().numpy(), rtol=0, atol=1e-6)
            assert not np.array_equal(pulled[name], params[name])
        versions = [shard["dense"]["version"] for shard in client.stats()]
    assert versions == read == [5 if shard == lone else 4 for shard in range(2)]


def test_bad_dense_pushes_apply_nothing(two_shards):
    params = model_params(4)
    with PSClient(two_shards) as client:
        client.dense_init(params, ADAM)
        good = {name: np.ones_like(value) for name, value in params.items()}
        with pytest.raises(ValueError, match=r"grads\['scale'\] holds NaN"):  # caught before sending
            client.dense_push({**good, "scale": np.array(np.nan, np.float32)})
        shard = dense_shard("mlp.0.weight", 2)
        with Client(two_shards[shard], timeout=10) as raw:
            for bad, error in [({"mlp.0.weight": np.full((16, 8), np.inf, np.float32)}, "NaN or inf"),
                               ({"mlp.0.weight": np.ones((8, 16), np.float32)}, r"shape.*\[8, 16\].*\[16, 8\]"),
                               ({"mlp.0.weight": np.ones((16, 8), np.float64)}, "float32"),
                               ({"mlp.0.weight": good["mlp.0.weight"], "other": np.ones(3, np.float32)},
                                r"\['other'\] are not initialised")]:
                with pytest.raises(RemoteError, match=error):
                    raw.request("dense_push", bad)
            with pytest.raises(RemoteError, match="optimizer 'name' must be one of"):
                raw.request("dense_init", {"other": np.ones(3, np.float32)}, {"optimizer": {"name": "rmsprop", "lr": 1}})
            with pytest.raises(RemoteError, match="optimizer 'lr' must be a number > 0"):
                raw.request("dense_init", {"other": np.ones(3, np.float32)}, {"optimizer": {"name": "sgd", "lr": 0}})
        pulled = client.dense_pull(list(params))
        for name in params:
            np.testing.assert_array_equal(pulled[name], params[name])
        assert [shard["dense"]["version"] for shard in client.stats()] == [0, 0]


def test_dense_checkpoint_and_load_round_trip(two_shards, tmp_path):
    params = model_params(5)
    rng = np.random.default_rng(6)

    def grads():
        return {name: rng.standard_normal(value.shape).astype(np.float32) for name, value in params.items()}

    with PSClient(two_shards) as client:
        client.dense_init(params, ADAM)
        client.dense_push(grads())
        client.checkpoint(tmp_path / "ckpt")
        saved = client.dense_pull(list(params))
        step = grads()
        client.dense_push(step)  # the step taken from the checkpointed state (adam moments too)
        stepped = client.dense_pull(list(params))
        client.load(tmp_path / "ckpt")
        for name, value in client.dense_pull(list(params)).items():
            np.testing.assert_array_equal(value, saved[name])
        assert [shard["dense"]["version"] for shard in client.stats()] == [1, 1]
        client.dense_push(step)  # same step again: same result only if the optimizer state came back
        for name, value in client.dense_pull(list(params)).items():
            np.testing.assert_allclose(value, stepped[name], rtol=0, atol=1e-7)


def test_checkpoint_of_a_server_without_dense_params_loads_as_none(two_shards, tmp_path):
    with PSClient(two_shards) as client:
        client.checkpoint(tmp_path / "plain")
        assert not list(tmp_path.glob("plain/*/dense"))
        client.dense_init(model_params(7), ADAM)
        client.load(tmp_path / "plain")
        assert [shard["dense"] for shard in client.stats()] == [{"params": {}, "version": 0}] * 2
        with pytest.raises(RemoteError, match="not initialised"):
            client.dense_pull(["scale"])
        client.dense_init(model_params(8), {**ADAM, "lr": 0.5})  # an empty store takes any optimizer
