"""The torch optimizer of a model's dense parameters, built from a train.dense_optimizer section; every
process that steps dense parameters (trainers, HT's group PSs) builds it here."""
from __future__ import annotations

import torch


def optimizer_of(spec: dict, params) -> torch.optim.Optimizer:
    """The torch optimizer a train.dense_optimizer section (as a dict: name, lr, weight_decay) names."""
    cls = {"adam": torch.optim.Adam, "adagrad": torch.optim.Adagrad, "sgd": torch.optim.SGD}[spec["name"]]
    return cls(params, lr=spec["lr"], weight_decay=spec["weight_decay"])
