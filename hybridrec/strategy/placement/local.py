"""The local placement: every table is an in-process `EmbeddingStore` in the trainer.

The lookup is the collections' fused native call (dedupe, probe, pool for all tables at once)
inside the forward pass, and the update is applied inside backward (optimizer-in-backward), so a
connection has nothing to do before or after the step. One trainer only: tables in the process
are not shared with other processes.

The pipelined local step (hybridrec/train/local_pipeline.py) splits that step up: `look_ahead`
looks a batch up (keys inserted) on the pipeline's thread, `apply_ahead` applies the batch before
it there, `pool_ahead` then pools it from the updated rows, and `inputs` makes the dense model's
tensors of it, whose backward records the gradients.
"""
from __future__ import annotations

from pathlib import Path

from hybridrec.config import ConfigError
from hybridrec.embedding import EmbeddingCollection
from hybridrec.embedding.checkpoint import load as load_store, load_resharded
from hybridrec.embedding.disk_tier import TIER_FACTS
from hybridrec.embedding.inputs import EmbeddingInputs
from hybridrec.embedding.read_ahead import ReadAhead
from hybridrec.strategy.placement import PlacementDefaults
from hybridrec.strategy.placement.checkpoint_layout import local_directory, table_directories


class _InProcess:
    """A connection that hands the batch on: the lookup happens in `LocalPlacement.inputs`.
    `coming` (set when tables have disk tiers) takes the batch the stream hands over next."""

    bytes_sent = bytes_received = 0

    def __init__(self, coming=None):
        self.coming = coming

    def prepare(self, batch):
        return batch

    def lookup(self, prepared, train: bool):
        return prepared

    def update(self, looked, grads: dict) -> dict:
        return {}

    def close(self) -> None:
        pass


class LocalPlacement(PlacementDefaults):
    # no read-ahead unless __init__ finds a tiered table (subclasses that build their own
    # collections, DES's field_sharded, read nothing ahead)
    _read_ahead: ReadAhead | None = None
    _coming = None

    def __init__(self, cfg, tables, world, endpoints=None):
        if world.size != 1:
            raise ConfigError(f"strategy.placement local keeps the tables inside one trainer process; this job has "
                              f"{world.size} trainers (use placement ps for several)")
        self.names = tables.sparse_names
        self.collections = {side: EmbeddingCollection(side_tables, mapping)
                            for side, side_tables, mapping in (("deep", tables.deep, tables.deep_map),
                                                               ("wide", tables.wide, tables.wide_map))
                            if side_tables}
        tiered = any(store.disk_tier is not None for c in self.collections.values() for store in c.stores.values())
        # the coming batch's cold rows are read on a thread of their own during this one's step
        self._read_ahead = ReadAhead() if tiered else None
        self._coming = None

    def connect(self) -> _InProcess:
        return _InProcess(self._note_coming if self._read_ahead is not None else None)

    def _note_coming(self, batch) -> None:
        self._coming = batch

    def _read_coming(self, batch) -> None:
        for collection in self.collections.values():
            collection.read_ahead(batch.sparse, self.names)

    def inputs(self, looked, batch, requires_grad: bool) -> EmbeddingInputs:
        if isinstance(looked, dict):  # looked up ahead: {side: LookedAhead}
            out = {side: self.collections[side].attach(ahead) for side, ahead in looked.items()}
        else:
            out = {}
            for side, collection in self.collections.items():
                collection.train(requires_grad)  # a lookup outside training neither inserts nor updates
                out[side] = collection.forward_stacked(batch.sparse, self.names)
            if requires_grad and self._coming is not None:  # this batch's lookup is done: read the next's ahead
                coming, self._coming = self._coming, None
                self._read_ahead.submit(self._read_coming, coming)
        wide = out.get("wide")
        return EmbeddingInputs(out.get("deep"), None if wide is None else wide.squeeze(-1))

    def look_ahead(self, batch) -> dict:
        """{side: LookedAhead}: a training batch's lookup, ahead of its step (any thread)."""
        return {side: collection.look_ahead(batch.sparse, self.names) for side, collection in self.collections.items()}

    def apply_ahead(self, looked: dict) -> bool:
        """The update of a looked-ahead batch its backward recorded (False: it was not trained)."""
        applied = [self.collections[side].apply_ahead(ahead) for side, ahead in looked.items()]
        return any(applied)

    def pool_ahead(self, looked: dict, previous: dict | None) -> tuple[int, int]:
        """Pools a looked-ahead batch from the rows as they are now; (rows it reads that
        `previous`, the batch before it, updated; rows it reads), over the sides."""
        shared = sum(self.collections[side].pool_ahead(ahead, None if previous is None else previous[side])
                     for side, ahead in looked.items())
        return shared, sum(ahead.unique_rows for ahead in looked.values())

    def _tables(self):
        for side, collection in self.collections.items():
            for table, store in collection.stores.items():
                yield side, collection, table, store

    def _directories(self, root: Path):
        """(collection, table, store, its directory in the local layout under `root`) of every table."""
        for side, collection, table, store in self._tables():
            yield collection, table, store, local_directory(root, side, table)

    def save(self, directory: Path) -> None:
        for _, _, store, path in self._directories(directory):
            store.save(path)

    def load(self, directory: Path) -> None:
        """The tables of a checkpoint of any placement: its own layout, or the sharded layout of
        the PS servers and the sharded placement, every shard's rows merged into one store."""
        for side, collection, table, store in list(self._tables()):
            found = table_directories(directory, side, table)
            tier = {}
            if store.config.tier is not None:  # the loaded store takes over the table's disk tier
                tier = {"tier": store.config.tier}
                store.close()
            if found == [local_directory(directory, side, table)]:
                # the running config decides the capacity and threads; the checkpoint the rows
                loaded = load_store(found[0], capacity=store.config.capacity, num_threads=store.config.num_threads,
                                    **tier)
            elif tier:  # the memory tier keeps its capacity: the rows past it go to disk
                loaded = load_resharded(found, 0, 1, num_threads=store.config.num_threads,
                                        capacity=store.config.capacity, **tier)
            else:  # room for every shard's rows (load_resharded's default capacity: the shards' total)
                loaded = load_resharded(found, 0, 1, num_threads=store.config.num_threads)
            collection.replace_store(table, loaded)

    def stores(self) -> dict:
        """{table: EmbeddingStore} of the tables this trainer holds (what a publisher reads)."""
        return {table: store for _, _, table, store in self._tables()}

    def expire(self, step: int, now: float) -> int:
        return sum(store.expire(step, now) for collection in self.collections.values()
                   for store in collection.stores.values() if store.config.expire_after is not None)

    def facts(self) -> dict:
        tiers = {table: {k: store.stats()[k] for k in TIER_FACTS} for _, _, table, store in self._tables() if store.disk_tier is not None}
        return {"embedding_rows": {side: sum(len(s) for s in c.stores.values())
                                   for side, c in self.collections.items()},
                **({"embedding_tiers": tiers} if tiers else {})}

    def close(self) -> None:
        """Stop the read-ahead, then close every store: a disk tier's directory is free again for
        the next store of this process (scoring the checkpoint, training again)."""
        try:
            if self._read_ahead is not None:
                self._read_ahead.close()
        finally:
            for _, _, _, store in self._tables():
                store.close()


PLACEMENT = LocalPlacement

