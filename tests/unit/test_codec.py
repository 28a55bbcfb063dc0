"""Wire codecs: exact ID round trips (any bag order, huge batches), byte savings, fp16 error."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from hybridrec.comm.codec import (
    FP16_SCALE_TARGET, Encoded, Fp16BlockCodec, RawIdCodec, RawValueCodec, UniqueIdCodec, make_id_codec,
    make_value_codec,
)
from hybridrec.data.batch import JaggedFeatures


def zipf_features(batch_size, num_features, max_len, seed, exponent=1.2):
    """Multi-hot Zipf IDs in random bag order, with empty bags and repeated IDs in a bag."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, max_len + 1, size=num_features * batch_size)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    ranks = rng.zipf(exponent, size=int(offsets[-1])).astype(np.uint64)
    values = ranks * np.uint64(0x9E3779B97F4A7C15)  # spread over all 64 bits
    return JaggedFeatures([f"f{i}" for i in range(num_features)], values, offsets)


def assert_same_features(actual, expected):
    assert actual.names == expected.names
    np.testing.assert_array_equal(actual.offsets, expected.offsets)
    np.testing.assert_array_equal(actual.values, expected.values)
    assert actual.values.dtype == np.uint64 and actual.offsets.dtype == np.int64


@pytest.mark.parametrize("codec", [RawIdCodec(), UniqueIdCodec()], ids=["none", "unique"])
def test_id_codecs_round_trip_multi_hot_batch_exactly(codec):
    features = zipf_features(batch_size=500, num_features=3, max_len=6, seed=1)
    assert_same_features(codec.decode(codec.encode(features)), features)


def test_unique_codec_splits_a_batch_larger_than_uint16_into_sub_batches():
    rng = np.random.default_rng(2)
    batch_size = 70_000  # > 65535: sample positions no longer fit one uint16 range
    values = rng.zipf(1.3, size=2 * batch_size).astype(np.uint64)
    offsets = np.arange(2 * batch_size + 1, dtype=np.int64)
    features = JaggedFeatures(["a", "b"], values, offsets)
    encoded = UniqueIdCodec().encode(features)
    assert encoded.arrays["positions"].dtype == np.uint16
    assert_same_features(UniqueIdCodec().decode(encoded), features)


@settings(max_examples=60, deadline=None)
@given(
    bags=st.lists(st.lists(st.integers(0, 2**64 - 1) | st.integers(0, 5), max_size=5),
                  min_size=2, max_size=40),
    num_features=st.sampled_from([1, 2]),
    sub_batch=st.integers(1, 7),
)
def test_unique_codec_round_trips_any_jagged_batch(bags, num_features, sub_batch):
    bags = bags[: len(bags) // num_features * num_features]
    lengths = [len(bag) for bag in bags]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    values = np.array([key for bag in bags for key in bag], dtype=np.uint64)
    features = JaggedFeatures([f"f{i}" for i in range(num_features)], values, offsets)
    codec = UniqueIdCodec(max_sub_batch=sub_batch)
    assert_same_features(codec.decode(codec.encode(features)), features)


def test_unique_codec_sends_each_key_once_per_feature_and_ranks_only_when_needed():
    one_hot = JaggedFeatures(["a"], np.array([7, 3, 7, 7, 3], dtype=np.uint64),
                             np.arange(6, dtype=np.int64))
    encoded = UniqueIdCodec().encode(one_hot)
    np.testing.assert_array_equal(np.sort(encoded.arrays["keys"]), [3, 7])
    assert "ranks" not in encoded.arrays
    # sample 1 lists key 9 before key 1, which the batch saw first (in sample 0)
    reordered = JaggedFeatures(["a"], np.array([1, 9, 1], dtype=np.uint64),
                               np.array([0, 1, 3], dtype=np.int64))
    encoded = UniqueIdCodec().encode(reordered)
    assert "ranks" in encoded.arrays
    assert_same_features(UniqueIdCodec().decode(encoded), reordered)


def test_unique_ids_and_fp16_rows_take_3x_fewer_bytes_than_int64_keys_and_fp32_rows():
    features = zipf_features(batch_size=4096, num_features=8, max_len=3, seed=3)
    dim = 16
    rng = np.random.default_rng(4)
    ids = UniqueIdCodec().encode(features)
    unique_rows = rng.standard_normal((len(ids.arrays["keys"]), dim)).astype(np.float32)
    occurrence_rows = rng.standard_normal((len(features.values), dim)).astype(np.float32)
    baseline = RawIdCodec().encode(features).nbytes + RawValueCodec().encode(occurrence_rows).nbytes
    compressed = ids.nbytes + Fp16BlockCodec().encode(unique_rows).nbytes
    assert baseline >= 3 * compressed, (baseline, compressed)


def test_encoded_nbytes_counts_every_array_on_the_wire():
    encoded = Encoded("x", {"a": np.zeros(3, np.uint64), "b": np.zeros((2, 5), np.float16)})
    assert encoded.nbytes == 3 * 8 + 2 * 5 * 2


@pytest.mark.parametrize("block_size", [None, 4])
def test_fp16_error_is_within_half_an_fp16_ulp_of_each_block_norm(block_size):
    rng = np.random.default_rng(5)
    magnitudes = 10.0 ** rng.uniform(-30, 30, size=(300, 1))  # far outside fp16's own range
    rows = (rng.standard_normal((300, 16)) * magnitudes).astype(np.float32)
    codec = Fp16BlockCodec(block_size=block_size)
    encoded = codec.encode(rows)
    decoded = codec.decode(encoded)
    block = 16 if block_size is None else block_size
    norms = np.abs(rows.reshape(300, -1, block)).max(axis=2, keepdims=True)
    error = np.abs(decoded - rows).reshape(300, -1, block)
    assert np.all(error <= norms * (2.0**-11 + 2.0**-20))
    assert encoded.arrays["values"].dtype == np.float16


def test_fp16_keeps_all_zero_blocks_exactly_zero():
    rows = np.zeros((3, 8), dtype=np.float32)
    rows[1, :4] = [1.0, -2.0, 0.5, 3.0]
    codec = Fp16BlockCodec(block_size=4)
    decoded = codec.decode(codec.encode(rows))
    assert np.all(decoded[[0, 2]] == 0) and np.all(decoded[1, 4:] == 0)
    assert np.all(np.isfinite(decoded))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_fp16_rejects_non_finite_input_naming_the_argument(bad):
    grads = np.ones((2, 4), dtype=np.float32)
    grads[1, 2] = bad
    with pytest.raises(ValueError, match="grads"):
        Fp16BlockCodec().encode(grads, argument="grads")


def test_codecs_reject_bad_arguments_with_the_allowed_values():
    with pytest.raises(ValueError, match="unique"):
        make_id_codec("zstd")
    with pytest.raises(ValueError, match="fp16"):
        make_value_codec("int3")
    with pytest.raises(ValueError, match="block_size"):
        Fp16BlockCodec(block_size=3).encode(np.ones((2, 8), np.float32))
    with pytest.raises(TypeError, match="float32"):
        Fp16BlockCodec().encode(np.ones((2, 8), np.float64))
    with pytest.raises(ValueError, match="max_sub_batch"):
        UniqueIdCodec(max_sub_batch=70_000)


def test_unique_decode_rejects_tampered_positions():
    features = zipf_features(batch_size=50, num_features=2, max_len=2, seed=6)
    encoded = UniqueIdCodec().encode(features)
    positions = encoded.arrays["positions"].copy()
    positions[0] = 60_000
    tampered = Encoded(encoded.codec, {**encoded.arrays, "positions": positions}, encoded.meta)
    with pytest.raises(ValueError, match="positions"):
        UniqueIdCodec().decode(tampered)
    with pytest.raises(ValueError, match="codec"):
        RawIdCodec().decode(encoded)


def torch_fp16_reference(rows, block, scale_target):
    """The torch implementation the numba fp16 kernels replaced: (values, scales, decoded)."""
    import torch

    n, dim = rows.shape
    blocks = torch.from_numpy(rows.copy()).view(n, dim // block, block)
    norms = blocks.abs().amax(dim=2) if rows.size else torch.zeros(n, dim // block)
    scales = (scale_target / norms).clamp_(max=float(np.finfo(np.float32).max))
    values = torch.empty((n, dim // block, block), dtype=torch.float16)
    torch.mul(blocks, scales.unsqueeze(2), out=values)
    decoded = torch.div(values, scales.unsqueeze(2)).view(n, dim)
    return values.view(n, dim).numpy(), scales.numpy(), decoded.numpy()


def awkward_rows(n, dim, seed):
    """Rows mixing zero rows and blocks, -0.0, negatives, huge and tiny magnitudes, and values
    that land in fp16's subnormal range (or below it) once scaled by their block's norm."""
    rng = np.random.default_rng(seed)
    magnitudes = 10.0 ** rng.uniform(-44, 38, size=(n, 1))
    rows = rng.standard_normal((n, dim)) * magnitudes
    rows *= 10.0 ** rng.uniform(-12, 0, size=(n, dim)) * (rng.random((n, dim)) < 0.3) + (rng.random((n, dim)) >= 0.3)
    rows = rows.astype(np.float32)
    rows[rng.random(n) < 0.1] = 0.0
    rows[rng.random((n, dim)) < 0.05] = -0.0
    rows[rng.random((n, dim)) < 0.02] = np.float32(2.0**-149)  # float32's smallest subnormal
    return rows


@pytest.mark.parametrize("dim, block_size", [(1, None), (4, None), (4, 1), (16, None), (16, 4),
                                             (17, None), (17, 1), (64, None), (64, 16)])
@pytest.mark.parametrize("scale_target", [16384.0, 1000.1, 32768.0])
def test_fp16_is_bit_identical_to_the_torch_cast_it_replaced(dim, block_size, scale_target):
    codec = Fp16BlockCodec(block_size=block_size, scale_target=scale_target)
    for seed in range(4):
        rows = awkward_rows(257, dim, seed)
        encoded = codec.encode(rows)
        values, scales, decoded = torch_fp16_reference(rows, dim if block_size is None else block_size,
                                                       scale_target)
        assert encoded.arrays["values"].dtype == np.float16 and encoded.arrays["scales"].dtype == np.float32
        assert encoded.arrays["values"].shape == values.shape and encoded.arrays["scales"].shape == scales.shape
        assert encoded.arrays["values"].tobytes() == values.tobytes()
        assert encoded.arrays["scales"].tobytes() == scales.tobytes()
        assert codec.decode(encoded).tobytes() == decoded.tobytes()


def test_fp16_casts_every_float32_bit_pattern_range_like_torch():
    """Scale 1 blocks (norm == scale_target) put every fp16 rounding case through the kernels:
    ties to even, subnormals, the smallest normal, values rounding up to the next binade."""
    rng = np.random.default_rng(7)
    bits = rng.integers(0x30000000, 0x46800000, size=(4096, 15), dtype=np.uint32)
    bits |= rng.integers(0, 2, size=bits.shape, dtype=np.uint32) << np.uint32(31)
    bits[:, :3] = (bits[:, :3] & np.uint32(0xFFFFE000)) | np.uint32(0x1000)  # exact ties
    rows = np.concatenate([bits.view(np.float32), np.full((4096, 1), 16384.0, np.float32)], axis=1)
    steps = rng.integers(0, 1024, size=(4096, 3)) + 0.5  # ties between fp16 subnormals
    rows[:, 3:6] = steps * 2.0**-24 * np.where(rng.random((4096, 3)) < 0.5, -1, 1)
    rows[:, 6:8] = [2.0**-25, 1.5 * 2.0**-25]  # halfway to the smallest subnormal, and past it
    codec = Fp16BlockCodec()
    encoded = codec.encode(rows)
    values, scales, decoded = torch_fp16_reference(rows, 16, 16384.0)
    assert np.all(scales == 1.0)
    assert encoded.arrays["values"].tobytes() == values.tobytes()
    assert codec.decode(encoded).tobytes() == decoded.tobytes()


def test_fp16_decodes_every_float16_like_torch():
    import torch

    values = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).reshape(-1, 16)
    scales = np.random.default_rng(8).uniform(0.5, 3.0, size=(len(values), 1)).astype(np.float32)
    encoded = Encoded("fp16", {"values": values, "scales": scales}, {"block_size": 16})
    expected = torch.div(torch.from_numpy(values), torch.from_numpy(scales)).numpy()
    assert Fp16BlockCodec().decode(encoded).tobytes() == expected.tobytes()


def test_fp16_accepts_read_only_and_empty_arrays():
    rows = awkward_rows(8, 16, 9)
    rows.flags.writeable = False
    codec = Fp16BlockCodec(block_size=4)
    encoded = codec.encode(rows)
    frozen = {name: array.copy() for name, array in encoded.arrays.items()}
    for array in frozen.values():
        array.flags.writeable = False
    decoded = codec.decode(Encoded("fp16", frozen, encoded.meta))
    assert decoded.tobytes() == torch_fp16_reference(rows, 4, FP16_SCALE_TARGET)[2].tobytes()
    for shape in [(0, 16), (3, 0)]:
        empty = codec.encode(np.zeros(shape, np.float32))
        assert codec.decode(empty).shape == shape
