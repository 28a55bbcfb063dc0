"""The dense model's embedding inputs for one batch, made from what the embedding worker sent.

Pooled parts ("deep" [B, F*D], "wide" [B, F]) become the inputs as they are. Unique rows (the
lossless wire mode) are pooled here with the batch's `BatchLayout`, which this process
computes from its own IDs exactly as the embedding worker did (in the pipeline's feeder
thread, `prepare_layout`; the autograd graph is built in the training thread: a graph built in
the feeder thread made the process abort at exit). Either way the tensors that
came off the wire are autograd leaves, and `gradients()` hands back their gradients, by part
name, for the push.
"""
from __future__ import annotations

import numpy as np
import torch

from hybridrec.data.batch import JaggedFeatures
from hybridrec.parallel.embedding_client import Pulled
from hybridrec.parallel.tables import JobTables
from hybridrec.ps.pooling import BatchLayout, batch_layout


def layout_of(features: JaggedFeatures, tables: JobTables) -> BatchLayout:
    """The batch's layout as the embedding worker computes it (no autograd: any thread may)."""
    pooling = {name: cfg.pooling for name, cfg in tables.all_tables().items()}
    return batch_layout(features, tables.sparse_names, tables.deep_map, tables.wide_map, pooling)


def prepare_layout(tables: JobTables):
    """A pipeline `prepare` hook: the layout of batches that arrive as unique rows, else None."""
    return lambda batch, pulled: layout_of(batch.sparse, tables) if pulled.layout == "unique" else None


class EmbeddingInputs:
    def __init__(self, pulled: Pulled, features: JaggedFeatures, tables: JobTables, requires_grad: bool,
                 layout: BatchLayout | None = None):
        self.leaves = {name: torch.from_numpy(np.array(part, dtype=np.float32)).requires_grad_(requires_grad)
                       for name, part in pulled.parts.items()}
        shape = (pulled.batch_size, pulled.num_features)
        if pulled.layout == "unique":
            layout = layout if layout is not None else layout_of(features, tables)
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
