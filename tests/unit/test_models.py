"""Tests for hybridrec.models: the forward contract, gradients, the model-specific maths,
the multi-task heads, the registry and that every model learns a planted CTR problem."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from hybridrec.models import (
    DLRM,
    CrossNetwork,
    LogisticRegression,
    PairwiseInteraction,
    TaskHead,
    build_model,
    model_hparams,
)
from hybridrec.metrics import auc

MODEL_NAMES = ["lr", "fm", "wide_deep", "deepfm", "dcn", "dlrm"]
MODELS_WITH_HEAD = ["wide_deep", "deepfm", "dcn", "dlrm"]
SMALL = {  # small layers keep the tests fast
    "wide_deep": {"hidden": (32, 16)},
    "deepfm": {"hidden": (32, 16)},
    "dcn": {"hidden": (32, 16), "cross_layers": 2},
    "dlrm": {"top_mlp": (32, 16), "bottom_mlp": (16, 8)},
}
F, D, N_DENSE, B = 5, 8, 3, 16


@pytest.fixture(autouse=True)
def one_thread():
    """The test machine's cores are shared: one intra-op thread avoids oversubscription stalls."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def make(name: str, num_tasks: int = 1, num_dense: int = N_DENSE, **hparams):
    return build_model(name, F, D, num_dense, num_tasks, **{**SMALL.get(name, {}), **hparams})


def inputs(model, batch: int = B, *, requires_grad: bool = False, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    deep = torch.randn(batch, model.num_sparse, model.embedding_dim, generator=g) if model.needs_deep else None
    wide = torch.randn(batch, model.num_sparse, generator=g) if model.needs_wide else None
    dense = torch.randn(batch, model.num_dense, generator=g)
    for tensor in (deep, wide):
        if tensor is not None:
            tensor.requires_grad_(requires_grad)
    return deep, wide, dense


HEAD_VARIANTS = [(1, {}), (3, {}), (3, {"multitask": "mmoe"}), (2, {"tower_hidden": (8,), "multitask": "mmoe"})]
SHAPE_CASES = [(name, 1, {}) for name in MODEL_NAMES] + [(name, 3, {}) for name in ("lr", "fm")]
SHAPE_CASES += [(name, tasks, head) for name in MODELS_WITH_HEAD for tasks, head in HEAD_VARIANTS]
SHAPE_CASES += [("dcn", 2, {"structure": "stacked"}), ("dcn", 1, {"hidden": ()}), ("dlrm", 1, {"top_mlp": ()})]


@pytest.mark.parametrize("name,num_tasks,hparams", SHAPE_CASES)
def test_forward_returns_one_finite_logit_per_task(name, num_tasks, hparams):
    model = make(name, num_tasks, **hparams)
    logits = model(*inputs(model))
    assert logits.shape == (B, num_tasks)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_models_accept_no_dense_features(name):
    model = make(name, num_dense=0)
    deep, wide, dense = inputs(model)
    assert dense.shape == (B, 0)
    with_empty = model(deep, wide, dense)
    with_none = model(deep, wide, None)
    assert with_empty.shape == (B, 1)
    torch.testing.assert_close(with_empty, with_none)


GRADIENT_CASES = [(name, 1, {}) for name in MODEL_NAMES]
GRADIENT_CASES += [(name, 2, {"multitask": "mmoe", "tower_hidden": (4,)}) for name in MODELS_WITH_HEAD]
GRADIENT_CASES += [("dcn", 2, {"structure": "stacked", "tower_hidden": (4,)}), ("lr", 2, {}), ("fm", 2, {})]


@pytest.mark.parametrize("name,num_tasks,hparams", GRADIENT_CASES)
def test_gradients_reach_every_parameter_and_the_embeddings(name, num_tasks, hparams):
    torch.manual_seed(0)
    model = make(name, num_tasks, **hparams)
    deep, wide, dense = inputs(model, batch=64, requires_grad=True)
    labels = torch.randint(0, 2, (64, num_tasks)).float()
    nn.functional.binary_cross_entropy_with_logits(model(deep, wide, dense), labels).backward()
    for param_name, param in model.named_parameters():
        assert param.grad is not None, f"{param_name} got no gradient"
        assert param.grad.abs().sum() > 0, f"{param_name} got an all-zero gradient"
    if model.needs_deep:
        assert deep.grad is not None and deep.grad.abs().sum() > 0
    if model.needs_wide:
        assert wide.grad is not None and wide.grad.abs().sum() > 0


@pytest.mark.parametrize(
    "name,needs_deep,needs_wide",
    [("lr", False, True), ("fm", True, True), ("wide_deep", True, True), ("deepfm", True, True),
     ("dcn", True, False), ("dlrm", True, False)],
)
def test_models_declare_which_embeddings_they_need(name, needs_deep, needs_wide):
    model = make(name)
    assert (model.needs_deep, model.needs_wide) == (needs_deep, needs_wide)


def test_lr_starts_as_the_sum_of_first_order_weights():
    model = LogisticRegression(F, D, N_DENSE)
    _, wide, dense = inputs(model)
    torch.testing.assert_close(model(None, wide, dense), wide.sum(dim=1, keepdim=True))


def test_fm_pairwise_term_equals_the_explicit_sum_over_feature_pairs():
    deep = torch.randn(B, F, D, dtype=torch.float64)
    explicit = sum((deep[:, f] * deep[:, g]).sum(dim=1) for f, g in itertools.combinations(range(F), 2))
    term = PairwiseInteraction(D, 1).double()
    torch.testing.assert_close(term(deep).squeeze(1), explicit)


def test_cross_layer_follows_the_dcn_v2_formula():
    cross = CrossNetwork(in_dim=6, num_layers=2)
    x0 = torch.randn(4, 6)
    first, second = cross.layers
    x1 = x0 * first(x0) + x0
    torch.testing.assert_close(cross(x0), x0 * second(x1) + x1)


@pytest.mark.parametrize("num_sparse,embedding_dim", [(1, 4), (5, 8), (26, 16)])
def test_dlrm_interaction_has_size_d_plus_pairs_of_f_plus_one_vectors(num_sparse, embedding_dim):
    model = DLRM(num_sparse, embedding_dim, N_DENSE, top_mlp=(8,), bottom_mlp=(embedding_dim,))
    expected = embedding_dim + (num_sparse + 1) * num_sparse // 2
    assert model.interaction_dim == expected
    deep, _, dense = inputs(model, batch=3)
    assert model.interact(deep, dense).shape == (3, expected)


def test_dlrm_interaction_holds_the_bottom_output_and_each_distinct_pair_dot_once():
    model = DLRM(3, 4, 2, bottom_mlp=(4,), top_mlp=())
    deep, _, dense = inputs(model, batch=2)
    bottom = model.bottom(dense)
    vectors = torch.cat([bottom.unsqueeze(1), deep], dim=1)
    pair_dots = [(vectors[:, i] * vectors[:, j]).sum(dim=1) for i, j in itertools.combinations(range(4), 2)]
    expected = torch.cat([bottom, torch.stack(pair_dots, dim=1)], dim=1)
    torch.testing.assert_close(model.interact(deep, dense), expected)


def test_dlrm_without_dense_features_interacts_only_the_embeddings():
    model = DLRM(F, D, 0, top_mlp=(8,))
    assert model.interaction_dim == F * (F - 1) // 2


def test_dlrm_rejects_a_bottom_mlp_that_does_not_end_in_embedding_dim():
    with pytest.raises(ValueError, match=r"bottom_mlp.*embedding_dim=8.*\[16, 4\]"):
        build_model("dlrm", F, D, N_DENSE, bottom_mlp=[16, 4])


def test_dlrm_rejects_a_single_vector_to_interact():
    with pytest.raises(ValueError, match="num_sparse=1"):
        DLRM(1, D, 0)


def test_mmoe_gates_are_probability_distributions_over_experts():
    head = TaskHead(10, 3, multitask="mmoe", num_experts=5)
    gates = head.gate_weights(torch.randn(7, 10))
    assert gates.shape == (7, 3, 5)
    assert (gates >= 0).all()
    torch.testing.assert_close(gates.sum(dim=-1), torch.ones(7, 3))


def test_gate_weights_of_a_shared_bottom_head_is_an_error():
    with pytest.raises(ValueError, match="mmoe"):
        TaskHead(10, 2).gate_weights(torch.randn(1, 10))


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_initialisation_is_deterministic_under_manual_seed(name):
    def state_after_seed(seed):
        torch.manual_seed(seed)
        return make(name, 2).state_dict()

    first, again, other = state_after_seed(1), state_after_seed(1), state_after_seed(2)
    for key in first:
        torch.testing.assert_close(first[key], again[key])
    if name not in ("lr", "fm"):  # LR and FM start from fixed values, not random ones
        assert any(not torch.equal(first[key], other[key]) for key in first)


def test_eval_mode_disables_dropout():
    torch.manual_seed(0)
    model = make("deepfm", hidden=(32,), dropout=0.5)
    batch = inputs(model)
    model.train()
    assert not torch.equal(model(*batch), model(*batch))
    model.eval()
    torch.testing.assert_close(model(*batch), model(*batch))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_models_run_on_cuda(name):
    model = make(name, 2).cuda()
    on_cuda = [t.cuda() if t is not None else None for t in inputs(model)]
    assert model(*on_cuda).device.type == "cuda"


# --- registry ---------------------------------------------------------------------------


def test_unknown_model_name_names_the_closest_valid_one():
    with pytest.raises(ValueError, match=r"'deepfn'.*did you mean 'deepfm'"):
        build_model("deepfn", F, D, N_DENSE)


def test_unknown_hparam_names_the_closest_valid_one():
    with pytest.raises(ValueError, match=r"'cross_layer'.*'dcn'.*did you mean 'cross_layers'"):
        build_model("dcn", F, D, N_DENSE, cross_layer=2)


def test_lr_rejects_deep_model_hparams():
    with pytest.raises(ValueError, match=r"'hidden'.*'lr'"):
        build_model("lr", F, D, N_DENSE, hidden=(8,))


def test_model_hparams_lists_each_models_options_with_defaults():
    assert model_hparams("lr") == {}
    assert model_hparams("fm") == {}
    dcn = model_hparams("dcn")
    assert dcn["cross_layers"] == 3 and dcn["dropout"] == 0.0 and dcn["structure"] in ("stacked", "parallel")
    assert {"bottom_mlp", "top_mlp", "multitask", "num_experts", "tower_hidden"} <= set(model_hparams("dlrm"))
    assert model_hparams("deepfm") == model_hparams("wide_deep")
    with pytest.raises(ValueError, match="did you mean 'dlrm'"):
        model_hparams("dlmr")


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_every_listed_default_is_accepted_by_build_model(name):
    model = build_model(name, F, D, N_DENSE, 2, **model_hparams(name))
    assert model(*inputs(model)).shape == (B, 2)


@pytest.mark.parametrize(
    "name,bad,error,pattern",
    [
        ("dcn", {"hidden": [64, 0]}, ValueError, r"hidden.*\[64, 0\]"),
        ("dcn", {"hidden": "64"}, TypeError, "hidden"),
        ("dcn", {"dropout": 1.5}, ValueError, "dropout.*1.5"),
        ("dcn", {"structure": "serial"}, ValueError, r"structure.*stacked.*'serial'"),
        ("dcn", {"cross_layers": -1}, ValueError, "cross_layers.*-1"),
        ("deepfm", {"multitask": "ple"}, ValueError, r"multitask.*'ple'"),
        ("dlrm", {"num_experts": 0}, ValueError, "num_experts.*0"),
        ("dlrm", {"expert_hidden": []}, ValueError, "expert_hidden"),
        ("wide_deep", {"tower_hidden": [True]}, ValueError, "tower_hidden"),
    ],
)
def test_bad_hparam_values_are_rejected_with_the_parameter_named(name, bad, error, pattern):
    with pytest.raises(error, match=pattern):
        build_model(name, F, D, N_DENSE, 2, **bad)


@pytest.mark.parametrize(
    "sizes,error,pattern",
    [((0, D, 1), ValueError, "num_sparse.*0"), ((F, 2.0, 1), TypeError, "embedding_dim"),
     ((F, D, -1), ValueError, "num_dense.*-1"), ((F, D, 1, True), TypeError, "num_tasks")],
)
def test_bad_sizes_are_rejected_with_the_parameter_named(sizes, error, pattern):
    with pytest.raises(error, match=pattern):
        build_model("deepfm", *sizes)


def test_forward_rejects_inputs_of_the_wrong_shape_or_missing():
    model = make("fm")
    deep, wide, dense = inputs(model)
    with pytest.raises(ValueError, match=r"`deep`.*\[B, 5, 8\].*\[16, 5, 4\]"):
        model(deep[..., :4], wide, dense)
    with pytest.raises(ValueError, match="needs `wide`"):
        model(deep, None, dense)
    with pytest.raises(ValueError, match=r"`dense`.*\[16, 3\]"):
        model(deep, wide, dense[:8])
    with pytest.raises(TypeError, match="floating-point"):
        model(deep, wide.long(), dense)


# --- learning a planted problem -----------------------------------------------------------


def planted_ctr_problem(num_samples, num_tasks, *, num_features=4, vocab=10, num_dense=3, seed=1):
    """IDs, dense features and labels drawn from a hidden FM-like model (per task)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (num_samples, num_features), generator=g)
    dense = torch.randn(num_samples, num_dense, generator=g)
    features = torch.arange(num_features)
    logits = []
    for _ in range(num_tasks):
        first_order = torch.randn(num_features, vocab, generator=g)[features, ids].sum(dim=1)
        latent = torch.randn(num_features, vocab, 3, generator=g)[features, ids]
        pairwise = 0.5 * (latent.sum(dim=1).square() - latent.square().sum(dim=1)).sum(dim=1)
        logits.append(2.0 * (first_order + 0.5 * pairwise + dense @ torch.randn(num_dense, generator=g)))
    labels = (torch.rand(num_samples, num_tasks, generator=g) < torch.sigmoid(torch.stack(logits, 1))).float()
    return ids + features * vocab, dense, labels  # ids offset so every feature has its own rows


def held_out_auc_after_training(name, num_tasks=1, steps=150, **hparams):
    """Train the model and learnable embedding tables on 4000 samples, return AUCs on 1000 more."""
    torch.manual_seed(0)
    rows, dense, labels = planted_ctr_problem(5000, num_tasks)
    num_features, embedding_dim = rows.shape[1], 8
    deep_table = nn.Embedding(int(rows.max()) + 1, embedding_dim)
    nn.init.normal_(deep_table.weight, std=0.1)
    wide_table = nn.Embedding(int(rows.max()) + 1, 1)
    nn.init.zeros_(wide_table.weight)
    model = build_model(name, num_features, embedding_dim, dense.shape[1], num_tasks, **hparams)
    parameters = [*model.parameters(), *deep_table.parameters(), *wide_table.parameters()]
    optimizer = torch.optim.Adam(parameters, lr=0.01)

    def logits(part):
        wide = wide_table(rows[part]).squeeze(-1) if model.needs_wide else None
        return model(deep_table(rows[part]), wide, dense[part])

    train, test = slice(0, 4000), slice(4000, None)
    for _ in range(steps):
        loss = nn.functional.binary_cross_entropy_with_logits(logits(train), labels[train])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        probs = torch.sigmoid(logits(test))
    return [auc(labels[test, task], probs[:, task]) for task in range(num_tasks)]


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_every_model_learns_a_planted_ctr_problem(name):
    (test_auc,) = held_out_auc_after_training(name, **SMALL.get(name, {}))
    assert test_auc > 0.75


@pytest.mark.parametrize("name,multitask", [("deepfm", "shared_bottom"), ("dlrm", "mmoe")])
def test_multitask_heads_learn_two_planted_tasks(name, multitask):
    hparams = {**SMALL[name], "multitask": multitask, "tower_hidden": (8,), "expert_hidden": (16,)}
    aucs = held_out_auc_after_training(name, num_tasks=2, **hparams)
    assert min(aucs) > 0.75
