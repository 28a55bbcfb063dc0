"""Tests of the synthetic generator: determinism, sharding, Zipf keys over uint64, the
planted model's AUC, and the TSV round trip through the real readers."""
import numpy as np
import pytest

from hybridrec.data.batch import Batch
from hybridrec.data.criteo import CriteoReader
from hybridrec.data.synthetic import (CRITEO_LIKE, SyntheticConfig, SyntheticReader,
                                      criteo_like, planted_auc, planted_probabilities,
                                      write_synthetic)
from hybridrec.data.tabular import DelimitedTextReader

SMALL = criteo_like(n_categorical=4, n_dense=3, n_multi_hot=2, vocab_size=5000)


def whole(reader) -> Batch:
    return Batch.concat(list(reader)).validate()


def assert_same(a: Batch, b: Batch) -> None:
    np.testing.assert_array_equal(a.sparse.values, b.sparse.values)
    np.testing.assert_array_equal(a.sparse.offsets, b.sparse.offsets)
    np.testing.assert_array_equal(a.labels, b.labels)
    np.testing.assert_array_equal(a.sample_ids, b.sample_ids)
    np.testing.assert_allclose(a.dense, b.dense, rtol=1e-6)


def test_same_seed_same_rows_whatever_the_batch_size_or_first_row():
    reference = whole(SyntheticReader(SMALL, rows=9000, batch_size=4096, seed=7))
    assert_same(whole(SyntheticReader(SMALL, rows=9000, batch_size=333, seed=7)), reference)
    tail = whole(SyntheticReader(SMALL, rows=5000, batch_size=1000, seed=7, first_row=4000))
    assert_same(tail, reference.slice_rows(4000, 9000))
    other = whole(SyntheticReader(SMALL, rows=9000, batch_size=4096, seed=8))
    assert not np.array_equal(other.sparse.values, reference.sparse.values)


def test_ranks_get_disjoint_covering_blocks():
    ids = [whole(SyntheticReader(SMALL, rows=20000, batch_size=1000, rank=r, world_size=3))
           .sample_ids for r in range(3)]
    assert sorted(np.concatenate(ids).tolist()) == list(range(20000))


def test_keys_are_zipf_skewed_and_spread_over_uint64():
    batch = whole(SyntheticReader(CRITEO_LIKE, rows=20000, batch_size=20000, seed=1))
    values, _ = batch.feature("C5")
    _, counts = np.unique(values, return_counts=True)
    assert counts.max() > 20 * len(values) / CRITEO_LIKE.vocab_size  # a hot head
    top_bit = (batch.sparse.values >> np.uint64(63)).mean()
    assert 0.45 < top_bit < 0.55
    lengths = whole(SyntheticReader(SMALL, rows=4000, batch_size=4000)).sparse.lengths()
    assert (lengths[:4] == 1).all() and lengths[4:].max() == SMALL.multi_hot_max_length
    assert (lengths[4:] == 0).any()


def test_planted_model_is_calibrated_and_its_auc_is_high():
    batch = whole(SyntheticReader(CRITEO_LIKE, rows=30000, batch_size=8192, seed=3))
    probabilities = planted_probabilities(batch, CRITEO_LIKE, seed=3)
    assert abs(probabilities.mean() - batch.labels.mean()) < 0.01
    held_out = planted_auc(CRITEO_LIKE, rows=30000, seed=3, first_row=30000)
    assert 0.75 < held_out < 0.95
    weak = criteo_like(id_weight_std=0.0, dense_weight_std=0.0)
    assert abs(planted_auc(weak, rows=20000, seed=3) - 0.5) < 0.03


def test_written_tsv_reads_back_into_the_generated_batches(tmp_path):
    path = tmp_path / "synth.tsv"
    schema = write_synthetic(path, rows=5000, seed=11)
    assert_same(whole(CriteoReader(path, batch_size=1024)),
                whole(SyntheticReader(CRITEO_LIKE, rows=5000, batch_size=1024, seed=11)))
    multi = tmp_path / "multi.tsv"
    schema = write_synthetic(multi, rows=3000, seed=2, config=SMALL)
    assert_same(whole(DelimitedTextReader(multi, schema, batch_size=700)),
                whole(SyntheticReader(SMALL, rows=3000, batch_size=700, seed=2)))


def test_bad_configs_name_the_parameter():
    with pytest.raises(ValueError, match="vocab_size must be in \\[1, 2\\*\\*32\\], got 0"):
        SyntheticConfig(vocab_size=0)
    with pytest.raises(ValueError, match="config preset must be one of \\['criteo-like'\\]"):
        SyntheticReader("avazu-like")
    with pytest.raises(ValueError, match="write_synthetic writes TSV"):
        write_synthetic("x.parquet", 10)
