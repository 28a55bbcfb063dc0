"""Early stopping: training ends once the validation AUC has not improved for `train.patience`
evaluations in a row, and the best step's model (the best-by-validation checkpoint that
hybridrec.train.best keeps) is put back before the final checkpoint and the test metrics.

The count of evaluations since the best lives in the run's progress, so a resumed run stops
where the uninterrupted one would.
"""
from __future__ import annotations

from pathlib import Path

from hybridrec.train.checkpoint import latest_checkpoint, read_dense
from hybridrec.train.resume import load_embeddings


class EarlyStopping:
    """Counts evaluations without improvement; `stopped` once `patience` of them came in a row."""

    def __init__(self, patience: int, progress) -> None:
        """`progress`: the run's progress (its `evaluations_since_best` and `stopped_early`)."""
        self.patience = patience
        self.progress = progress

    @property
    def stopped(self) -> bool:
        return self.progress.stopped_early

    def validated(self, improved: bool) -> bool:
        """Record one evaluation; True when training ends with it."""
        p = self.progress
        p.evaluations_since_best = 0 if improved else p.evaluations_since_best + 1
        if p.evaluations_since_best >= self.patience:
            p.stopped_early = True
        return p.stopped_early


def restore_best(best_dir: Path, world, placement, dense) -> int:
    """Load the best-by-validation checkpoint under `best_dir` into the running job (every
    trainer calls it: each loads the dense state, and the tables where trainers hold them;
    else the leader loads them into the placement's servers); its step."""
    path = latest_checkpoint(best_dir)
    if path is None:
        raise RuntimeError(f"early stopping: no best checkpoint under {best_dir}")
    dense.load(read_dense(path))
    if world.leader or placement.tables_on_trainers:
        load_embeddings(placement, path)
    world.barrier()
    return int(path.name.removeprefix("step-"))
