"""A dense model and loss of your own over hybridrec's embedding tables, from Python.

Generates a small click data set with a planted model (string and integer categorical columns
with gaps, numeric columns with gaps, an interaction between two fields), trains a TorchRec-style
over-arch (pooled embeddings and dense features in, logits out) with a label-smoothed loss,
evaluates it on held-out rows and scores a DataFrame of new rows:

    python examples/custom_model.py                       # local: one process (seconds)
    python examples/custom_model.py --preset picasso      # the same job over 2 trainer processes

It prints the held-out AUC next to the AUC of the planted model itself (the best any model can
reach on these rows). See docs/python-api.md.
"""
from __future__ import annotations

import argparse

import numpy as np
import pandas as pd
import torch
from torch import nn

from hybridrec.api import Job, ModelInputs, PooledEmbeddings
from hybridrec.metrics import auc

FIELDS = {"user": 300, "item": 200, "site": 20, "device": 6}  # categorical columns and their vocabularies
CONFIG = {
    "data": {"format": "tabular", "batch_size": 256,
             "schema": {"labels": ["clicked"], "dense": ["price", "age"], "categorical": list(FIELDS)}},
    "model": {"embedding_dim": 8},
    "embedding": {"default": {"capacity": 10_000}},
    "train": {"epochs": 4, "dense_optimizer": {"lr": 0.005}, "progress": False},
    "seed": 7,
}


def planted_rows(rows: int, seed: int) -> tuple[pd.DataFrame, np.ndarray]:
    """(rows with a `clicked` label, the planted click probability of each). The label follows a
    logistic model: a weight per ID of each field, an item x device interaction, the price."""
    rng = np.random.default_rng(seed)
    weights = np.random.default_rng(0)  # the planted model is the same for every call
    ids = {name: rng.integers(0, size, rows) for name, size in FIELDS.items()}
    logit = -1.0 + sum(weights.normal(0, 0.8, size)[ids[name]] for name, size in FIELDS.items())
    logit += weights.normal(0, 1.0, (FIELDS["item"], FIELDS["device"]))[ids["item"], ids["device"]]
    price = rng.lognormal(3, 1, rows)
    logit -= 0.5 * (np.log(price) - 3)
    probability = 1 / (1 + np.exp(-logit))
    frame = pd.DataFrame({
        "user": ids["user"],                                                    # integers
        "item": [f"item-{i}" for i in ids["item"]],                            # strings
        "site": pd.Series([f"site{i}" for i in ids["site"]]).where(rng.random(rows) > 0.1),  # strings, 10% missing
        "device": pd.Series(ids["device"], dtype=float).where(rng.random(rows) > 0.1),      # integers with gaps
        "price": np.where(rng.random(rows) > 0.05, np.log1p(price), np.nan),   # numeric, 5% missing
        "age": rng.normal(0, 1, rows),
        "clicked": (rng.random(rows) < probability).astype(np.float32),
    })
    return frame, probability


class DotInteractionOverArch(nn.Module):
    """DLRM's shape, as a TorchRec user writes it above an EmbeddingBagCollection: the dense
    features through an MLP to one more embedding, every pairwise dot product of the embeddings,
    and an MLP over those and the dense embedding to the logits."""

    def __init__(self, inputs: ModelInputs, hidden: int = 32):
        super().__init__()
        dim, fields = inputs.embedding_dim, inputs.num_sparse + 1
        self.dense_arch = nn.Sequential(nn.Linear(inputs.num_dense, dim), nn.ReLU())
        self.pairs = torch.triu_indices(fields, fields, offset=1)
        self.over_arch = nn.Sequential(nn.Linear(dim + self.pairs.shape[1], hidden), nn.ReLU(),
                                       nn.Linear(hidden, inputs.num_tasks))

    def forward(self, dense: torch.Tensor, sparse: PooledEmbeddings) -> torch.Tensor:
        embedded_dense = self.dense_arch(dense)
        stacked = torch.cat([embedded_dense.unsqueeze(1), sparse.stacked()], dim=1)  # [B, F+1, D]
        dots = torch.bmm(stacked, stacked.transpose(1, 2))[:, self.pairs[0], self.pairs[1]]
        return self.over_arch(torch.cat([embedded_dense, dots], dim=1))


def smoothed_bce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Binary cross-entropy against labels smoothed toward 0.5 by 0.05 (less over-confident scores)."""
    return nn.functional.binary_cross_entropy_with_logits(logits, labels * 0.9 + 0.05)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="local", help="strategy.preset (local, picasso, persia, het, des, ht)")
    parser.add_argument("--out", default="runs/custom_model", help="train.output_dir")
    parser.add_argument("--rows", type=int, default=12_000, help="rows to generate (70%% train, 15%% valid, 15%% test)")
    args = parser.parse_args(argv)

    frame, _ = planted_rows(args.rows, seed=1)
    cut, held = int(0.7 * len(frame)), int(0.85 * len(frame))
    train, valid, test = frame.iloc[:cut], frame.iloc[cut:held], frame.iloc[held:]
    overrides = [f"strategy.preset={args.preset}", f"train.output_dir={args.out}"]
    if args.preset != "local":
        overrides.append("strategy.roles.trainers=2")
    job = Job(CONFIG, model=DotInteractionOverArch, hparams={"hidden": 32}, loss=smoothed_bce, overrides=overrides)
    result = job.fit(train=train, valid=valid, test=test, overwrite=True)
    print(f"trained {result['step']} steps with {job.cfg.model.name}; test AUC {result['auc']:.4f}")

    new_rows, planted = planted_rows(2_000, seed=2)
    metrics = job.evaluate(new_rows)
    scores = job.predict(new_rows.drop(columns=["clicked"]))
    labels = new_rows["clicked"].to_numpy()
    print(f"new rows: AUC {metrics['auc']:.4f} (the planted model's {auc(labels, planted):.4f}), "
          f"logloss {metrics['logloss']:.4f}; first scores {[round(float(s), 3) for s in scores[:5]]}")
    return {"result": result, "new_rows": metrics, "scores": scores, "labels": labels,
            "planted_auc": auc(labels, planted)}


if __name__ == "__main__":
    main()
