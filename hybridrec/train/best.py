"""The best-by-validation checkpoint: when a job has validation rows (`data.valid_path` or
`data.valid_fraction`), every validation (at `train.eval_every` and at the end of training)
that beats the best so far writes a checkpoint to `<output_dir>/best/checkpoints/step-N/` (the
one before it is deleted) and records the step and its metrics in `<output_dir>/best/best.json`.
`hybridrec eval CONFIG --checkpoint <output_dir>/best` evaluates it.

The score is the validation AUC, averaged over the tasks of a multi-task model; higher is
better. A resumed run continues from the best its earlier part recorded; a fresh run starts
with none (a `best/` left by a run that --overwrite replaced is deleted)."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

from hybridrec.train.reporting import json_text

BEST_DIR = "best"
RECORD = "best.json"


def validation_score(metrics: dict) -> float | None:
    """The mean AUC over the tasks (keys `auc` or `<task>/auc`); None when it is not a number."""
    aucs = [v for k, v in metrics.items() if k == "auc" or k.endswith("/auc")]
    if not aucs or any(v is None or not math.isfinite(v) for v in aucs):
        return None
    return sum(aucs) / len(aucs)


class BestKeeper:
    """Decides after each validation whether its step is the best so far and has it saved."""

    def __init__(self, output_dir, world, resumed: bool) -> None:
        """`world` (hybridrec.strategy.world.World): the leader reads or clears `best/` and every
        trainer starts from its record, so all trainers decide alike without a shared disk."""
        self.dir = Path(output_dir) / BEST_DIR
        self.leader = world.leader
        self.validated_step: int | None = None  # the step of the latest validation
        record = None
        if self.leader and resumed and (self.dir / RECORD).is_file():
            record = json.loads((self.dir / RECORD).read_text())
        elif self.leader and not resumed and self.dir.exists():
            shutil.rmtree(self.dir)
        self.record: dict | None = world.broadcast(record)

    def consider(self, step: int, metrics: dict, save) -> bool:
        """True (after `save(directory)` wrote the checkpoint) when `metrics` beat the best so
        far. Every trainer calls this with the same metrics, so all decide alike."""
        self.validated_step = step
        score = validation_score(metrics)
        if score is None or (self.record is not None and score <= self.record["valid_auc"]):
            return False
        save(self.dir)
        self.record = {"step": step, "valid_auc": score, "metrics": metrics}
        if self.leader:
            (self.dir / RECORD).write_text(json_text(self.record, indent=1))
        return True
