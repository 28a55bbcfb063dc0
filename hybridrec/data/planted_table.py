"""A small tabular CSV with a planted logistic model, as a user's own file looks: string
categoricals with empty cells, numeric columns on different scales with gaps, a 0/1 label.

What small-data defaults are measured on (`hybridrec bench small-data`) and tested with. The
label of a row is drawn from sigmoid(bias + the weights of its categories + linear effects of
its standardised numbers + one pairwise interaction of two categoricals), so a logistic
regression on one-hot columns gets most of the signal and a factorisation model can get the
rest. Missing cells carry no signal (they are left out at random). No real data set is used.
"""
from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import numpy as np

CATEGORICAL = ("city", "device", "plan", "channel", "product")
VOCAB = (40, 6, 4, 12, 150)
NUMERIC = ("age", "income", "visits")
LABEL = "converted"


@dataclass(frozen=True)
class PlantedTable:
    """What `write_planted_table` wrote: the schema of a config and the planted model's AUC on
    the last `test_rows` rows (the best a learned model can expect there)."""

    path: Path
    rows: int
    test_rows: int
    planted_auc: float

    @staticmethod
    def schema() -> dict:
        return {"labels": [LABEL], "dense": list(NUMERIC), "categorical": list(CATEGORICAL)}


def write_planted_table(path, rows: int = 5_000, seed: int = 0, missing: float = 0.1,
                        test_fraction: float = 0.2) -> PlantedTable:
    """Write `rows` rows to `path` (header line first); the planted model is fixed by `seed`."""
    from hybridrec.metrics import auc

    rng = np.random.default_rng(seed)
    weights = [rng.normal(0.0, 0.6, size) for size in VOCAB]
    pair = rng.normal(0.0, 0.8, (VOCAB[1], VOCAB[2]))  # device x plan
    codes = [rng.integers(0, size, rows) if size < 100 else _zipf(rng, size, rows) for size in VOCAB]
    age = rng.normal(40, 12, rows).clip(18, 90)
    income = rng.lognormal(10.5, 0.6, rows)
    visits = rng.poisson(3.0, rows).astype(np.float64)
    logit = -0.8 + sum(w[c] for w, c in zip(weights, codes)) + pair[codes[1], codes[2]]
    logit += 0.5 * (age - 40) / 12 - 0.4 * (np.log(income) - 10.5) / 0.6 + 0.3 * (visits - 3.0) / 1.7
    labels = (rng.random(rows) < 1.0 / (1.0 + np.exp(-logit))).astype(int)
    test = int(round(rows * test_fraction))
    planted = auc(labels[rows - test:], 1.0 / (1.0 + np.exp(-logit[rows - test:]))) if test else float("nan")
    gaps = rng.random((rows, len(VOCAB) + len(NUMERIC))) < missing
    with open(path, "w", newline="") as handle:
        out = csv.writer(handle)
        out.writerow([LABEL, *CATEGORICAL, *NUMERIC])
        for r in range(rows):
            cells = [f"{name[:3]}_{codes[j][r]}" for j, name in enumerate(CATEGORICAL)]
            cells += [f"{age[r]:.0f}", f"{income[r]:.2f}", f"{visits[r]:.0f}"]
            out.writerow([labels[r], *("" if gaps[r, j] else cell for j, cell in enumerate(cells))])
    return PlantedTable(Path(path), rows, test, float(planted))


def _zipf(rng, size: int, rows: int) -> np.ndarray:
    """Codes 0..size-1 drawn with probability ~ 1/(k+1): a long tail of rare values."""
    p = 1.0 / np.arange(1, size + 1)
    return rng.choice(size, rows, p=p / p.sum())
