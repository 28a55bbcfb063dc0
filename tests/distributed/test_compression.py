"""Compression on the wire (Hierarchical Training §4.2): bf16 and int8 round trips within their
error bounds, top-k with error feedback loses nothing over many steps, exact byte counts, the
bf16 value codec of the embedding wire, and the DDP hooks over a 2-process gloo group."""
import datetime
import os
import socket

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from hybridrec.comm.codec import decode_rows, encode_rows, make_value_codec
from hybridrec.comm.compression import (Bf16Codec, ErrorFeedback, Int8Codec, TopKCodec, WireStats, bf16_bits,
                                        bf16_floats, dense_comm_hook, make_codec, raw_bytes, wire)


def _tensor(seed: int, shape=(64, 33), spread: float = 6.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * torch.exp(torch.randn(shape, generator=g) * spread / 3)


def test_bf16_round_trip_error_bound_and_bytes():
    x = _tensor(0)
    codec = Bf16Codec()
    packed = codec.encode(x)
    assert packed.nbytes == x.numel() * 2 == raw_bytes(x) // 2
    back = codec.decode(packed)
    assert back.dtype == torch.float32 and back.shape == x.shape
    assert bool(((back - x).abs() <= x.abs() * 2.0**-8).all())  # half a step of 8 significant bits


def test_bf16_numpy_rounding_is_torchs_to_nearest_even():
    special = np.array([0.0, -0.0, 1.0, 1.00390625, 1.01171875, 1.0 + 2**-8 + 2**-20, np.inf, -np.inf, np.nan,
                        3.3895314e38, 3.4e38, 1e-40, -1e-45], np.float32)  # ties, a carry, overflow, subnormals
    values = np.concatenate([special, _tensor(1, (4096,)).numpy()])
    expected = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    bits = bf16_bits(values)
    finite = np.isfinite(values)
    assert np.array_equal(bits[finite], expected[finite])
    assert np.isnan(bf16_floats(bits)[np.isnan(values)]).all()
    assert np.array_equal(bf16_floats(bits)[~np.isnan(values)], torch.from_numpy(values).to(torch.bfloat16)
                          .float().numpy()[~np.isnan(values)])


def test_bf16_value_codec_on_the_embedding_wire():
    rows = _tensor(2, (100, 16)).numpy()
    codec = make_value_codec("bf16")
    encoded = codec.encode(rows)
    assert encoded.nbytes == rows.size * 2
    back = codec.decode(encoded)
    assert back.dtype == np.float32 and np.all(np.abs(back - rows) <= np.abs(rows) * 2.0**-8)
    narrow = rows[:, :1].copy()  # the dim-1 wide rows go through encode_rows' blocks
    assert np.array_equal(decode_rows(codec, encode_rows(codec, narrow)), bf16_floats(bf16_bits(narrow)))


def test_bf16_value_codec_through_a_ps_server(tmp_path):
    from hybridrec.ps import PSClient, serve

    from hybridrec.embedding import EmbeddingStore, TableConfig

    tables = {"user": {"dim": 8, "capacity": 1000, "optimizer": {"name": "sgd", "lr": 0.5}, "seed": 3}}
    keys = np.arange(1, 301, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    warm = EmbeddingStore(TableConfig.from_dict(tables["user"]))  # a cold numba cache compiles here, not
    warm.pull(keys)  # inside the client's request timeout
    warm.push(keys, np.ones((len(keys), 8), np.float32))
    server = serve(tables=tables, block=False, checkpoint_root=tmp_path)
    try:
        with PSClient([server.address], value_codec="none", timeout=120) as exact, \
                PSClient([server.address], value_codec="bf16", timeout=120) as compressed:
            rows = exact.lookup("user", keys)
            approx = compressed.lookup("user", keys, insert=False)
            assert compressed.push("user", keys, np.ones((len(keys), 8), np.float32)) == 0
            updated = exact.lookup("user", keys, insert=False)
    finally:
        assert server.stop(timeout=5)
    assert np.array_equal(approx, bf16_floats(bf16_bits(rows)))
    np.testing.assert_allclose(updated, rows - 0.5, rtol=1e-6, atol=1e-6)  # the bf16 gradients of 1 arrive exactly


@pytest.mark.parametrize("block_size", [None, 16, 50])
def test_int8_round_trip_error_bound_and_bytes(block_size):
    x = _tensor(3, (40, 32))
    codec = Int8Codec(block_size)
    packed = codec.encode(x)
    back = codec.decode(packed)
    blocks = x.reshape(-1, 32) if block_size is None else torch.nn.functional.pad(
        x.reshape(-1), (0, -x.numel() % block_size)).reshape(-1, block_size)
    n_blocks = blocks.shape[0]
    assert packed.nbytes == n_blocks * blocks.shape[1] + 4 * n_blocks
    bound = blocks.abs().amax(dim=1) / 254 * (1 + 1e-6)
    error = torch.nn.functional.pad((back - x).abs().reshape(-1), (0, blocks.numel() - x.numel())).reshape(blocks.shape)
    assert bool((error <= bound[:, None]).all())
    zeros = torch.zeros(3, 8)
    assert torch.equal(codec.decode(codec.encode(zeros)), zeros)


def test_int8_is_refused_for_gradients_and_non_finite_values():
    with pytest.raises(ValueError, match="forward activations only"):
        Int8Codec().encode(torch.ones(2, 2), "grad", gradient=True)
    with pytest.raises(ValueError, match="NaN/inf"):
        Int8Codec().encode(torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(ValueError, match="must be one of"):
        make_codec("int4")


def test_topk_bytes_and_selection():
    x = _tensor(4, (1000,))
    packed = TopKCodec(0.05).encode(x)
    assert packed.nbytes == 50 * (4 + 4)
    kept = packed.tensors["indices"].long()
    assert set(kept.tolist()) == set(torch.topk(x.abs(), 50).indices.tolist())
    assert TopKCodec(0.05, values="bf16").encode(x).nbytes == 50 * (4 + 2)
    with pytest.raises(ValueError, match="ratio"):
        TopKCodec(0.0)


@pytest.mark.parametrize("values", ["float32", "bf16"])
def test_topk_error_feedback_sends_everything_eventually(values):
    """Over many steps, the sum of the decoded messages plus the residual equals the sum of the
    true gradients: nothing is lost, only delayed (bf16's rounding goes into the residual too)."""
    state = ErrorFeedback(TopKCodec(0.02, values=values))
    sent = torch.zeros(50, 20, dtype=torch.float64)
    true = torch.zeros(50, 20, dtype=torch.float64)
    for step in range(200):
        grad = _tensor(100 + step, (50, 20), spread=3.0)
        packed = state.encode(grad)
        assert packed.nbytes == 20 * (4 + (4 if values == "float32" else 2))
        sent += state.decode(packed).double()
        true += grad.double()
    assert state.steps == 200
    torch.testing.assert_close(sent + state.residual.double(), true, rtol=1e-5, atol=1e-4)
    assert float((true - sent).abs().max()) > 1.0  # the residual is not trivially empty
    with pytest.raises(ValueError, match="one state per tensor"):
        state.encode(torch.ones(3))


def test_wire_compresses_forward_and_backward_and_counts_the_bytes():
    torch.manual_seed(5)
    layer = nn.Linear(16, 4)
    x = torch.randn(32, 16, requires_grad=True)
    stats = WireStats()
    out = layer(wire(x, "int8", "bf16", stats))
    out.backward(torch.ones_like(out))
    assert stats.forward_bytes == 32 * 16 + 32 * 4 and stats.backward_bytes == 32 * 16 * 2
    assert stats.raw_bytes == 2 * 32 * 16 * 4 and stats.crossings == 1
    reference = torch.ones(32, 4) @ layer.weight  # the exact input gradient
    torch.testing.assert_close(x.grad, Bf16Codec().decode(Bf16Codec().encode(reference)), rtol=0, atol=0)
    codec = Int8Codec()
    torch.testing.assert_close(layer.weight.grad, torch.ones(32, 4).T @ codec.decode(codec.encode(x.detach())))
    exact = torch.randn(3, 5, requires_grad=True)
    assert torch.equal(wire(exact), exact)
    with pytest.raises(ValueError, match="gradients lose too much"):
        wire(exact, "bf16", "int8")


# ------------------------------------------------------------------------------------ DDP hooks
STEPS = 12
ROWS = 20


def _rank_gradients(rank: int) -> torch.Tensor:
    """[STEPS, ROWS] gradients rank `rank` produces: loss = sum(w . x) has gradient x, whatever w is."""
    return _tensor(500 + rank, (STEPS, ROWS), spread=3.0)


def _worker(rank: int, port: int, out):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=30))
    try:
        for codec in ("topk", "bf16"):
            torch.manual_seed(0)
            model = nn.Linear(ROWS, 1, bias=False)
            ddp = nn.parallel.DistributedDataParallel(model)
            hook = dense_comm_hook(codec, topk_ratio=0.1)
            hook.register(ddp)
            averaged = torch.zeros(ROWS, dtype=torch.float64)
            grads = _rank_gradients(rank)
            for step in range(STEPS):
                ddp.zero_grad()
                ddp(grads[step][None, :]).sum().backward()
                averaged += model.weight.grad.reshape(-1).double()
            residual = hook.state.residual_of(0)
            total = (torch.zeros(ROWS) if residual is None else residual).double()
            torch.distributed.all_reduce(total)
            out.put((codec, rank, averaged.numpy(), (total / 2).numpy(), hook.state.bytes_sent,
                     hook.state.raw_bytes, hook.state.steps))
    except BaseException:
        torch.distributed.destroy_process_group()
        raise
    out.close()
    out.join_thread()  # the results are in the pipe
    # every collective has returned on both ranks: the worker leaves without the interpreter's
    # teardown, in which a gloo rank has aborted (SIGABRT, "terminate called without an active
    # exception") after its peer had gone
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def gloo_results():
    """{codec: [(rank, averaged gradient sum, mean residual, bytes sent, raw bytes, steps)] * 2}
    from two processes running DDP with each hook (one process group for both, so the test pays
    for one start-up). Spawned, not forked: a fork inherits whatever the test process's thread
    pools (torch's, numba's) hold at that moment, and a child can hang on it."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(rank, port, out), daemon=True) for rank in range(2)]
    for p in procs:
        p.start()
    try:
        rows = [out.get(timeout=60) for _ in range(4)]
    finally:
        for p in procs:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs)
    return {codec: sorted(r[1:] for r in rows if r[0] == codec) for codec in ("topk", "bf16")}


def test_topk_hook_over_gloo_keeps_the_sum_of_gradients(gloo_results):
    results = gloo_results["topk"]
    true_mean = (_rank_gradients(0).double() + _rank_gradients(1).double()).sum(0) / 2
    for rank, averaged, mean_residual, sent, raw, steps in results:
        assert steps == STEPS
        # the first step is a plain allreduce; then 2 of 20 entries (int32 index + float32 value) a step
        assert sent == ROWS * 4 + (STEPS - 1) * 2 * 8 and raw == STEPS * ROWS * 4
        np.testing.assert_allclose(averaged + mean_residual, true_mean.numpy(), rtol=1e-5, atol=1e-4)
        assert np.abs(mean_residual).max() > 0.1
    np.testing.assert_array_equal(results[0][1], results[1][1])  # both replicas got the same gradients


def test_bf16_hook_over_gloo_averages_within_bf16_precision(gloo_results):
    results = gloo_results["bf16"]
    true = (_rank_gradients(0).double() + _rank_gradients(1).double()) / 2
    for rank, averaged, _, sent, raw, _ in results:
        assert sent * 2 == raw
        np.testing.assert_allclose(averaged, true.sum(0).numpy(), rtol=0,
                                   atol=float(true.abs().sum()) * 2.0**-7)
    assert dense_comm_hook("none") is None
    with pytest.raises(ValueError, match="dense_codec must be one of"):
        dense_comm_hook("int8")
