"""Training checkpoints: dense weights, dense optimizer, every embedding store, progress and
random-number state, written together so that `--resume` continues exactly where a run stopped.

Layout: `<output_dir>/checkpoints/step-<N>/` with `dense.pt` (model + optimizer state dicts and
torch RNG state), `progress.json` (step, epoch, batch within the epoch, samples seen) and
`embeddings/` (the placement's tables: the local placement writes `<deep|wide>/<table>/` store
checkpoints, see hybridrec.embedding.checkpoint; PS servers write their shards).
`progress.json` also records the settings that fix the batch order and the model's shape, and
resuming with different ones is refused (they would silently train something else).
A checkpoint directory is complete once `progress.json` exists; it is written last, after the
directory was assembled under a temporary name and renamed into place. `latest` names the newest.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from hybridrec.config import ConfigError

PROGRESS = "progress.json"
# config keys a resumed run must share with the run that wrote the checkpoint: they decide which
# batches come in which order and what shape the model has (capacity, epochs, lrs may change)
RESUME_KEYS = ("seed", "data.format", "data.synthetic", "data.path", "data.schema", "data.train_rows",
               "data.test_fraction", "data.batch_size", "model", "embedding.default.init",
               "embedding.default.seed")


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
    torch.save({**dense_state, "torch_rng": torch.get_rng_state()}, tmp / "dense.pt")
    write_embeddings(tmp / "embeddings")
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


def latest_checkpoint(output_dir) -> Path | None:
    """The newest complete checkpoint under `output_dir` (or None)."""
    root = checkpoint_root(output_dir)
    pointer = root / "latest"
    if pointer.is_file():
        path = root / pointer.read_text().strip()
        if (path / PROGRESS).is_file():
            return path
    done = sorted(p for p in root.glob("step-*") if (p / PROGRESS).is_file()) if root.is_dir() else []
    return done[-1] if done else None


def read_progress(path, cfg=None) -> dict:
    """A checkpoint's progress record; with `cfg`, refuses (ConfigError) a checkpoint written
    under different RESUME_KEYS values."""
    path = Path(path)
    if not (path / PROGRESS).is_file():
        raise FileNotFoundError(f"checkpoint: {path} is not a complete training checkpoint (no {PROGRESS})")
    record = json.loads((path / PROGRESS).read_text())
    saved = record.pop("identity", None)
    if cfg is not None and saved is not None:
        now = resume_identity(cfg)
        changed = [f"{k}: checkpoint {saved.get(k)!r}, config {now[k]!r}" for k in now if saved.get(k) != now[k]]
        if changed:
            raise ConfigError(f"resume: {path} was trained with other settings; resuming would not continue "
                              f"that run. Differences: " + "; ".join(changed))
    return record


def read_dense(path) -> dict:
    """The dense.pt state of a checkpoint; restores torch's RNG state as it was saved."""
    state = torch.load(Path(path) / "dense.pt", weights_only=True, map_location="cpu")
    torch.set_rng_state(state["torch_rng"])
    return state
