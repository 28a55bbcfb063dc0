"""Tests for hybridrec.metrics: AUC against scikit-learn (with ties), logloss and NE
against their formulas, and the streaming accumulator."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.metrics import roc_auc_score

from hybridrec.metrics import MetricAccumulator, auc, logloss, normalized_entropy


def random_scored_labels(seed: int, n: int, positive_rate: float, score_levels: int):
    """Labels correlated with scores; few distinct score levels force many ties."""
    rng = np.random.default_rng(seed)
    labels = (rng.random(n) < positive_rate).astype(np.float32)
    scores = np.round((rng.random(n) + 0.3 * labels) * score_levels) / score_levels
    return labels, scores


@pytest.mark.parametrize(
    "seed,n,positive_rate,score_levels",
    [(0, 50, 0.5, 3), (1, 1000, 0.1, 10), (2, 5000, 0.03, 1000), (3, 7, 0.5, 2), (4, 20000, 0.5, 10**6)],
)
def test_auc_matches_sklearn_with_ties(seed, n, positive_rate, score_levels):
    labels, scores = random_scored_labels(seed, n, positive_rate, score_levels)
    assert len(np.unique(labels)) == 2
    assert auc(labels, scores) == pytest.approx(roc_auc_score(labels, scores), abs=1e-12)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.booleans(), st.integers(min_value=0, max_value=4)), min_size=2, max_size=40)
    .filter(lambda rows: len({label for label, _ in rows}) == 2)
)
def test_auc_matches_sklearn_on_any_small_tied_sample(rows):
    labels = np.array([label for label, _ in rows], dtype=np.float64)
    scores = np.array([score for _, score in rows], dtype=np.float64)
    assert auc(labels, scores) == pytest.approx(roc_auc_score(labels, scores), abs=1e-12)


def test_auc_of_perfect_reversed_and_constant_scores():
    labels = np.array([0, 0, 1, 1])
    assert auc(labels, np.array([0.1, 0.2, 0.8, 0.9])) == 1.0
    assert auc(labels, np.array([0.9, 0.8, 0.2, 0.1])) == 0.0
    assert auc(labels, np.full(4, 0.5)) == 0.5


@pytest.mark.parametrize("labels", [np.zeros(5), np.ones(5), np.zeros(0)])
def test_auc_of_a_single_class_is_nan(labels):
    assert math.isnan(auc(labels, np.linspace(0, 1, labels.size)))


def test_auc_accepts_torch_tensors():
    labels, scores = random_scored_labels(5, 300, 0.4, 20)
    assert auc(torch.from_numpy(labels), torch.from_numpy(scores)) == pytest.approx(auc(labels, scores))


@pytest.mark.parametrize(
    "labels,scores,pattern",
    [([0, 1, 2], [0.1, 0.2, 0.3], "labels must be 0 or 1"), ([0, 1], [0.1, 0.2, 0.3], "same length"),
     ([[0, 1]], [[0.1, 0.2]], "1-d"), ([0, 1], [0.1, float("nan")], "finite")],
)
def test_auc_rejects_bad_input(labels, scores, pattern):
    with pytest.raises(ValueError, match=pattern):
        auc(labels, scores)


def test_logloss_matches_the_cross_entropy_formula():
    rng = np.random.default_rng(0)
    labels = (rng.random(500) < 0.3).astype(np.float64)
    probs = rng.uniform(0.01, 0.99, 500)
    expected = -np.mean(labels * np.log(probs) + (1 - labels) * np.log(1 - probs))
    assert logloss(labels, probs) == pytest.approx(expected, rel=1e-12)


def test_logloss_clips_certain_wrong_predictions_to_a_finite_loss():
    eps = 1e-6
    assert logloss([1, 0], [0.0, 1.0], eps=eps) == pytest.approx(-math.log(eps), rel=1e-9)


def test_normalized_entropy_divides_logloss_by_the_base_rate_entropy():
    rng = np.random.default_rng(1)
    labels = (rng.random(800) < 0.2).astype(np.float64)
    probs = rng.uniform(0.05, 0.6, 800)
    base = labels.mean()
    base_entropy = -(base * np.log(base) + (1 - base) * np.log(1 - base))
    assert normalized_entropy(labels, probs) == pytest.approx(logloss(labels, probs) / base_entropy, rel=1e-12)


def test_predicting_the_base_rate_has_normalized_entropy_one():
    labels = np.array([1, 0, 0, 0, 1, 0, 0, 0, 0, 0], dtype=np.float64)
    assert normalized_entropy(labels, np.full(10, labels.mean())) == pytest.approx(1.0)


def test_normalized_entropy_of_a_single_class_is_nan():
    assert math.isnan(normalized_entropy(np.ones(4), np.full(4, 0.9)))


def test_eps_outside_its_range_is_rejected():
    with pytest.raises(ValueError, match="eps.*0.7"):
        logloss([0, 1], [0.5, 0.5], eps=0.7)


def test_accumulator_over_batches_equals_metrics_of_the_whole_set():
    labels, scores = random_scored_labels(6, 1000, 0.25, 50)
    probs = np.clip(scores / scores.max(), 0, 1)
    accumulator = MetricAccumulator()
    for start in range(0, 1000, 128):
        accumulator.update(torch.from_numpy(probs[start : start + 128]), labels[start : start + 128])
    result = accumulator.compute()
    assert result["count"] == 1000
    assert result["auc"] == pytest.approx(auc(labels, probs.astype(np.float32)))
    assert result["logloss"] == pytest.approx(logloss(labels, probs), rel=1e-6)
    assert result["ne"] == pytest.approx(normalized_entropy(labels, probs), rel=1e-6)


def test_accumulator_reports_each_task_and_nan_auc_for_a_single_class_task():
    rng = np.random.default_rng(2)
    labels = np.stack([(rng.random(200) < 0.5), np.zeros(200)], axis=1).astype(np.float32)
    probs = rng.random((200, 2)).astype(np.float32)
    accumulator = MetricAccumulator(num_tasks=2, task_names=["click", "purchase"])
    accumulator.update(probs[:100], labels[:100])
    accumulator.update(probs[100:], labels[100:])
    result = accumulator.compute()
    per_task = {f"{task}/{metric}" for task in ("click", "purchase") for metric in ("auc", "logloss", "ne")}
    assert set(result) == per_task | {"count"}
    assert result["click/auc"] == pytest.approx(auc(labels[:, 0], probs[:, 0]))
    assert math.isnan(result["purchase/auc"]) and math.isnan(result["purchase/ne"])
    assert result["purchase/logloss"] == pytest.approx(logloss(labels[:, 1], probs[:, 1]), rel=1e-6)


def test_accumulator_reset_forgets_previous_batches():
    accumulator = MetricAccumulator()
    accumulator.update([0.9, 0.1], [1, 0])
    accumulator.reset()
    assert accumulator.count == 0
    result = accumulator.compute()
    assert result["count"] == 0 and math.isnan(result["auc"]) and math.isnan(result["logloss"])


@pytest.mark.parametrize(
    "probs,labels,pattern",
    [([2.5, -1.0], [1, 0], "probabilities"), ([[0.5, 0.5]], [[1, 0]], r"\[B, 1\]"), ([0.5, 0.5], [1], "batch size")],
)
def test_accumulator_rejects_logits_and_mismatched_shapes(probs, labels, pattern):
    with pytest.raises(ValueError, match=pattern):
        MetricAccumulator().update(probs, labels)


@pytest.mark.parametrize("kwargs,pattern", [({"num_tasks": 0}, "num_tasks"), ({"num_tasks": 2, "task_names": ["a"]}, "task_names")])
def test_accumulator_rejects_bad_configuration(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        MetricAccumulator(**kwargs)
