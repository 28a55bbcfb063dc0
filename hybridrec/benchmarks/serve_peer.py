"""The peer of `hybridrec bench serve`: the same model served by plain PyTorch behind the same HTTP
layer. Each table is an `nn.EmbeddingBag` over the bundle's fp32 rows (one more row of zeros for
IDs the table does not hold), raw keys are mapped to rows by a Python dict, and the pooled bags go
to the same dense model; parsing, micro-batching and HTTP are hybridrec serve's own.

    python -m hybridrec.benchmarks.serve_peer BUNDLE --port 0 [serve options]
"""
from __future__ import annotations

import argparse
import sys

import numpy as np
import torch

from hybridrec.serving.predictor import Predictor


class TorchDictPredictor(Predictor):
    """Predictor whose lookup and pooling are an EmbeddingBag per table fed by a dict."""

    def __init__(self, version):
        super().__init__(version)
        self.bags, self.rows_of = {}, {}
        for name, table in version.tables.items():
            weights = np.concatenate([table.weights(), np.zeros((1, table.dim), np.float32)])
            mode = "mean" if table.pooling == "mean" else "sum"
            self.bags[name] = torch.nn.EmbeddingBag.from_pretrained(torch.from_numpy(weights), freeze=True, mode=mode)
            self.rows_of[name] = {int(k): i for i, k in enumerate(table.keys.tolist())}

    def pooled(self, batch) -> dict[str, np.ndarray]:
        sparse, size = batch.sparse, batch.batch_size
        offsets = sparse.offsets
        out, missing, looked = {}, 0, 0
        with torch.inference_mode():
            for side in self.sides:
                pooled = []
                for f, t in enumerate(side.feature_table.tolist()):
                    table = side.tables[t]
                    lo, hi = offsets[f * size], offsets[(f + 1) * size]
                    rows_of, absent = self.rows_of[table.name], len(table.keys)
                    ids = [rows_of.get(k, absent) for k in sparse.values[lo:hi].tolist()]
                    missing += ids.count(absent)
                    looked += hi - lo
                    bag_offsets = torch.from_numpy(offsets[f * size:(f + 1) * size] - lo)
                    pooled.append(self.bags[table.name](torch.tensor(ids, dtype=torch.int64), bag_offsets))
                out[side.name] = torch.stack(pooled, dim=1).numpy()
        self.count_lookups(looked, missing)
        return out


def main(argv=None) -> int:
    from hybridrec.serving.options import add_serve_arguments, options_from
    from hybridrec.serving.server import serve

    parser = argparse.ArgumentParser(prog="python -m hybridrec.benchmarks.serve_peer")
    add_serve_arguments(parser)
    args = parser.parse_args(argv)
    serve(options_from(args), args.host, args.port, args.timeout, predictor=TorchDictPredictor)
    return 0


if __name__ == "__main__":
    sys.exit(main())
