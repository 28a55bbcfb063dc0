"""The one training loop: read batches, forward, loss, backward (embedding optimizers run inside
backward), dense optimizer step; evaluate on held-out data, log, checkpoint, resume.

Distributed strategies plug in underneath (where embeddings live, how dense gradients are
synchronised); this loop stays the same.
"""
from __future__ import annotations

import json
import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from hybridrec.config import JobConfig
from hybridrec.data import PrefetchLoader
from hybridrec.train.checkpoint import checkpoint_root, latest_checkpoint, load_training, save_training
from hybridrec.train.data import build_sources
from hybridrec.train.metrics import MetricAccumulator
from hybridrec.train.recmodel import RecModel, resolve_device
from hybridrec.train.reporting import Reporter


def seed_everything(seed: int, threads: int, deterministic: bool) -> None:
    """Seed every random generator training may use and set the torch and numba thread counts."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    try:
        import numba

        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    except (ImportError, ValueError):
        pass
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)


def dense_optimizer(cfg: JobConfig, params):
    """The torch optimizer of the dense model's parameters, as train.dense_optimizer says."""
    d = cfg.train.dense_optimizer
    cls = {"adam": torch.optim.Adam, "adagrad": torch.optim.Adagrad, "sgd": torch.optim.SGD}[d.name]
    return cls(params, lr=d.lr, weight_decay=d.weight_decay)


def _labels(batch) -> torch.Tensor:
    return torch.from_numpy(batch.labels)


@torch.no_grad()
def evaluate(model: RecModel, source, label_names) -> dict:
    """Exact AUC, logloss and normalised entropy per task on every row of `source`."""
    was_training = model.training
    model.eval()
    acc = MetricAccumulator(len(label_names), label_names if len(label_names) > 1 else None)
    for batch in source:
        acc.update(torch.sigmoid(model(batch)).cpu().numpy(), batch.labels)
    model.train(was_training)
    return acc.compute()


def open_checkpoint(out_dir: Path, resume: bool, overwrite: bool):
    """The checkpoint to resume from (None for a fresh run); refuses to mix two runs in one dir
    unless `overwrite`, which deletes the old run's checkpoints."""
    if resume and overwrite:
        raise ValueError("resume and overwrite exclude each other: continue a run or start it over")
    found = latest_checkpoint(out_dir)
    if resume and found is None:
        raise FileNotFoundError(f"--resume: no checkpoint under {out_dir / 'checkpoints'}")
    if not resume and found is not None:
        if not overwrite:
            raise FileExistsError(f"train.output_dir {str(out_dir)!r} already holds a run's checkpoints "
                                  f"({found.name}); pass --resume to continue it, --overwrite to start over "
                                  f"(deleting them), or choose another train.output_dir (--set train.output_dir=...)")
        shutil.rmtree(checkpoint_root(out_dir))
        return None
    return found


def _total_steps(cfg: JobConfig, sources) -> int | None:
    """Steps the run will take, for the progress bar (None when the data's size is unknown);
    batches of `batch_size` rows, which rows dropped as bad can make a few less."""
    by_data = (cfg.train.epochs * -(-sources.train_rows // cfg.data.batch_size)
               if sources.train_rows is not None else None)
    limits = [n for n in (by_data, cfg.train.max_steps) if n is not None]
    return min(limits) if limits else None


def train(cfg: JobConfig, resume: bool = False, on_step=None, overwrite: bool = False) -> dict:
    """Train as the config says; returns the final test metrics plus run facts.

    A fresh run refuses an output_dir that already holds checkpoints (it would mix two runs) unless
    `overwrite=True`; `resume=True` continues from the latest one and ends exactly as an
    uninterrupted run would.
    `on_step(step, model)` is called after every training step.
    """
    seed_everything(cfg.seed, cfg.train.threads, cfg.train.deterministic)
    out_dir = Path(cfg.train.output_dir)
    sources = build_sources(cfg.data, cfg.seed)
    model = RecModel(cfg, sources.sparse_names, sources.num_dense, sources.num_tasks)
    model.dense_model.to(resolve_device(cfg.train.device))
    optimizer = dense_optimizer(cfg, model.dense_model.parameters())
    progress = {"step": 0, "epoch": 0, "batch_in_epoch": 0, "samples": 0}
    checkpoint = open_checkpoint(out_dir, resume, overwrite)
    if checkpoint is not None:
        progress = load_training(checkpoint, model, optimizer, cfg)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    max_steps = cfg.train.max_steps
    done = max_steps is not None and progress["step"] >= max_steps
    train_seconds, samples_this_run = 0.0, 0  # wall time of training steps, data waits included
    model.train()
    with Reporter(out_dir, cfg.train, total_steps=_total_steps(cfg, sources), resumed_step=progress["step"],
                  append=checkpoint is not None) as reporter:
        for epoch in range(progress["epoch"], cfg.train.epochs):
            if done:
                break
            skip = progress["batch_in_epoch"] if epoch == progress["epoch"] else 0
            with PrefetchLoader(sources.train, depth=max(cfg.data.prefetch, 1)) as loader:
                batches = loader if cfg.data.prefetch else sources.train  # prefetch 0: this thread reads
                tick = time.perf_counter()
                for index, batch in enumerate(batches):
                    if index < skip:  # resuming: these batches were trained before the checkpoint
                        tick = time.perf_counter()
                        continue
                    logits = model(batch)
                    loss = loss_fn(logits, _labels(batch).to(logits.device))
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()  # also applies the embedding optimizers
                    optimizer.step()
                    train_seconds += time.perf_counter() - tick
                    samples_this_run += batch.batch_size
                    progress.update(step=progress["step"] + 1, epoch=epoch, batch_in_epoch=index + 1,
                                    samples=progress["samples"] + batch.batch_size)
                    step = progress["step"]
                    reporter.train_step(step, loss.item(), torch.sigmoid(logits.detach()).cpu().numpy(), batch.labels,
                                        batch.batch_size)
                    if on_step is not None:
                        on_step(step, model)
                    if cfg.train.eval_every and step % cfg.train.eval_every == 0:
                        reporter.eval_result(step, evaluate(model, sources.test, sources.label_names))
                    if cfg.train.checkpoint_every and step % cfg.train.checkpoint_every == 0:
                        save_training(out_dir, model, optimizer, progress, cfg, cfg.train.keep_checkpoints)
                    if max_steps is not None and step >= max_steps:
                        done = True
                        break
                    tick = time.perf_counter()
            if not done:
                progress.update(epoch=epoch + 1, batch_in_epoch=0)
        # checkpoint before the final evaluation: evaluating reads the stores, and a resumed run
        # must start from the state training left, whatever was evaluated in between
        save_training(out_dir, model, optimizer, progress, cfg, cfg.train.keep_checkpoints)
        result = {**evaluate(model, sources.test, sources.label_names),
                  "step": progress["step"], "samples": progress["samples"],
                  "train_samples_per_s": samples_this_run / train_seconds if train_seconds else None,
                  "best_auc": sources.best_auc, "bad_rows": sources.bad_rows(),
                  "embedding_rows": {c: sum(len(s) for s in col.stores.values())
                                     for c, col in model.collections().items()}}
        reporter.final(progress["step"], result)
    (out_dir / "final_metrics.json").write_text(json.dumps(result, indent=1))
    return result


def evaluate_checkpoint(cfg: JobConfig, checkpoint) -> dict:
    """Test metrics of a saved checkpoint (a step-N directory or an output dir's latest)."""
    seed_everything(cfg.seed, cfg.train.threads, cfg.train.deterministic)
    sources = build_sources(cfg.data, cfg.seed, with_best_auc=False)
    model = RecModel(cfg, sources.sparse_names, sources.num_dense, sources.num_tasks)
    model.dense_model.to(resolve_device(cfg.train.device))
    path = Path(checkpoint)
    if not (path / "progress.json").is_file():
        found = latest_checkpoint(path)
        if found is None:
            raise FileNotFoundError(f"--checkpoint: {path} holds no training checkpoint")
        path = found
    progress = load_training(path, model)
    return {**evaluate(model, sources.test, sources.label_names), "step": progress["step"], "checkpoint": str(path)}
