"""`hybridrec export`: a training checkpoint of any strategy written as an inference bundle.

Reads the checkpoint's saved config (the model's shape, the data's schema, the tables), the
dense weights (`train.checkpoint.model_state`: Hierarchical Training's centre copy where the PS
servers hold it) and every table's rows, wherever the placement kept them (the local layout of
local and DES runs, the shards of the PS servers of persia, het and ht runs and of PICASSO's
trainers): keys and weights only, no optimizer state or eviction metadata.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from hybridrec.bundle.format import TablePart, write_version
from hybridrec.bundle.job import job_fields, now
from hybridrec.bundle.precision import quantize, stored_precision
from hybridrec.embedding.checkpoint_format import read as read_store_checkpoint
from hybridrec.job.tables import job_tables
from hybridrec.strategy.placement.checkpoint_layout import table_directories
from hybridrec.train.checkpoint import config_for_checkpoint, model_state, read_progress
from hybridrec.train.evaluation import checkpoint_directory


def checkpoint_rows(directories: list[Path], dim: int) -> tuple[np.ndarray, np.ndarray]:
    """(keys, float32 weights [n, dim]) of one table over its store checkpoints (shards)."""
    keys, weights = [], []
    for directory in directories:
        try:
            saved = read_store_checkpoint(directory)
        except (OSError, ValueError) as exc:
            raise FileNotFoundError(f"export: {exc}") from None
        keys.append(np.ascontiguousarray(saved.meta.view(np.uint64)[:, 0]))
        weights.append(np.ascontiguousarray(saved.rows[:, :dim]))
    return np.concatenate(keys), np.concatenate(weights)


def table_parts(embeddings: Path, tables, precision: str) -> list[TablePart]:
    """Every table of a job (`job.tables.JobTables`) read from a checkpoint's `embeddings`."""
    parts = []
    for side, configs in (("deep", tables.deep), ("wide", tables.wide)):
        for name, config in configs.items():
            keys, weights = checkpoint_rows(table_directories(embeddings, side, name), config.dim)
            stored = stored_precision(precision, config.dim)
            parts.append(TablePart(name, config.dim, side, config.pooling, stored, keys, quantize(weights, stored)))
    return parts


def export(source, out, precision: str = "fp32", config=None, config_name: str = "the config") -> Path:
    """Write the checkpoint `source` names (a step-N directory, or a run's output dir: its latest)
    as a bundle version at `out`; returns `out`."""
    path = checkpoint_directory(source)
    cfg = config_for_checkpoint(path, config, config_name)
    progress = read_progress(path)
    tables = job_tables(cfg)
    parts = table_parts(path / "embeddings", tables, precision)
    manifest = {**job_fields(cfg, tables, precision, str(path)), "version": 1, "kind": "full", "base": None,
                "step": int(progress["step"]), "stream_position": progress.get("stream_by_rank"), "created": now()}
    return write_version(Path(out), manifest, model_state(path), parts)
