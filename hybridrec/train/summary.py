"""What every command says at its start and its end, in words: the resolved strategy first, a short
summary last, with the same keys for every strategy (`SUMMARY_KEYS`), where the machine-readable
whole is final_metrics.json (and `--json`).

Staleness has one name everywhere: the updates an embedding read missed, `max_staleness` and
`mean_staleness` in final_metrics.json, whatever bounds it (Persia's tau, HET's clock bound, SSP's
iterations; 0 for synchronous jobs); the dense part's, where it may be stale (Hierarchical
Training's groups), is `max_dense_staleness` / `mean_dense_staleness`. This module only formats
dicts: it imports nothing heavy, so the command line uses it freely.
"""
from __future__ import annotations

import math

SUMMARY_KEYS = ("strategy", "steps", "samples", "samples/s", "test AUC", "test logloss", "staleness")
EVAL_KEYS = ("checkpoint", "strategy", "test rows", "test AUC", "test logloss", "test NE")
_AXES = ("placement", "consistency", "dense")


def describe_strategy(record: dict) -> str:
    """'persia (placement ps, consistency bounded tau=2, dense allreduce, codecs unique/fp16)' from
    a strategy record (`StrategyConfig.record()`, final_metrics.json's `strategy`)."""
    parts = []
    for axis in _AXES:
        value = record.get(axis)
        if value is None:
            continue
        detail = record.get(value) if isinstance(record.get(value), dict) else None
        if axis == "consistency" and record.get("tau") and detail is None:
            detail = {"tau": record["tau"]}
        text = f"{axis} {value}"
        if detail:
            text += " " + " ".join(f"{k}={v}" for k, v in detail.items())
        parts.append(text)
    codecs = [record.get("id_codec"), record.get("value_codec")]
    if any(codec not in (None, "none") for codec in codecs):
        parts.append(f"codecs {codecs[0]}/{codecs[1]}")
    return f"{record.get('preset') or 'custom'} ({', '.join(parts)})"


def start_line(command: str, record: dict, trainers: int | None = None) -> str:
    """The first line of a command: the strategy it runs."""
    who = "" if not trainers else f", {trainers} trainer{'s' if trainers != 1 else ''}"
    return f"hybridrec {command}: strategy {describe_strategy(record)}{who}"


def _number(value, digits: int = 5) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if isinstance(value, float) and digits == 0:
        return f"{value:,.0f}"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return f"{value:,}"


def _per_task(result: dict, metric: str) -> str:
    """`metric` of the single task, or 'task value' per task of a multi-task model."""
    if metric in result:
        return _number(result[metric])
    tasks = [(key[:-len(metric) - 1], value) for key, value in result.items() if key.endswith(f"/{metric}")]
    return ", ".join(f"{task} {_number(value)}" for task, value in tasks) or "n/a"


def staleness_text(result: dict) -> str:
    text = (f"max {_number(result.get('max_staleness', 0))}, mean {_number(result.get('mean_staleness', 0.0), 2)} "
            "updates an embedding read missed")
    if "max_dense_staleness" in result:
        text += (f"; dense max {_number(result['max_dense_staleness'])}, "
                 f"mean {_number(result.get('mean_dense_staleness', 0.0), 2)}")
    return text


def _lines(title: str, rows: list[tuple[str, str]]) -> list[str]:
    width = max(len(key) for key, _ in rows) + 1
    return [title] + [f"  {key + ':':<{width}} {value}" for key, value in rows]


def summary_lines(command: str, result: dict, output_dir: str | None = None) -> list[str]:
    """The end of a training command: `SUMMARY_KEYS` (then what only some runs have) from the
    final result (final_metrics.json's content)."""
    trainers = result.get("trainers", 1)
    auc = _per_task(result, "auc")
    if result.get("best_auc") is not None:
        auc += f" (the planted model's: {_number(result['best_auc'])}, the best achievable)"
    rows = [("strategy", f"{describe_strategy(result.get('strategy', {}))}, {trainers} trainer"
             + ("s" if trainers != 1 else "")),
            ("steps", _number(result.get("step"))),
            ("samples", _number(result.get("samples"))),
            ("samples/s", _number(result.get("train_samples_per_s"), 0)),
            ("test AUC", auc),
            ("test logloss", _per_task(result, "logloss")),
            ("staleness", staleness_text(result))]
    best = result.get("best_valid")
    if isinstance(best, dict) and best.get("step") is not None:
        rows.append(("best validation step", f"{_number(best['step'])} (validation AUC "
                                             f"{_number(best.get('valid_auc'))})"))
    bad = {split: count for split, count in (result.get("bad_rows") or {}).items() if count}
    if bad:
        rows.append(("bad rows", ", ".join(f"{split} {_number(count)}" for split, count in bad.items())))
    if output_dir is not None:
        rows.append(("output", f"{output_dir} (final_metrics.json: every figure; --json prints it)"))
    return _lines(f"hybridrec {command}: finished", rows)


def eval_lines(result: dict) -> list[str]:
    """`hybridrec eval`'s answer (`EVAL_KEYS`) from evaluate_checkpoint's result."""
    rows = [("checkpoint", f"{result.get('checkpoint')} (step {_number(result.get('step'))})"),
            ("strategy", describe_strategy(result.get("strategy", {}))),
            ("test rows", _number(int(result["count"])) if result.get("count") is not None else "n/a"),
            ("test AUC", _per_task(result, "auc")),
            ("test logloss", _per_task(result, "logloss")),
            ("test NE", _per_task(result, "ne"))]
    return _lines("hybridrec eval:", rows)
