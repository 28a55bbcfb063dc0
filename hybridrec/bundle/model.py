"""The dense model's architecture as a bundle records it: the registry name and the keyword
arguments `models.build_model` takes (the job's feature counts and model.hparams), so the model is
rebuilt from the manifest alone and its state dict (dense.pt) loaded into it. A model of the
user's (hybridrec.models.custom) is recorded by its import path, its inputs and hparams: whatever
loads the bundle must import it too; a model given as a Python object has no such record and is
refused."""
from __future__ import annotations

import dataclasses

import torch

from hybridrec.errors import UserError
from hybridrec.job.tables import model_inputs
from hybridrec.models import build_model
from hybridrec.models.custom import OBJECT, ModelInputs, build_custom_model, is_import_path


def model_spec(cfg, tables) -> dict:
    """The architecture of a job's dense model (what `job.tables.job_dense_model` builds)."""
    m = cfg.model
    if m.name == OBJECT:
        raise UserError("export: model.name is object, a model handed to hybridrec.api as an nn.Module instance, "
                        "which a bundle cannot rebuild; train with an import path (model=MyModule the class, or "
                        "'package.module:Factory') to export, or score in Python with hybridrec.api's "
                        "Job.predict (docs/python-api.md)")
    if is_import_path(m.name):
        return {"name": m.name, "inputs": dataclasses.asdict(model_inputs(cfg, tables)), "hparams": dict(m.hparams)}
    return {"name": m.name, "kwargs": {"num_sparse": len(tables.sparse_names), "embedding_dim": m.embedding_dim,
                                       "num_dense": tables.num_dense, "num_tasks": tables.num_tasks, **m.hparams}}


def build(spec: dict, state: dict) -> torch.nn.Module:
    """The model of `spec` holding the weights `state`, in evaluation mode."""
    if is_import_path(spec["name"]):
        inputs = spec["inputs"]
        model = build_custom_model(spec["name"], ModelInputs(**{**inputs, "feature_names": tuple(inputs["feature_names"])}),
                                   spec["hparams"])
    else:
        model = build_model(spec["name"], **spec["kwargs"])
    model.load_state_dict(state)
    return model.eval()
