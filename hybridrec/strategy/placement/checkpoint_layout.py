"""Where a training checkpoint's `embeddings/` directory keeps each table, whichever placement
wrote it, so that any reader (evaluation, export) finds the rows of every strategy's checkpoint:

* the local layout, `<deep|wide>/<table>/` (the local and field_sharded placements; the ':' of a
  wide table's name, `<table>:wide`, is written as '_');
* the sharded layout, `shard-<r>-of-<n>/<table>/` (the PS servers, and the sharded placement,
  whose trainers write the servers' layout): each shard holds the keys routed to it.

Each of those directories is one store checkpoint (embedding/checkpoint_format.py).
"""
from __future__ import annotations

from pathlib import Path


def local_directory(embeddings, side: str, table: str) -> Path:
    """The directory of `table` (on `side`, deep or wide) in the local layout."""
    return Path(embeddings) / side / table.replace(":", "_")


def shard_directories(embeddings) -> list[Path]:
    """The shard directories of the sharded layout, in shard order (none: another layout)."""
    return sorted(p for p in Path(embeddings).glob("shard-*-of-*") if p.is_dir())


def table_directories(embeddings, side: str, table: str) -> list[Path]:
    """Every store checkpoint holding rows of `table`: one in the local layout, one per shard in
    the sharded layout. FileNotFoundError naming the table when the checkpoint has none."""
    local = local_directory(embeddings, side, table)
    if local.is_dir():
        return [local]
    shards = [shard / table for shard in shard_directories(embeddings)]
    if shards and all(d.is_dir() for d in shards):
        return shards
    missing = [str(d) for d in shards if not d.is_dir()] or [str(local)]
    raise FileNotFoundError(f"checkpoint: {Path(embeddings)} holds no rows of table {table!r} (missing "
                            f"{', '.join(missing)})")
