"""PSClient: pull and push embedding rows on a set of PS shards as if they were one table.

Keys are deduplicated, routed to shards with the project's one global hash
`route(keys, table_id, num_shards)` (Persia's shuffled, uniform partition), sent to every
shard at once (one socket per server: send all, then receive all) and the rows are put back
in the caller's key order. Gradients of equal keys are summed before they leave. Rows and
gradients travel with the job's value codec ("none" or "fp16"). Lookups, stats, checkpoint,
load and ping are retried after a timeout; pushes are not (a retried push could apply twice).

Not thread-safe: use one PSClient per thread.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from hybridrec.comm.codec import Encoded, make_value_codec
from hybridrec.comm.transport import Client, Message, request_all
from hybridrec.embedding import route


def table_route_id(table: str) -> int:
    """The `table_id` that `route` gets for a table name: stable across processes and runs."""
    return zlib.crc32(table.encode("utf-8"))


def shard_directory(directory: str | Path, shard: int, num_shards: int) -> Path:
    """Where shard `shard` of `num_shards` keeps its checkpoint inside `directory`."""
    return Path(directory) / f"shard-{shard:04d}-of-{num_shards:04d}"


def _check_keys(keys: np.ndarray) -> np.ndarray:
    if not isinstance(keys, np.ndarray) or keys.dtype != np.uint64 or keys.ndim != 1:
        raise TypeError(
            f"keys must be a 1-D numpy uint64 array, got "
            f"{type(keys).__name__} {getattr(keys, 'dtype', '')} {getattr(keys, 'shape', '')}"
        )
    return np.ascontiguousarray(keys)


class PSClient:
    """One logical embedding service over `addresses` (shard i = addresses[i])."""

    def __init__(self, addresses: Sequence[str], *, timeout: float = 10.0, retries: int = 2,
                 value_codec: str = "none", **codec_options: Any):
        if isinstance(addresses, str) or not addresses:
            raise ValueError(f"addresses must be a non-empty list of 'tcp://host:port', got {addresses!r}")
        self.addresses = list(addresses)
        self.codec = make_value_codec(value_codec, **codec_options)
        self._clients = [Client(a, timeout=timeout, retries=retries) for a in self.addresses]
        self._dims: dict[str, int] = {}

    @property
    def num_shards(self) -> int:
        return len(self._clients)

    def _broadcast(self, op: str, meta_of_shard=lambda shard: {}, idempotent: bool = True) -> list[Message]:
        return request_all([(c, op, {}, meta_of_shard(i)) for i, c in enumerate(self._clients)],
                           idempotent=idempotent)

    def dim(self, table: str) -> int:
        """The row width of `table`, asked of the first shard once."""
        if table not in self._dims:
            tables = self._clients[0].request("ping", idempotent=True).meta["tables"]
            self._dims.update(tables)
            if table not in self._dims:
                raise ValueError(f"table {table!r} is not served; tables: {sorted(tables)}")
        return self._dims[table]

    def _partition(self, table: str, unique_keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(order, bounds): unique_keys[order[bounds[s]:bounds[s+1]]] belong to shard s."""
        with np.errstate(over="ignore"):  # route's salt multiply wraps on purpose
            shard = route(unique_keys, table_route_id(table), self.num_shards)
        order = np.argsort(shard, kind="stable")
        bounds = np.zeros(self.num_shards + 1, dtype=np.int64)
        np.cumsum(np.bincount(shard, minlength=self.num_shards), out=bounds[1:])
        return order, bounds

    def lookup(self, table: str, keys: np.ndarray, insert: bool = True) -> np.ndarray:
        """float32 [len(keys), dim] rows in the order of `keys` (absent keys read as zeros)."""
        keys = _check_keys(keys)
        unique_keys, inverse = np.unique(keys, return_inverse=True)
        order, bounds = self._partition(table, unique_keys)
        meta = {"table": table, "insert": bool(insert), "codec": self.codec.name}
        shards = [s for s in range(self.num_shards) if bounds[s + 1] > bounds[s]]
        replies = request_all(
            [(self._clients[s], "lookup", {"keys": unique_keys[order[bounds[s]:bounds[s + 1]]]}, meta)
             for s in shards],
            idempotent=True,
        )
        unique_rows = np.empty((len(unique_keys), self.dim(table)), dtype=np.float32)
        for s, reply in zip(shards, replies):
            encoded = Encoded(reply.meta.get("codec"), reply.arrays, reply.meta.get("codec_meta", {}))
            unique_rows[order[bounds[s]:bounds[s + 1]]] = self.codec.decode(encoded)
        return unique_rows[inverse.reshape(-1)]

    def push(self, table: str, keys: np.ndarray, grads: np.ndarray) -> int:
        """Send gradients (one row per key; equal keys are summed); returns dropped updates.

        A dropped update is a key the shard no longer holds (evicted or never admitted).
        """
        keys = _check_keys(keys)
        dim = self.dim(table)
        if not isinstance(grads, np.ndarray) or grads.dtype != np.float32 or grads.shape != (len(keys), dim):
            raise ValueError(
                f"grads must be a float32 array of shape ({len(keys)}, {dim}), got "
                f"{getattr(grads, 'dtype', type(grads).__name__)} {getattr(grads, 'shape', '')}"
            )
        if not np.isfinite(grads).all():
            raise ValueError("grads holds NaN or inf; nothing was sent")
        unique_keys, inverse = np.unique(keys, return_inverse=True)
        summed = torch.zeros(len(unique_keys), dim).index_add_(
            0, torch.from_numpy(inverse.reshape(-1)), torch.from_numpy(np.ascontiguousarray(grads))
        ).numpy()
        order, bounds = self._partition(table, unique_keys)
        requests = []
        for s in range(self.num_shards):
            picked = order[bounds[s]:bounds[s + 1]]
            if len(picked):
                encoded = self.codec.encode(summed[picked], argument="grads")
                requests.append((self._clients[s], "push", {"keys": unique_keys[picked], **encoded.arrays},
                                 {"table": table, "codec": encoded.codec, "codec_meta": encoded.meta}))
        return sum(int(reply.meta["dropped"]) for reply in request_all(requests, idempotent=False))

    def ping(self) -> list[dict[str, Any]]:
        return [reply.meta for reply in self._broadcast("ping")]

    def stats(self) -> list[dict[str, Any]]:
        """Each shard's {pid, tables: {name: store stats}}."""
        return [reply.meta for reply in self._broadcast("stats")]

    def checkpoint(self, directory: str | Path) -> list[Path]:
        """Every shard saves its tables under `directory` (a path the servers can write)."""
        paths = [shard_directory(directory, s, self.num_shards) for s in range(self.num_shards)]
        self._broadcast("checkpoint", lambda s: {"directory": str(paths[s])})
        return paths

    def load(self, directory: str | Path) -> None:
        """Every shard replaces its tables with the checkpoint `checkpoint(directory)` wrote."""
        self._broadcast("load", lambda s: {"directory": str(shard_directory(directory, s, self.num_shards))})

    def shutdown(self) -> None:
        """Ask every shard to stop (each replies first)."""
        self._broadcast("shutdown", idempotent=False)

    def close(self) -> None:
        for client in self._clients:
            client.close()

    def __enter__(self) -> "PSClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
