"""Hierarchical Training's group PSs and the net transformation: layers placed on group PSs run
there and the trainer's model computes exactly what the whole model computes; the wire codecs
count their bytes; a group PS survives malformed requests; a job with group PSs converges."""
import copy
import subprocess

import numpy as np
import pytest
import torch

from hybridrec.comm.transport import Client, RemoteError
from hybridrec.models import build_model
from hybridrec.ps import PSClient, serve
from hybridrec.hierarchical.elastic_averaging import CENTRE_OPTIMIZER
from hybridrec.hierarchical.group_ps import GroupPS, Unit
from hybridrec.hierarchical.operator_placement import CostModel, Device, plan_model
from hybridrec.hierarchical.net_transformation import (RemoteLink, placed_devices, plan_units, remote_model,
                                                         split_model, split_slices, unit_module)
from helpers import LEARNT_GAP, launch_ht_job


DEVICES = ["trainer", "ps0", "ps1"]
SGD = {"name": "sgd", "lr": 0.1, "weight_decay": 0.0}


def _model(name="deepfm"):
    torch.manual_seed(0)
    hparams = {"hidden": [8, 6]} if name == "deepfm" else {}
    return build_model(name, num_sparse=3, embedding_dim=4, num_dense=2, num_tasks=1, **hparams)


def _inputs(batch=5, seed=1, wide=True):
    g = torch.Generator().manual_seed(seed)
    deep = torch.randn(batch, 3, 4, generator=g, requires_grad=True)
    wide = torch.randn(batch, 3, generator=g, requires_grad=True) if wide else None
    dense = torch.randn(batch, 2, generator=g)
    return deep, wide, dense


def _planned(model) -> dict[str, list[str]]:
    """The modules -> group PS of the operator placement's own plan for `model` on two group PSs."""
    devices = tuple(Device(name, 1e10, 1e9, 2**30) for name in DEVICES)
    return plan_model(model, CostModel(devices), batch_size=8, refine_seconds=0.5).modules


class Remote:
    """The model as a trainer runs it: its units on in-process group PSs over real sockets."""

    def __init__(self, model, modules, splits=(), codec="none", centre=(), slices_of=None):
        self.split = split_model(model, list(splits))
        self.units = plan_units(self.split, placed_devices(modules, list(splits), DEVICES))
        slices = split_slices(self.split, list(splits))
        self.servers = []
        for j in range(2):
            units = [Unit(u.name, u.prefix, copy.deepcopy(unit_module(self.split, u)))
                     for u in self.units if u.device == j]
            self.servers.append(GroupPS(units, SGD, wire=codec, centre=list(centre), alpha=0.5, period=1,
                                        slices=slices, threads=2))
        for server in self.servers:
            server.start()
        self.clients = [Client(s.address, timeout=20.0) for s in self.servers]
        self.links = {u.name: RemoteLink(self.clients[u.device], u.name, 0, codec) for u in self.units}
        self.module = remote_model(self.split, self.units, self.links)

    def params(self):
        out = {}
        for server in self.servers:
            out.update({k: v.detach().clone() for k, v in server.params.items()})
        return out

    def close(self):
        for client in self.clients:
            client.close()
        for server in self.servers:
            server.stop()


MODULES = {"linear": ["ps1"], "interaction": ["ps1"], "mlp.layers.0": ["ps0"], "mlp.layers.2": ["ps0"],
           "head.output": ["ps1"]}


def test_an_mlp_chain_on_one_group_ps_is_one_unit():
    units = plan_units(_model(), placed_devices(MODULES, [], DEVICES))
    chain = [u for u in units if u.prefix == "mlp.layers"]
    assert len(chain) == 1 and chain[0].paths == ("mlp.layers.0", "mlp.layers.1", "mlp.layers.2", "mlp.layers.3")
    assert sorted(u.name for u in units if u is not chain[0]) == ["head.output", "interaction", "linear"]


@pytest.mark.parametrize("name, splits, modules", [
    ("deepfm", [], MODULES),
    ("deepfm", [{"module": "mlp.layers.0", "how": "vertical", "parts": 2}],
     {**MODULES, "mlp.layers.0": ["ps0", "ps1"]}),
    ("deepfm", [{"module": "mlp.layers.2", "how": "horizontal", "parts": 2}],
     {**MODULES, "mlp.layers.2": ["ps1", "ps0"]}),
    ("dlrm", [], None),  # the planner's own placement; the bottom MLP sees only dense features
])
def test_the_remote_model_computes_and_trains_exactly_like_the_whole_model(name, splits, modules):
    model = _model(name)
    remote = Remote(model, modules or _planned(model), splits)
    try:
        local = copy.deepcopy(model)
        optimizer = torch.optim.SGD(local.parameters(), lr=SGD["lr"])
        for step in range(3):
            deep, wide, dense = _inputs(seed=step, wide=model.needs_wide)
            rdeep = deep.detach().clone().requires_grad_()
            rwide = None if wide is None else wide.detach().clone().requires_grad_()
            out = local(deep, wide, dense)
            got = remote.module(rdeep, rwide, dense)
            torch.testing.assert_close(got, out, rtol=1e-5, atol=1e-6)
            out.square().sum().backward()
            got.square().sum().backward()
            torch.testing.assert_close(rdeep.grad, deep.grad, rtol=1e-5, atol=1e-6)
            if wide is not None:
                torch.testing.assert_close(rwide.grad, wide.grad, rtol=1e-5, atol=1e-6)
            optimizer.step()
            optimizer.zero_grad()
        # the group PSs applied the same SGD steps to their parameters (split parts: slices of the whole)
        whole = dict(local.named_parameters())
        slices = split_slices(remote.split, splits)
        for name, value in remote.params().items():
            if name in slices:
                centre, dim, start, stop = slices[name]
                expected = whole[centre].detach().narrow(dim, start, stop - start)
            else:
                expected = whole[name].detach()
            torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-6)
        assert not list(remote.module.parameters())  # the trainer holds no parameter
    finally:
        remote.close()


@pytest.mark.parametrize("codec", ["bf16", "int8", "topk"])
def test_a_wire_codec_sends_fewer_bytes_and_stays_close(codec):
    model = _model()
    runs = {}
    for name in ("none", codec):
        remote = Remote(model, MODULES, codec=name)
        try:
            deep, wide, dense = _inputs(batch=64)
            out = remote.module(deep, wide, dense)
            out.sum().backward()
            runs[name] = (out.detach(), deep.grad.clone(),
                          sum(link.bytes_sent + link.bytes_received for link in remote.links.values()))
        finally:
            remote.close()
    (out, grad, plain), (coded_out, coded_grad, coded) = runs["none"], runs[codec]
    assert coded < plain
    if codec == "bf16":
        assert coded < 0.6 * plain
    def relative_error(a, b):
        return float((a - b).norm() / b.norm())

    if codec == "topk":  # float32 activations; a few entries of each gradient, the rest waits in the residual
        torch.testing.assert_close(coded_out, out)
        assert 0 < int((coded_grad != 0).sum()) < int((grad != 0).sum())
    else:
        assert relative_error(coded_out, out) < {"bf16": 0.01, "int8": 0.05}[codec]
        assert relative_error(coded_grad, grad) < 0.05


def test_a_split_part_syncs_with_its_slice_of_the_centre(tmp_path):
    model = _model()
    splits = [{"module": "mlp.layers.0", "how": "vertical", "parts": 2}]
    server = serve(tables={"t": {"dim": 4, "capacity": 16}}, block=False,
                   dense_params={n: tuple(p.shape) for n, p in model.named_parameters()})
    try:
        with PSClient([server.address]) as centre:
            start = {n: p.detach().numpy() + 1.0 for n, p in model.named_parameters()}  # the centre is 1 away
            centre.dense_init(start, CENTRE_OPTIMIZER)
            remote = Remote(model, {**MODULES, "mlp.layers.0": ["ps0", "ps1"]}, splits, centre=[server.address])
            try:
                before = remote.params()
                for s in remote.servers:
                    s.sync.stop()
                    s.sync.sync_once()
                after = remote.params()
                values = centre.dense_pull(list(start))
            finally:
                remote.close()
    finally:
        server.stop(timeout=5)
    slices = split_slices(remote.split, splits)
    name = "mlp.layers.0.parts.1.weight"
    _, dim, lo, hi = slices[name]
    # alpha 0.5: the part and its slice of the centre meet half way; the rest of the centre is unmoved by it
    torch.testing.assert_close(after[name], before[name] + 0.5)
    np.testing.assert_allclose(values["mlp.layers.0.weight"][lo:hi], start["mlp.layers.0.weight"][lo:hi] - 0.5,
                               rtol=1e-6)


def test_a_group_ps_answers_malformed_requests_with_an_error_and_keeps_serving():
    remote = Remote(_model(), MODULES)
    try:
        client = remote.clients[0]
        bad = [("forward", {}, {"unit": "nope", "caller": 0, "call": 0}, "not one of this group PS's units"),
               ("forward", {}, {"unit": "mlp.layers[0:3]", "caller": -1, "call": 0}, "caller must be an int"),
               ("backward", {}, {"unit": "mlp.layers[0:3]", "caller": 0, "call": 99, "grad": {"slots": []}},
                "no forward of it is kept"),
               ("forward", {"in0.values": np.zeros((2, 3), np.float32)},
                {"unit": "mlp.layers[0:3]", "caller": 0, "call": 1, "train": True, "grads": [True],
                 "inputs": {"slots": [{"codec": "none", "shape": [2, 3], "bf16": []}]}}, "do not fit"),
               ("forward", {"in0.values": np.zeros(5, np.float32)},
                {"unit": "mlp.layers[0:3]", "caller": 0, "call": 2, "train": True, "grads": [True],
                 "inputs": {"slots": [{"codec": "none", "shape": [2, 3], "bf16": []}]}}, "do not make shape")]
        for op, arrays, meta, message in bad:
            with pytest.raises(RemoteError, match=message):
                client.request(op, arrays, meta)
        assert client.request("ping").meta["units"] == ["mlp.layers[0:3]"]
    finally:
        remote.close()


def test_two_groups_with_a_group_ps_each_converge_on_loopback(tmp_path):
    result = launch_ht_job(tmp_path, {"groups": 2, "group_ps": 1, "alpha": 0.2, "period": 2, "wire_codec": "bf16",
                                     "plan": {"refine_seconds": 0.5}})
    assert result["dense_replicas"] == 2 and result["group_ps"] == 1 and result["wire_codec"] == "bf16"
    assert result["wire_bytes_per_step"] > 0 and result["elastic_syncs"] > 0
    assert result["auc"] > result["best_auc"] - LEARNT_GAP
    assert subprocess.run(["pgrep", "-f", "hybridrec.cli group-ps"], capture_output=True).returncode == 1  # the launcher stopped them
