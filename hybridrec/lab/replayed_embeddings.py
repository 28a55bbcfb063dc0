"""The embedding tables of a replayed job, held as the job's PS servers held them: each table on
each server is a store of its own (a column of the job's `EmbeddingPlan`) that applies its share
of the workers' updates in its own order, the order the job recorded.

The emulator keeps each table in one in-process store (the local placement's). A job's PS
servers each hold the rows of the keys the global route hash gives them, and each server's
store of a table applies the updates in the order their requests reached it, which differs
between stores: the trainers push one step's updates right after the same AllReduce, all at
once. So an update here is split, once its gradient is known (`LookedAhead.unique_grads`), into
its parts, one per (table, server): the distinct rows of the keys routed there with their summed
gradients. A part lands (`EmbeddingStore.apply` of those rows) when its store's order reaches
it, and a read first lands, store by store, exactly the updates the job's lookup read there (the
emulator first computes the steps whose updates a read needs: `missing`). A store that has
applied more than a read saw (the job's reads admit no order that never takes a count back:
`EmbeddingPlan.inversions`: two servers answered two lookups in opposite orders) is read as it
was: each store keeps the weights its last `UNDO` parts overwrote, puts them back for the
read's pooling, newest first, and the weights of now after it. Past that (and where an update
the read needs cannot be computed yet) the read differs, and `departures` counts the updates by
which it does. A read or update the job did not record lands every part computed
so far / at the end. Rows are independent under every optimizer of the stores (their step count,
used by Adam's bias correction and Adagrad's lr_decay, counts parts here, updates per store in
the job).
"""
from __future__ import annotations

from collections import deque
from typing import Callable

import numpy as np

from hybridrec.embedding.buckets import shard_of
from hybridrec.embedding.hashing import table_route_id
from hybridrec.embedding.store import Lookup
from hybridrec.lab.embeddings import SharedEmbeddings
from hybridrec.ps.routing import static_owners

_NONE = np.empty(0, np.int32)
UNDO = 64  # parts per store whose overwritten weights are kept, to read a store as it was


class ReplayedEmbeddings(SharedEmbeddings):
    """`SharedEmbeddings` whose updates land part by part in the job's PS stores' orders (`plan`:
    hybridrec.lab.trace.EmbeddingPlan)."""

    def __init__(self, placement, workers: int, plan, observer: Callable | None = None):
        super().__init__(placement, workers, observer)
        self.plan = plan
        self.landed = [0] * len(plan.columns)  # per store, the updates of its order applied
        self.column = {column: k for k, column in enumerate(plan.columns)}
        servers = 1 + max((shard for _, shard in plan.columns), default=0)
        self.owners = static_owners(servers)
        self.parts: dict[tuple[int, int], dict] = {}  # (worker, step) -> {store column: (store, rows, keys, grads)}
        self.known: set = set()  # updates computed (their parts made)
        self.unplanned: list[tuple[int, int]] = []  # updates computed that no store's order holds
        self.planned = {key for order in plan.order for key in order}
        self.departures = 0
        self._names = {id(store): name for collection in placement.collections.values()
                       for name, store in collection.stores.items()}
        self._route = {name: table_route_id(name) for name in self._names.values()}
        self._complete: list[set] = [set() for _ in range(workers)]  # steps whose every part landed
        self.position = {key: n for n, key in enumerate(plan.read_order)}
        self.made: set = set()  # recorded reads made
        self.read_counts: dict = {}  # (worker, step) -> {store: updates it held when the read was made}
        self.undo = [deque(maxlen=UNDO) for _ in plan.columns]  # per store: (count before, store, rows, weights)
        self.next_read = 0  # the first of the plan's read order not made

    def missing(self, worker: int, step: int) -> list[tuple[int, int]]:
        """The updates a read must see that are not computed yet."""
        wanted = self.plan.reads.get((worker, step))
        if wanted is None:
            return []
        return [key for k, count in wanted.items() for key in self.plan.order[k][self.landed[k]:count]
                if key not in self.known]

    def due_before(self, worker: int, step: int) -> list[tuple[int, int]]:
        """The recorded reads the plan's read order puts before this one that are not made yet
        (made first, each store's counts then never fall)."""
        position = self.position.get((worker, step))
        if position is None:
            return []
        return [key for key in self.plan.read_order[self.next_read:position] if key not in self.made]

    def read(self, worker: int, step: int, batch, expected: np.ndarray | None = None) -> dict:
        wanted = self.plan.reads.get((worker, step))
        if wanted is None:  # a lookup the job did not record: every update computed so far
            self.land_all()
        restore: list = []  # (store, rows, weights of now), put back after the read, last first
        held = {}
        for k, count in (wanted or {}).items():
            self.land(k, count)
            held[k] = self.landed[k]
            if self.landed[k] > count:
                if self._as_it_was(k, count, restore):
                    held[k] = count
                else:
                    self.departures += self.landed[k] - count
        self.read_counts[worker, step] = held
        self.made.add((worker, step))
        while self.next_read < len(self.plan.read_order) and self.plan.read_order[self.next_read] in self.made:
            self.next_read += 1
        try:
            return super().read(worker, step, batch, expected)
        finally:
            for store, rows, weights in reversed(restore):
                with store.lock:
                    store.rows[rows, :weights.shape[1]] = weights

    def enqueue(self, worker: int, step: int, looked: dict) -> None:
        """Splits the update into its stores' parts (applied by `land`)."""
        super().enqueue(worker, step, looked)
        self.queues[worker].pop()  # the parts replace the queued update
        parts: dict = {}
        for ahead in looked.values():
            for store, rows, keys, grads in ahead.unique_grads():
                name = self._names[id(store)]
                server = shard_of(keys, self._route[name], self.owners)
                for shard in np.unique(server).tolist():
                    mine = server == shard
                    k = self.column.get((name, shard))
                    parts[k if k is not None else (name, shard)] = (store, rows[mine], keys[mine], grads[mine])
            ahead.grads = None
        self.parts[worker, step] = parts
        self.known.add((worker, step))
        if not parts:
            self._completed((worker, step))
        elif (worker, step) not in self.planned:
            self.unplanned.append((worker, step))

    def _as_it_was(self, k: int, count: int, restore: list) -> bool:
        """Put back in store k the weights of the rows its parts landed since it held `count`
        updates (newest first), noting in `restore` the weights of now; False (nothing changed)
        when it kept too few parts' weights."""
        kept = [entry for entry in self.undo[k] if entry[0] >= count]
        if len(kept) != self.landed[k] - count:
            return False
        for _, store, rows, weights in reversed(kept):
            with store.lock:
                restore.append((store, rows, store.rows[rows, :weights.shape[1]].copy()))
                store.rows[rows, :weights.shape[1]] = weights
        return True

    def land(self, k: int, count: int) -> None:
        """Store k applies the updates of its order until it holds `count` of them; one not
        computed yet (the emulator computes what a read needs first, unless the read would wait
        for itself) stops it, counted as departures."""
        order = self.plan.order[k]
        while self.landed[k] < count:
            key = order[self.landed[k]]
            if key not in self.known:
                self.departures += count - self.landed[k]
                return
            self._apply_part(key, k)
            self.landed[k] += 1

    def land_all(self) -> None:
        """Every store applies every update of its order computed so far, then the parts no
        store's order holds (of steps, or stores, the job did not record)."""
        for k, order in enumerate(self.plan.order):
            while self.landed[k] < len(order) and order[self.landed[k]] in self.known:
                self._apply_part(order[self.landed[k]], k)
                self.landed[k] += 1
        for key in self.unplanned:
            for part in list(self.parts.get(key, {})):
                self._apply_part(key, part)
        self.unplanned = [key for key in self.unplanned if self.parts.get(key)]
        for key, parts in list(self.parts.items()):
            for part in [p for p in parts if not isinstance(p, int)]:
                self._apply_part(key, part)

    def _apply_part(self, key: tuple[int, int], part) -> None:
        parts = self.parts.get(key)
        if parts is None:  # every part landed already (it had none on this store)
            return
        found = parts.pop(part, None)
        if found is not None:
            store, rows, keys, grads = found
            if isinstance(part, int):  # the weights it overwrites, to read the store as it was
                live = rows[rows >= 0]
                with store.lock:
                    self.undo[part].append((self.landed[part], store, live, store.rows[live, :store.dim].copy()))
            store.apply(Lookup(_NONE, _NONE, rows, keys), grads)
            self._pending[rows.astype(np.int64) + self._offsets[id(store)]] -= 1
        if not parts:
            self._completed(key)

    def _completed(self, key: tuple[int, int]) -> None:
        """Every part of update `key` landed: `applied` counts each worker's prefix of such."""
        del self.parts[key]
        worker, step = key
        self._complete[worker].add(step)
        while int(self.applied[worker]) in self._complete[worker]:
            self._complete[worker].discard(int(self.applied[worker]))
            self.applied[worker] += 1
            if self.observer is not None:
                self.observer("apply", worker=worker, step=int(self.applied[worker]) - 1)

    def catch_up(self, targets: np.ndarray, schedule) -> None:
        """The stores' orders decide what lands: a bound's catch-up lands what is computed."""
        self.land_all()

    def drain(self) -> None:
        for k, order in enumerate(self.plan.order):
            self.land(k, len(order))
        self.land_all()
        for key, parts in list(self.parts.items()):  # parts on stores whose order lacks them
            for part in list(parts):
                self._apply_part(key, part)

    def facts(self) -> dict:
        return {**super().facts(), "embedding_departures": self.departures,
                "embedding_inversions": self.plan.inversions}
