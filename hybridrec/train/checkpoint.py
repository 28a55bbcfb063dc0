"""Training checkpoints: dense weights, dense optimizer, every embedding store, progress and
random-number state, written together so that `--resume` continues exactly where a run stopped.

Layout: `<output_dir>/checkpoints/step-<N>/` with `dense.pt` (model + optimizer state dicts and
torch RNG state), `progress.json` (step, epoch, batch within the epoch, samples seen) and
`embeddings/` (the placement's tables: the local placement writes `<deep|wide>/<table>/` store
checkpoints, see hybridrec.embedding.checkpoint; PS servers write their shards).
`progress.json` also records the settings that fix the batch order and the model's shape, and
resuming with different ones is refused (they would silently train something else). A run on a
stream adds `stream_by_rank`: each trainer's place in the stream (hybridrec.train.stream).
A checkpoint directory is complete once `progress.json` exists; it is written last, after the
directory was assembled under a temporary name and renamed into place. `latest` names the newest.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

import torch

from hybridrec.config import ConfigError
from hybridrec.errors import UserError

PROGRESS = "progress.json"
CONFIG = "config.json"  # the resolved config the run was trained with
DENSE = "dense.pt"
_TMP = re.compile(r"\.step-[0-9]+\.tmp-(?P<pid>[0-9]+)")
# config keys a resumed run must share with the run that wrote the checkpoint: they decide which
# batches come in which order and what shape the model has (capacity, epochs, lrs may change)
RESUME_KEYS = ("seed", "data.format", "data.synthetic", "data.path", "data.schema", "data.train_rows",
               "data.test_fraction", "data.test_path", "data.valid_fraction", "data.valid_path",
               "data.shuffle_buffer", "data.batch_size", "model", "embedding.default.init",
               "embedding.default.seed")


class CheckpointTimer:
    """train.checkpoint_every_s: a checkpoint is due once that many seconds passed since the last."""

    def __init__(self, every_s: float | None) -> None:
        self.every_s = every_s
        self._last = time.monotonic()

    def due(self, agree=None) -> bool:
        """`agree(flag)`: trainers that step together take the leader's answer (a checkpoint is a
        collective); without it, this trainer's clock."""
        if self.every_s is None:
            return False
        late = time.monotonic() - self._last >= self.every_s
        return agree(late) if agree is not None else late

    def reset(self) -> None:
        self._last = time.monotonic()


class CheckpointError(UserError):
    """A checkpoint that cannot be read; the message names the file, what is wrong and what to do."""


def resume_identity(cfg) -> dict:
    """The values of RESUME_KEYS in `cfg` (JSON-ready)."""
    dumped = cfg.model_dump(mode="json", by_alias=True)
    out = {}
    for key in RESUME_KEYS:
        node = dumped
        for part in key.split("."):
            node = node[part]
        out[key] = node
    return out


def checkpoint_root(output_dir) -> Path:
    return Path(output_dir) / "checkpoints"


def save_checkpoint(output_dir, dense_state: dict, write_embeddings, progress: dict, cfg=None,
                    keep: int | None = None) -> Path:
    """The checkpoint protocol of every strategy: `dense_state` (+ torch RNG) to dense.pt,
    `write_embeddings(directory)` fills `<checkpoint>/embeddings`, then progress.json, the atomic
    rename and the `latest` pointer."""
    root = checkpoint_root(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{progress['step']:09d}"
    tmp = root / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    torch.save({**dense_state, "torch_rng": torch.get_rng_state()}, tmp / DENSE)
    write_embeddings(tmp / "embeddings")
    if cfg is not None:
        (tmp / CONFIG).write_text(json.dumps(cfg.model_dump(mode="json", by_alias=True), indent=1))
    record = {**progress, "identity": resume_identity(cfg)} if cfg is not None else dict(progress)
    (tmp / PROGRESS).write_text(json.dumps(record))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    (root / "latest.tmp").write_text(final.name)
    os.replace(root / "latest.tmp", root / "latest")
    if keep is not None:
        for old in sorted(root.glob("step-*"))[:-keep]:
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
    return final


def complete_checkpoints(output_dir) -> list[Path]:
    """The complete checkpoints under `output_dir`, newest first (`latest` names the newest)."""
    root = checkpoint_root(output_dir)
    done = sorted((p for p in root.glob("step-*") if (p / PROGRESS).is_file()), reverse=True) if root.is_dir() else []
    pointer = root / "latest"
    if pointer.is_file():
        named = root / pointer.read_text().strip()
        if named in done:
            done.remove(named)
            done.insert(0, named)
    return done


def latest_checkpoint(output_dir) -> Path | None:
    """The newest complete checkpoint under `output_dir` (or None)."""
    done = complete_checkpoints(output_dir)
    return done[0] if done else None


def remove_interrupted_writes(output_dir) -> list[Path]:
    """Delete the half-written checkpoints (`.step-N.tmp-<pid>`) of processes that are gone,
    e.g. killed with SIGKILL while writing; returns what was removed."""
    root, removed = checkpoint_root(output_dir), []
    for tmp in sorted(root.glob(".step-*.tmp-*")) if root.is_dir() else []:
        match = _TMP.fullmatch(tmp.name)
        if match and not Path(f"/proc/{match['pid']}").exists():
            shutil.rmtree(tmp, ignore_errors=True)
            removed.append(tmp)
    return removed


def read_progress(path, cfg=None) -> dict:
    """A checkpoint's progress record; with `cfg`, refuses (ConfigError) a checkpoint written
    under different RESUME_KEYS values. CheckpointError when the record cannot be read."""
    path = Path(path)
    if not (path / PROGRESS).is_file():
        raise FileNotFoundError(f"checkpoint: {path} is not a complete training checkpoint (no {PROGRESS})")
    try:
        record = json.loads((path / PROGRESS).read_text())
        int(record["step"]), int(record["epoch"]), list(record["next_batch_by_rank"])
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"checkpoint: {path / PROGRESS} is damaged ({type(exc).__name__}: {exc}); resume from "
                              "an older checkpoint or start over (--overwrite)") from None
    saved = record.pop("identity", None)
    if cfg is not None and saved is not None:
        now = resume_identity(cfg)
        changed = [f"{k}: checkpoint {saved.get(k)!r}, config {now[k]!r}" for k in now if saved.get(k) != now[k]]
        if changed:
            raise ConfigError(f"resume: {path} was trained with other settings; resuming would not continue "
                              f"that run. Differences: " + "; ".join(changed))
    return record


def read_dense(path) -> dict:
    """The dense.pt state of a checkpoint; restores torch's RNG state as it was saved.
    CheckpointError when the file cannot be read as a checkpoint's dense state."""
    file = Path(path) / DENSE
    try:
        state = torch.load(file, weights_only=True, map_location="cpu")
        torch.set_rng_state(state["torch_rng"])
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint: {file} is missing; resume from an older checkpoint or start over "
                              "(--overwrite)") from None
    except Exception as exc:  # torch raises many types for a damaged file; its advice to unpickle anyway is unsafe
        raise CheckpointError(f"checkpoint: {file} is not a dense state this program wrote ({type(exc).__name__}); "
                              "resume from an older checkpoint or start over (--overwrite)") from None
    if not isinstance(state.get("model"), dict):
        raise CheckpointError(f"checkpoint: {file} holds no model state; resume from an older checkpoint or "
                              "start over (--overwrite)")
    return state


def read_config(path) -> dict | None:
    """The resolved config a checkpoint was trained with (None for checkpoints without one)."""
    file = Path(path) / CONFIG
    if not file.is_file():
        return None
    try:
        return json.loads(file.read_text())
    except ValueError as exc:
        raise CheckpointError(f"checkpoint: {file} is damaged ({exc}); give the run's config file instead") from None


# what a config may not change to evaluate, export or score a checkpoint's model: the model and
# the inputs it was trained on (which columns feed which feature, how dense values are scaled);
# the data's files, splits, batch sizes and reading options may differ
SCHEMA_MODEL_KEYS = ("labels", "dense", "categorical", "multi_categorical", "hour_columns", "dense_transform",
                     "standardize", "dense_mean", "dense_std")


def _flat(prefix: str, value) -> dict:
    """{dotted key: value} of a nested dict's leaves (lists are leaves)."""
    if isinstance(value, dict) and value:
        out = {}
        for key, inner in value.items():
            out.update(_flat(f"{prefix}.{key}", inner))
        return out
    return {prefix: value}


def model_keys(cfg) -> dict:
    """{dotted config key: value} of everything that shapes the model (SCHEMA_MODEL_KEYS and the
    model section but its training loss; the features and tables of the data format)."""
    from hybridrec.job.sources import data_layout

    keys = _flat("model", {k: v for k, v in cfg.model.model_dump(mode="json").items() if k != "loss"})
    schema = cfg.data.schema
    if schema is not None:
        keys.update({f"data.schema.{k}": list(v) if isinstance(v, tuple) else v
                     for k, v in schema.to_dict().items() if k in SCHEMA_MODEL_KEYS})
    else:
        sparse, num_dense, labels = data_layout(cfg.data)
        keys.update({"data.format": cfg.data.format, "data.format's sparse features": sparse,
                     "data.format's dense features": num_dense, "data.format's labels": labels})
        if cfg.data.format == "synthetic":
            keys.update(_flat("data.synthetic", {k: v for k, v in cfg.data.synthetic.model_dump().items()
                                                 if k.startswith(("n_", "multi_hot"))}))
    keys.update({f"embedding.shared.{name}.features": list(t.features) for name, t in cfg.embedding.shared.items()})
    return keys


def _with_trained_scaling(given, trained):
    """`given` with the dense statistics of the run that wrote the checkpoint, when it has none
    of its own (a config file as written; training filled them in)."""
    mine, theirs = given.data.schema, trained.data.schema
    if mine is None or theirs is None or mine.scaled or not theirs.scaled or mine.standardize != theirs.standardize:
        return given
    schema = given.data.schema_.model_copy(update={"dense_mean": theirs.dense_mean, "dense_std": theirs.dense_std})
    return given.model_copy(update={"data": given.data.model_copy(update={"schema_": schema})})


def config_for_checkpoint(path, given=None, given_name: str = "the config"):
    """The config to rebuild checkpoint `path`'s model with: the one saved with it, or `given`
    (its data to read: other files and splits are fine) when it agrees with the saved one on
    everything that shapes the model (`model_keys`; ConfigError naming each key that differs).
    Checkpoints without a saved config need `given`."""
    from hybridrec.config import parse_config

    path = Path(path)
    saved = read_config(path)
    if saved is None:
        if given is None:
            raise ConfigError(f"checkpoint: {path} holds no {CONFIG} (it predates saved configs); give the config "
                              "it was trained with")
        return given
    trained = parse_config(saved, str(path / CONFIG))
    if given is None:
        return trained
    given = _with_trained_scaling(given, trained)
    before, now = model_keys(trained), model_keys(given)
    differences = [f"{key}: checkpoint {before.get(key)!r}, {given_name} {now.get(key)!r}"
                   for key in dict.fromkeys([*before, *now]) if before.get(key) != now.get(key)]
    if differences:
        raise ConfigError(f"{given_name} changes the model of checkpoint {path}: " + "; ".join(differences)
                          + f". Only the data's files, splits and reading may differ; leave the config out to use "
                            f"the one saved with it ({path / CONFIG})")
    return given


def model_state(path) -> dict:
    """The dense model's weights of checkpoint `path`: dense.pt's, except that the parameters the
    PS servers hold (their `dense/` directories: Hierarchical Training's centre copy, which is the
    job's result, or the async discipline's parameters) are taken from them. What evaluation and
    export read, so both score the same model."""
    from hybridrec.ps.dense import DenseStore
    from hybridrec.strategy.placement.checkpoint_layout import shard_directories

    state = dict(read_dense(path)["model"])
    for shard in shard_directories(Path(path) / "embeddings"):
        try:
            store = DenseStore.load(shard / "dense", {name: list(value.shape) for name, value in state.items()})
        except ValueError as exc:
            raise CheckpointError(f"checkpoint: {exc}") from None
        held = [name for name in store.shapes() if name in state]
        for name, value in store.pull(held).items():
            state[name] = torch.from_numpy(value.copy()).reshape(state[name].shape).to(state[name].dtype)
    return state
