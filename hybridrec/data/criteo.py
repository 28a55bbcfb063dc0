"""Reader of the raw Criteo Kaggle / Terabyte click logs (TSV: label, I1..I13, C1..C26).

Integer features become log(1 + max(x, 0)) with missing = 0; categorical hex strings become
uint64 IDs hashed per field (equal strings in different fields never collide, see
`kernels.token_key`); an empty categorical is a missing ID (length 0 for that sample).
Parsing is the streaming numba path of `DelimitedTextReader`: constant memory, rank-sharded,
bad rows counted and reported with file and line.
"""
from __future__ import annotations

from hybridrec.data.tabular import DelimitedTextReader, TabularSchema

CRITEO_DENSE = tuple(f"I{i}" for i in range(1, 14))
CRITEO_CATEGORICAL = tuple(f"C{i}" for i in range(1, 27))
CRITEO_SCHEMA = TabularSchema(
    labels=("label",), dense=CRITEO_DENSE, categorical=CRITEO_CATEGORICAL, delimiter="\t",
    header=False, column_names=("label",) + CRITEO_DENSE + CRITEO_CATEGORICAL,
    dense_transform="log1p", binary_labels=True, standardize=False)


class CriteoReader(DelimitedTextReader):
    """Batches of Criteo rows: 13 dense features, 26 single-ID sparse features C1..C26.

    `CriteoReader(path_or_paths, batch_size, rank=0, world_size=1, strict=False,
    chunk_bytes=8 MiB, drop_last=False)`; iterate it (again and again) for `Batch`es."""

    def __init__(self, paths, batch_size: int, **kwargs) -> None:
        super().__init__(paths, CRITEO_SCHEMA, batch_size, **kwargs)
