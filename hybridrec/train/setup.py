"""What a training or evaluating process sets up before its first batch: the random generators and
thread counts (`seed_everything`), the device (`resolve_device`) and the job's dense model on it
(`dense_model`)."""
from __future__ import annotations

import random

import numpy as np
import torch

from hybridrec.config import JobConfig
from hybridrec.job.tables import job_dense_model
from hybridrec.models.custom import BCE, resolve_loss, torch_loss


def seed_everything(seed: int, threads: int, deterministic: bool) -> None:
    """Seed every random generator training may use and set the torch and numba thread counts."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    try:
        import numba

        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    except (ImportError, ValueError):
        pass
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)


def resolve_device(name: str) -> torch.device:
    """'auto' = CUDA when available, else CPU; asking for CUDA without it is an error."""
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("train.device: 'cuda' was asked for but torch.cuda.is_available() is False; "
                         "use 'auto' or 'cpu'")
    return torch.device("cuda" if name == "cuda" or (name == "auto" and torch.cuda.is_available()) else "cpu")


def dense_model(cfg: JobConfig, tables, module: torch.nn.Module | None = None) -> torch.nn.Module:
    """The job's dense model on its device; `module`: a model object of the caller's (hybridrec.api)."""
    return job_dense_model(cfg, tables, module).to(resolve_device(cfg.train.device))


def training_loss(cfg: JobConfig, loss=None):
    """The loss training minimises: `loss(logits, labels)` a Python caller gave, else model.loss
    (binary cross-entropy unless it names a loss of the user's), its result checked to be a scalar."""
    if loss is None and cfg.model.loss == BCE:
        return torch.nn.BCEWithLogitsLoss()
    if loss is None:
        return torch_loss(resolve_loss(cfg.model.loss), cfg.model.loss)
    return torch_loss(loss, "(the loss given in Python)")

