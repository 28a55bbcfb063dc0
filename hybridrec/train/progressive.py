"""Progressive validation (test-then-train, the online-learning convention): every training batch
is scored by the forward pass that trains it, before its update, so the training predictions are
honest predictions on data the model has not seen.

`ProgressiveMetrics` keeps two views of them: the exact AUC and logloss of the last `window`
samples (a ring of their scores and labels), and the cumulative ones since the run began, in
constant memory: logloss as a sum, AUC from per-class histograms of the scores in 2**16 bins
(pairs in one bin count half, so the cumulative AUC is exact up to scores within 1.5e-5 of each
other). Histograms add up, so the cumulative figures of several trainers merge exactly.
"""
from __future__ import annotations

import numpy as np

from hybridrec.metrics import auc

BINS = 1 << 16
_EPS = 1e-7


def _logloss_sum(probs: np.ndarray, labels: np.ndarray) -> float:
    p = np.clip(probs.astype(np.float64), _EPS, 1 - _EPS)
    return float(-(labels * np.log(p) + (1 - labels) * np.log(1 - p)).sum())


def binned_auc(positives: np.ndarray, negatives: np.ndarray) -> float:
    """AUC of scores given as per-bin counts of positives and negatives (ties within a bin: half)."""
    n_pos, n_neg = positives.sum(), negatives.sum()
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    below = np.cumsum(negatives) - negatives  # negatives in lower bins
    return float((positives * (below + 0.5 * negatives)).sum() / (n_pos * n_neg))


class ProgressiveMetrics:
    """Windowed and cumulative AUC / logloss of the first task's predictions, batch by batch."""

    def __init__(self, window: int) -> None:
        self.window = int(window)
        self._probs = np.zeros(self.window, np.float32)
        self._labels = np.zeros(self.window, np.float32)
        self._filled = 0
        self._next = 0
        self.histogram = np.zeros((2, BINS), np.int64)  # [negatives, positives] per score bin
        self.logloss_sum = 0.0
        self.count = 0

    def update(self, probs: np.ndarray, labels: np.ndarray) -> None:
        probs = np.asarray(probs, np.float32).reshape(len(probs), -1)[:, 0]
        labels = np.asarray(labels, np.float32).reshape(len(labels), -1)[:, 0]
        n = len(probs)
        if not n:
            return
        bins = np.minimum((probs.astype(np.float64) * BINS).astype(np.int64), BINS - 1)
        positive = labels > 0.5
        self.histogram[1] += np.bincount(bins[positive], minlength=BINS)
        self.histogram[0] += np.bincount(bins[~positive], minlength=BINS)
        self.logloss_sum += _logloss_sum(probs, labels)
        self.count += n
        take = probs[-self.window:], labels[-self.window:]
        for values, ring in zip(take, (self._probs, self._labels)):
            first = min(len(values), self.window - self._next)
            ring[self._next:self._next + first] = values[:first]
            ring[:len(values) - first] = values[first:]
        self._next = (self._next + len(take[0])) % self.window
        self._filled = min(self.window, self._filled + len(take[0]))

    def windowed(self) -> dict:
        probs, labels = self._probs[:self._filled], self._labels[:self._filled]
        if not self._filled:
            return {"window_auc": float("nan"), "window_logloss": float("nan"), "window_samples": 0}
        return {"window_auc": auc(labels, probs), "window_logloss": _logloss_sum(probs, labels) / self._filled,
                "window_samples": int(self._filled)}

    def cumulative(self) -> dict:
        return self.merged([self.state()])

    def state(self) -> dict:
        """What `merged` needs of this trainer's figures (sent between trainers)."""
        return {"histogram": self.histogram, "logloss_sum": self.logloss_sum, "count": self.count}

    @staticmethod
    def merged(states: list[dict]) -> dict:
        """Cumulative AUC, logloss and sample count of several trainers' `state()`s together."""
        histogram = sum(s["histogram"] for s in states)
        count = sum(s["count"] for s in states)
        return {"progressive_auc": binned_auc(histogram[1], histogram[0]),
                "progressive_logloss": sum(s["logloss_sum"] for s in states) / count if count else float("nan"),
                "progressive_samples": int(count)}
