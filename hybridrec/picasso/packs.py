"""PICASSO's D-packing (§III-B): the tables of one side (deep or wide) and dim looked up together
as one pack, their features the pack's segments; cut further by parameter volume (Eq. 1,
`split_packs`) and into groups of about equal volume whose collectives are pipelined (Eq. 3,
`k_groups`). Volumes are known from the config alone, so every trainer makes the same packs
without exchanging statistics. `table_columns` lists the (feature, column) pairs each table
serves, the unpacked lookup's unit.
"""
from __future__ import annotations

import numpy as np

from hybridrec.embedding import EmbeddingStore
from hybridrec.embedding.hashing import route_salt, table_route_id
from hybridrec.embedding.table_arrays import TableArrays


class Pack:
    """Tables of one side and dim looked up together; `features[t]` lists the (feature, output
    column) pairs table t serves, and the segments are those pairs table after table."""

    def __init__(self, side: str, tables: list[str], features: dict[str, list[tuple[str, int]]]):
        self.side, self.tables = side, tables
        pairs = [(t, f, c) for t, table in enumerate(tables) for f, c in features[table]]
        self.seg_table = np.array([t for t, _, _ in pairs], np.int64)
        self.seg_features = [f for _, f, _ in pairs]
        self.seg_col = np.array([c for _, _, c in pairs], np.int64)
        self.tab_seg = np.searchsorted(self.seg_table, np.arange(len(tables) + 1)).astype(np.int64)
        self.table_index = np.arange(len(tables), dtype=np.int64)  # hot-set index of each pack table
        self._positions: dict = {}
        self.stores: list[EmbeddingStore] = []

    def bind(self, stores: dict[str, EmbeddingStore]) -> None:
        """Serve from these stores (at the start, and after a checkpoint was loaded)."""
        self.stores = [stores[t] for t in self.tables]
        self.dim = self.stores[0].dim
        self.arrays = TableArrays(self.stores)
        self.icfg = np.stack([s.icfg for s in self.stores])
        self.fcfg = np.stack([s.fcfg for s in self.stores])
        self.seeds = np.array([s.config.seed for s in self.stores], np.uint64)
        self.pool_modes = np.array([s.pool_mode for s in self.stores], np.int64)
        self.opt_codes = np.array([s.opt_code for s in self.stores], np.int64)
        self.opt_params = np.stack([s.opt_params for s in self.stores])
        self.salts = np.array([route_salt(table_route_id(t)) for t in self.tables], np.uint64)
        self.rooms = np.empty(len(self.stores), np.int64)

    def positions(self, names: list[str]) -> np.ndarray:
        """Each segment's feature position in a batch with these feature names."""
        key = tuple(names)
        found = self._positions.get(key)
        if found is None:
            where = {n: i for i, n in reversed(list(enumerate(names)))}
            missing = [f for f in self.seg_features if f not in where]
            if missing:
                raise ValueError(f"features: the batch has no features {missing}; it has {list(names)}")
            found = self._positions[key] = np.array([where[f] for f in self.seg_features], np.int64)
        return found

    def volume(self) -> int:
        """Parameter volume per sample (PICASSO Eq. 1 with one ID per feature and sample, known from
        the config alone so that every trainer makes the same packs): dim x features served."""
        return self.dim * len(self.seg_features)


def split_pack(pack: Pack, shards: int, features, stores) -> list[Pack]:
    """`pack` cut into `shards` packs of consecutive tables with about equal volume."""
    shards = max(1, min(shards, len(pack.tables)))
    if shards == 1:
        return [pack]
    weight = np.array([len(features[t]) for t in pack.tables], np.float64)
    cuts = np.searchsorted(np.cumsum(weight), weight.sum() * np.arange(1, shards) / shards, side="left") + 1
    bounds = sorted({0, *[int(c) for c in cuts if 0 < c < len(pack.tables)], len(pack.tables)})
    out = [Pack(pack.side, pack.tables[a:b], features) for a, b in zip(bounds, bounds[1:])]
    for part in out:
        part.bind(stores)
    return out


def make_packs(tables, stores: dict[str, EmbeddingStore], split_packs: bool, k_groups: int) -> list[Pack]:
    """D-packing: one pack per side and dim, each table's features (columns of the side's output)
    with it; then Eq. 1 (`split_packs`: a pack above the average volume split into shards of
    about the smallest pack's volume) and Eq. 3 (`k_groups`: capacity = total volume / k_groups,
    a larger pack cut to fit). The list's order is the interleaving order."""
    features: dict[str, list[tuple[str, int]]] = {}
    packs: list[Pack] = []
    for side, mapping in (("deep", tables.deep_map), ("wide", tables.wide_map)):
        by_dim: dict[int, list[str]] = {}
        for column, name in enumerate(tables.sparse_names):
            table = mapping.get(name)
            if table is None:
                continue
            if table not in features:
                features[table] = []
                by_dim.setdefault(stores[table].dim, []).append(table)
            features[table].append((name, column))
        for dim_tables in by_dim.values():
            pack = Pack(side, dim_tables, features)
            pack.bind(stores)
            packs.append(pack)
    if split_packs and len(packs) > 1:
        volumes = [p.volume() for p in packs]
        mean, least = float(np.mean(volumes)), min(volumes)
        packs = [q for p, v in zip(packs, volumes)
                 for q in (split_pack(p, int(round(v / least)), features, stores) if v > mean else [p])]
    if k_groups > 1:
        capacity = sum(p.volume() for p in packs) / k_groups
        packs = [q for p in packs for q in split_pack(p, int(np.ceil(p.volume() / capacity - 1e-9)), features, stores)]
    return packs


def table_columns(names: list[str], mapping: dict) -> dict[str, list[tuple[str, int]]]:
    """table -> the (feature, output column) pairs it serves."""
    out: dict[str, list] = {}
    for column, name in enumerate(names):
        if name in mapping:
            out.setdefault(mapping[name], []).append((name, column))
    return out


class store_locks:
    """Hold the locks of some stores (one when they share it)."""

    def __init__(self, stores):
        self._locks = list({id(s.lock): s.lock for s in stores}.values())

    def __enter__(self):
        for lock in self._locks:
            lock.acquire()

    def __exit__(self, *exc):
        for lock in reversed(self._locks):
            lock.release()
