"""Turns the `data` section of a job config into train and test batch sources.

Knows each format's reader and how test rows are chosen (a separate file, the first N rows as
train, or the last fraction). Also reports what the model needs to know about the data: sparse
feature names, number of dense features and of tasks; and for synthetic data the planted
model's AUC on the test rows, the best a learned model can expect.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Iterable

from hybridrec.config import ConfigError, DataConfig
from hybridrec.data import (AvazuReader, CriteoReader, DelimitedTextReader, ParquetReader, SyntheticConfig,
                            SyntheticReader, TabularSchema, planted_auc, split_first_rows, split_fraction)
from hybridrec.data.criteo import CRITEO_SCHEMA
from hybridrec.data.avazu import avazu_schema
from hybridrec.data.tabular import PARQUET_SUFFIXES


@dataclasses.dataclass
class DataSources:
    train: Iterable
    test: Iterable
    sparse_names: list[str]
    num_dense: int
    label_names: list[str]
    best_auc: float | None = None  # synthetic data only: the planted model's test AUC
    train_rows: int | None = None  # rows in the training split when known without reading it (all ranks)
    train_reader: object = None  # the file readers under train/test (they count bad rows)
    test_reader: object = None

    @property
    def num_tasks(self) -> int:
        return len(self.label_names)

    def bad_rows(self) -> dict:
        """Rows the file readers skipped as malformed in their latest pass (train: the last epoch;
        test: the last evaluation, which with a row split reads the whole file)."""
        return {split: getattr(getattr(reader, "bad_rows", None), "count", 0)
                for split, reader in (("train", self.train_reader), ("test", self.test_reader))}


def _synthetic_config(cfg: DataConfig) -> SyntheticConfig:
    fields = cfg.synthetic.model_dump()
    fields.pop("train_rows")
    fields.pop("test_rows")
    return SyntheticConfig(**fields)


def _file_reader(cfg: DataConfig, paths, batch_size: int, rank: int, world_size: int):
    common = dict(rank=rank, world_size=world_size, strict=cfg.strict)
    if cfg.format == "criteo":
        return CriteoReader(paths, batch_size, **common)
    if cfg.format == "avazu":
        return AvazuReader(paths, batch_size, **common)
    schema = TabularSchema.from_dict(dict(cfg.schema_))
    first = paths[0] if isinstance(paths, list) else paths
    reader_cls = ParquetReader if str(first).lower().endswith(PARQUET_SUFFIXES) else DelimitedTextReader
    return reader_cls(paths, schema, batch_size, **common)


def _check_paths(cfg: DataConfig) -> None:
    """Every data file exists; relative paths are taken from the current directory."""
    for key in ("path", "test_path"):
        value = getattr(cfg, key)
        for path in [value] if isinstance(value, str) else value or []:
            if not Path(path).is_file():
                raise ConfigError(f"data.{key}: file {path!r} does not exist (relative paths are resolved "
                                  f"from the current directory, {os.getcwd()})")


def _schema(cfg: DataConfig) -> TabularSchema:
    if cfg.format == "criteo":
        return CRITEO_SCHEMA
    if cfg.format == "avazu":
        return avazu_schema()
    return TabularSchema.from_dict(dict(cfg.schema_))


def data_layout(cfg: DataConfig) -> tuple[list[str], int, list[str]]:
    """(sparse feature names, number of dense features, label names) from the config alone,
    without reading any data: what the roles of a distributed job agree on before they start."""
    if cfg.format == "synthetic":
        syn = _synthetic_config(cfg)
        return list(syn.sparse_names), syn.n_dense, ["label"]
    schema = _schema(cfg)
    return list(schema.sparse_feature_names), len(schema.dense), list(schema.labels)


def build_sources(cfg: DataConfig, seed: int, rank: int = 0, world_size: int = 1,
                  with_best_auc: bool = True) -> DataSources:
    """Train and test sources for this rank (test is read whole by every rank)."""
    eval_bs = cfg.eval_batch_size or cfg.batch_size
    if cfg.format == "synthetic":
        syn = _synthetic_config(cfg)
        rows = cfg.synthetic.train_rows
        train = SyntheticReader(syn, rows, cfg.batch_size, seed=seed, rank=rank, world_size=world_size)
        test = SyntheticReader(syn, cfg.synthetic.test_rows, eval_bs, seed=seed, first_row=rows)
        best = planted_auc(syn, cfg.synthetic.test_rows, seed=seed, first_row=rows) if with_best_auc else None
        return DataSources(train, test, list(syn.sparse_names), syn.n_dense, ["label"], best, train_rows=rows)
    _check_paths(cfg)
    schema = _schema(cfg)
    train_reader = _file_reader(cfg, cfg.path, cfg.batch_size, rank, world_size)
    train_rows = cfg.train_rows
    if cfg.test_path is not None:
        test_reader = _file_reader(cfg, cfg.test_path, eval_bs, 0, 1)
        train, test = train_reader, test_reader
    else:
        test_reader = _file_reader(cfg, cfg.path, eval_bs, 0, 1)
        if cfg.train_rows is not None:
            train, _ = split_first_rows(train_reader, cfg.train_rows)
            _, test = split_first_rows(test_reader, cfg.train_rows)
        else:
            total = test_reader.count_rows()
            train, _ = split_fraction(train_reader, cfg.test_fraction, total)
            _, test = split_fraction(test_reader, cfg.test_fraction, total)
            train_rows = train.stop
    return DataSources(train, test, schema.sparse_feature_names, len(schema.dense), list(schema.labels),
                       train_rows=train_rows, train_reader=train_reader, test_reader=test_reader)
