"""The dense model's embedding inputs for one batch, made from what the embedding worker sent.

Pooled parts ("deep" [B, F*D], "wide" [B, F]) become the inputs as they are. Unique rows (the
lossless wire mode) are pooled here with the batch's `BatchLayout`, which this process
computes from its own IDs exactly as the embedding worker did. Everything here runs in the
training thread, which keeps torch out of the pipeline's threads (once suspected of the aborts
at exit that DDP's teardown turned out to cause, see nn_worker.main). Either way the tensors that
came off the wire are autograd leaves, and `gradients()` hands back their gradients, by part
name, for the push.
"""
from __future__ import annotations

import numpy as np
import torch

from hybridrec.data.batch import JaggedFeatures
from hybridrec.parallel.embedding_client import Pulled
from hybridrec.parallel.tables import JobTables


class EmbeddingInputs:
    def __init__(self, pulled: Pulled, features: JaggedFeatures, tables: JobTables, requires_grad: bool):
        self.leaves = {name: torch.from_numpy(np.array(part, dtype=np.float32)).requires_grad_(requires_grad)
                       for name, part in pulled.parts.items()}
        shape = (pulled.batch_size, pulled.num_features)
        if pulled.layout == "unique":
            self.deep, self.wide = tables.layout(features).assemble(self.leaves, tables.deep_dim)
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
