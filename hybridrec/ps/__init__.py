"""hybridrec.ps: the embedding parameter server (one process per shard), its client, and the
dense parameters a shard can hold for fully asynchronous training (`DenseStore`).

Server names are imported lazily so `python -m hybridrec.ps.server` runs the module once.
"""

from hybridrec.ps.client import PSClient, dense_shard, shard_directory, table_route_id
from hybridrec.ps.dense import DenseStore

_SERVER_NAMES = ("EmbeddingServer", "open_stores", "serve")


def __getattr__(name: str):
    if name in _SERVER_NAMES:
        from hybridrec.ps import server
        return getattr(server, name)
    raise AttributeError(f"module 'hybridrec.ps' has no attribute {name!r}")


__all__ = ["DenseStore", "PSClient", "dense_shard", "shard_directory", "table_route_id", *_SERVER_NAMES]
