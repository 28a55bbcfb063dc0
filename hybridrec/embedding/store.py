"""EmbeddingStore: one capacity-bounded table of uint64 keys, the engine under every mode.

The local placement (through `EmbeddingCollection`) and the PS servers hold their rows in this class.
It validates every input, owns the arrays (heap or named shared memory, see memory.py) and calls
the numba kernels in kernels.py; no Python runs per ID. Calls are serialised by a lock so a PS
server can use it from several threads; the kernels release the GIL, so different stores (tables,
shards) run in parallel.
"""
from __future__ import annotations

import dataclasses
import threading

import numpy as np

from hybridrec.errors import UserError

from . import checkpoint_format
from . import kernels as K
from .checkpoint_format import Snapshot
from .disk_tier import DiskTier
from .read_ahead import prefault_cold_records
from .tier_kernels import no_tier
from .memory import Arena, shared_exists, unlink_shared
from .table import POOLING_MODES, TableConfig

_MAGIC = 0x48524534  # "HRE4": the LRU order is a ring of row numbers (kernels.py), not a linked list
_MAGIC_LISTED = 0x48524533  # "HRE3": the layout before, with linked LRU lists (re-linked into a ring on attach)
_MAGIC_TAGGED = 0x48524532  # "HRE2": the layout before, whose entries carry no displacement (re-indexed on attach)
_MAGIC_UNTAGGED = 0x48524543  # "HREC": the layout before, whose index entries are bare row numbers
# scalars[*]
S_MAGIC, S_EPOCH, S_STEP, S_DIRTY, S_DROPPED, S_INDEX_GEN = (K.SC_MAGIC, K.SC_EPOCH, K.SC_STEP, K.SC_DIRTY,
                                                         K.SC_DROPPED, K.SC_INDEX_GEN)
SCALARS_WIDTH = K.SCALARS_WIDTH
LOAD_FACTOR = 0.5  # at most this many live keys per index slot
MIN_SLOTS = 64  # index slots per partition at generation 0; each generation doubles them


def full_slot_counts(row_counts: np.ndarray) -> np.ndarray:
    """Index slots per partition once every row is in use."""
    return np.maximum(np.ceil(row_counts / LOAD_FACTOR).astype(np.int64), 8)


def slot_counts(row_counts: np.ndarray, generation: int) -> np.ndarray:
    """Index slots per partition at an index generation: doubling from MIN_SLOTS up to the
    number a full partition needs. The index grows with the live keys, never past that bound,
    so a large mostly-empty table keeps a small, cache-resident index."""
    return np.minimum(full_slot_counts(row_counts), MIN_SLOTS << min(max(generation, 0), 40))


@dataclasses.dataclass
class Lookup:
    """The result of probing one batch of keys.

    rows[i]: the row of keys[i] (-1: absent / not admitted, reads as zeros, gets no update);
    inverse[i]: position of keys[i] among the unique rows (-1 likewise);
    uniq_rows / uniq_keys: the batch's distinct rows and their keys, in first-seen order.
    """

    rows: np.ndarray
    inverse: np.ndarray
    uniq_rows: np.ndarray
    uniq_keys: np.ndarray

    @property
    def num_unique(self) -> int:
        return int(self.uniq_rows.shape[0])


def check_keys(keys, name="keys") -> np.ndarray:
    if not isinstance(keys, np.ndarray):
        raise TypeError(f"{name}: expected a numpy uint64 array, got {type(keys).__name__}")
    if keys.dtype != np.uint64:
        raise TypeError(f"{name}: dtype must be uint64 (any 64-bit key), got {keys.dtype}; convert with .astype(np.uint64)")
    if keys.ndim != 1:
        raise ValueError(f"{name}: must be 1-D, got shape {keys.shape}")
    return np.ascontiguousarray(keys)


def check_grad(grad, rows, dim, name="grads") -> np.ndarray:
    if not isinstance(grad, np.ndarray):
        raise TypeError(f"{name}: expected a numpy float32 array, got {type(grad).__name__}")
    if grad.ndim != 2 or grad.shape != (rows, dim):
        raise ValueError(f"{name}: shape must be ({rows}, {dim}), got {grad.shape}")
    grad = np.ascontiguousarray(grad, dtype=np.float32)
    if not K.all_finite(grad):
        raise ValueError(f"{name}: contains NaN or inf; the update was refused and no row was changed")
    return grad


class EmbeddingStore:
    """A table of embeddings for arbitrary uint64 keys with a fused sparse optimizer.

    Build it from a `TableConfig` or from the same fields as keywords::

        store = EmbeddingStore(dim=16, capacity=1_000_000, optimizer={"name": "adagrad", "lr": 0.05})
        rows = store.pull(keys)            # float32 [n, 16]; inserts new keys
        store.push(keys, grads)            # sums equal keys, applies Adagrad

    A row is `[embedding | optimizer state]` in the float32 array `rows`; its metadata record
    (key, LRU links, access count, clock, last training use) is the same row of the int32 array
    `meta` beside it, and the hash index maps keys to row numbers (see kernels.py). When all
    `capacity` rows are used, the least recently (LRU) or least frequently (LFU) used row is
    evicted. A key's first value depends only on (seed, key). With `shm_name` the arrays are named
    shared memory that survives the process (`EmbeddingStore.attach(name)` maps them again).

    Code that drives the kernels over many stores at once (`EmbeddingCollection`) holds `lock`,
    calls `make_index_room` and `restart_epoch_count_if_due` before a kernel inserts keys, and
    raises `batch_too_large_error()` when the kernel reports a full partition. Checkpoints go
    through `snapshot` / `restore` (checkpoint_format.py writes and reads the files).
    """

    def __init__(self, config: TableConfig | None = None, *, shm_name: str | None = None, **fields):
        if config is None:
            config = TableConfig(**fields)
        elif fields:
            config = dataclasses.replace(config, **fields)
        self.config = config
        self._lock = threading.RLock()
        self._marks: list[tuple[int, int, float]] = []  # expiry: (lookup call, step, time) at each expire()
        self._arena = Arena(shm_name, create=True)
        self._allocate(create=True)
        self._arena.write_config({"table": config.to_dict(), "magic": _MAGIC})
        self._open_tier()

    # ---------------------------------------------------------------- construction
    def _allocate(self, create: bool) -> None:
        cfg = self.config
        nparts = cfg.num_threads
        self.nparts = nparts
        self.icfg, self.fcfg = cfg.kernel_config(nparts)
        self.opt_code = cfg.optimizer.code
        self.opt_params = cfg.optimizer.packed()
        self.pool_mode = POOLING_MODES[cfg.pooling]
        self.seed = np.uint64(cfg.seed)
        a = self._arena
        self.rows = a.array("rows", (cfg.capacity, cfg.row_width), np.float32, create=create, prefault=cfg.prefault)
        self.meta = a.array("meta", (cfg.capacity, K.META_WIDTH), np.int32, create=create, prefault=cfg.prefault)
        self.r32 = self.meta
        self.r64 = self.meta.view(np.uint64)  # column 0: the row's key
        row_counts = np.full(nparts, cfg.capacity // nparts, dtype=np.int64)
        row_counts[: cfg.capacity % nparts] += 1
        self.row_counts = row_counts
        self.parts = a.array("parts", (nparts, K.PARTS_WIDTH), np.int64, create=create)
        self.scalars = a.array("scalars", (SCALARS_WIDTH,), np.int64, create=create)
        # The index array is made once, for the full layout; a generation uses its first slots
        # (`make_index_room`). Growing thus re-lays those slots in place instead of allocating a new
        # array, whose fresh pages would fault in during a training step.
        full_slots = int(full_slot_counts(row_counts).sum())
        if not create and a.size_of("index", np.int32) != full_slots:
            self.index = None  # made by an earlier hybridrec, whose index file grew with the keys: see attach
        else:
            self.index = a.array("index", (full_slots,), np.int32, create=create, prefault=cfg.prefault)
        sketch_width = 1
        if cfg.admit_min_frequency > 1:
            sketch_width = 1 << max(10, int(np.ceil(np.log2(max(cfg.capacity, 2)))) - 1)
        self.sketch = a.array("sketch", (2, sketch_width), np.uint16, create=create)
        log_slots = K.log_slots(row_counts)
        if create or a.size_of("lru_log", np.int32, missing=0) == log_slots:
            self.lru_log = a.array("lru_log", (log_slots,), np.int32, create=create, prefault=cfg.prefault)
        else:  # a store of an earlier layout, whose LRU order is in linked lists: attach builds the ring
            self.lru_log = a.replace_array("lru_log", (log_slots,), np.int32)
        if create:
            self.parts[:] = 0
            self.parts[:, K.PT_ROW_START] = np.concatenate([[0], np.cumsum(row_counts)[:-1]])
            self.parts[:, K.PT_ROW_COUNT] = row_counts
            slots = slot_counts(row_counts, 0)
            self.index[:int(slots.sum())] = -1
            self._set_slot_layout(slots)
            self.parts[:, K.PT_LOG_END] = 0
            self.parts[:, K.PT_LOG_START] = 0
            self.scalars[:] = 0
            self.sketch[:] = 0
            self.scalars[S_MAGIC] = _MAGIC

    @classmethod
    def attach(cls, shm_name: str) -> "EmbeddingStore":
        """Map a named shared-memory store again, e.g. after its owning process was killed.

        If that process died inside an update, the hash index and LRU rings are rebuilt from the
        rows; every update that had completed is kept.
        """
        arena = Arena(shm_name, create=False)
        saved = arena.read_config()
        self = cls.__new__(cls)
        self.config = TableConfig.from_dict(saved["table"])
        self._lock = threading.RLock()
        self._marks = []  # kept in process memory: after an attach, expiry starts counting again
        self._arena = arena
        self._allocate(create=False)
        if self.scalars[S_MAGIC] == _MAGIC_UNTAGGED:
            raise ValueError(f"shm_name: {shm_name!r} holds a store of an earlier hybridrec layout (index entries "
                             f"without hash tags); save it with that version and load the checkpoint instead")
        if self.scalars[S_MAGIC] in (_MAGIC_TAGGED, _MAGIC_LISTED):  # the same rows: index and LRU rings rebuilt
            self.scalars[S_DIRTY] = 1
            self.scalars[S_MAGIC] = _MAGIC
        if self.scalars[S_MAGIC] != _MAGIC:
            raise ValueError(f"shm_name: {shm_name!r} does not hold a hybridrec store (bad magic)")
        if self.index is None:  # a full-size index in place of the grown one, then its keys re-inserted
            self.scalars[S_DIRTY] = 1
            self.index = arena.replace_array("index", (int(full_slot_counts(self.row_counts).sum()),), np.int32)
        if self.scalars[S_DIRTY]:
            self._repair()
        else:
            self._set_slot_layout(self.parts[:, K.PT_SLOT_COUNT].copy())
        self._open_tier()
        return self

    def _open_tier(self) -> None:
        """Open the disk tier the config names (its rows kept from an earlier process), repairing
        it against the memory tier if a process died while writing it."""
        spec = self.config.tier
        self._ahead_lock = threading.Lock()  # a read-ahead holds it: the tier is not closed under it
        self.disk_tier = None if spec is None else DiskTier(spec["path"], spec["capacity_rows"],
                                                             self.config.row_width, self.nparts)
        self._tier = no_tier() if self.disk_tier is None else self.disk_tier.tier
        if self.disk_tier is not None and self.disk_tier.needs_repair:
            self.disk_tier.repair(self.keys())

    @classmethod
    def open_shared(cls, shm_name: str, config: TableConfig | None = None, **fields) -> "EmbeddingStore":
        """Attach to `shm_name` if it exists (its table config must match), else create it."""
        if shared_exists(shm_name):
            store = cls.attach(shm_name)
            want = config if config is not None else TableConfig(**fields)
            if want != store.config:
                raise ValueError(
                    f"shm_name: store {shm_name!r} exists with a different table config: "
                    f"existing {store.config.to_dict()}, requested {want.to_dict()}"
                )
            return store
        return cls(config, shm_name=shm_name, **fields)

    unlink_shared = staticmethod(unlink_shared)

    @property
    def lock(self):
        """The `threading.RLock` that serialises this store's calls. Hold it while a kernel reads or
        changes the store's arrays outside the store's own methods."""
        return self._lock

    def share_lock(self, lock) -> None:
        """Serialise this store's calls on `lock`, a `threading.RLock` that other stores hold too,
        so that code mutating all of them at once takes one lock, not one per store (the tables of
        an `EmbeddingCollection`). Call it before the store is used from more than one thread."""
        self._lock = lock

    # ---------------------------------------------------------------- index growth
    @property
    def index_room(self) -> int:
        """Keys the fullest partition may hold before the index must grow: a kernel that inserts n
        new keys into a partition of size s needs `make_index_room(n)` first when s + n exceeds it."""
        return self._room

    def _set_slot_layout(self, slots: np.ndarray) -> None:
        self.parts[:, K.PT_SLOT_START] = np.concatenate([[0], np.cumsum(slots)[:-1]])
        self.parts[:, K.PT_SLOT_COUNT] = slots
        # keys a partition may hold before the index must grow (full partitions never grow)
        full = slots >= full_slot_counts(self.row_counts)
        self._room = int(np.where(full, np.iinfo(np.int64).max // 4, np.floor(slots * LOAD_FACTOR)).min())

    def _fitting_generation(self, generation: int, n_new: int) -> int:
        """The first index generation from `generation` on whose slots keep every partition under
        LOAD_FACTOR with n_new more keys (a partition never holds more than its rows)."""
        need = np.minimum(self.parts[:, K.PT_SIZE] + n_new, self.row_counts) / LOAD_FACTOR
        generation = max(generation, 0)
        while (slot_counts(self.row_counts, generation) < need).any():
            generation += 1
        return generation

    def make_index_room(self, n_new: int) -> None:
        """Grow the hash index, if it must, so that n_new more keys keep every partition under
        LOAD_FACTOR. Call it with the lock held."""
        # the common case, once per table per step: max() of a few Python ints, not a numpy reduction
        if max(self.parts[:, K.PT_SIZE].tolist()) + n_new <= self._room:
            return
        gen = int(self.scalars[S_INDEX_GEN])
        new_gen = self._fitting_generation(gen, n_new)
        if new_gen != gen:
            self._relay_index(new_gen)

    def _relay_index(self, generation: int) -> None:
        """Lay the index out for `generation` and re-insert every live key into it."""
        self.scalars[S_DIRTY] = 1  # until the keys are all re-inserted (a crash in between: attach repairs)
        self._set_slot_layout(slot_counts(self.row_counts, generation))
        self.scalars[S_INDEX_GEN] = generation
        K.rebuild_index(self.r64, self.index, self.parts, 0, int(self.icfg[K.IC_ROW_BITS]))
        self.scalars[S_DIRTY] = 0

    def _repair(self) -> None:
        self.scalars[S_INDEX_GEN] = self._fitting_generation(int(self.scalars[S_INDEX_GEN]), 0)
        self._set_slot_layout(slot_counts(self.row_counts, int(self.scalars[S_INDEX_GEN])))
        bad = K.rebuild_index(self.r64, self.index, self.parts, 0, int(self.icfg[K.IC_ROW_BITS]))
        if bad >= 0:
            raise ValueError(f"store {self._arena.name!r}: rows are corrupt (key of row {bad} appears twice)")
        self._relink_lru()
        self.scalars[S_DIRTY] = 0

    def _relink_lru(self) -> None:
        """Build the LRU ring of each partition that keeps one from its rows' stamps (a ring not
        kept yet is built at the partition's first eviction)."""
        if self.config.eviction == "lru":
            for p in range(self.nparts):
                if self.parts[p, K.PT_LRU_KEPT]:
                    K.link_lru_from_stamps(self.lru_log, self.r32, 0, self.parts, p)

    # ---------------------------------------------------------------- core operations
    def restart_epoch_count_if_due(self) -> None:
        """Restart the count of lookup calls before it outgrows the int32 stamps that record each
        row's last use (the LRU order they encode is kept). Call it, with the lock held, before a
        kernel counts another lookup call."""
        if self.scalars[S_EPOCH] >= K.EPOCH_LIMIT:
            if self.config.eviction == "lru":  # recency lives in the stamps until a ring is kept
                for p in range(self.nparts):
                    if not self.parts[p, K.PT_LRU_KEPT]:
                        K.link_lru_from_stamps(self.lru_log, self.r32, 0, self.parts, p)
            self.meta[:, K.M_STAMP] = 0
            self.scalars[S_EPOCH] = 1

    def batch_too_large_error(self, table: str | None = None) -> UserError:
        """The error for a batch with more distinct keys than a partition has rows to give it (a
        kernel reports ERR_FULL: every row is in use by the batch, so none can be evicted); with
        the `table` name it names the job config keys that set its capacity."""
        if table is None:
            where, keys = "keys", "capacity"
        elif table.endswith(":wide"):
            where, keys = f"table {table!r}", "embedding.wide.capacity (default: embedding.default.capacity)"
        else:
            where, keys = (f"table {table!r}", f"embedding.per_feature.{table}.capacity or embedding.shared.{table}."
                                               f"capacity (default: embedding.default.capacity)")
        return UserError(
            f"{where}: the batch has more distinct keys than the table can hold at once "
            f"(capacity {self.config.capacity} rows over {self.nparts} partition(s)); raise {keys} "
            f"or use smaller batches (data.batch_size)"
        )

    def _probe(self, keys: np.ndarray, mode: int) -> Lookup:
        n = keys.shape[0]
        if mode != K.MODE_FIND or self.disk_tier is not None:  # (a read-only lookup takes rows back from disk)
            self.make_index_room(n)
        out_rows = np.empty(n, np.int32)
        inverse = np.empty(n, np.int32)
        uniq = np.empty(n, np.int32)
        self.restart_epoch_count_if_due()
        self.scalars[S_EPOCH] += 1
        epoch = int(self.scalars[S_EPOCH])
        tier = self.disk_tier
        if tier is not None:
            tier.begin_write(n)  # the records a call can write at most: one per key
        if self.nparts == 1:  # the kernel hashes the keys as it dedupes them
            self.scalars[S_DIRTY] = 1
            nuniq, err = K.lookup_serial(keys, self.rows, self.r32, self.r64, self.index, self.parts,
                                         self.sketch, self.icfg, self.fcfg, self.seed, epoch, mode,
                                         out_rows, inverse, uniq, self._tier, self.lru_log)
            self.scalars[S_DIRTY] = 0
        else:
            hashes = np.empty(n, np.uint64)
            part_of = np.empty(n, np.int64)
            K.compute_partitions(keys, self.nparts, hashes, part_of)
            order = np.empty(n, np.int64)
            starts = np.empty(self.nparts + 1, np.int64)
            K.order_by_partition(part_of, self.nparts, order, starts)
            counts = np.zeros(self.nparts, np.int64)
            errors = np.zeros(self.nparts, np.int64)
            self.scalars[S_DIRTY] = 1
            K.lookup_parallel(keys, hashes, order, starts, self.rows, self.r32, self.r64, self.index, self.parts,
                              self.sketch, self.icfg, self.fcfg, self.seed, epoch, mode, out_rows, inverse,
                              uniq, counts, errors, self._tier, self.lru_log)
            self.scalars[S_DIRTY] = 0
            err = int(errors.max())
            nuniq = K.compact_unique(starts, counts, part_of, uniq, inverse)
        if tier is not None:
            tier.end_write()
        if err == K.ERR_FULL:
            raise self.batch_too_large_error()
        uniq = uniq[:nuniq]
        return Lookup(out_rows, inverse, uniq, self.r64[uniq, 0].copy())

    def lookup(self, keys: np.ndarray, insert: bool = True) -> Lookup:
        """Probe a batch of keys; with `insert`, new keys are admitted (by policy) and initialised."""
        keys = check_keys(keys)
        with self._lock:
            return self._probe(keys, K.MODE_TRAIN if insert else K.MODE_FIND)

    def read_ahead(self, keys: np.ndarray) -> int:
        """Fault in the disk-tier records a coming lookup of `keys` will read (its cold keys'),
        from the calling thread, while another thread may use the store, until that lookup
        starts (read_ahead.py); returns how many.
        Changes nothing a lookup reads; a store without a tier has nothing to do."""
        if self.disk_tier is None:
            return 0
        keys = check_keys(keys)
        with self._ahead_lock:
            if self.disk_tier is None:
                return 0
            return int(prefault_cold_records(keys, self.r64, self.index, self.parts, self.icfg,
                                             self.scalars, self._tier))

    def apply(self, lookup: Lookup, grad_unique: np.ndarray) -> int:
        """One optimizer step with the summed gradient of each unique row of `lookup`.

        Rows evicted since the lookup are skipped; the number skipped is returned and counted in
        `stats()["dropped_updates"]`. A gradient with NaN/inf is refused before any row changes.
        """
        grad_unique = check_grad(grad_unique, lookup.num_unique, self.config.dim, "grad_unique")
        with self._lock:
            self.scalars[S_STEP] += 1
            self.scalars[S_DIRTY] = 1
            skipped = K.apply_updates(self.rows, self.r32, self.r64, lookup.uniq_rows, lookup.uniq_keys,
                                      grad_unique, self.icfg, self.fcfg, self.opt_code, self.opt_params,
                                      int(self.scalars[S_STEP]))
            self.scalars[S_DIRTY] = 0
            self.scalars[S_DROPPED] += skipped
            return int(skipped)

    def pull(self, keys: np.ndarray, insert: bool = True) -> np.ndarray:
        """float32 [n, dim] rows of `keys` (absent or not-admitted keys read as zeros)."""
        keys = check_keys(keys)
        with self._lock:
            found = self._probe(keys, K.MODE_TRAIN if insert else K.MODE_FIND)
            out = np.empty((keys.shape[0], self.config.dim), np.float32)
            K.gather_rows(self.rows, found.rows, out)
        return out

    def push(self, keys: np.ndarray, grads: np.ndarray) -> int:
        """Apply gradients given per key (equal keys are summed first); absent keys are skipped.

        Returns the number of distinct keys whose update was dropped because they are not in the
        store (evicted since they were pulled, or never admitted).
        """
        keys = check_keys(keys)
        grads = check_grad(grads, keys.shape[0], self.config.dim, "grads")
        with self._lock:
            found = self._probe(keys, K.MODE_FIND)
            ugrad = np.zeros((found.num_unique, self.config.dim), np.float32)
            K.scatter_rows_grad(grads, found.inverse, ugrad)
            missing = int(np.unique(keys[found.rows < 0]).shape[0])
            return self.apply(found, ugrad) + missing

    # ---------------------------------------------------------------- expiry
    # Each row's metadata stamps its last training use with the lookup call (epoch) that used it.
    # `expire` records, at every call, a mark (lookup call, step, time): a row whose stamp is at or
    # before the mark of step s (time t) was last trained at or before s (t). So the rows unseen
    # for longer than the bound are those stamped at or before the newest mark old enough.

    MAX_EXPIRY_MARKS = 4096  # past this, every other old mark is forgotten (expiry then acts later)

    def expire(self, step: int, now: float | None = None) -> int:
        """Drop the rows that training has not used for longer than `config.expire_after`
        (`{"steps": N}`: in none of the N steps up to and including `step`; `{"seconds": S}`: not
        since `now - S`), counting them in `stats()["expired"]`; returns how many. Call it
        between training steps (row numbers of lookups in flight change), with the caller's
        step count, every step for exact expiry: a row is dropped at the first call that finds
        it too old, so calls every k steps drop it up to k - 1 steps late."""
        bound = self.config.expire_after
        if bound is None:
            return 0
        import time

        now = time.time() if now is None else float(now)
        with self._lock:
            self._marks.append((int(self.scalars[S_EPOCH]), int(step), now))
            old_enough = [i for i, (_, s, t) in enumerate(self._marks)
                          if (s <= step - bound["steps"] if "steps" in bound else t <= now - bound["seconds"])]
            if not old_enough:
                self._thin_marks()
                return 0
            newest = old_enough[-1]
            last_stamp = self._marks[newest][0]
            del self._marks[:newest]
            self._thin_marks()
            self.scalars[S_DIRTY] = 1
            dropped = K.expire_rows(self.rows, self.r32, self.r64, self.index, self.parts, self.icfg, last_stamp,
                                   self.lru_log)
            self.scalars[S_DIRTY] = 0
            self.scalars[K.SC_EXPIRED] += dropped
            return int(dropped)

    def _thin_marks(self) -> None:
        if len(self._marks) > self.MAX_EXPIRY_MARKS:
            self._marks = self._marks[:-self.MAX_EXPIRY_MARKS // 2:2] + self._marks[-self.MAX_EXPIRY_MARKS // 2:]

    # ---------------------------------------------------------------- clocks (HET's c_g)
    # Each row's metadata holds its clock: the number of updates applied to it (a plain `push` or
    # `apply` adds one), a Lamport clock in HET's sense. It lives in `meta`, so it is in every
    # checkpoint and in shared memory, and a new row starts at 0.

    def pull_clocked(self, keys: np.ndarray, insert: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(float32 [n, dim] rows, int32 [n] clocks, int32 [n] row numbers) of `keys`, as `pull`
        reads them; an absent or not-admitted key reads as zeros with clock 0 and row -1."""
        keys = check_keys(keys)
        with self._lock:
            found = self._probe(keys, K.MODE_TRAIN if insert else K.MODE_FIND)
            out = np.empty((keys.shape[0], self.config.dim), np.float32)
            K.gather_rows(self.rows, found.rows, out)
            clocks = np.where(found.rows >= 0, self.meta[np.maximum(found.rows, 0), K.M_CLOCK], 0).astype(np.int32)
        return out, clocks, found.rows

    def clocks(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(int32 [n] clocks, int32 [n] row numbers) of `keys`, read only: -1 and -1 where a key
        is absent. HET's clock-only reads: no vector is touched."""
        keys = check_keys(keys)
        with self._lock:
            found = self._probe(keys, K.MODE_FIND)
            clocks = np.where(found.rows >= 0, self.meta[np.maximum(found.rows, 0), K.M_CLOCK], -1).astype(np.int32)
        return clocks, found.rows

    def push_clocked(self, keys: np.ndarray, grads: np.ndarray, clocks: np.ndarray) -> int:
        """HET's write-back (Het.Cache.Evict): one optimizer step per distinct key with its summed
        gradient, then the key's clock becomes max(its clock before, the clock sent with it)
        (c_g = max(c_g, c_c)). Absent keys are skipped and counted, as `push` does."""
        keys = check_keys(keys)
        grads = check_grad(grads, keys.shape[0], self.config.dim, "grads")
        clocks = np.asarray(clocks)
        if clocks.shape != keys.shape or clocks.dtype.kind not in "iu":
            raise ValueError(f"clocks: need an integer array of shape {keys.shape}, got {clocks.dtype} {clocks.shape}")
        with self._lock:
            found = self._probe(keys, K.MODE_FIND)
            ugrad = np.zeros((found.num_unique, self.config.dim), np.float32)
            K.scatter_rows_grad(grads, found.inverse, ugrad)
            present = found.inverse >= 0
            sent = np.full(found.num_unique, np.iinfo(np.int32).min, np.int64)
            np.maximum.at(sent, found.inverse[present], clocks[present].astype(np.int64))
            before = self.meta[found.uniq_rows, K.M_CLOCK].astype(np.int64)
            skipped = self.apply(found, ugrad)  # nothing is evicted meanwhile: the lock is held
            self.meta[found.uniq_rows, K.M_CLOCK] = np.minimum(np.maximum(before, sent), np.iinfo(np.int32).max)
            missing = int(np.unique(keys[~present]).shape[0])
            return skipped + missing

    # ---------------------------------------------------------------- pooled forward / backward
    def pool(self, lookup: Lookup, offsets: np.ndarray, out: np.ndarray, mode: int | None = None,
             column: int | None = None) -> None:
        """out[b] = pooled rows of lookup.rows[offsets[b]:offsets[b+1]] (the table's pooling mode);
        `out` is [B, dim], or [B, C, dim] with `column` naming where this table's output goes."""
        out3, column = _as_columns(out, column)
        K.gather_pool(self.rows, lookup.rows, offsets, self.pool_mode if mode is None else mode, out3, column)

    def pooled_grad(self, lookup: Lookup, offsets: np.ndarray, grad: np.ndarray, ugrad: np.ndarray,
                    mode: int | None = None, column: int | None = None) -> None:
        """Add the gradient of pooled outputs into ugrad [num_unique, dim] (transpose of `pool`)."""
        grad3, column = _as_columns(grad, column)
        K.scatter_pooled_grad(grad3, column, lookup.inverse, offsets, self.pool_mode if mode is None else mode, ugrad)

    # ---------------------------------------------------------------- persistence
    def save(self, directory, extra: dict | None = None):
        """Write a consistent checkpoint (checkpoint_format.py) to `directory`, replacing any
        there atomically; returns its path. `extra` is stored in the manifest as it is."""
        return checkpoint_format.write(directory, self.snapshot(extra))

    @classmethod
    def load(cls, directory, shm_name: str | None = None, **overrides) -> "EmbeddingStore":
        """A new store holding a checkpoint; every checksum is verified first. `overrides` may
        change table fields (capacity, num_threads, ...); dim and optimizer must match."""
        manifest = checkpoint_format.read_manifest(directory)
        config = TableConfig.from_dict({**manifest["table"], **overrides})
        checkpoint_format.check_compatible(manifest, config, directory)
        snapshot = checkpoint_format.read(directory, manifest)
        store = cls(config, shm_name=shm_name)
        store.restore(snapshot, source=f"checkpoint: {directory}")
        return store

    def snapshot(self, extra: dict | None = None) -> Snapshot:
        """Copies of the live rows, their metadata, the partition bookkeeping, the admission sketch
        and the counters, all taken under the lock: weights and optimizer state of one instant."""
        with self._lock:
            live = self.live_rows()
            return Snapshot(config=self.config, nparts=self.nparts, rows=self.rows[live], meta=self.meta[live],
                            parts=self.parts.copy(), sketch=self.sketch.copy(), step=int(self.scalars[S_STEP]),
                            epoch=int(self.scalars[S_EPOCH]), dropped_updates=int(self.scalars[S_DROPPED]),
                            extra=dict(extra or {}), expired=int(self.scalars[K.SC_EXPIRED]),
                            expiry_marks=list(self._marks), tier=self._tier_image())

    def _tier_image(self) -> dict | None:
        """The disk tier's part of a snapshot: its layout and chunk files (DiskTier.save_chunks)."""
        if self.disk_tier is None:
            return None
        return {"layout": self.disk_tier.layout, "rows": len(self.disk_tier), "chunks": self.disk_tier.save_chunks()}

    def restore(self, snapshot: Snapshot, source: str = "snapshot") -> None:
        """Fill this store, which must be empty, with `snapshot` and its counters. With the
        snapshot's partition layout the rows are copied into place and the index is rebuilt;
        otherwise (another capacity or thread count, or a snapshot without partitions, such as
        rows gathered from several shards) they are re-inserted with `insert_rows`. `source` names
        the snapshot in errors."""
        parts = snapshot.parts
        with self._lock:
            if len(self):
                raise ValueError(f"restore: the store already holds {len(self)} keys; restore into a new store")
            if self.disk_tier is not None:
                self.disk_tier.clear()  # the snapshot is the whole table: its cold rows replace these
            same_layout = (parts.shape == self.parts.shape and np.array_equal(parts[:, :2], self.parts[:, :2])
                           and snapshot.sketch.shape == self.sketch.shape)
            if same_layout:
                slots = self.parts[:, K.PT_SLOT_START:K.PT_SLOT_COUNT + 1].copy()
                self.parts[:] = parts
                self.parts[:, K.PT_SLOT_START:K.PT_SLOT_COUNT + 1] = slots  # the index is laid out to fit below
                live = self.live_rows()
                self.rows[live] = snapshot.rows
                self.meta[live] = snapshot.meta
                self.sketch[:] = snapshot.sketch
                self._relay_index(self._fitting_generation(int(self.scalars[S_INDEX_GEN]), 0))
                self._relink_lru()  # the snapshot holds the order in its stamps, not the ring
                if len(np.unique(self.keys())) != len(self):
                    raise ValueError(f"{source} is corrupt (a key appears in two rows)")
            else:
                self.insert_rows(snapshot.rows, snapshot.meta)
            for cold in checkpoint_format.tier_rows(snapshot.tier, source):
                self.add_cold_rows(*cold)
            self.scalars[S_STEP] = snapshot.step
            self.scalars[S_EPOCH] = max(int(self.scalars[S_EPOCH]), snapshot.epoch)
            self.scalars[S_DROPPED] = snapshot.dropped_updates
            self.scalars[K.SC_EXPIRED] = snapshot.expired
            self._marks = [(int(e), int(s), float(t)) for e, s, t in snapshot.expiry_marks]

    def insert_rows(self, rows: np.ndarray, meta: np.ndarray) -> None:
        """Insert saved rows: `rows` [n, row_width] (embedding and optimizer state) with their
        metadata records `meta` [n, META_WIDTH], bypassing admission. They go in least recently
        used first, so that if they do not all fit, the most recently used ones are kept; each
        keeps its access count and clock."""
        width = self.config.row_width
        if rows.ndim != 2 or rows.shape[1] != width or meta.shape != (rows.shape[0], K.META_WIDTH):
            raise ValueError(f"insert_rows: need rows [n, {width}] and meta [n, {K.META_WIDTH}], "
                             f"got {rows.shape} and {meta.shape}")
        if len(rows) == 0:
            return
        order = np.lexsort((meta[:, K.M_SLOT], meta[:, K.M_STAMP]))  # last training use, oldest first
        rows, meta = rows[order], meta[order]
        keys = np.ascontiguousarray(meta.view(np.uint64)[:, 0])
        chunk = max(1, self.config.capacity // max(self.nparts, 1) // 2)
        with self._lock:
            for start in range(0, len(keys), chunk):
                part = slice(start, start + chunk)
                found = self._probe(keys[part], K.MODE_FORCE)
                self.rows[found.rows] = rows[part]
                self.meta[found.rows, K.M_COUNT] = meta[part, K.M_COUNT]
                self.meta[found.rows, K.M_CLOCK] = meta[part, K.M_CLOCK]

    def rows_where(self, select) -> tuple[np.ndarray, np.ndarray]:
        """Copies of the rows ([n, row_width]: embedding and optimizer state) and metadata records
        of the live keys for which `select(keys)` (a bool array over uint64 keys) is true: what
        `insert_rows` puts into another store (a PS moving or replicating buckets)."""
        with self._lock:
            live = self.live_rows()
            chosen = live[np.asarray(select(self.r64[live, 0].copy()), dtype=bool)]
            return self.rows[chosen].copy(), self.meta[chosen].copy()

    def rows_of(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Copies of the rows and metadata records (as `rows_where`) of the distinct `keys` the
        store holds, without touching them: what a PS forwards to a bucket's backup."""
        keys = check_keys(keys)
        with self._lock:
            found = self._probe(keys, K.MODE_FIND)
            held = found.uniq_rows[found.uniq_rows >= 0]
            return self.rows[held].copy(), self.meta[held].copy()

    def remove_where(self, select) -> int:
        """Drop the live keys for which `select(keys)` is true (rows, index entries and LRU
        links, as expiry drops them); returns how many. Row numbers change, as with `expire`."""
        with self._lock:
            live = self.live_rows()
            chosen = live[np.asarray(select(self.r64[live, 0].copy()), dtype=bool)]
            if len(chosen) == 0:
                return 0
            lowest = np.iinfo(np.int32).min  # no lookup call stamps a row so: only the chosen ones
            self.meta[chosen, K.M_STAMP] = lowest
            self.scalars[S_DIRTY] = 1
            dropped = K.expire_rows(self.rows, self.r32, self.r64, self.index, self.parts, self.icfg, lowest,
                                   self.lru_log)
            self.scalars[S_DIRTY] = 0
            return int(dropped)

    # ---------------------------------------------------------------- introspection
    def __len__(self) -> int:
        return int(self.parts[:, K.PT_SIZE].sum())

    @property
    def dim(self) -> int:
        return self.config.dim

    @property
    def step(self) -> int:
        return int(self.scalars[S_STEP])

    @property
    def shm_name(self) -> str | None:
        return self._arena.name

    def live_rows(self) -> np.ndarray:
        """Row numbers in use, partition by partition."""
        return np.concatenate([
            np.arange(self.parts[p, K.PT_ROW_START], self.parts[p, K.PT_ROW_START] + self.parts[p, K.PT_SIZE])
            for p in range(self.nparts)
        ]).astype(np.int64)

    def keys(self) -> np.ndarray:
        return self.r64[self.live_rows(), 0].copy()

    def export(self) -> dict:
        """Copies of every live row: keys, weights [n, dim], optimizer state [n, state], access
        counts and clocks (update counts); the memory tier's rows in row order, then the disk
        tier's."""
        cfg = self.config
        with self._lock:
            live = self.live_rows()
            rows = self.rows[live]
            meta = self.meta[live]
            parts = [(meta.view(np.uint64)[:, 0].copy(), rows, meta[:, K.M_COUNT].copy(), meta[:, K.M_CLOCK].copy())]
            if self.disk_tier is not None:
                parts.extend(self.disk_tier.chunks())
        keys, rows, counts, clocks = (np.concatenate(column) for column in zip(*parts))
        return {"keys": keys, "weights": rows[:, :cfg.dim].copy(), "state": rows[:, cfg.dim:].copy(),
                "counts": counts, "clocks": clocks}

    def add_cold_rows(self, keys: np.ndarray, rows: np.ndarray, counts: np.ndarray, clocks: np.ndarray) -> None:
        """Put saved rows that were on a disk tier back: on this store's disk tier, or, without
        one, into memory as the least recently used rows (`insert_rows`)."""
        with self._lock:
            if self.disk_tier is not None:
                self.disk_tier.insert(keys, rows, counts, clocks)
                return
            meta = np.zeros((len(keys), K.META_WIDTH), np.int32)
            meta.view(np.uint64)[:, 0] = keys
            meta[:, K.M_COUNT] = counts
            meta[:, K.M_CLOCK] = clocks
            self.insert_rows(rows, meta)

    def memory_bytes(self) -> int:
        """Bytes of the store's arrays. Every array, the index included, is made at the size a full
        store needs, so this is also the memory of the store at full capacity (pages never
        written, of a store not prefaulted, are not backed until then)."""
        return int(self.rows.nbytes + self.meta.nbytes + self.index.nbytes + self.parts.nbytes + self.scalars.nbytes + self.sketch.nbytes
                   + self.lru_log.nbytes)

    def stats(self) -> dict:
        """Counters and sizes; with a disk tier also its rows, bytes and the memory tier's hit
        rate (`DiskTier.stats`)."""
        p = self.parts
        tier = {} if self.disk_tier is None else {"rows_in_memory": len(self), **self.disk_tier.stats()}
        return {**tier,
            "size": len(self),
            "capacity": self.config.capacity,
            "dim": self.config.dim,
            "optimizer": self.config.optimizer.name,
            "step": self.step,
            "inserted": int(p[:, K.PT_INSERTED].sum()),
            "evicted": int(p[:, K.PT_EVICTED].sum()),
            "rejected": int(p[:, K.PT_REJECTED].sum()),
            "dropped_updates": int(self.scalars[S_DROPPED]),
            "expired": int(self.scalars[K.SC_EXPIRED]),
            "memory_bytes": self.memory_bytes(),
            "bytes_per_row": self.memory_bytes() / self.config.capacity,
            "shm_name": self._arena.name,
        }

    def close(self) -> None:
        """Flush and unmap shared memory (the named store stays for a later attach)."""
        for arr in (self.rows, self.meta, self.index, self.parts, self.scalars, self.sketch):
            if isinstance(arr, np.memmap):
                arr.flush()
        with self._ahead_lock:
            if self.disk_tier is not None:
                self.disk_tier.close()
                self.disk_tier, self._tier = None, no_tier()


def _as_columns(arr: np.ndarray, column: int | None):
    """A [B, dim] array as [B, 1, dim] (column 0), or a [B, C, dim] array with its column."""
    if column is None:
        if arr.ndim != 2:
            raise ValueError(f"expected a [B, dim] array, got shape {arr.shape}")
        return arr.reshape(arr.shape[0], 1, arr.shape[1]), 0
    return arr, column
