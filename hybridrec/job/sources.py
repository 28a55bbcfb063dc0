"""Turns the `data` section of a job config into train, validation and test batch sources.

Knows each format's reader and how held-out rows are chosen: test rows from a separate file,
the first N data lines as train (`train_rows`, bad lines included, so the split falls at the
same line whatever the lines hold) or the last fraction; validation rows from a separate file
or the last fraction of the training rows. Each reader reads only its own rows, so a bad line
is counted and reported once, by the split it belongs to. Training rows go through the shuffle
buffer when `data.shuffle_buffer` is set. Also reports what the model needs to know about the
data: sparse feature names, number of dense features and of tasks; and for synthetic data the
planted model's AUC on the test rows, the best a learned model can expect.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Iterable

from hybridrec.config import ConfigError, DataConfig
from hybridrec.data import (AvazuReader, CriteoReader, SyntheticConfig, SyntheticReader, TabularSchema, planted_auc,
                            tabular_reader)
from hybridrec.data.avazu import avazu_schema
from hybridrec.data.criteo import CRITEO_SCHEMA
from hybridrec.data.shuffle import ShuffleBuffer
from hybridrec.errors import UserError

SPLITS = ("train", "valid", "test")


@dataclasses.dataclass
class DataSources:
    train: Iterable
    test: Iterable
    sparse_names: list[str]
    num_dense: int
    label_names: list[str]
    best_auc: float | None = None  # synthetic data only: the planted model's test AUC
    train_rows: int | None = None  # rows in the training split when known without reading it (all ranks)
    train_reader: object = None  # the readers under train/valid/test (file readers count bad rows)
    test_reader: object = None
    valid: Iterable | None = None  # the validation rows, None without data.valid_path / valid_fraction
    valid_reader: object = None
    train_paths: list[str] = dataclasses.field(default_factory=list)
    stream: object = None  # with data.stream: this trainer's StreamSource (also `train`)

    @property
    def num_tasks(self) -> int:
        return len(self.label_names)

    def bad_rows(self) -> dict:
        """Rows the file readers skipped as malformed in their latest pass (train: the last epoch;
        valid and test: the last evaluation), each line counted by the one split it belongs to."""
        return {split: getattr(getattr(getattr(self, f"{split}_reader"), "bad_rows", None), "count", 0)
                for split in SPLITS if split != "valid" or self.valid is not None}

    def no_training_rows(self, rank: int = 0, world_size: int = 1) -> UserError:
        """The error of a run that took no training step: what the training reader read and
        rejected, with the first reasons."""
        if self.stream is not None:
            return UserError(f"trainer {rank} of {world_size}: the stream gave no record to train "
                             f"({self.stream.bad_records} bad ones) before it ended (data.stream.idle_timeout "
                             f"{self.stream.common.idle_timeout} s, or a signal)")
        if world_size > 1:
            return UserError(f"trainer {rank} of {world_size}: no training step was taken; some trainer got no "
                             "training batch (the rows are dealt to trainers in blocks, so a small data set may "
                             "leave one with none): use more rows or fewer trainers")
        reader = self.train_reader
        read, bad = getattr(reader, "rows_read", 0), getattr(getattr(reader, "bad_rows", None), "count", 0)
        start, stop = getattr(reader, "row_range", (0, None))
        rows = f"data lines {start}..{stop - 1}" if stop is not None else "every data line"
        message = (f"no training rows: {rows} of data.path {self.train_paths} gave {read} rows, "
                   f"{bad} of them rejected")
        examples = getattr(getattr(reader, "bad_rows", None), "examples", [])
        if examples:
            message += "; the first: " + "; ".join(str(e) for e in examples)
        elif read == 0:
            message += " (is the file empty, or only a header?)"
        return UserError(message)


def _synthetic_config(cfg: DataConfig) -> SyntheticConfig:
    fields = cfg.synthetic.model_dump()
    fields.pop("train_rows")
    fields.pop("test_rows")
    return SyntheticConfig(**fields)


def _file_reader(cfg: DataConfig, paths, batch_size: int, rank: int = 0, world_size: int = 1,
                 row_range: tuple[int, int | None] = (0, None)):
    common = dict(rank=rank, world_size=world_size, strict=cfg.strict, row_range=row_range)
    if cfg.format == "criteo":
        return CriteoReader(paths, batch_size, **common)
    if cfg.format == "avazu":
        return AvazuReader(paths, batch_size, **common)
    return tabular_reader(paths, cfg.schema, batch_size, **common)


def _check_paths(cfg: DataConfig) -> None:
    """Every data file exists; relative paths are taken from the current directory."""
    for key in ("path", "test_path", "valid_path"):
        value = getattr(cfg, key)
        for path in [value] if isinstance(value, str) else value or []:
            if Path(path).is_dir():
                raise ConfigError(f"data.{key}: {path!r} is a directory; name its data files (a list of paths: "
                                  f"[{path.rstrip('/')}/part-0.csv, ...]), the reader does not list directories")
            if not Path(path).is_file():
                raise ConfigError(f"data.{key}: file {path!r} does not exist (relative paths are resolved "
                                  f"from the current directory, {os.getcwd()})")


def _schema(cfg: DataConfig) -> TabularSchema:
    if cfg.format == "criteo":
        return CRITEO_SCHEMA
    if cfg.format == "avazu":
        return avazu_schema()
    return cfg.schema


def file_schema(cfg: DataConfig) -> TabularSchema:
    """How a data file of this config is read: the format's schema, data.schema for tabular
    files, and for synthetic data the TSV that `hybridrec data synth` writes (read back into the
    very batches the generator yields)."""
    return _synthetic_config(cfg).schema() if cfg.format == "synthetic" else _schema(cfg)


def data_layout(cfg: DataConfig) -> tuple[list[str], int, list[str]]:
    """(sparse feature names, number of dense features, label names) from the config alone,
    without reading any data: what the roles of a distributed job agree on before they start."""
    if cfg.format == "synthetic":
        syn = _synthetic_config(cfg)
        return list(syn.sparse_names), syn.n_dense, ["label"]
    schema = _schema(cfg)
    return list(schema.sparse_feature_names), len(schema.dense), list(schema.labels)


def _held_out(rows: int, fraction: float | None) -> int:
    """Rows of `rows` that the last `fraction` takes (0 without a fraction)."""
    return 0 if fraction is None else int(round(rows * fraction))


def _shuffled(cfg: DataConfig, train: Iterable, seed: int) -> Iterable:
    return ShuffleBuffer(train, cfg.shuffle_buffer, cfg.batch_size, seed) if cfg.shuffle_buffer else train


def build_sources(cfg: DataConfig, seed: int, rank: int = 0, world_size: int = 1,
                  with_best_auc: bool = True, stream: dict | None = None) -> DataSources:
    """Train, validation and test sources for this rank (validation and test are read whole by
    every rank). With data.stream, `stream` says which trainer reads: {rank, trainers,
    whole_stream, job} (see `hybridrec.data.stream.StreamContext`)."""
    eval_bs = cfg.eval_batch_size or cfg.batch_size
    if cfg.stream is not None:
        return _stream_sources(cfg, eval_bs, stream or {})
    if cfg.format == "synthetic":
        syn = _synthetic_config(cfg)
        rows = cfg.synthetic.train_rows
        held = _held_out(rows, cfg.valid_fraction)
        train = SyntheticReader(syn, rows - held, cfg.batch_size, seed=seed, rank=rank, world_size=world_size)
        valid = SyntheticReader(syn, held, eval_bs, seed=seed, first_row=rows - held) if cfg.valid_fraction else None
        test = SyntheticReader(syn, cfg.synthetic.test_rows, eval_bs, seed=seed, first_row=rows)
        best = planted_auc(syn, cfg.synthetic.test_rows, seed=seed, first_row=rows) if with_best_auc else None
        return DataSources(_shuffled(cfg, train, seed), test, list(syn.sparse_names), syn.n_dense, ["label"], best,
                           train_rows=rows - held, train_reader=train, test_reader=test, valid=valid,
                           valid_reader=valid)
    _check_paths(cfg)
    schema = _schema(cfg)
    # the data lines of data.path that train (and validate): [0, stop), stop None = every line
    if cfg.test_path is not None:
        test = _file_reader(cfg, cfg.test_path, eval_bs)
        stop = None
    else:
        stop = cfg.train_rows
        if stop is None:
            total = _file_reader(cfg, cfg.path, eval_bs).count_rows()
            stop = int(round(total * (1.0 - cfg.test_fraction)))
        test = _file_reader(cfg, cfg.path, eval_bs, row_range=(stop, None))
    valid = None
    if cfg.valid_path is not None:
        valid = _file_reader(cfg, cfg.valid_path, eval_bs)
    elif cfg.valid_fraction is not None:
        rows = stop if stop is not None else _file_reader(cfg, cfg.path, eval_bs).count_rows()
        stop = rows - _held_out(rows, cfg.valid_fraction)
        valid = _file_reader(cfg, cfg.path, eval_bs, row_range=(stop, rows))
    train = _file_reader(cfg, cfg.path, cfg.batch_size, rank, world_size, row_range=(0, stop))
    paths = [cfg.path] if isinstance(cfg.path, str) else list(cfg.path)
    return DataSources(_shuffled(cfg, train, seed), test, schema.sparse_feature_names, len(schema.dense),
                       list(schema.labels), train_rows=stop, train_reader=train, test_reader=test, valid=valid,
                       valid_reader=valid, train_paths=paths)


def _stream_sources(cfg: DataConfig, eval_bs: int, reader: dict) -> DataSources:
    """The trainer's stream source as training data; test and validation rows from files."""
    from hybridrec.data.stream import StreamContext, open_source

    _check_paths(cfg)
    schema = _schema(cfg)
    source = open_source(cfg.stream, StreamContext(schema, cfg.batch_size, strict=cfg.strict, **reader))
    test = _file_reader(cfg, cfg.test_path, eval_bs) if cfg.test_path is not None else []
    valid = _file_reader(cfg, cfg.valid_path, eval_bs) if cfg.valid_path is not None else None
    return DataSources(source, test, schema.sparse_feature_names, len(schema.dense), list(schema.labels),
                       train_reader=source, test_reader=test if cfg.test_path is not None else None, valid=valid,
                       valid_reader=valid, stream=source)
