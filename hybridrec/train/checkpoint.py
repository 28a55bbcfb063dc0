"""Training checkpoints: dense weights, dense optimizer, every embedding store, progress and
random-number state, written together so that `--resume` continues exactly where a run stopped.

Layout: `<output_dir>/checkpoints/step-<N>/` with `dense.pt` (model + optimizer state dicts and
torch RNG state), `progress.json` (step, epoch, batch within the epoch, samples seen) and
`embeddings/<collection>/<table>/` (store checkpoints, see hybridrec.embedding.checkpoint).
A checkpoint directory is complete once `progress.json` exists; it is written last, after the
directory was assembled under a temporary name and renamed into place. `latest` names the newest.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from hybridrec.embedding.checkpoint import load as load_store

PROGRESS = "progress.json"


def checkpoint_root(output_dir) -> Path:
    return Path(output_dir) / "checkpoints"


def save_training(output_dir, model, optimizer, progress: dict) -> Path:
    root = checkpoint_root(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{progress['step']:09d}"
    tmp = root / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    torch.save({"model": model.dense_model.state_dict(), "optimizer": optimizer.state_dict(),
                "torch_rng": torch.get_rng_state()}, tmp / "dense.pt")
    for cname, collection in model.collections().items():
        for tname, store in collection.stores.items():
            store.save(tmp / "embeddings" / cname / tname.replace(":", "_"))
    (tmp / PROGRESS).write_text(json.dumps(progress))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    (root / "latest.tmp").write_text(final.name)
    os.replace(root / "latest.tmp", root / "latest")
    return final


def latest_checkpoint(output_dir) -> Path | None:
    root = checkpoint_root(output_dir)
    pointer = root / "latest"
    if pointer.is_file():
        path = root / pointer.read_text().strip()
        if (path / PROGRESS).is_file():
            return path
    done = sorted(p for p in root.glob("step-*") if (p / PROGRESS).is_file()) if root.is_dir() else []
    return done[-1] if done else None


def load_training(path, model, optimizer=None) -> dict:
    """Restore a checkpoint into `model` (and `optimizer`); returns its progress record."""
    path = Path(path)
    if not (path / PROGRESS).is_file():
        raise FileNotFoundError(f"checkpoint: {path} is not a complete training checkpoint (no {PROGRESS})")
    state = torch.load(path / "dense.pt", weights_only=False)
    model.dense_model.load_state_dict(state["model"])
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["torch_rng"])
    for cname, collection in model.collections().items():
        for tname, store in list(collection.stores.items()):
            directory = path / "embeddings" / cname / tname.replace(":", "_")
            loaded = load_store(directory, **_layout_of(store))
            collection.stores[tname] = loaded
    return json.loads((path / PROGRESS).read_text())


def _layout_of(store) -> dict:
    """Fields that the running config decides (a checkpoint may be loaded with a new capacity)."""
    return {"capacity": store.config.capacity, "num_threads": store.config.num_threads}
