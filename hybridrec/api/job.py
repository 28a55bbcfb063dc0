"""`Job`: one training job driven from Python. It takes the config (a YAML file, a dict or a
`JobConfig`), the user's dense model and loss, pandas DataFrames as data, trains with the
config's strategy (in this process for `local`, else by launching every role on this machine,
as `hybridrec train` does), and scores DataFrames with the trained model.

The model may be named three ways: an import path ('package.module:Factory' or
'path/to/file.py:Factory'), a class or function (named by its import path, so every process of a
distributed job can build it, and `hybridrec eval` / `export` can too), or an `nn.Module` instance
(model.name `object`: this process only, so the local strategy only, and no export). The loss
likewise: a name (`bce`), an import path, a module-level function or class, or any callable
(`object`, this process only). See docs/python-api.md.
"""
from __future__ import annotations

import contextlib
import copy
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
import yaml

from hybridrec.api.frames import is_frame, stage
from hybridrec.api.naming import import_path_of, python_path_with
from hybridrec.config import JobConfig, apply_overrides, parse_config
from hybridrec.data import tabular_reader
from hybridrec.errors import UserError
from hybridrec.job.tables import job_tables, model_inputs
from hybridrec.models.custom import OBJECT, is_import_path
from hybridrec.strategy.world import World
from hybridrec.train.best import BEST_DIR
from hybridrec.train.checkpoint import config_for_checkpoint, latest_checkpoint
from hybridrec.train.evaluation import checkpoint_directory, evaluate, load_local
from hybridrec.train.step import logits_of
from hybridrec.train.trainer import train as train_in_process

SOURCE = "hybridrec.api"  # where config errors of a config given as data say they come from
STAGED = "data"  # DataFrames given to fit() are written to <output_dir>/data/<split>.parquet
FRAME = "<a DataFrame given to fit()>"  # data.path / data.test_path of a tabular config that names no file
SPLIT_KEYS = {"train": "path", "valid": "valid_path", "test": "test_path"}


def _config_data(config) -> tuple[dict, str]:
    """(plain config data, its name for messages) of a YAML path, a dict or a JobConfig."""
    if isinstance(config, JobConfig):
        return config.model_dump(mode="json", by_alias=True), SOURCE
    if isinstance(config, dict):
        return copy.deepcopy(config), SOURCE
    if isinstance(config, (str, os.PathLike)):
        path = Path(config)
        if not path.is_file():
            raise UserError(f"config: file {str(path)!r} does not exist")
        return yaml.safe_load(path.read_text()) or {}, str(path)
    raise UserError(f"config: expected a YAML file path, a dict or a JobConfig, got {type(config).__name__}")


def _frames_to_come(data: dict) -> None:
    """A tabular config may leave its data files out (DataFrames come with fit()): those keys hold
    a placeholder until then, so the config validates now."""
    section = data.setdefault("data", {})
    if section.get("schema") is not None:
        section.setdefault("format", "tabular")
    if section.get("format") != "tabular" or section.get("stream") is not None:
        return
    if section.get("path") is None:
        section["path"] = FRAME
    if not any(section.get(key) is not None for key in ("test_path", "train_rows", "test_fraction")):
        section["test_path"] = FRAME


class Job:
    """A training job from Python (see the module docstring and docs/python-api.md)."""

    def __init__(self, config, *, model=None, loss=None, hparams: dict | None = None,
                 overrides: Sequence[str] = ()):
        data, self.source = _config_data(config)
        data, _ = apply_overrides(data, list(overrides))
        section = data.setdefault("model", {})
        self._module: torch.nn.Module | None = None  # a model object (model.name object)
        self._loss: Callable | None = None  # a loss object (model.loss object)
        factory = self._name_model(section, model, hparams)
        if loss is not None:
            self._name_loss(section, loss)
        _frames_to_come(data)
        self._data = data
        self.cfg: JobConfig = parse_config(data, self.source)
        if factory is not None:  # a class or function without an import path: made here, once
            torch.manual_seed(self.cfg.seed)
            self._module = factory(model_inputs(self.cfg, job_tables(self.cfg)), **(hparams or {}))
        self.result: dict | None = None  # fit()'s final metrics and run facts
        self._checkpoint: Path | None = None  # a checkpoint chosen by Job.load
        self._loaded = None  # (checkpoint, model, placement) scoring uses

    @classmethod
    def from_config(cls, config, overrides: Sequence[str] = (), **kwargs) -> "Job":
        """A job from a YAML file (or dict, or JobConfig) with `--set`-style overrides."""
        return cls(config, overrides=overrides, **kwargs)

    @classmethod
    def load(cls, checkpoint, *, model=None, loss=None, hparams: dict | None = None) -> "Job":
        """The job a checkpoint was trained by (a run's output_dir: its best-by-validation
        checkpoint if it has one, else the latest; or a step-N directory), with the config saved in
        it. A model trained as an `nn.Module` instance (model.name object) needs `model` again."""
        path = Path(checkpoint)
        chosen = path if (path / "progress.json").is_file() else _newest(path)
        if chosen is None:
            raise UserError(f"Job.load: {path} holds no training checkpoint")
        cfg = config_for_checkpoint(chosen, None)
        if cfg.model.name == OBJECT and model is None:
            raise UserError(f"Job.load: {chosen} was trained with a model given as an nn.Module instance; pass "
                            f"model= an instance of the same module (its weights are loaded from the checkpoint)")
        job = cls(cfg, model=model, loss=loss, hparams=hparams)
        job._checkpoint = chosen
        return job

    # ------------------------------------------------------------------ training
    def fit(self, train=None, valid=None, test=None, *, resume: bool = False, overwrite: bool = False) -> dict:
        """Train; `train`, `valid`, `test`: DataFrames replacing the config's data files (the
        config's data.schema says which columns are what). Returns the final test metrics and run
        facts (as final_metrics.json holds them)."""
        data = copy.deepcopy(self._data)
        self._use_frames(data, {split: frame for split, frame in (("train", train), ("valid", valid), ("test", test))
                                if frame is not None})
        cfg = parse_config(data, self.source)
        if cfg.strategy.distributed:
            result = self._launch(cfg, resume, overwrite)
        else:
            result = train_in_process(cfg, resume=resume, overwrite=overwrite, model=self._module, loss=self._loss)
        self._data, self.cfg, self.result = data, cfg, result
        self._checkpoint = self._loaded = None
        return result

    def _launch(self, cfg: JobConfig, resume: bool, overwrite: bool) -> dict:
        """Every role of a distributed job started on this machine (hybridrec.parallel.launch),
        each building the model and loss from their import paths."""
        from hybridrec.parallel.launch import launch
        from hybridrec.parallel.roles import role_counts

        for what, held, key in (("model", self._module, "model.name"), ("loss", self._loss, "model.loss")):
            if held is not None:
                raise UserError(f"fit: strategy {cfg.strategy.record()['preset'] or 'distributed'} builds the {what} "
                                f"in every trainer process, which a Python object cannot reach; give a class or "
                                f"function defined at the top level of a module or script (or {key} as an import "
                                f"path, 'package.module:name'), not an instance or a local definition")
        out = Path(cfg.train.output_dir).resolve()
        out.mkdir(parents=True, exist_ok=True)
        config_path = out / "api-job.yaml"
        config_path.write_text(yaml.safe_dump(cfg.model_dump(mode="json", by_alias=True), sort_keys=False))
        with _environment(PYTHONPATH=python_path_with([cfg.model.name, cfg.model.loss])):
            code = launch(str(config_path), **role_counts(cfg), resume=resume, overwrite=overwrite)
        if code != 0:
            raise UserError(f"fit: the distributed job ({config_path}) ended with exit code {code}; the lines its "
                            f"roles printed above say why")
        return json.loads((out / "final_metrics.json").read_text())

    def _use_frames(self, data: dict, frames: dict) -> None:
        """Stage the DataFrames as Parquet files under output_dir/data and point the config at them."""
        if frames and self.cfg.data.schema is None:
            raise UserError("fit: DataFrames need data.format: tabular and data.schema naming the label, dense and "
                            "categorical columns (docs/python-api.md)")
        section = data["data"]
        staged = Path(self.cfg.train.output_dir).resolve() / STAGED
        for split, frame in frames.items():
            path = stage(frame, self.cfg.data.schema, staged / f"{split}.parquet", f"fit({split}=...)")
            section[SPLIT_KEYS[split]] = str(path)
        if "test" in frames:
            section.pop("train_rows", None)
            section.pop("test_fraction", None)
        if "valid" in frames:
            section.pop("valid_fraction", None)
        for split in ("train", "test"):
            if section.get(SPLIT_KEYS[split]) == FRAME:
                raise UserError(f"fit: no {split} rows: give {split}=DataFrame, or data.{SPLIT_KEYS[split]} in the "
                                f"config" + (" (or data.test_fraction / data.train_rows)" if split == "test" else ""))

    # ------------------------------------------------------------------ scoring
    @property
    def checkpoint(self) -> Path:
        """The checkpoint scoring uses: the one Job.load named, else the run's best-by-validation
        checkpoint when the job validates, else its latest."""
        chosen = self._checkpoint or _newest(Path(self.cfg.train.output_dir))
        if chosen is None:
            raise UserError(f"no checkpoint in train.output_dir {self.cfg.train.output_dir!r}: fit() first, or "
                            f"Job.load a trained run")
        return chosen

    def evaluate(self, data=None) -> dict:
        """AUC, logloss and normalised entropy of the trained model on `data` (a DataFrame with the
        label columns), or on the config's test rows."""
        model, placement = self._model()
        if data is None:
            from hybridrec.job.sources import build_sources

            sources = build_sources(self.cfg.data, self.cfg.seed, with_best_auc=False)
            return evaluate(model, placement, sources.test, sources.label_names, World())
        with self._frame_reader(data, "evaluate(data)", labels=True) as reader:
            metrics = evaluate(model, placement, reader, list(self.cfg.data.schema.labels), World())
            return {**metrics, "bad_rows": reader.bad_rows.count}

    def predict(self, data) -> np.ndarray:
        """Probabilities for every row of the DataFrame `data` ([n], or [n, tasks] for a multi-task
        model), in its row order; label columns are not needed. A row the reader rejects (a dense
        value that is infinite or beyond float32) gets NaN."""
        model, placement = self._model()
        tasks = len(self.cfg.data.schema.labels) if self.cfg.data.schema is not None else 1
        scores = np.full((len(data), tasks), np.nan, np.float32)
        with self._frame_reader(data, "predict(data)", labels=False) as reader, torch.no_grad():
            connection = placement.connect()
            device = next(model.parameters(), torch.empty(0)).device
            try:
                for batch in reader:
                    looked = connection.lookup(connection.prepare(batch), train=False)
                    inputs = placement.inputs(looked, batch, requires_grad=False)
                    probs = torch.sigmoid(logits_of(model, inputs, batch, device)).cpu().numpy()
                    scores[batch.sample_ids.astype(np.int64)] = probs
            finally:
                connection.close()
        return scores[:, 0] if tasks == 1 else scores

    def export(self, out, precision: str = "fp32") -> Path:
        """The trained model as an inference bundle (`hybridrec export`; docs/serving.md)."""
        from hybridrec.serving.export import export

        return export(self.checkpoint, out, precision=precision)

    @contextlib.contextmanager
    def _frame_reader(self, frame, where: str, labels: bool):
        """A reader of `frame`'s rows staged in a temporary Parquet file (removed afterwards)."""
        schema = self.cfg.data.schema
        if schema is None or not is_frame(frame):
            raise UserError(f"{where}: expected a pandas DataFrame and a config with data.format: tabular and "
                            f"data.schema (got {type(frame).__name__}, data.format {self.cfg.data.format!r})")
        with tempfile.TemporaryDirectory(prefix="hybridrec-api-") as tmp:
            path = stage(frame, schema, Path(tmp) / "rows.parquet", where, labels=labels)
            yield tabular_reader(path, schema, self.cfg.data.eval_batch_size or self.cfg.data.batch_size,
                                 strict=self.cfg.data.strict)

    def _model(self):
        """(dense model in eval mode, local placement) of `checkpoint`, loaded once per checkpoint."""
        chosen = self.checkpoint
        if self._loaded is None or self._loaded[0] != chosen:
            self.cfg = config_for_checkpoint(chosen, self.cfg)  # with what training learnt of the data (scaling)
            model, placement, _ = load_local(self.cfg, chosen, self._module)
            self._loaded = (chosen, model.eval(), placement)
        return self._loaded[1:]

    # ------------------------------------------------------------------ naming the model and loss
    def _name_model(self, section: dict, model, hparams: dict | None):
        """Put `model` into the config's model section; a class or function without an import
        path is returned, to be made once the config is parsed."""
        if model is None:
            if hparams is not None:
                section["hparams"] = dict(hparams)
            return None
        if isinstance(model, str):
            section["name"] = model
        elif isinstance(model, torch.nn.Module):
            if hparams:
                raise UserError("hparams go to a model's factory; model is an nn.Module instance, already made: "
                                "pass its class (model=MyModule, hparams={...}) or leave hparams out")
            section["name"], section["hparams"], self._module = OBJECT, {}, model
            return None
        elif callable(model):
            path = import_path_of(model)
            if path is None:
                section["name"], section["hparams"] = OBJECT, {}
                return model
            section["name"] = path
        else:
            raise UserError(f"model: expected an import path, a class or function making the model, or an "
                            f"nn.Module instance; got {type(model).__name__}")
        if hparams is not None:
            section["hparams"] = dict(hparams)
        return None

    def _name_loss(self, section: dict, loss) -> None:
        if isinstance(loss, str):
            section["loss"] = loss
        elif callable(loss):
            path = import_path_of(loss)
            section["loss"] = path if path is not None else OBJECT
            self._loss = None if path is not None else loss
        else:
            raise UserError(f"loss: expected 'bce', an import path or a callable loss(logits, labels) -> scalar; "
                            f"got {type(loss).__name__}")


def _newest(output_dir: Path) -> Path | None:
    """A run's best-by-validation checkpoint when it has one, else its latest (None: none)."""
    best = latest_checkpoint(output_dir / BEST_DIR) if (output_dir / BEST_DIR).is_dir() else None
    return best or latest_checkpoint(output_dir)


@contextlib.contextmanager
def _environment(**values: str):
    """os.environ with `values` set while the block runs (the launcher's roles inherit it)."""
    before = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def train(config, *, model=None, loss=None, hparams: dict | None = None, overrides: Sequence[str] = (),
          data=None, valid=None, test=None, resume: bool = False, overwrite: bool = False) -> Job:
    """Job(config, model=..., loss=...).fit(data, valid, test): the trained job (its final metrics
    in `.result`), ready to `evaluate` and `predict`."""
    job = Job(config, model=model, loss=loss, hparams=hparams, overrides=overrides)
    job.fit(data, valid, test, resume=resume, overwrite=overwrite)
    return job
