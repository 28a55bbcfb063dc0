"""The settings a job on data files gets from the data when its config leaves them out, so that a
config naming only the data, the schema and the model learns on a small file as on a big one.

`resolve_defaults(cfg)` returns the config with these filled in (what the run trains, saves with
its checkpoints and evaluates with) and a line for each, which the trainer prints:

* **batch size** (`data.batch_size` unset; file formats): about 1/100 of the training rows as a
  power of two, between 32 and 4,096, so a small file still takes ~100 steps per epoch and a big
  one the long-standing 4,096.
* **learning rates** (`embedding.default.optimizer` and `train.dense_optimizer` unset): Adagrad
  at 0.05 for the tables and Adam at 0.001 for the dense layers at every batch size the defaults
  choose. Both scale each coordinate's step by its own gradient history, so the rate that suits
  batches of 4,096 serves batches of 32 (`hybridrec bench small-data` trains with it); what
  follows the data's size is the batch size and, through early stopping, the number of epochs.
* **early stopping** (`train.early_stopping` auto: on for file formats when `train.epochs` is
  unset, and trainers that step together): up to `MAX_EPOCHS` epochs, an evaluation on the
  validation rows every epoch (at most every `MAX_EVAL_EVERY` steps), `train.patience`
  evaluations without a better AUC end training, and the best step's model is kept
  (hybridrec.train.early_stopping). Without validation rows in the config, the last part of the
  training rows validates (hybridrec.train.validation_split).
* **standardised dense columns** (format tabular, `data.schema.standardize` true): mean and
  standard deviation of the training rows into the schema (hybridrec.data.standardize).

Synthetic data and streams keep the config's settings as they are.
"""
from __future__ import annotations

import importlib
import math

from hybridrec.config import JobConfig, parse_config
from hybridrec.train.validation_split import default_fraction, has_validation

MAX_EPOCHS = 100
MAX_EVAL_EVERY = 1_000
MIN_BATCH, MAX_BATCH = 32, 4_096
ROWS_PER_BATCH = 100  # about this many steps per epoch on a small file
RATES = {"embedding": 0.05, "dense": 0.001}  # Adagrad, Adam


def batch_size_for(rows: int) -> int:
    """The default batch size for `rows` training rows (see the module docstring)."""
    if rows <= 0:
        return MIN_BATCH
    return int(min(MAX_BATCH, max(MIN_BATCH, 2 ** math.floor(math.log2(max(rows / ROWS_PER_BATCH, 1))))))


def _lockstep(cfg: JobConfig) -> bool:
    """Whether the job's trainers step together (mid-run evaluations need it)."""
    from hybridrec.axes import AXES, Axis

    value = AXES[Axis.DENSE][cfg.strategy.resolved["dense"]]
    return importlib.import_module(f"hybridrec.strategy.{value.module}").DENSE.lockstep


def _training_reader(cfg: JobConfig):
    """The reader of every training row of the config (rank 0 of one; validation rows excluded)."""
    from hybridrec.job.sources import build_sources

    return build_sources(cfg.data, cfg.seed, with_best_auc=False).train_reader


def _rows(reader) -> int:
    start, stop = reader.row_range
    total = reader.count_rows()
    return max(0, min(total, stop if stop is not None else total) - start)


def resolve_defaults(cfg: JobConfig) -> tuple[JobConfig, list[str]]:
    """(the config with the data's defaults filled in, a line saying each)."""
    data, train = cfg.data, cfg.train
    if data.stream is not None or data.format == "synthetic":
        if train.early_stopping is True and not has_validation(data):
            raise_without_validation()
        return cfg, []
    updated = cfg.model_dump(mode="json", by_alias=True)
    notes = []
    rows = _rows(_training_reader(cfg))
    batch = data.batch_size
    if "batch_size" not in data.model_fields_set:
        batch = updated["data"]["batch_size"] = batch_size_for(rows)
        notes.append(f"batch size {batch} for {rows:,} training rows (data.batch_size: about rows / "
                     f"{ROWS_PER_BATCH} as a power of two, {MIN_BATCH}..{MAX_BATCH})")
    rates = RATES
    default_table = cfg.embedding.default
    if "default" not in cfg.embedding.model_fields_set or "optimizer" not in default_table.model_fields_set:
        updated["embedding"]["default"]["optimizer"] = {"name": "adagrad", "lr": rates["embedding"]}
        notes.append(f"embedding tables: adagrad lr {rates['embedding']:g} (embedding.default.optimizer)")
    if "dense_optimizer" not in train.model_fields_set:
        updated["train"]["dense_optimizer"]["lr"] = rates["dense"]
        notes.append(f"dense layers: adam lr {rates['dense']:g} (train.dense_optimizer)")
    stopping = train.early_stopping is True or (train.early_stopping == "auto" and "epochs" not in train.model_fields_set
                                                and _lockstep(cfg))
    updated["train"]["early_stopping"] = stopping
    if stopping:
        notes += _early_stopping(cfg, updated, rows, batch)
    resolved = parse_config(updated, "the config with the data's defaults")
    schema = resolved.data.schema
    if schema is not None and schema.standardize and schema.dense and not schema.scaled:
        resolved, note = _standardised(resolved)
        notes.append(note)
    return resolved, notes


def _early_stopping(cfg: JobConfig, updated: dict, rows: int, batch: int) -> list[str]:
    data, train = cfg.data, cfg.train
    if not _lockstep(cfg):
        raise_not_lockstep(cfg)
    notes = []
    if not has_validation(data):
        fraction = updated["data"]["valid_fraction"] = default_fraction(rows)
        notes.append(f"validation: the last {fraction:.1%} of the training rows, {round(rows * fraction):,} rows "
                     f"(data.valid_fraction; or give data.valid_path)")
        rows -= round(rows * fraction)
    if "epochs" not in train.model_fields_set:
        updated["train"]["epochs"] = MAX_EPOCHS
    steps = max(1, math.ceil(rows / batch))
    if "eval_every" not in train.model_fields_set:
        updated["train"]["eval_every"] = min(steps, MAX_EVAL_EVERY)
    notes.append(f"early stopping: an evaluation every {updated['train']['eval_every']} steps ({steps} per epoch), "
                 f"training ends after {train.patience} without a better validation AUC (train.patience), at most "
                 f"{updated['train']['epochs']} epochs; the best step's model is kept (train.epochs set: that many "
                 f"epochs, no early stopping)")
    return notes


def _standardised(cfg: JobConfig) -> tuple[JobConfig, str]:
    from hybridrec.data.standardize import dense_statistics

    reader = _training_reader(cfg)
    stats = dense_statistics(reader.paths, cfg.data.schema, reader.row_range)
    updated = cfg.model_dump(mode="json", by_alias=True)
    updated["data"]["schema"].update(dense_mean=list(stats.mean), dense_std=list(stats.std))
    gaps = ", ".join(f"{name} {share:.0%}" for name, share in zip(cfg.data.schema.dense, stats.missing) if share)
    note = (f"dense columns standardised by the mean and deviation of {stats.rows:,} training rows "
            f"(data.schema.standardize); empty cells read as the mean" + (f" (empty: {gaps})" if gaps else ""))
    return parse_config(updated, "the config with the data's defaults"), note


def raise_without_validation():
    from hybridrec.config import ConfigError

    raise ConfigError("train.early_stopping: true needs validation rows: data.valid_fraction (synthetic data) or "
                      "data.valid_path (a stream)")


def raise_not_lockstep(cfg: JobConfig):
    from hybridrec.config import ConfigError

    raise ConfigError(f"train.early_stopping: strategy.dense {cfg.strategy.resolved['dense']} trains without the "
                      f"trainers stepping together, so there are no evaluations mid-run to stop by; set "
                      f"train.epochs, or train.early_stopping: false")
