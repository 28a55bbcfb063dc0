"""What a training run tells the user: its progress with live loss and AUC (a bar on a terminal,
lines otherwise: hybridrec.train.progress), metrics as JSON lines in `<output_dir>/metrics.jsonl`,
and TensorBoard scalars with train.tensorboard (`pip install 'hybridrec[tensorboard]'`).

Metrics files are strict JSON: a metric that is not a number (the AUC of a set with one class,
anything of an empty set) is written as null, never as the bare NaN that JSON does not have
(`json_text` does this for every file a run writes)."""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import numpy as np

from hybridrec.metrics import auc
from hybridrec.train.progress import progress_display

_WINDOW = 50  # batches in the running training AUC
TENSORBOARD_MISSING = ("hybridrec: warning: train.tensorboard is on but TensorBoard is not installed: "
                       "pip install 'hybridrec[tensorboard]'; metrics go to metrics.jsonl only")


def finite(value):
    """`value` with every float that is not finite (NaN, inf) replaced by None, in nested
    dicts, lists and tuples too."""
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    if isinstance(value, (float, np.floating)):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, np.integer):
        return int(value)
    return value


def json_text(value, **kwargs) -> str:
    """Strict JSON of `value` (non-finite floats as null; see `finite`)."""
    return json.dumps(finite(value), allow_nan=False, **kwargs)


class Reporter:
    """Use as a context manager (`with Reporter(...) as reporter:`) so files are closed on errors.
    A fresh run starts `metrics.jsonl` anew; a resumed one (`append=True`) adds to it. `launched`:
    the leader of a process group, whose progress lines go to stdout for the launcher."""

    def __init__(self, output_dir, train_cfg, total_steps=None, resumed_step: int = 0, append: bool = False,
                 launched: bool = False):
        self.dir = Path(output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.log_every = train_cfg.log_every
        self._jsonl = open(self.dir / "metrics.jsonl", "a" if append else "w")
        self._window: list = []
        self._samples = 0
        self._t0 = time.perf_counter()
        self._bar = None
        if train_cfg.progress:
            self._bar = progress_display(total_steps, resumed_step, train_cfg.progress_every_s, launched)
        self._tb = None
        if train_cfg.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.dir / "tensorboard"))
            except ImportError:
                print(TENSORBOARD_MISSING, file=sys.stderr, flush=True)

    def _write(self, record: dict) -> None:
        self._jsonl.write(json_text(record) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step" and not (isinstance(value, float) and math.isnan(value)):
                    self._tb.add_scalar(f"{record['split']}/{key}", value, record["step"])

    def train_step(self, step: int, loss: float, probs: np.ndarray, labels: np.ndarray, batch_size: int,
                   job_samples: int | None = None) -> None:
        """The leader's step `step` (`batch_size` its rows); `job_samples`: what the whole job has
        trained so far, for the progress display (default: the leader's own samples)."""
        if batch_size:  # else a lockstep trainer whose stream had nothing stepped empty: nothing to score
            self._window.append((loss, probs[:, 0].copy(), labels[:, 0].copy()))
            del self._window[:-_WINDOW]
            self._samples += batch_size
        if batch_size and step % self.log_every == 0:
            elapsed = time.perf_counter() - self._t0
            run_auc = auc(np.concatenate([w[2] for w in self._window]), np.concatenate([w[1] for w in self._window]))
            run_loss = float(np.mean([w[0] for w in self._window]))
            record = {"split": "train", "step": step, "loss": run_loss, "auc": run_auc,
                      "samples_per_s": self._samples / elapsed if elapsed > 0 else None}
            self._write(record)
            if self._bar is not None:
                self._bar.set_figures(loss=f"{run_loss:.4f}", auc=f"{run_auc:.4f}")
        if self._bar is not None:
            self._bar.update(step, self._samples if job_samples is None else job_samples)

    def progressive(self, step: int, record: dict) -> None:
        """A stream's progressive validation record (hybridrec.train.stream) at `step`."""
        self._write({"split": "progressive", "step": step, **record})
        if self._bar is not None and record.get("window_auc") is not None:
            self._bar.set_figures(window_auc=f"{record['window_auc']:.4f}")

    def eval_result(self, step: int, metrics: dict, split: str = "test") -> None:
        self._write({"split": split, "step": step, **metrics})
        if self._bar is not None:
            self._bar.write(f"step {step}: {split} " + ", ".join(f"{k}={v:.4f}" for k, v in metrics.items()
                                                                 if isinstance(v, float)))

    def final(self, step: int, result: dict) -> None:
        self._write({"split": "final", "step": step, **{k: v for k, v in result.items()
                                                         if isinstance(v, (int, float)) or v is None}})

    def __enter__(self) -> "Reporter":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        self._jsonl.close()
