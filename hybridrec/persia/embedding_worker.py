"""The embedding worker: Persia's middle tier between the data loader, the NN workers and the PS.

Persia §4.1 steps (1)-(7):
  put   the ID features of a batch arrive (with the job's ID codec); the worker gives the batch
        sample ids whose first byte is its rank (sample i of the batch = first + i), buffers the
        IDs under the first id and answers with it;
  pull  an NN worker asks for a buffered batch's embeddings: the worker deduplicates and routes
        the IDs of every table to the PS shards (one request per shard for all tables) and
        answers (with, per table and shard, how many updates the shard's store had applied when
        it read them: `versions`), with the job's value codec, either the rows of each table's unique keys (the
        lossless mode, `id_codec: unique`: the NN worker pools them itself, from the same
        layout of the same IDs, so no index is sent) or pooled [B, F, D] deep and [B, F] wide
        embeddings (`id_codec: none`, the baseline);
  (once a pull's rows are in, the worker has the PS servers read the next buffered batch's cold
        rows ahead, on a thread of its own, when they keep tables on a disk tier;)
  push  the NN worker sends the gradients of what it pulled: the worker maps them back to the
        keys (pooled mode: through the pooling; unique mode: one row per key already), and
        pushes them to the PS, where the fused optimizer applies them; the batch leaves the
        buffer. The answer names, per table and shard, the update's place in the order that
        shard's store applied updates (`versions`: the staleness lab replays a job in that order).
The worker keeps no state across restarts: batches buffered when it dies are lost; a pull or
push of a lost batch is answered with `lost: true` and counted, as Persia does. Lookups to a PS
shard that died are retried until it is back (restarted on its shared memory); a push it did
not acknowledge is not retried (it may have been applied) and is counted as unacknowledged. The buffer
holds at most `max_buffered` batches and `max_buffered_bytes` of IDs; older ones are dropped and
counted. A put of more samples than the job's batches have (`max_batch_size`) is refused before
its IDs are decoded.

Run one with `hybridrec embedding-worker CONFIG --rank 0 --ps tcp://127.0.0.1:7001,...`.
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from hybridrec.comm.codec import (Encoded, decode_rows, encode_rows, make_id_codec, make_value_codec, with_prefix,
                                  without_prefix)
from hybridrec.comm.transport import Message, Operation, Server, Service, check_addresses
from hybridrec.data.batch import JaggedFeatures
from hybridrec.job.tables import JobTables
from hybridrec.ps.client import PSClient
from hybridrec.embedding.layout import BatchLayout, unpool
from hybridrec.embedding.read_ahead import ReadAhead

READY = "hybridrec-embedding-worker listening on "  # printed with the address once it serves
SAMPLE_ID_RANK_SHIFT = 56  # a sample id's first byte is the embedding worker's rank
MAX_RANK = 255


def worker_of(sample_id: int) -> int:
    """The rank of the embedding worker that buffered `sample_id`."""
    return int(sample_id) >> SAMPLE_ID_RANK_SHIFT


@dataclass
class _Buffered:
    features: JaggedFeatures
    layout: BatchLayout | None = None  # made by the first pull, reused by the push


def _meta_int(meta: dict, name: str) -> int:
    value = meta.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"meta {name!r} must be an int >= 0, got {value!r}")
    return value


class EmbeddingWorker(Service):
    """Buffers batches' ID features and serves their pooled embeddings from the PS shards."""

    def __init__(self, tables: JobTables, ps_addresses: Sequence[str], rank: int, *,
                 host: str = "127.0.0.1", port: int = 0, threads: int = 2, id_codec: str = "unique",
                 value_codec: str = "none", timeout: float = 30.0, retries: int = 3,
                 max_buffered: int = 256, max_buffered_bytes: int = 1 << 30, max_batch_size: int = 1 << 16,
                 max_connections: int = 256):
        if not isinstance(rank, int) or not 0 <= rank <= MAX_RANK:
            raise ValueError(f"rank must be an int in [0, {MAX_RANK}] (it is a sample id's first byte), got {rank!r}")
        for name, value in (("max_buffered", max_buffered), ("max_buffered_bytes", max_buffered_bytes),
                            ("max_batch_size", max_batch_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self.tables, self.rank = tables, rank
        self.ps_addresses = check_addresses(ps_addresses, "ps_addresses")  # clients connect lazily, per thread
        self.id_codec = make_id_codec(id_codec)
        # the lossless mode deduplicates the rows as well as the IDs: only unique rows travel
        self.unique_rows = id_codec == "unique"
        self.value_codec = make_value_codec(value_codec)
        self._ps_options = dict(timeout=timeout, retries=retries, value_codec=value_codec)
        self._ps = threading.local()  # one PSClient per server thread (clients are not thread-safe)
        self._ps_clients: list[PSClient] = []
        self.max_buffered, self.max_buffered_bytes, self.max_batch_size = max_buffered, max_buffered_bytes, max_batch_size
        self._buffer: OrderedDict[int, _Buffered] = OrderedDict()
        self._buffered_bytes = 0
        self._lock = threading.Lock()
        self._next_sample = 0
        self.counters = {"puts": 0, "pulls": 0, "pushes": 0, "dropped_batches": 0, "lost_pulls": 0,
                         "lost_pushes": 0, "dropped_updates": 0, "unacknowledged_pushes": 0, "read_aheads": 0,
                         "read_ahead_records": 0, "lost_read_aheads": 0}
        self._dims = {name: cfg.dim for name, cfg in tables.all_tables().items()}
        self._read_ahead = ReadAhead("hybridrec-worker-read-ahead")
        self._tiered: list[str] | None = None  # the PS servers' tables with a disk tier, asked at the first pull
        operations = {
            "ping": Operation(self._ping),
            "put": Operation(self._put, arrays=None),
            "pull": Operation(self._pull),
            "push": Operation(self._push, arrays=None),
            "stats": Operation(self._stats),
            "shutdown": Operation(self._shutdown),
        }
        self.transport = Server(operations, host=host, port=port, threads=threads, max_connections=max_connections)

    def _release(self) -> None:
        try:
            self._read_ahead.close()
        finally:
            for client in self._ps_clients:
                client.close()

    def _client(self) -> PSClient:
        client = getattr(self._ps, "client", None)
        if client is None:
            client = self._ps.client = PSClient(self.ps_addresses, **self._ps_options)
            with self._lock:
                self._ps_clients.append(client)
        return client

    def _count(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self.counters[name] += amount

    # ------------------------------------------------------------------ operations
    def _ping(self, request: Message) -> Message:
        return Message("ping", meta={"pid": os.getpid(), "rank": self.rank, "ps": self.ps_addresses})

    def _put(self, request: Message) -> Message:
        encoded = Encoded(request.meta.get("codec"), dict(request.arrays), request.meta.get("codec_meta", {}))
        if encoded.codec != self.id_codec.name:
            raise ValueError(f"meta 'codec' is {encoded.codec!r}; this job's ID codec is {self.id_codec.name!r}")
        declared = encoded.meta.get("batch_size") if isinstance(encoded.meta, dict) else None
        if isinstance(declared, int) and declared > self.max_batch_size:  # checked before decoding sizes anything
            raise ValueError(f"codec_meta 'batch_size' is {declared}; this job's batches have at most "
                             f"{self.max_batch_size} samples (data.batch_size, data.eval_batch_size)")
        features = self.id_codec.decode(encoded)
        if sorted(features.names) != sorted(self.tables.sparse_names):
            raise ValueError(f"the batch has features {features.names}; this job's sparse features are "
                             f"{self.tables.sparse_names}")
        batch = features.batch_size
        nbytes = features.values.nbytes + features.offsets.nbytes
        if nbytes > self.max_buffered_bytes:
            raise ValueError(f"the batch's IDs take {nbytes} bytes, more than this worker buffers in all "
                             f"({self.max_buffered_bytes})")
        with self._lock:
            if self._next_sample + batch >= 1 << SAMPLE_ID_RANK_SHIFT:
                self._next_sample = 0  # the 56-bit counter wraps after 7e16 samples
            first = (self.rank << SAMPLE_ID_RANK_SHIFT) | self._next_sample
            self._next_sample += max(batch, 1)
            self._buffer[first] = _Buffered(features)
            self._buffered_bytes += nbytes
            while len(self._buffer) > self.max_buffered or self._buffered_bytes > self.max_buffered_bytes:
                self._forget(self._buffer.popitem(last=False)[1])
                self.counters["dropped_batches"] += 1
            self.counters["puts"] += 1
        return Message("put", meta={"first_sample_id": first, "batch_size": batch})

    def _forget(self, entry: _Buffered) -> None:
        """Book a batch that left the buffer (the lock is held)."""
        self._buffered_bytes -= entry.features.values.nbytes + entry.features.offsets.nbytes

    def _layout(self, entry: _Buffered) -> BatchLayout:
        if entry.layout is None:
            entry.layout = self.tables.layout(entry.features)
        return entry.layout

    def _pull(self, request: Message) -> Message:
        first = _meta_int(request.meta, "first_sample_id")
        train = request.meta.get("train", True)
        if not isinstance(train, bool):
            raise ValueError(f"meta 'train' must be true or false, got {train!r}")
        with self._lock:
            entry = self._buffer.get(first) if train else self._buffer.pop(first, None)
            if entry is not None and not train:
                self._forget(entry)
        if entry is None:
            self._count("lost_pulls")
            return Message("pull", meta={"lost": True})
        layout = self._layout(entry)
        versions: dict[str, list[int]] = {}
        rows = self._client().lookup_tables(layout.unique, insert=train, unique=True,  # deduplicated by the layout
                                            versions=versions)
        if train and self._tiered != []:
            self._read_next(first)
        meta: dict[str, Any] = {"lost": False, "batch_size": layout.batch_size, "num_features": layout.num_features,
                                "layout": "unique" if self.unique_rows else "pooled", "versions": versions}
        if self.unique_rows:  # lossless: each unique row once; the NN worker pools (same layout, no index sent)
            parts = {table: rows[table] for table in layout.tables()}
        else:  # one pooled row per (sample, feature)
            deep, wide = layout.assemble({t: torch.from_numpy(r) for t, r in rows.items()}, self.tables.deep_dim)
            parts = {side: value.reshape(layout.batch_size, -1).numpy()
                     for side, value in (("deep", deep), ("wide", wide)) if value is not None}
        meta["parts"] = list(parts)
        arrays: dict[str, np.ndarray] = {}
        for name, values in parts.items():
            part_arrays, meta[name] = with_prefix(encode_rows(self.value_codec, values, name), name)
            arrays.update(part_arrays)
        self._count("pulls")
        return Message("pull", arrays, meta)

    def _read_next(self, first: int) -> None:
        """Have the servers read ahead the cold rows of the batch buffered after `first` (the
        next to be pulled, in put order), if any, on the read-ahead thread."""
        with self._lock:
            after = False
            for sample, entry in self._buffer.items():
                if after:
                    break
                after = sample == first
            else:
                return
        self._read_ahead.submit(self._read_coming, entry)

    def _read_coming(self, entry: _Buffered) -> None:
        client = self._client()
        if self._tiered is None:
            self._tiered = [t for t in client.tiered_tables() if t in self._dims]
        layout = self._layout(entry)
        wanted = {table: layout.unique[table] for table in self._tiered if table in layout.unique}
        if not wanted:
            return
        try:
            touched = client.read_ahead_tables(wanted)
        except (TimeoutError, ConnectionError):  # a hint lost with its server: the pull will fault the rows in
            self._count("lost_read_aheads")
            return
        with self._lock:
            self.counters["read_aheads"] += 1
            self.counters["read_ahead_records"] += touched

    def _gradients(self, request: Message, layout: BatchLayout) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """(keys, gradient rows) per table from a push, every part checked before any is used."""
        expected: dict[str, tuple[int, int]]
        if self.unique_rows:
            expected = {t: (len(layout.unique[t]), self._dims[t]) for t in layout.tables()}
        else:
            expected = {side: (layout.batch_size, layout.num_features * dim)
                        for side, bags, dim in (("deep", layout.deep, self.tables.deep_dim), ("wide", layout.wide, 1)) if bags}
        values = {}
        for name, shape in expected.items():
            if name not in request.meta:
                raise ValueError(f"push lacks the gradients of {name!r}")
            encoded = without_prefix(request.arrays, name, request.meta[name])
            if encoded.codec != self.value_codec.name:
                raise ValueError(f"{name} gradients use codec {encoded.codec!r}; this job's value codec is "
                                 f"{self.value_codec.name!r}")
            grad = decode_rows(self.value_codec, encoded)
            if grad.shape != shape:
                raise ValueError(f"{name} gradients have shape {grad.shape}, expected {shape}")
            if not np.isfinite(grad).all():
                raise ValueError(f"{name} gradients hold NaN or inf; nothing was applied")
            values[name] = np.ascontiguousarray(grad)
        if self.unique_rows:
            return {t: (layout.unique[t], values[t]) for t in layout.tables()}
        grads = {}
        for side, bags_list in (("deep", layout.deep), ("wide", layout.wide)):
            if bags_list:
                grad = torch.from_numpy(values[side]).view(layout.batch_size, layout.num_features, -1)
                grads.update({bags.table: (bags.keys, unpool(bags, grad)) for bags in bags_list})
        return grads

    def _push(self, request: Message) -> Message:
        first = _meta_int(request.meta, "first_sample_id")
        with self._lock:
            entry = self._buffer.get(first)
        if entry is None:
            self._count("lost_pushes")
            return Message("push", meta={"lost": True, "dropped": 0})
        grads = self._gradients(request, self._layout(entry))
        with self._lock:  # the batch leaves the buffer once its gradients are checked
            entry = self._buffer.pop(first, None)
            if entry is None:
                self.counters["lost_pushes"] += 1
                return Message("push", meta={"lost": True, "dropped": 0})
            self._forget(entry)
        versions: dict[str, list[int]] = {}
        try:
            dropped = self._client().push_tables(grads, unique=self.unique_rows, versions=versions)
        except TimeoutError:
            # a PS shard died mid-push: pushes are not retried (one may have been applied before the
            # crash), so this batch's update is lost on that shard, as asynchronous training allows
            self._count("unacknowledged_pushes")
            return Message("push", meta={"lost": False, "dropped": 0, "unacknowledged": True})
        with self._lock:
            self.counters["pushes"] += 1
            self.counters["dropped_updates"] += int(dropped)
        return Message("push", meta={"lost": False, "dropped": int(dropped), "versions": versions})

    def _stats(self, request: Message) -> Message:
        with self._lock:
            return Message("stats", meta={"pid": os.getpid(), "rank": self.rank, "buffered": len(self._buffer),
                                          **self.counters})

    def _shutdown(self, request: Message) -> Message:
        self.transport.request_stop()
        return Message("shutdown", meta={"pid": os.getpid()})


def main(argv: list[str] | None = None, prog: str = "python -m hybridrec.persia.embedding_worker") -> int:
    from hybridrec.config import load_config
    from hybridrec.job.tables import job_tables
    from hybridrec.ps.server import run_until_stopped

    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    parser.add_argument("config", help="the job's YAML config (tables, codecs, timeouts)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    parser.add_argument("--rank", type=int, required=True, help=f"this worker's rank, 0..{MAX_RANK}")
    parser.add_argument("--ps", required=True, help="the PS servers' addresses, comma-separated, in shard order")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port (printed on start)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.set)
        strategy = cfg.strategy
        torch.set_num_threads(1)
        addresses = check_addresses([a for a in args.ps.split(",") if a], "--ps")
        worker = EmbeddingWorker(job_tables(cfg), addresses, args.rank, host=args.host,
                                 port=args.port, threads=args.threads, id_codec=strategy.id_codec,
                                 value_codec=strategy.value_codec, timeout=strategy.request_timeout,
                                 retries=strategy.retries, max_buffered=strategy.max_buffered_batches,
                                 max_batch_size=max(cfg.data.batch_size, cfg.data.eval_batch_size or 0))
    except ValueError as error:  # ConfigError too: a bad config, --ps, --rank, --threads or --port
        parser.error(str(error))
    worker.start()
    run_until_stopped(worker, on_ready=lambda: print(f"{READY}{worker.address} pid {os.getpid()}", flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
