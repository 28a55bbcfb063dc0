"""DES (issue 22) in one process: the model-side split computes what the model computes (outputs,
gradients, optimizer steps) for any split of the fields; the full model's state and optimizer
state are assembled from the owners' blocks and sliced back; the fields are dealt to trainers by
table size with shared tables kept together; the ring AllReduce's bytes; unsupported models and
impossible axes are refused at config load; DES on one trainer trains what the local placement
trains, and `hybridrec eval` reads its checkpoint. The multi-process tests are in
test_des_distributed.py."""
from __future__ import annotations

import copy
import re

import pytest
import torch
from torch.nn import functional as nnf

from hybridrec.config import ConfigError, load_config, parse_config
from hybridrec.job.tables import job_tables
from hybridrec.models import build_model
from hybridrec.des.substitution import SUPPORTED, SubstitutedModel
from hybridrec.des.fields import field_groups
from hybridrec.des.partial_sums import ring_bytes
from hybridrec.strategy.placement.field_sharded import assign_fields
from hybridrec.train.evaluation import evaluate_checkpoint
from hybridrec.train.trainer import train

torch.set_num_threads(1)

F, D, N_DENSE, TASKS, B = 7, 4, 3, 2, 6
SPLIT = [[0, 3, 6], [1], [2, 4, 5]]
CASES = [("lr", {}), ("fm", {}), ("wide_deep", {"hidden": [8, 5]}), ("deepfm", {"hidden": [8]}),
         ("deepfm", {"hidden": [8], "multitask": "mmoe", "expert_hidden": [4]})]


def substituted(model, split=SPLIT):
    """One SubstitutedModel per owner, each on its own copy of the model (as each trainer builds one)."""
    return [SubstitutedModel(copy.deepcopy(model), fields) for fields in split]


def des_forward(subs, deep, wide, dense, split=SPLIT):
    """Every owner's logits, each from the summed partials with its own partial in the graph (the
    others' arrive as numbers, as after an AllReduce)."""
    parts = [s.partial(deep[:, f], wide[:, f]) for s, f in zip(subs, split)]
    return [s.upper(parts[t] + sum(p.detach() for i, p in enumerate(parts) if i != t), dense)
            for t, s in enumerate(subs)]


@pytest.mark.parametrize("name, hparams", CASES)
def test_the_substitution_computes_the_model_and_trains_like_it(name, hparams):
    torch.manual_seed(0)
    model = build_model(name, F, D, N_DENSE, TASKS, **hparams)
    subs = substituted(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    optimizers = [torch.optim.Adam(s.parameters(), lr=0.01) for s in subs]
    for step in range(4):
        deep, wide, dense = torch.randn(B, F, D), torch.randn(B, F), torch.randn(B, N_DENSE)
        labels = torch.rand(B, TASKS)
        ours_deep, ours_wide = deep.clone().requires_grad_(), wide.clone().requires_grad_()
        deep.requires_grad_(), wide.requires_grad_()
        optimizer.zero_grad()
        logits = model(deep, wide, dense)
        nnf.binary_cross_entropy_with_logits(logits, labels).backward()
        optimizer.step()
        for o in optimizers:
            o.zero_grad()
        outs = des_forward(subs, ours_deep, ours_wide, dense)
        for out in outs:
            torch.testing.assert_close(out, logits, rtol=1e-5, atol=1e-6)
            nnf.binary_cross_entropy_with_logits(out, labels).backward()
        for o in optimizers:
            o.step()
        # the embeddings' gradients (what the placement applies to each owner's rows)
        torch.testing.assert_close(ours_wide.grad, wide.grad, rtol=1e-5, atol=1e-7)
        if model.needs_deep:
            torch.testing.assert_close(ours_deep.grad, deep.grad, rtol=1e-5, atol=1e-7)
    full = subs[0].full_state([s.own_tensors() for s in subs])
    assert list(full) == list(model.state_dict())
    for key, value in model.state_dict().items():
        torch.testing.assert_close(full[key], value, rtol=1e-5, atol=1e-6)
    opt_full = subs[0].full_optimizer_state([s.own_optimizer_state(o) for s, o in zip(subs, optimizers)],
                                            optimizers[0].state_dict()["param_groups"])
    reference = optimizer.state_dict()
    assert opt_full["state"].keys() == reference["state"].keys()
    for index, entries in reference["state"].items():
        for key, value in entries.items():
            torch.testing.assert_close(opt_full["state"][index][key], value, rtol=1e-5, atol=1e-7)
    # and back: a trainer that loads the assembled states holds what the owner of its fields held
    again = SubstitutedModel(copy.deepcopy(model), SPLIT[2])
    again_optimizer = torch.optim.Adam(again.parameters(), lr=0.01)
    again.load_full_state(full)
    again.load_full_optimizer_state(again_optimizer, opt_full)
    for (n, a), (_, b) in zip(again.named_parameters(), subs[2].named_parameters()):
        torch.testing.assert_close(a, b, msg=n)
    steps = [state["step"] for state in again_optimizer.state.values()]
    assert len({id(step) for step in steps}) == len(steps)  # each its own: Adam counts them up in place
    mine, theirs = again.own_optimizer_state(again_optimizer), subs[2].own_optimizer_state(optimizers[2])
    for n, entries in theirs["tensors"].items():
        for key, value in entries.items():
            torch.testing.assert_close(mine["tensors"][n][key], value, msg=f"{n}.{key}")


def test_the_partial_results_are_small_and_shaped_as_the_paper_says():
    widths = {"lr": TASKS, "fm": TASKS + 2 * D, "wide_deep": TASKS + 8, "deepfm": TASKS + 2 * D + 8}
    for name, width in widths.items():
        model = build_model(name, F, D, N_DENSE, TASKS, **({"hidden": [8]} if "deep" in name else {}))
        sub = SubstitutedModel(model, [1, 2])
        assert sub.partial_width == width
        assert sub.partial(torch.randn(B, 2, D), torch.randn(B, 2)).shape == (B, width)
        # the trainer keeps only its block of the weight-rich first layer
        assert sub.first_order.shape == (2, TASKS)
        if "deep" in name:
            assert sub.fc.shape == (8, 2 * D)


def test_fields_are_dealt_by_table_size_with_shared_tables_together():
    cfg = parse_config({"data": {"synthetic": {"n_categorical": 6}}, "model": {"name": "deepfm"},
                        "embedding": {"default": {"capacity": 1000},
                                      "per_feature": {"C1": {"capacity": 5000}, "C2": {"capacity": 3000}},
                                      "shared": {"pair": {"features": ["C5", "C6"], "capacity": 1500}}},
                        "strategy": {"preset": "des"}})
    tables = job_tables(cfg)
    assert field_groups(tables) == [[0], [1], [2], [3], [4, 5]]
    owned = assign_fields(tables, 2)
    # capacity x dim (16 deep, 1 wide of capacity 1000): C1 81000, C2 49000, C5+C6 25000, C3 and C4 17000
    # each, dealt largest first to the lighter trainer: 81000 + 17000 against 49000 + 25000 + 17000
    assert owned == [[0, 3], [1, 2, 4, 5]]
    assert assign_fields(tables, 2) == owned  # every trainer computes the same split
    three = assign_fields(tables, 3)
    assert sorted(sum(three, [])) == list(range(6)) and [4, 5] in [[f for f in o if f >= 4] for o in three]
    with pytest.raises(ConfigError, match="6 trainers but only 5 groups of features"):
        assign_fields(tables, 6)


@pytest.mark.parametrize("size", [2, 3, 4, 7])
def test_ring_allreduce_bytes(size):
    payload = 4 * 1001
    counts = [ring_bytes(payload, 4, rank, size) for rank in range(size)]
    assert sum(sent for sent, _ in counts) == sum(received for _, received in counts) == 2 * (size - 1) * payload
    assert ring_bytes(payload, 4, 0, 1) == (0, 0)


@pytest.mark.parametrize("model, hparams, message", [
    ("dcn", "", "model 'dcn' cannot be substituted exactly: DCN's cross network"),
    ("dlrm", "", "model 'dlrm' cannot be substituted exactly: DLRM's dot interaction"),
    ("deepfm", "\n  hparams:\n    hidden: []", "has no first hidden layer to substitute"),
])
def test_a_model_des_cannot_substitute_is_refused_at_config_load(tmp_path, model, hparams, message):
    path = tmp_path / "job.yaml"
    path.write_text(f"model:\n  name: {model}{hparams}\nstrategy:\n  preset: des\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    text = str(info.value)
    assert message in text and "strategy.dense: des" in text
    assert re.search(rf"{re.escape(str(path))}:\d+: strategy", text), text
    if not hparams:
        assert f"DES supports {list(SUPPORTED)}" in text


@pytest.mark.parametrize("strategy, message", [
    ({"placement": "field_sharded"}, "DES needs both"),
    ({"dense": "des"}, "DES needs both"),
    ({"preset": "des", "consistency": "bounded"}, "DES is fully synchronous"),
    ({"preset": "des", "value_codec": "fp16"}, "the wire codecs do not apply"),
])
def test_axes_des_cannot_run_with_are_refused(strategy, message):
    with pytest.raises(ConfigError, match=message):
        parse_config({"model": {"name": "lr"}, "strategy": strategy})


JOB = {"seed": 2, "data": {"format": "synthetic", "batch_size": 128,
                           "synthetic": {"n_categorical": 5, "n_dense": 2, "vocab_size": 300, "train_rows": 768,
                                         "test_rows": 256}},
       "model": {"name": "wide_deep", "embedding_dim": 4, "hparams": {"hidden": [8]}},
       "embedding": {"default": {"capacity": 4000, "optimizer": {"name": "adagrad", "lr": 0.1}}},
       "train": {"progress": False, "dense_optimizer": {"name": "adam", "lr": 0.01}}}


def test_des_on_one_trainer_trains_what_the_local_placement_trains_and_eval_reads_its_checkpoint(tmp_path):
    local = train(parse_config({**JOB, "train": {**JOB["train"], "output_dir": str(tmp_path / "local")}}))
    des = train(parse_config({**JOB, "strategy": {"preset": "des"},
                              "train": {**JOB["train"], "output_dir": str(tmp_path / "des")}}))
    assert des["strategy"]["preset"] == "des" and des["step"] == local["step"] == 6
    assert des["auc"] == pytest.approx(local["auc"], abs=1e-6)
    assert des["logloss"] == pytest.approx(local["logloss"], abs=1e-6)
    assert des["fields_by_trainer"] == [["C1", "C2", "C3", "C4", "C5"]]
    assert des["des"]["wire_bytes_per_step"] == 0  # one trainer: nothing to reduce
    # the checkpoint holds the whole model and every table, as a local run's does
    again = evaluate_checkpoint(None, tmp_path / "des")
    assert again["auc"] == pytest.approx(des["auc"], abs=1e-9) and again["step"] == 6
