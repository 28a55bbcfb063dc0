"""first_seen_unique, the one first-seen dedupe: distinct keys in order of first appearance and
each key's index among them, against a plain Python model."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridrec.embedding.dedupe import first_seen_unique


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from([0, 1, 7, 2**63, 2**64 - 1, 12345678901234567890]) | st.integers(0, 2**64 - 1),
                max_size=300))
def test_first_seen_unique_matches_a_python_model(values):
    keys = np.array(values, dtype=np.uint64)
    unique, inverse = first_seen_unique(keys)
    model = list(dict.fromkeys(values))
    assert unique.dtype == np.uint64 and inverse.dtype == np.int64
    assert unique.tolist() == model
    assert inverse.tolist() == [model.index(v) for v in values]


def test_first_seen_unique_takes_views_and_refuses_other_dtypes():
    keys = np.array([5, 3, 5, 9, 3, 3], dtype=np.uint64)
    unique, inverse = first_seen_unique(keys[::2])  # 5, 5, 3
    assert unique.tolist() == [5, 3] and inverse.tolist() == [0, 0, 1]
    with pytest.raises(TypeError, match="uint64"):
        first_seen_unique(keys.astype(np.int64))
