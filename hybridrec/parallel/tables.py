"""The embedding tables of a job, derived from its config alone (no data is read).

Every role of a distributed job computes this independently and must get the same answer:
PS servers host the tables, embedding workers map features to tables and pool, NN workers
size the dense model. The derivation is the one the local trainer uses (`RecModel`), so a
config trains the same model locally and distributed.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from hybridrec.config import JobConfig
from hybridrec.data.batch import JaggedFeatures
from hybridrec.embedding import TableConfig
from hybridrec.models import model_class
from hybridrec.ps.pooling import BatchLayout, batch_layout
from hybridrec.train.data import data_layout
from hybridrec.train.recmodel import embedding_tables


@dataclass(frozen=True)
class JobTables:
    """Tables and feature -> table maps of the deep (dim = embedding_dim) and wide (dim 1) sides."""

    sparse_names: list[str]
    num_dense: int
    label_names: list[str]
    deep: dict[str, TableConfig]
    deep_map: dict[str, str]
    wide: dict[str, TableConfig]
    wide_map: dict[str, str]

    @property
    def num_tasks(self) -> int:
        return len(self.label_names)

    def all_tables(self) -> dict[str, TableConfig]:
        """Every table the PS servers host (wide tables are named '<table>:wide')."""
        return {**self.deep, **self.wide}

    @property
    def deep_dim(self) -> int:
        """The deep side's embedding dimension (0 when the model has no deep side)."""
        return next((cfg.dim for cfg in self.deep.values()), 0)

    @cached_property
    def pooling(self) -> dict[str, str]:
        return {name: cfg.pooling for name, cfg in self.all_tables().items()}

    def layout(self, features: JaggedFeatures) -> BatchLayout:
        """Where a batch's IDs go, as the embedding worker and the NN workers both compute it."""
        return batch_layout(features, self.sparse_names, self.deep_map, self.wide_map, self.pooling)


def job_tables(cfg: JobConfig) -> JobTables:
    sparse_names, num_dense, label_names = data_layout(cfg.data)
    cls = model_class(cfg.model.name)
    deep, deep_map = (embedding_tables(cfg, sparse_names, cfg.model.embedding_dim, wide=False)
                      if cls.needs_deep else ({}, {}))
    wide, wide_map = embedding_tables(cfg, sparse_names, 1, wide=True) if cls.needs_wide else ({}, {})
    return JobTables(sparse_names, num_dense, label_names, deep, deep_map, wide, wide_map)
