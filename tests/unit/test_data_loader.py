"""Tests of the prefetch loader (order, error propagation, clean stop) and row splits."""
import threading

import numpy as np
import pytest

from hybridrec.data.loader import PrefetchLoader, RowRange, split_first_rows, split_fraction
from hybridrec.data.synthetic import SyntheticReader, criteo_like

SMALL = criteo_like(n_categorical=3, n_dense=2)


def prefetch_threads():
    return [t for t in threading.enumerate() if t.name == "hybridrec-prefetch"]


def test_prefetch_yields_the_source_batches_in_order():
    source = SyntheticReader(SMALL, rows=5000, batch_size=700, seed=4)
    expected = [b.sample_ids.tolist() for b in source]
    with PrefetchLoader(source, depth=2) as loader:
        got = [b.sample_ids.tolist() for b in loader]
    assert got == expected
    assert not prefetch_threads()


def test_reader_error_reaches_the_consumer_after_the_good_batches():
    def failing():
        yield from SyntheticReader(SMALL, rows=200, batch_size=100)
        raise OSError("disk vanished")

    class Source:
        def __iter__(self):
            return failing()

    seen = []
    with pytest.raises(OSError, match="disk vanished"):
        for batch in PrefetchLoader(Source(), depth=1):
            seen.append(len(batch))
    assert seen == [100, 100]
    assert not prefetch_threads()


def test_leaving_early_stops_an_endless_producer():
    class Endless:
        def __iter__(self):
            while True:
                yield from SyntheticReader(SMALL, rows=100, batch_size=50)

    loader = PrefetchLoader(Endless(), depth=2, join_timeout_seconds=5.0)
    iterator = iter(loader)
    first = [next(iterator) for _ in range(3)]
    iterator.close()
    assert len(first) == 3 and not prefetch_threads()


def test_first_rows_split_is_disjoint_and_covering():
    source = SyntheticReader(SMALL, rows=3000, batch_size=512, seed=1)
    train, test = split_first_rows(source, 1234)
    train_ids = np.concatenate([b.sample_ids for b in train])
    test_ids = np.concatenate([b.sample_ids for b in test])
    assert train_ids.tolist() == list(range(1234))
    assert test_ids.tolist() == list(range(1234, 3000))


def test_fraction_split_counts_rows_from_the_source():
    source = SyntheticReader(SMALL, rows=1000, batch_size=300)
    train, test = split_fraction(source, 0.25)
    assert sum(len(b) for b in train) == 750
    assert sum(len(b) for b in test) == 250
    with pytest.raises(ValueError, match="test_fraction must be in \\(0, 1\\), got 1.5"):
        split_fraction(source, 1.5)


def test_row_range_rejects_a_stop_before_start():
    with pytest.raises(ValueError, match="stop must be None or an int >= start"):
        RowRange([], 10, 5)
