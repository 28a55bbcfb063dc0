"""Evaluation metrics for CTR models: exact AUC, logloss, normalized entropy, and a
streaming accumulator that gathers predictions over batches (per task); and the histogram in
which training reports how stale its reads were (`StalenessHistogram`).

All functions take probabilities (not logits) and binary labels as 1-d arrays and are
vectorised numpy: AUC is rank based, O(n log n), with tied scores given their average
rank (the Mann-Whitney statistic), so it equals the area under the ROC curve exactly.
AUC is undefined when only one class is present; it is then nan, not an error.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

DEFAULT_EPS = 1e-7


def _as_1d(name: str, values: object) -> np.ndarray:
    if hasattr(values, "detach"):  # torch tensor: no torch import needed at module level
        values = values.detach().cpu().numpy()
    array = np.asarray(values, dtype=np.float64)
    if array.ndim != 1:
        raise ValueError(f"{name} must be 1-d; got shape {array.shape}")
    if not np.isfinite(array).all():
        raise ValueError(f"{name} must be finite; got {np.count_nonzero(~np.isfinite(array))} nan/inf values")
    return array


def _labels_and_probs(labels: object, probs: object, *, binary: bool) -> tuple[np.ndarray, np.ndarray]:
    y = _as_1d("labels", labels)
    p = _as_1d("probs", probs)
    if y.shape != p.shape:
        raise ValueError(f"labels and probs must have the same length; got {y.shape[0]} and {p.shape[0]}")
    if binary and not np.isin(y, (0.0, 1.0)).all():
        raise ValueError(f"labels must be 0 or 1; got values such as {np.setdiff1d(y, (0.0, 1.0))[:3].tolist()}")
    if not binary and ((y < 0) | (y > 1)).any():
        raise ValueError("labels must lie in [0, 1]")
    return y, p


def _check_eps(eps: float) -> float:
    if not 0.0 < eps < 0.5:
        raise ValueError(f"eps must be in (0, 0.5); got {eps!r}")
    return eps


def auc(labels: object, scores: object) -> float:
    """Exact area under the ROC curve; nan when `labels` holds a single class (or is empty)."""
    y, s = _labels_and_probs(labels, scores, binary=True)
    positives = int(y.sum())
    negatives = y.size - positives
    if positives == 0 or negatives == 0:
        return float("nan")
    order = np.argsort(s, kind="stable")
    sorted_scores = s[order]
    # Runs of equal scores share the average of the 1-based ranks they span.
    run_starts = np.flatnonzero(np.r_[True, sorted_scores[1:] != sorted_scores[:-1]])
    run_ends = np.r_[run_starts[1:], s.size]
    average_rank = (run_starts + run_ends + 1) / 2.0
    ranks = np.repeat(average_rank, run_ends - run_starts)
    positive_rank_sum = ranks[y[order] == 1.0].sum()
    return float((positive_rank_sum - positives * (positives + 1) / 2.0) / (positives * negatives))


def logloss(labels: object, probs: object, eps: float = DEFAULT_EPS) -> float:
    """Mean binary cross-entropy, probabilities clipped to [eps, 1 - eps]; nan for no samples."""
    y, p = _labels_and_probs(labels, probs, binary=False)
    if y.size == 0:
        return float("nan")
    p = np.clip(p, _check_eps(eps), 1.0 - eps)
    return float(-np.mean(y * np.log(p) + (1.0 - y) * np.log1p(-p)))


def normalized_entropy(labels: object, probs: object, eps: float = DEFAULT_EPS) -> float:
    """Logloss divided by the entropy of the base rate (He et al., 2014); < 1 beats the base rate.

    nan when the base rate is 0 or 1 (its entropy is 0) or there are no samples.
    """
    y, _ = _labels_and_probs(labels, probs, binary=False)
    base_rate = float(y.mean()) if y.size else float("nan")
    if not 0.0 < base_rate < 1.0:
        return float("nan")
    base_entropy = -(base_rate * np.log(base_rate) + (1.0 - base_rate) * np.log1p(-base_rate))
    return logloss(labels, probs, eps) / float(base_entropy)


class MetricAccumulator:
    """Collects probabilities and labels over batches and reports AUC, logloss and NE per task.

    `update(probs, labels)` takes arrays or tensors of shape [B] or [B, num_tasks].
    `compute()` returns {"auc", "logloss", "ne", "count"} for one task and
    {"<task>/auc", "<task>/logloss", "<task>/ne", ..., "count"} for several.
    """

    def __init__(self, num_tasks: int = 1, task_names: Sequence[str] | None = None, eps: float = DEFAULT_EPS):
        if isinstance(num_tasks, bool) or not isinstance(num_tasks, int) or num_tasks < 1:
            raise ValueError(f"num_tasks must be an int >= 1; got {num_tasks!r}")
        if task_names is None:
            task_names = [f"task{t}" for t in range(num_tasks)]
        if len(task_names) != num_tasks or len(set(task_names)) != num_tasks:
            raise ValueError(f"task_names must be {num_tasks} distinct names; got {list(task_names)!r}")
        self.num_tasks = num_tasks
        self.task_names = list(task_names)
        self.eps = _check_eps(eps)
        self.reset()

    def reset(self) -> None:
        """Forget every batch seen so far."""
        self._probs: list[np.ndarray] = []
        self._labels: list[np.ndarray] = []

    @property
    def count(self) -> int:
        """Number of samples collected."""
        return sum(chunk.shape[0] for chunk in self._labels)

    def _as_2d(self, name: str, values: object) -> np.ndarray:
        if hasattr(values, "detach"):
            values = values.detach().float().cpu().numpy()
        array = np.asarray(values, dtype=np.float32)
        if array.ndim == 1 and self.num_tasks == 1:
            array = array[:, None]
        if array.ndim != 2 or array.shape[1] != self.num_tasks:
            raise ValueError(f"{name} must have shape [B, {self.num_tasks}]; got {list(array.shape)}")
        return array

    def update(self, probs: object, labels: object) -> None:
        """Add one batch of predicted probabilities and their labels."""
        p = self._as_2d("probs", probs)
        y = self._as_2d("labels", labels)
        if p.shape[0] != y.shape[0]:
            raise ValueError(f"probs and labels must have the same batch size; got {p.shape[0]} and {y.shape[0]}")
        if p.size and (not np.isfinite(p).all() or p.min() < 0.0 or p.max() > 1.0):
            raise ValueError("probs must be probabilities in [0, 1] (apply a sigmoid to logits first)")
        self._probs.append(p)
        self._labels.append(y)

    def compute(self) -> dict[str, float]:
        """AUC, logloss and NE of everything collected, per task, plus the sample count."""
        probs = np.concatenate(self._probs) if self._probs else np.zeros((0, self.num_tasks), np.float32)
        labels = np.concatenate(self._labels) if self._labels else np.zeros((0, self.num_tasks), np.float32)
        results: dict[str, float] = {}
        for task, name in enumerate(self.task_names):
            prefix = "" if self.num_tasks == 1 else f"{name}/"
            y, p = labels[:, task], probs[:, task]
            results[f"{prefix}auc"] = auc(y, p)
            results[f"{prefix}logloss"] = logloss(y, p, self.eps)
            results[f"{prefix}ne"] = normalized_entropy(y, p, self.eps)
        results["count"] = float(labels.shape[0])
        return results


class StalenessHistogram:
    """Counts of non-negative integers (the staleness of reads: updates or steps a read missed)
    in power-of-two buckets: 0, 1, 2-3, 4-7, ...; with the exact count, sum and maximum. Two
    histograms merge by adding (`merge`), so each trainer keeps its own and the job sums them.
    `as_dict()` is what final_metrics.json holds; `from_dict` reads it back."""

    BUCKETS = 40

    def __init__(self) -> None:
        self.counts = np.zeros(self.BUCKETS, np.int64)
        self.total = 0
        self.sum = 0
        self.max = 0

    def add(self, values) -> None:
        values = np.asarray(values, np.int64).ravel()
        if values.size == 0:
            return
        if values.min() < 0:
            raise ValueError(f"staleness must be >= 0; got {int(values.min())}")
        buckets = np.minimum(np.ceil(np.log2(values + 1.0)).astype(np.int64), self.BUCKETS - 1)  # bit length
        self.counts += np.bincount(buckets, minlength=self.BUCKETS)
        self.total += int(values.size)
        self.sum += int(values.sum())
        self.max = max(self.max, int(values.max()))

    def merge(self, other: "StalenessHistogram") -> "StalenessHistogram":
        self.counts += other.counts
        self.total += other.total
        self.sum += other.sum
        self.max = max(self.max, other.max)
        return self

    @staticmethod
    def label(bucket: int) -> str:
        if bucket <= 1:
            return str(bucket)
        return f"{1 << (bucket - 1)}-{(1 << bucket) - 1}"

    def as_dict(self) -> dict:
        return {"count": self.total, "mean": self.sum / self.total if self.total else 0.0, "max": self.max,
                "sum": self.sum, "buckets": {self.label(b): int(n) for b, n in enumerate(self.counts) if n}}

    @classmethod
    def from_dict(cls, data: dict) -> "StalenessHistogram":
        histogram = cls()
        labels = {cls.label(b): b for b in range(cls.BUCKETS)}
        for label, count in data.get("buckets", {}).items():
            if label not in labels:
                raise ValueError(f"staleness histogram: unknown bucket {label!r}; buckets are 0, 1, 2-3, 4-7, ...")
            histogram.counts[labels[label]] = int(count)
        histogram.total, histogram.sum, histogram.max = int(data["count"]), int(data["sum"]), int(data["max"])
        return histogram
