"""The dense model's architecture as a bundle records it: the registry name and the keyword
arguments `models.build_model` takes (the job's feature counts and model.hparams), so the model is
rebuilt from the manifest alone and its state dict (dense.pt) loaded into it."""
from __future__ import annotations

import torch

from hybridrec.models import build_model


def model_spec(cfg, tables) -> dict:
    """The architecture of a job's dense model (what `job.tables.job_dense_model` builds)."""
    m = cfg.model
    return {"name": m.name, "kwargs": {"num_sparse": len(tables.sparse_names), "embedding_dim": m.embedding_dim,
                                       "num_dense": tables.num_dense, "num_tasks": tables.num_tasks, **m.hparams}}


def build(spec: dict, state: dict) -> torch.nn.Module:
    """The model of `spec` holding the weights `state`, in evaluation mode."""
    model = build_model(spec["name"], **spec["kwargs"])
    model.load_state_dict(state)
    return model.eval()
