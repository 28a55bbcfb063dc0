"""Tests of the Batch / JaggedFeatures contract: validation, per-feature access, row slicing,
concatenation and rebatching."""
import numpy as np
import pytest
import torch

from hybridrec.data.batch import Batch, JaggedFeatures, rebatch


def random_batch(rows: int, seed: int = 0, first_id: int = 0) -> Batch:
    rng = np.random.default_rng(seed)
    names = ["a", "b", "c"]
    lengths = rng.integers(0, 4, size=len(names) * rows)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    values = rng.integers(0, 2**63, size=offsets[-1], dtype=np.uint64) * np.uint64(2)
    return Batch(JaggedFeatures(names, values, offsets),
                 rng.random((rows, 2), dtype=np.float32),
                 rng.integers(0, 2, (rows, 1)).astype(np.float32),
                 np.arange(first_id, first_id + rows, dtype=np.uint64))


def ids_of(batch: Batch, name: str, row: int) -> list[int]:
    values, offsets = batch.feature(name)
    return values[offsets[row]:offsets[row + 1]].tolist()


def test_feature_returns_each_samples_ids_with_rebased_offsets():
    names = ["x", "y"]
    # B = 2: x = [[1, 2], []], y = [[3], [4, 5]]
    offsets = np.array([0, 2, 2, 3, 5], dtype=np.int64)
    values = np.array([1, 2, 3, 4, 5], dtype=np.uint64)
    batch = Batch(JaggedFeatures(names, values, offsets), np.zeros((2, 0), np.float32),
                  np.zeros((2, 1), np.float32), np.arange(2, dtype=np.uint64)).validate()
    y_values, y_offsets = batch.feature("y")
    assert y_offsets.tolist() == [0, 1, 3]
    assert y_values.tolist() == [3, 4, 5]
    assert ids_of(batch, "x", 1) == []
    with pytest.raises(KeyError, match="'z'"):
        batch.feature("z")


@pytest.mark.parametrize("mutate, error, message", [
    (lambda b: setattr(b.sparse, "values", b.sparse.values.astype(np.int64)), TypeError,
     "values must have dtype uint64"),
    (lambda b: b.sparse.offsets.__setitem__(2, b.sparse.offsets[3] + 1), ValueError,
     "non-decreasing"),
    (lambda b: setattr(b.sparse, "values", b.sparse.values[:-1]), ValueError,
     "must equal len\\(values\\)"),
    (lambda b: setattr(b.sparse, "offsets", b.sparse.offsets + 1), ValueError,
     "start with 0"),
    (lambda b: setattr(b, "dense", b.dense[:-1]), ValueError, "dense has 4 rows"),
    (lambda b: setattr(b, "labels", b.labels.astype(np.float64)), TypeError,
     "labels must have dtype float32"),
    (lambda b: setattr(b, "sample_ids", b.sample_ids[:-1]), ValueError,
     "dense has 5 rows, expected B = 4"),
])
def test_validate_names_the_broken_invariant(mutate, error, message):
    batch = random_batch(5, seed=3)
    batch.sparse.values = np.append(batch.sparse.values, np.uint64(7))  # ensure non-empty
    batch.sparse.offsets[-1] += 1
    batch.validate()
    mutate(batch)
    with pytest.raises(error, match=message):
        batch.validate()


def test_slices_concatenate_back_to_the_original():
    batch = random_batch(50, seed=1)
    parts = [batch.slice_rows(0, 7), batch.slice_rows(7, 7), batch.slice_rows(7, 50)]
    for part in parts:
        part.validate()
    joined = Batch.concat(parts).validate()
    np.testing.assert_array_equal(joined.sparse.values, batch.sparse.values)
    np.testing.assert_array_equal(joined.sparse.offsets, batch.sparse.offsets)
    np.testing.assert_array_equal(joined.dense, batch.dense)
    assert ids_of(parts[2], "b", 3) == ids_of(batch, "b", 10)


def test_rebatch_gives_exact_sizes_and_keeps_row_order():
    stream = [random_batch(n, seed=n, first_id=start)
              for n, start in ((5, 0), (13, 5), (1, 18), (9, 19))]
    out = list(rebatch(stream, 8))
    assert [len(b) for b in out] == [8, 8, 8, 4]
    assert np.concatenate([b.sample_ids for b in out]).tolist() == list(range(28))
    assert ids_of(out[1], "c", 0) == ids_of(stream[1], "c", 3)
    assert [len(b) for b in rebatch(stream, 8, drop_last=True)] == [8, 8, 8]
    with pytest.raises(ValueError, match="batch_size"):
        list(rebatch(stream, 0))


def test_to_torch_shares_memory_with_the_arrays():
    batch = random_batch(4)
    dense, labels = batch.to_torch()
    assert dense.dtype == torch.float32 and labels.shape == (4, 1)
    batch.dense[0, 0] = 42.0
    assert dense[0, 0].item() == 42.0
