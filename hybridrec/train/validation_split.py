"""The validation rows early stopping watches when a config names none: the last part of the
training rows (`data.valid_fraction`), sized so that its AUC is steady enough to compare steps
by and the training rows lose little: 15% of them, at least 1,000 rows when there are 5,000
or more, at most 100,000.
"""
from __future__ import annotations

SHARE = 0.15
MIN_ROWS = 1_000
MAX_ROWS = 100_000


def has_validation(data) -> bool:
    """Whether the data section names validation rows (a file or a fraction)."""
    return data.valid_path is not None or data.valid_fraction is not None


def default_fraction(training_rows: int) -> float:
    """data.valid_fraction for `training_rows` rows (before the split)."""
    rows = SHARE * training_rows
    if training_rows >= MIN_ROWS / 0.2:
        rows = max(rows, MIN_ROWS)
    rows = min(rows, MAX_ROWS)
    return round(rows / training_rows, 6) if training_rows else SHARE
