"""Scoring held-out rows: exact AUC, logloss and normalised entropy of a model over a data source,
shared out among the trainers (`evaluate`), and of a saved checkpoint of a local or DES run
(`evaluate_checkpoint`, what `hybridrec eval` runs)."""
from __future__ import annotations

from pathlib import Path

import torch

from hybridrec.config import JobConfig
from hybridrec.job.sources import build_sources
from hybridrec.job.tables import job_tables
from hybridrec.metrics import MetricAccumulator
from hybridrec.strategy.dense import model_device
from hybridrec.strategy.world import World
from hybridrec.train.checkpoint import config_for_checkpoint, latest_checkpoint, model_state, read_progress
from hybridrec.train.resume import load_embeddings
from hybridrec.train.setup import dense_model, seed_everything
from hybridrec.train.step import logits_of
from hybridrec.train.threads import thread_split


def _lookup_for_evaluation(connection, batch, attempts: int = 3):
    """A test batch's rows; a batch lost on the way (its embedding worker restarted between the
    put and the pull) is sent again."""
    for _ in range(attempts):
        looked = connection.lookup(connection.prepare(batch), train=False)
        if looked is not None:
            return looked
    raise RuntimeError(f"evaluation: the rows of a test batch were lost {attempts} times in a row")


@torch.no_grad()
def evaluate(model: torch.nn.Module, placement, source, label_names, readers: World) -> dict:
    """Exact AUC, logloss and normalised entropy per task on every row of `source`: of the
    trainers as the rows are dealt to them (`readers`, the strategy's), trainer r scores batches
    r, r+W, ...; every one of them gets the metrics of all."""
    was_training = model.training
    model.eval()
    device = model_device(model)
    connection = placement.connect()
    scored = []
    try:
        for index, batch in enumerate(source):
            if index % readers.size != readers.rank:
                continue
            looked = _lookup_for_evaluation(connection, batch)
            logits = logits_of(model, placement.inputs(looked, batch, requires_grad=False), batch, device)
            scored.append((torch.sigmoid(logits).cpu().numpy(), batch.labels))
    finally:
        connection.close()
        model.train(was_training)
    acc = MetricAccumulator(len(label_names), label_names if len(label_names) > 1 else None)
    for part in readers.gather(scored):
        for probs, labels in part:
            acc.update(probs, labels)
    return acc.compute()


def checkpoint_directory(checkpoint) -> Path:
    """A step-N checkpoint directory, or the latest one of a run's output dir."""
    path = Path(checkpoint)
    if (path / "progress.json").is_file():
        return path
    found = latest_checkpoint(path)
    if found is None:
        raise FileNotFoundError(f"--checkpoint: {path} holds no training checkpoint")
    return found


def load_local(cfg: JobConfig, checkpoint, module: torch.nn.Module | None = None):
    """(dense model, local placement, progress) of a checkpoint of any strategy (a step-N
    directory or an output dir, whose latest checkpoint is taken), in this process: the model's
    weights as `model_state` reads them (HT's centre copy where the PS servers hold it) and every
    table, from the local layout (local, DES) or merged from the shards the PS servers (persia,
    het, ht) or PICASSO's trainers wrote. `module`: the model object of a run whose model.name is
    `object` (hybridrec.api), which the checkpoint's weights are loaded into."""
    from hybridrec.strategy.placement.local import LocalPlacement

    path = checkpoint_directory(checkpoint)
    tables = job_tables(cfg)
    model = dense_model(cfg, tables, module)
    placement = LocalPlacement(cfg, tables, World())
    progress = read_progress(path)  # any data may be scored: only the model must agree (config_for_checkpoint)
    model.load_state_dict(model_state(path))
    load_embeddings(placement, path)
    return model, placement, {**progress, "checkpoint": str(path)}


def evaluate_checkpoint(cfg: JobConfig | None, checkpoint, config_name: str = "the config") -> dict:
    """Test metrics of a saved checkpoint of a local run, with the config saved in it, or `cfg`
    when that agrees with it on the model's shape."""
    cfg = config_for_checkpoint(checkpoint_directory(checkpoint), cfg, config_name)
    seed_everything(cfg.seed, thread_split(cfg.train, cfg.strategy.resolved["placement"]).dense,
                    cfg.train.deterministic)
    sources = build_sources(cfg.data, cfg.seed, with_best_auc=False)
    model, placement, progress = load_local(cfg, checkpoint)
    return {**evaluate(model, placement, sources.test, sources.label_names, World()), "step": progress["step"],
            "checkpoint": progress["checkpoint"]}
