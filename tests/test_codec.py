"""Wire codecs: exact ID round trips (any bag order, huge batches), byte savings, fp16 error."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from hybridrec.comm.codec import (
    Encoded, Fp16BlockCodec, RawIdCodec, RawValueCodec, UniqueIdCodec, make_id_codec,
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
