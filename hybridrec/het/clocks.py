"""Clocks on the PS servers: HET's per-embedding clocks (HET §3.1-3.2) and SSP's worker clocks.

Server side (`ClockOps`, whose operations `EmbeddingServer` serves):

  het_sync     one request per shard carries a trainer's whole exchange of one step, for the
               tables of meta `tables`, each table's keys one after the other in packed arrays
               (meta `counts`: [write-backs, fetches, checks] per table), so a request is a few
               frames however many tables it serves:
                 w uint64 + wc int32 + "g.<codec array>" gradients: write-backs (Het.Cache.Evict:
                   the store applies each accumulated gradient with its optimizer and sets
                   c_g = max(c_g, c_c));
                 f uint64: fetches (Het.Cache.Fetch: rows and their c_g);
                 c uint64 + cc int32: clock-only checks (CheckValid's second bound,
                   c_g <= c_c + s, with s = meta `staleness`; null is s = infinity).
               They are done in that order, so a key written back and fetched again in one request
               reads its new value. Each table's gradients are encoded with the value codec and
               its arrays packed ("g.<name>", flattened; meta `codec_meta` and `g_shapes` per
               table). Reply: "v.<codec array>" rows and fc int32 clocks of the fetches, st uint8
               (np.packbits) flags of the checks that failed; meta {codec, codec_meta, v_shapes,
               dropped, max_gap, gaps (the histogram of the clock gaps below)}. Every table is
               checked before any is changed.
  worker_clock meta {rank, world, clock, generation} -> meta {min}: SSP's worker clocks, the
               number of iterations each trainer finished; the reply is the slowest one's (a rank
               not heard from counts 0). A higher `generation` (a restarted trainer group) starts
               the table afresh, and its first report fixes its world (at most the server's
               `max_trainers`); every number is an int32, checked before any work.

The server also measures the largest clock gap it sees between two trainers' copies of one key:
whenever a trainer reads a key (a fetch, or a check that passes), its copy's clock is compared
with the clock of the last read of that key by another trainer (`max_gap` in the reply, and
every such gap in the reply's histogram `gaps`; `gap_histogram()` has all of them).

Trainer side: `HetBackend` routes a step's write-backs, fetches and checks of every table to the
shards by the PS client's static bucket table (`hybridrec.embedding.buckets`), sends one request per shard (several in order only past
`max_keys_per_request` keys) and puts the answers back in order, counting the payload bytes
of vectors (rows, gradients and their keys) and of clocks (every clock, the keys of checks and
the check flags) apart. `WorkerClockClient` reports and reads SSP's worker clocks on shard 0.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import numpy as np
from numba import njit

from hybridrec.comm.codec import Encoded, make_value_codec
from hybridrec.comm.transport import Message, Operation, request_all
from hybridrec.embedding import EmbeddingStore
from hybridrec.embedding.buckets import shard_of, static_owners
from hybridrec.embedding.hashing import table_route_id
from hybridrec.embedding.store import check_grad, check_keys
from hybridrec.metrics import StalenessHistogram


# ---------------------------------------------------------------- server side

@njit(cache=True, nogil=True)
def _observe(rows, keys, clocks, worker, last_worker, last_clock, last_key, buckets, totals):
    """Record reads of `keys` (rows in the store) by `worker` at `clocks`; the largest gap to the
    last read of the same key by another worker. Every such gap is counted in `buckets` (by its
    bit length: 0, 1, 2-3, 4-7, ...) and `totals` (count, sum)."""
    gap = 0
    top = buckets.shape[0] - 1
    for i in range(rows.shape[0]):
        r = rows[i]
        if r < 0:
            continue
        if last_key[r] == keys[i] and last_worker[r] >= 0 and last_worker[r] != worker:
            this = abs(np.int64(clocks[i]) - last_clock[r])
            gap = max(gap, this)
            bucket = 0
            rest = this
            while rest > 0 and bucket < top:
                bucket += 1
                rest >>= 1
            buckets[bucket] += 1
            totals[0] += 1
            totals[1] += this
        last_key[r] = keys[i]
        last_worker[r] = worker
        last_clock[r] = clocks[i]
    return gap


class GapTracker:
    """Per row of one store: the trainer that last read it and at what clock."""

    def __init__(self, store: EmbeddingStore):
        self.store = store
        capacity = store.config.capacity
        self.last_worker = np.full(capacity, -1, np.int32)
        self.last_clock = np.zeros(capacity, np.int64)
        self.last_key = np.zeros(capacity, np.uint64)
        self.lock = threading.Lock()

    def observe(self, rows: np.ndarray, keys: np.ndarray, clocks: np.ndarray, worker: int,
                gaps: StalenessHistogram) -> int:
        """The largest gap of these reads; every gap counted in `gaps`."""
        if worker < 0 or rows.shape[0] == 0:
            return 0
        totals = np.zeros(2, np.int64)
        with self.lock:
            gap = int(_observe(np.ascontiguousarray(rows, np.int32), keys, np.ascontiguousarray(clocks, np.int64),
                               worker, self.last_worker, self.last_clock, self.last_key, gaps.counts, totals))
        gaps.total += int(totals[0])
        gaps.sum += int(totals[1])
        gaps.max = max(gaps.max, gap)
        return gap


def stale_flags(store_clocks: np.ndarray, sent_clocks: np.ndarray, staleness: int | None) -> np.ndarray:
    """CheckValid's second bound fails: c_g > c_c + s (a key the store does not hold, c_g -1,
    never fails)."""
    if staleness is None:
        return np.zeros(store_clocks.shape[0], dtype=bool)
    return store_clocks.astype(np.int64) > sent_clocks.astype(np.int64) + int(staleness)


def _clocks(arrays: dict, name: str, n: int) -> np.ndarray:
    clocks = arrays.pop(name, None)
    if clocks is None or clocks.dtype != np.int32 or clocks.shape != (n,):
        got = None if clocks is None else f"{clocks.dtype} {clocks.shape}"
        raise ValueError(f"array {name!r} must be int32 of shape ({n},), got {got}")
    return clocks


def _take(arrays: dict, name: str, dtype, count: int) -> np.ndarray:
    array = arrays.pop(name, None)
    if array is None or array.dtype != dtype or array.shape != (int(count),):
        got = None if array is None else f"{array.dtype} {array.shape}"
        raise ValueError(f"array {name!r} must be {np.dtype(dtype).name} of shape ({int(count)},) (meta 'counts'), "
                         f"got {got}")
    return array


def pack_encoded(encoded: Sequence[Encoded], prefix: str) -> tuple[dict[str, np.ndarray], list[dict]]:
    """The codec arrays of several tables as one flat array per array name ("<prefix>.<name>"),
    and each table's shapes ({name: shape}) to unpack them."""
    names = sorted({name for one in encoded for name in one.arrays})
    arrays = {}
    for name in names:
        present = [one.arrays[name] for one in encoded if name in one.arrays]
        arrays[f"{prefix}.{name}"] = np.concatenate([np.ascontiguousarray(a).ravel() for a in present])
    return arrays, [{name: list(a.shape) for name, a in one.arrays.items()} for one in encoded]


def unpack_encoded(arrays: dict, prefix: str, shapes, count: int) -> list[dict[str, np.ndarray]]:
    """Inverse of `pack_encoded` for `count` tables; the packed arrays are removed from `arrays`."""
    if not isinstance(shapes, list) or len(shapes) != count or not all(isinstance(s, dict) for s in shapes):
        raise ValueError(f"meta '{prefix}_shapes' must be a list of {count} dicts of array shapes, got {shapes!r}")
    start = prefix + "."
    packed = {name[len(start):]: arrays.pop(name) for name in [n for n in arrays if n.startswith(start)]}
    out, offsets = [], dict.fromkeys(packed, 0)
    for table_shapes in shapes:
        own = {}
        for name, shape in table_shapes.items():
            if name not in packed or not isinstance(shape, list) or not all(isinstance(n, int) and n >= 0
                                                                            for n in shape):
                raise ValueError(f"array {start}{name} with shape {shape!r} is missing or the shape is not valid")
            size = int(np.prod(shape, dtype=np.int64))
            flat = packed[name][offsets[name]:offsets[name] + size]
            if flat.shape[0] != size:
                raise ValueError(f"array {start}{name} is shorter than its tables' shapes say")
            own[name] = flat.reshape(shape)
            offsets[name] += size
        out.append(own)
    for name, used in offsets.items():
        if used != packed[name].shape[0]:
            raise ValueError(f"array {start}{name} is longer than its tables' shapes say")
    return out


MAX_WORLD = 1 << 16  # trainers a worker-clock table serves at most (`EmbeddingServer(max_trainers=...)`)
MAX_CLOCK = (1 << 31) - 1  # clocks, staleness and generations are int32 on the wire and in the stores


def request_int(meta: dict, name: str, low: int, high: int) -> int:
    """meta `name` as an int in [low, high] (bools are not ints here), else ValueError naming it."""
    value = meta.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ValueError(f"meta {name!r} must be an int in [{low}, {high}], got {value!r:.40}")
    return value


class WorkerClocks:
    """SSP's table of worker clocks (one per server; trainers use shard 0's).

    A generation's first report fixes its world (at most `max_world` trainers); the table holds
    one clock per rank of it, and the slowest is found without walking ranks never heard from."""

    def __init__(self, max_world: int = MAX_WORLD):
        self.max_world = max_world
        self.generation = -1
        self.world = 0
        self.clocks: dict[int, int] = {}
        self.lock = threading.Lock()

    def report(self, rank: int, world: int, clock: int, generation: int) -> int:
        if world > self.max_world:
            raise ValueError(f"meta 'world' is {world}; this server serves at most {self.max_world} trainers "
                             f"(serve-ps --max-trainers)")
        with self.lock:
            if generation > self.generation:
                self.generation, self.world, self.clocks = generation, world, {}
            if generation == self.generation:
                if world != self.world:
                    raise ValueError(f"meta 'world' is {world}, but generation {generation} started with "
                                     f"{self.world} trainers; a new world needs a new generation")
                if clock >= 0:
                    self.clocks[rank] = clock
            if len(self.clocks) < self.world:  # a rank not heard from counts 0
                return 0
            return min(self.clocks.values())


class ClockOps:
    """The clock operations of one server over its stores; `stores_of(meta)` gives the store of
    each name in meta 'tables', `count_keys(list of key arrays)` refuses too many keys."""

    def __init__(self, stores_of: Callable[[dict], list[EmbeddingStore]],
                 count_keys: Callable[[Sequence[np.ndarray]], None] = lambda keys: None,
                 max_world: int = MAX_WORLD):
        self._stores_of = stores_of
        self._count_keys = count_keys
        self._gaps: dict[int, GapTracker] = {}
        self._gaps_lock = threading.Lock()
        self._gap_histogram = StalenessHistogram()  # every clock gap this server saw
        self.worker_clocks = WorkerClocks(max_world)

    def operations(self) -> dict[str, Operation]:
        return {"het_sync": Operation(self.het_sync, arrays=None),
                "worker_clock": Operation(self.worker_clock)}

    def gap_histogram(self) -> dict:
        """Every clock gap this server saw between two trainers' copies of a key (as_dict)."""
        with self._gaps_lock:
            return self._gap_histogram.as_dict()

    def _tracker(self, store: EmbeddingStore) -> GapTracker:
        with self._gaps_lock:
            tracker = self._gaps.get(id(store))
            if tracker is None or tracker.store is not store:  # a loaded checkpoint replaced the store
                tracker = self._gaps[id(store)] = GapTracker(store)
            return tracker

    def het_sync(self, request: Message) -> Message:
        meta = request.meta
        stores = self._stores_of(meta)
        codec = make_value_codec(meta.get("codec", "none"))
        staleness = None if meta.get("staleness") is None else request_int(meta, "staleness", 0, MAX_CLOCK)
        insert = meta.get("insert", True)
        if not isinstance(insert, bool):
            raise ValueError(f"meta 'insert' must be true or false, got {insert!r}")
        worker = request_int({"worker": -1, **meta}, "worker", -1, MAX_CLOCK)
        counts = meta.get("counts")
        if (not isinstance(counts, list) or len(counts) != len(stores)
                or not all(isinstance(c, list) and len(c) == 3
                           and all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= MAX_CLOCK for n in c)
                           for c in counts)):
            raise ValueError(f"meta 'counts' must be [write-backs, fetches, checks] (ints >= 0) for each of the "
                             f"{len(stores)} tables, got {counts!r:.200}")
        arrays = dict(request.arrays)
        totals = np.sum(np.array(counts, dtype=np.int64).reshape(-1, 3), axis=0)
        packed = {}
        for name, total in (("w", totals[0]), ("f", totals[1]), ("c", totals[2])):
            packed[name] = check_keys(_take(arrays, name, np.uint64, total), f"array {name!r}")
        packed["wc"] = _take(arrays, "wc", np.int32, totals[0])
        packed["cc"] = _take(arrays, "cc", np.int32, totals[2])
        self._count_keys([packed["w"], packed["f"], packed["c"]])
        grads_parts = unpack_encoded(arrays, "g", meta.get("g_shapes"), len(stores))
        if arrays:
            raise ValueError(f"het_sync got unexpected arrays {sorted(arrays)}")
        codec_meta = meta.get("codec_meta")
        if not isinstance(codec_meta, list) or len(codec_meta) != len(stores) or not all(
                isinstance(m, dict) for m in codec_meta):
            raise ValueError(f"meta 'codec_meta' must be a list of {len(stores)} dicts, got {codec_meta!r}")
        bounds = np.concatenate([np.zeros((1, 3), np.int64), np.cumsum(np.array(counts, np.int64).reshape(-1, 3),
                                                                       axis=0)])
        parts, grads = [], []  # checked whole before any table changes
        for i, store in enumerate(stores):
            pick = {kind: slice(int(bounds[i, k]), int(bounds[i + 1, k])) for k, kind in enumerate("wfc")}
            parts.append(pick)
            grads.append(check_grad(codec.decode(Encoded(codec.name, grads_parts[i], codec_meta[i])),
                                    counts[i][0], store.dim, f"table {i} grads"))
        encoded_rows, f_clocks, stale, dropped, gap = [], [], [], 0, 0
        gaps = StalenessHistogram()
        for store, pick, g in zip(stores, parts, grads):
            w, f, c = packed["w"][pick["w"]], packed["f"][pick["f"]], packed["c"][pick["c"]]
            if len(w):
                dropped += store.push_clocked(w, g, packed["wc"][pick["w"]])
            values, clocks, rows = store.pull_clocked(f, insert=insert)
            store_clocks, c_rows = store.clocks(c)
            sent = packed["cc"][pick["c"]]
            flags = stale_flags(store_clocks, sent, staleness)
            tracker = self._tracker(store)
            gap = max(gap, tracker.observe(rows, f, clocks, worker, gaps))
            gap = max(gap, tracker.observe(c_rows[~flags], c[~flags], sent[~flags], worker, gaps))
            encoded_rows.append(codec.encode(values))
            f_clocks.append(clocks)
            stale.append(flags)
        reply, shapes = pack_encoded(encoded_rows, "v")
        reply["fc"] = np.concatenate(f_clocks).astype(np.int32) if f_clocks else np.empty(0, np.int32)
        reply["st"] = np.packbits(np.concatenate(stale).astype(np.uint8)) if stale else np.empty(0, np.uint8)
        with self._gaps_lock:
            self._gap_histogram.merge(gaps)
        return Message("het_sync", reply, {"codec": codec.name, "codec_meta": [e.meta for e in encoded_rows],
                                           "v_shapes": shapes, "dropped": int(dropped), "max_gap": int(gap),
                                           "gaps": gaps.as_dict()})

    def worker_clock(self, request: Message) -> Message:
        meta = request.meta
        world = request_int(meta, "world", 1, 1 << 63)  # more than max_world: refused by `report`, naming it
        rank = request_int(meta, "rank", 0, world - 1)
        clock = request_int(meta, "clock", -1, MAX_CLOCK)  # -1: ask without reporting
        generation = request_int(meta, "generation", 0, MAX_CLOCK)
        return Message("worker_clock", meta={"min": self.worker_clocks.report(rank, world, clock, generation)})


# ---------------------------------------------------------------- trainer side

@dataclass
class TableSync:
    """What one exchange asks of the servers for one table (positions are kept in the reply)."""

    w_keys: np.ndarray  # uint64[w]: write-backs
    w_clocks: np.ndarray  # int64[w]: their c_c
    w_grads: np.ndarray  # float32[w, dim]: their accumulated gradients
    f_keys: np.ndarray  # uint64[f]: fetches
    c_keys: np.ndarray  # uint64[c]: clock checks
    c_clocks: np.ndarray  # int64[c]: their c_c

    @classmethod
    def empty(cls, dim: int) -> "TableSync":
        keys, clocks = np.empty(0, np.uint64), np.empty(0, np.int64)
        return cls(keys, clocks, np.empty((0, dim), np.float32), keys, keys, clocks)


@dataclass
class TableReply:
    values: np.ndarray  # float32[f, dim] rows of the fetches
    clocks: np.ndarray  # int64[f] their c_g
    stale: np.ndarray  # bool[c]: the check failed (c_g > c_c + s)


@dataclass
class WireCounts:
    """Payload bytes of HET's exchanges, vectors and clocks apart, and what the servers said."""

    vector_bytes_sent: int = 0
    vector_bytes_received: int = 0
    clock_bytes_sent: int = 0
    clock_bytes_received: int = 0
    requests: int = 0
    dropped: int = 0
    max_gap: int = 0
    gaps: StalenessHistogram = field(default_factory=StalenessHistogram)  # the clock gaps the servers saw

    def as_dict(self) -> dict:
        return {**self.__dict__, "gaps": self.gaps.as_dict()}


_CLOCK_ARRAYS = ("wc", "c", "cc", "fc", "st")  # every other array carries vectors or their keys


def _is_clock(name: str) -> bool:
    return name in _CLOCK_ARRAYS


@dataclass
class _Slice:
    table: int
    kind: str  # "w", "f" or "c"
    positions: np.ndarray  # indices into that table's list


@dataclass
class _Chunk:
    slices: list[_Slice] = field(default_factory=list)
    size: int = 0


class HetBackend:
    """A trainer's HET exchanges with the PS shards. `exchange(requests, idempotent)` sends
    [(shard, op, arrays, meta)] and returns the replies in order (the PS client's transport, or
    in-process servers in tests); `dims`: table -> row width."""

    def __init__(self, exchange: Callable[[list, bool], list[Message]], num_shards: int, dims: Mapping[str, int],
                 *, value_codec: str = "none", worker: int = -1, max_keys_per_request: int = 16384):
        self._exchange = exchange
        self.num_shards = num_shards
        self.dims = dict(dims)
        self.codec = make_value_codec(value_codec)
        self.worker = worker
        self.max_keys_per_request = max_keys_per_request
        self.counts = WireCounts()
        self._route_ids = {t: table_route_id(t) for t in self.dims}
        self._owners = static_owners(self.num_shards)

    @classmethod
    def over(cls, client, worker: int) -> "HetBackend":
        """The backend of a `PSClient` (its shards, codec and request limit)."""
        shards = client.shards

        def exchange(requests, idempotent):
            return request_all([(shards[s], op, arrays, meta) for s, op, arrays, meta in requests],
                               idempotent=idempotent)

        dims = {t: client.dim(t) for t in client.tables()}
        return cls(exchange, len(shards), dims, value_codec=client.codec.name, worker=worker,
                   max_keys_per_request=client.max_keys_per_request)

    def _split(self, table: str, keys: np.ndarray) -> list[np.ndarray]:
        """Positions of `keys` by shard (each in key order)."""
        if self.num_shards == 1:
            return [np.arange(len(keys))]
        shard = shard_of(keys, self._route_ids[table], self._owners)  # the PS client's static table
        order = np.argsort(shard, kind="stable")
        bounds = np.searchsorted(shard[order], np.arange(self.num_shards + 1))
        return [order[bounds[s]:bounds[s + 1]] for s in range(self.num_shards)]

    def _chunks(self, tables: list[str], requests: list[TableSync]) -> list[list[_Chunk]]:
        """Per shard, its requests in the order they must be served: write-backs, then fetches,
        then checks, cut every `max_keys_per_request` keys."""
        per_shard: list[list[_Slice]] = [[] for _ in range(self.num_shards)]
        for kind in ("w", "f", "c"):
            for t, (table, sync) in enumerate(zip(tables, requests)):
                keys = getattr(sync, f"{kind}_keys")
                if len(keys) == 0:
                    continue
                for s, positions in enumerate(self._split(table, keys)):
                    if len(positions):
                        per_shard[s].append(_Slice(t, kind, positions))
        out = []
        limit = self.max_keys_per_request
        for slices in per_shard:
            chunks = [_Chunk()] if slices else []
            for piece in slices:
                positions = piece.positions
                while len(positions):
                    room = limit - chunks[-1].size
                    if room == 0:
                        chunks.append(_Chunk())
                        room = limit
                    take, positions = positions[:room], positions[room:]
                    chunks[-1].slices.append(_Slice(piece.table, piece.kind, take))
                    chunks[-1].size += len(take)
            out.append(chunks)
        return out

    def _request(self, tables: list[str], requests: list[TableSync], chunk: _Chunk, staleness, insert) -> tuple:
        """(tables used, their [w, f, c] positions, arrays, meta) of one request."""
        used = sorted({piece.table for piece in chunk.slices})
        picked = {(piece.table, piece.kind): piece.positions for piece in chunk.slices}
        empty = np.empty(0, np.int64)
        positions = [{kind: picked.get((t, kind), empty) for kind in "wfc"} for t in used]
        lists = {name: [] for name in ("w", "wc", "f", "c", "cc")}
        encoded = []
        for t, pick in zip(used, positions):
            sync = requests[t]
            lists["w"].append(sync.w_keys[pick["w"]])
            lists["wc"].append(sync.w_clocks[pick["w"]].astype(np.int32))
            lists["f"].append(sync.f_keys[pick["f"]])
            lists["c"].append(sync.c_keys[pick["c"]])
            lists["cc"].append(sync.c_clocks[pick["c"]].astype(np.int32))
            encoded.append(self.codec.encode(np.ascontiguousarray(sync.w_grads[pick["w"]]),
                                             argument=f"grads of table {tables[t]!r}"))
        arrays = {name: np.concatenate(parts) for name, parts in lists.items()}
        grads, shapes = pack_encoded(encoded, "g")
        arrays.update(grads)
        meta = {"tables": [tables[t] for t in used], "codec": self.codec.name,
                "codec_meta": [one.meta for one in encoded], "g_shapes": shapes,
                "counts": [[len(p["w"]), len(p["f"]), len(p["c"])] for p in positions],
                "staleness": staleness, "insert": bool(insert), "worker": self.worker}
        return used, positions, arrays, meta

    def _count(self, arrays: Mapping[str, np.ndarray], sent: bool) -> None:
        clock = sum(a.nbytes for name, a in arrays.items() if _is_clock(name))
        vector = sum(a.nbytes for name, a in arrays.items() if not _is_clock(name))
        if sent:
            self.counts.clock_bytes_sent += clock
            self.counts.vector_bytes_sent += vector
        else:
            self.counts.clock_bytes_received += clock
            self.counts.vector_bytes_received += vector

    def _place(self, s: int, tables: list[str], used: list[int], positions: list[dict], answer: Message,
               replies: dict[str, TableReply]) -> None:
        """Put one shard's answer where its keys came from."""
        meta = answer.meta
        self.counts.dropped += int(meta.get("dropped", 0))
        self.counts.max_gap = max(self.counts.max_gap, int(meta.get("max_gap", 0)))
        if "gaps" in meta:
            self.counts.gaps.merge(StalenessHistogram.from_dict(meta["gaps"]))
        codec_meta = meta.get("codec_meta")
        if not isinstance(codec_meta, list) or len(codec_meta) != len(used):
            raise ValueError(f"shard {s} answered codec_meta {codec_meta!r} for {len(used)} tables")
        arrays = dict(answer.arrays)
        parts = unpack_encoded(arrays, "v", meta.get("v_shapes"), len(used))
        n_f = sum(len(p["f"]) for p in positions)
        n_c = sum(len(p["c"]) for p in positions)
        clocks, flags = arrays.get("fc"), arrays.get("st")
        if clocks is None or clocks.shape != (n_f,) or flags is None:
            raise ValueError(f"shard {s} answered no clocks for its {n_f} fetches")
        stale = np.unpackbits(flags, count=n_c).astype(bool)
        f_at = c_at = 0
        for i, (t, pick) in enumerate(zip(used, positions)):
            reply, f, c = replies[tables[t]], pick["f"], pick["c"]
            values = self.codec.decode(Encoded(meta.get("codec"), parts[i], codec_meta[i]))
            if values.shape != (len(f), self.dims[tables[t]]):
                raise ValueError(f"shard {s} answered {values.shape} rows for {len(f)} fetches of table {tables[t]!r}")
            reply.values[f] = values
            reply.clocks[f] = clocks[f_at:f_at + len(f)]
            reply.stale[c] = stale[c_at:c_at + len(c)]
            f_at += len(f)
            c_at += len(c)

    def sync(self, requests: Mapping[str, TableSync], staleness: int | None, insert: bool = True) -> dict[str, TableReply]:
        """Do every table's write-backs, fetches and checks; {table: reply} (tables with nothing
        to do get empty replies)."""
        tables = list(requests)
        syncs = [requests[t] for t in tables]
        replies = {t: TableReply(np.empty((len(s.f_keys), self.dims[t]), np.float32),
                                 np.empty(len(s.f_keys), np.int64), np.zeros(len(s.c_keys), bool))
                   for t, s in zip(tables, syncs)}
        per_shard = self._chunks(tables, syncs)
        rounds = max((len(chunks) for chunks in per_shard), default=0)
        for r in range(rounds):  # a shard's chunks one after another, the shards in parallel
            batch, plans = [], []
            writes = False
            for s, chunks in enumerate(per_shard):
                if r < len(chunks):
                    used, positions, arrays, meta = self._request(tables, syncs, chunks[r], staleness, insert)
                    writes = writes or len(arrays["w"]) > 0
                    self._count(arrays, sent=True)
                    batch.append((s, "het_sync", arrays, meta))
                    plans.append((s, used, positions))
            answers = self._exchange(batch, not writes)
            self.counts.requests += len(batch)
            for (s, used, positions), answer in zip(plans, answers):
                self._count(answer.arrays, sent=False)
                self._place(s, tables, used, positions, answer, replies)
        return replies


class WorkerClockClient:
    """SSP's worker clocks on shard 0: `report(clock)` sets this trainer's clock and returns the
    slowest trainer's; `wait_for(target, stop)` polls until the slowest reached `target`."""

    def __init__(self, client, rank: int, world: int, generation: int = 0):
        self._shard = client.shards[0]
        self.rank, self.world, self.generation = rank, world, generation
        self.bytes = 0  # header-only requests: counted as the JSON meta they carry
        self.slowest = 0

    def report(self, clock: int) -> int:
        reply = self._shard.request("worker_clock", meta={"rank": self.rank, "world": self.world, "clock": int(clock),
                                                          "generation": self.generation}, idempotent=True)
        self.slowest = int(reply.meta["min"])
        return self.slowest

    def wait_for(self, target: int, stopped: Callable[[], bool], poll: float = 0.002) -> bool:
        """Block until the slowest trainer's clock is at least `target` (True) or `stopped()`."""
        delay = poll
        while self.slowest < target:
            if stopped():
                return False
            self.report(-1)  # -1: ask without changing this trainer's clock
            if self.slowest >= target:
                break
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        return True


def in_process_exchange(servers: Sequence[ClockOps]) -> Callable[[list, bool], list[Message]]:
    """An exchange for `HetBackend` that calls the clock operations of in-process servers (one per
    shard) directly: the same requests and replies as over the wire, without the transport."""
    handlers = [server.operations() for server in servers]

    def exchange(requests, idempotent):
        return [handlers[s][op].handler(Message(op, arrays, meta)) for s, op, arrays, meta in requests]

    return exchange


def clock_ops_of(stores: Mapping[str, EmbeddingStore]) -> ClockOps:
    """The clock operations of one in-process shard holding `stores` (table name -> store)."""
    def stores_of(meta):
        tables = meta.get("tables")
        if not isinstance(tables, list) or any(t not in stores for t in tables):
            raise ValueError(f"meta 'tables' {tables!r}: this shard holds {sorted(stores)}")
        return [stores[t] for t in tables]

    return ClockOps(stores_of)
