"""The dense model's embedding inputs for one batch, made from what the embedding worker sent.

Pooled parts ("deep" [B, F*D], "wide" [B, F]) become the inputs as they are. Unique rows (the
lossless wire mode) are pooled here with the batch's `BatchLayout`, which this process
computes from its own IDs exactly as the embedding worker did. Everything here runs in the
training thread: torch work in the pipeline's feeder thread made NN workers abort at exit now
and then ("terminate called without an active exception"). Either way the tensors that
came off the wire are autograd leaves, and `gradients()` hands back their gradients, by part
name, for the push.
"""
from __future__ import annotations

import numpy as np
import torch

from hybridrec.data.batch import JaggedFeatures
from hybridrec.parallel.embedding_client import Pulled
from hybridrec.parallel.tables import JobTables
from hybridrec.ps.pooling import batch_layout


class EmbeddingInputs:
    def __init__(self, pulled: Pulled, features: JaggedFeatures, tables: JobTables, requires_grad: bool):
        self.leaves = {name: torch.from_numpy(np.array(part, dtype=np.float32)).requires_grad_(requires_grad)
                       for name, part in pulled.parts.items()}
        shape = (pulled.batch_size, pulled.num_features)
        if pulled.layout == "unique":
            pooling = {name: cfg.pooling for name, cfg in tables.all_tables().items()}
            layout = batch_layout(features, tables.sparse_names, tables.deep_map, tables.wide_map, pooling)
            deep_dim = next((cfg.dim for cfg in tables.deep.values()), 0)
            self.deep, self.wide = layout.assemble(self.leaves, deep_dim)
        elif pulled.layout == "pooled":
            deep, wide = self.leaves.get("deep"), self.leaves.get("wide")
            self.deep = None if deep is None else deep.view(*shape, -1)
            self.wide = None if wide is None else wide.view(shape)
        else:
            raise ValueError(f"pulled layout {pulled.layout!r} is neither 'unique' nor 'pooled'")

    def gradients(self) -> dict[str, np.ndarray]:
        """Each leaf's gradient (zeros where the loss did not reach it)."""
        return {name: (leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)).numpy()
                for name, leaf in self.leaves.items()}
