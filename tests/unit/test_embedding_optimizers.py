"""Each fused sparse optimizer matches a straightforward dense torch reference over many steps,
with keys repeated inside a batch and shared between batches."""
import numpy as np
import pytest
import torch

from hybridrec.embedding import EmbeddingStore

DIM = 8
UNIVERSE = np.array([3, 17, 2**40 + 5, 2**63 + 11, 99, 123456789, 7, 2**64 - 1], dtype=np.uint64)
STEPS = 60


def _batches(seed=0):
    rng = np.random.default_rng(seed)
    for _ in range(STEPS):
        n = int(rng.integers(3, 12))
        idx = rng.integers(0, len(UNIVERSE), size=n)  # repeats are likely
        grads = rng.normal(0, 1, size=(n, DIM)).astype(np.float32)
        yield idx, grads


def _dense_grad(idx, grads):
    g = torch.zeros(len(UNIVERSE), DIM)
    g.index_add_(0, torch.from_numpy(idx), torch.from_numpy(grads))
    present = torch.zeros(len(UNIVERSE), dtype=torch.bool)
    present[torch.from_numpy(idx)] = True
    return g, present


def _run(optimizer, reference_step, weight_decay=0.0, **store_kw):
    store = EmbeddingStore(dim=DIM, capacity=64, optimizer=optimizer, weight_decay=weight_decay, **store_kw)
    w = torch.from_numpy(store.pull(UNIVERSE).copy())
    state = {}
    for step, (idx, grads) in enumerate(_batches(), start=1):
        store.push(UNIVERSE[idx], grads)
        g, present = _dense_grad(idx, grads)
        reference_step(w, g, present, state, step)
    got = store.pull(UNIVERSE, insert=False)
    np.testing.assert_allclose(got, w.numpy(), rtol=1e-6, atol=1e-6)
    return store


def _torch_optimizer_reference(make_optimizer, sparse=False):
    """A reference step that runs a torch.optim optimizer on a dense parameter holding every
    row; with `sparse`, the gradient is handed over as a sparse tensor of the present rows."""
    state = {}

    def ref(w, g, present, _state, step):
        if "param" not in state:
            state["param"] = torch.nn.Parameter(w.clone())
            state["opt"] = make_optimizer([state["param"]])
        param = state["param"]
        if sparse:
            rows = torch.nonzero(present).flatten()
            param.grad = torch.sparse_coo_tensor(rows.unsqueeze(0), g[rows], w.shape, check_invariants=True)
        else:
            param.grad = g
        state["opt"].step()
        w.copy_(param.detach())

    return ref


def test_adagrad_matches_torch_adagrad():
    ref = _torch_optimizer_reference(
        lambda p: torch.optim.Adagrad(p, lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1))
    _run({"name": "adagrad", "lr": 0.1, "lr_decay": 0.01, "initial_accumulator_value": 0.1}, ref)


def test_sgd_matches_torch_sgd():
    _run({"name": "sgd", "lr": 0.05}, _torch_optimizer_reference(lambda p: torch.optim.SGD(p, lr=0.05)))


@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_momentum_matches_lazy_torch_reference(nesterov):
    # Lazy momentum: a row's buffer only moves when the row is in the batch (torch.optim.SGD's
    # rule applied to the present rows).
    def ref(w, g, present, state, step):
        buf = state.setdefault("buf", torch.zeros_like(w))
        gp = g[present] + 0.01 * w[present]
        buf[present] = 0.9 * buf[present] + gp
        upd = gp + 0.9 * buf[present] if nesterov else buf[present]
        w[present] -= 0.05 * upd

    _run({"name": "sgd", "lr": 0.05, "momentum": 0.9, "nesterov": nesterov}, ref, weight_decay=0.01)


def test_adam_matches_torch_sparse_adam():
    _run({"name": "adam", "lr": 0.01},
         _torch_optimizer_reference(lambda p: torch.optim.SparseAdam(p, lr=0.01), sparse=True))


def test_ftrl_matches_reference_formula():
    alpha, beta, l1, l2 = 0.1, 1.0, 1.5, 0.01

    def ref(w, g, present, state, step):
        z = state.setdefault("z", torch.zeros_like(w, dtype=torch.float64))
        n = state.setdefault("n", torch.zeros_like(w, dtype=torch.float64))
        gp, wp = g[present].double(), w[present].double()
        n_new = n[present] + gp * gp
        sigma = (n_new.sqrt() - n[present].sqrt()) / alpha
        z[present] += gp - sigma * wp
        n[present] = n_new
        zp = z[present]
        new = -(zp - zp.sign() * l1) / ((beta + n_new.sqrt()) / alpha + l2)
        new[zp.abs() <= l1] = 0.0
        w[present] = new.float()

    store = _run({"name": "ftrl", "lr": alpha, "l1": l1, "l2": l2, "beta": beta}, ref)
    assert (store.pull(UNIVERSE, insert=False) == 0).any(), "l1 should zero some coordinates"


def test_adagrad_weight_decay_and_bound():
    bound = 0.03

    def ref(w, g, present, state, step):
        acc = state.setdefault("acc", torch.zeros_like(w))
        gp = g[present] + 0.1 * w[present]
        acc[present] += gp * gp
        w[present] = (w[present] - 0.2 * gp / (acc[present].sqrt() + 1e-10)).clamp(-bound, bound)

    store = _run({"name": "adagrad", "lr": 0.2}, ref, weight_decay=0.1, weight_bound=bound)
    assert np.abs(store.pull(UNIVERSE, insert=False)).max() <= bound


def test_every_optimizer_keeps_state_inside_the_row():
    for name, width in (("sgd", 0), ("adagrad", DIM), ("adam", 2 * DIM), ("ftrl", 2 * DIM)):
        store = EmbeddingStore(dim=DIM, capacity=4, optimizer=name)
        assert store.config.state_width == width
        assert store.rows.shape[1] == store.config.row_width
