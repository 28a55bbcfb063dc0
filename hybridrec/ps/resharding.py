"""PS checkpoints that record the routing, and loading them into any number of servers.

Each server writes its tables, its dense params and `routing.json` into its shard directory
(`shard-<i>-of-<n>`): the routing table it held, its version, the buckets it owned and those it
had exported but still held (`BucketOwnership.claims`), all taken at the instant its tables
were copied. While a checkpoint runs the servers refuse to export or drop buckets (`freeze`),
so a bucket in the middle of a move is held by its old server (outgoing) and perhaps already
by its new one (owned).

Loading (`load_owned`), a server reads every shard directory of the checkpoint and keeps, of
the buckets it owns now, each bucket's rows from one shard: the one that owned it at the
highest routing version, else the one holding it outgoing. A checkpoint written before routing
existed (no `routing.json`) is read by the placement of that time (`route(key, table, n)`).
"""
from __future__ import annotations

import json
import re
from typing import Mapping

import numpy as np

from hybridrec.embedding import EmbeddingStore, checkpoint_format
from hybridrec.embedding.buckets import NUM_BUCKETS, bucket_of
from hybridrec.embedding.dir_handle import DirHandle, Entry
from hybridrec.embedding.hashing import route, table_route_id

ROUTING_FILE = "routing.json"
SHARD = re.compile(r"shard-(\d{4})-of-(\d{4})")


def shard_names(directory: DirHandle) -> list[tuple[str, int, int]]:
    """(name, index, count) of every shard directory of a PS checkpoint, in index order."""
    found = []
    for name in directory.names():
        match = SHARD.fullmatch(name)
        if match and directory.is_dir(name):
            found.append((name, int(match[1]), int(match[2])))
    counts = {count for _, _, count in found}
    if not found or len(counts) != 1 or sorted(i for _, i, _ in found) != list(range(counts.pop())):
        raise ValueError(f"meta 'directory' {directory.path!r} holds no complete PS checkpoint "
                         f"(shard-<i>-of-<n> directories for every i < n), found {[n for n, _, _ in found]}")
    return sorted(found, key=lambda shard: shard[1])


def choose_sources(claims: list[dict | None]) -> np.ndarray | None:
    """int[NUM_BUCKETS]: the shard each bucket is read from (see the module docstring); None when
    the checkpoint predates routing (no claims). A bucket nobody holds is an error."""
    if all(c is None for c in claims):
        return None
    if any(c is None for c in claims):
        raise ValueError("some shards of the checkpoint record their routing and some do not")
    source = np.full(NUM_BUCKETS, -1, np.int64)
    best = np.full(NUM_BUCKETS, -2, np.int64)
    for kind in ("owned", "outgoing"):
        for shard, claim in enumerate(claims):
            held = np.unpackbits(np.frombuffer(bytes.fromhex(claim[kind]), np.uint8)).astype(bool) & (source < 0 if kind == "outgoing" else True)
            better = held & (claim["version"] > best) if kind == "owned" else held
            source[better], best[better] = shard, claim["version"]
    if (source < 0).any():
        raise ValueError(f"the checkpoint holds no shard for buckets {np.flatnonzero(source < 0)[:8].tolist()}")
    return source


def load_owned(directory: DirHandle, current: Mapping[str, EmbeddingStore],
               owned: np.ndarray) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{table: (rows, meta)} of the buckets `owned` (bool[NUM_BUCKETS]) read from the checkpoint
    in `directory` (the parent of its shard directories), every table of `current`."""
    shards = shard_names(directory)
    handles = [directory.sub(name) for name, _, _ in shards]
    try:
        claims = [json.loads(h.read_bytes(ROUTING_FILE)) if h.is_file(ROUTING_FILE) else None for h in handles]
        sources = choose_sources(claims)
        for (name, _, _), handle in zip(shards, handles):
            missing = [table for table in current if not handle.is_dir(table)]
            if missing:  # checked before any is read
                raise ValueError(f"meta 'directory' {handle.path!r} has no checkpoint of tables {missing}")
        out = {}
        for table in current:
            route_id = table_route_id(table)
            rows, meta = [], []
            for shard, handle in enumerate(handles):
                # room for the rows of the checkpoint's disk tier too, which come back into memory here
                manifest = checkpoint_format.read_manifest(Entry(handle, table))
                held = int(manifest["size"]) + int((manifest.get("tier") or {}).get("rows", 0))
                saved = EmbeddingStore.load(Entry(handle, table), capacity=max(held, manifest["layout"]["capacity"]))
                if sources is None:  # before routing: route(key, table, n) placed every key
                    keep = lambda keys, shard=shard: (route(keys, route_id, len(shards)) == shard) & owned[
                        bucket_of(keys, route_id)]
                else:
                    keep = lambda keys, shard=shard: (sources == shard)[bucket_of(keys, route_id)] & owned[
                        bucket_of(keys, route_id)]
                part_rows, part_meta = saved.rows_where(keep)
                rows.append(part_rows)
                meta.append(part_meta)
            out[table] = (np.concatenate(rows), np.concatenate(meta))
        return out
    finally:
        for handle in handles:
            handle.close()
