"""The versioned routing table of the PS tier: which server holds each virtual bucket.

Every key lies in one of `NUM_BUCKETS` buckets (`hybridrec.embedding.buckets`); a
`RoutingTable` names the servers (their addresses) and, per bucket, the primary server and,
with replication, the backup (-1: none). Every change (a bucket moved, a backup promoted) makes
a table with a higher `version`; servers and clients keep the newest they have seen, and a
server asked for a bucket it does not own answers with its table instead of data
(`hybridrec.ps.ownership`), so a client whose table is older refreshes and retries.

Version 0 is the static table every client starts from (`RoutingTable.static`): contiguous
runs of buckets, one per server, no backups. `plan_servers` makes the table for another set of
servers moving as few buckets as possible (with replication, each bucket's backup on the next
server: `backups_for`), `compact` drops the servers left without buckets.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from hybridrec.embedding.buckets import NUM_BUCKETS, static_owners

NO_SERVER = -1


@dataclass(frozen=True)
class RoutingTable:
    """`owners[b]` and `backups[b]` index `addresses` (backups -1: none)."""

    version: int
    addresses: tuple[str, ...]
    owners: np.ndarray = field(repr=False)
    backups: np.ndarray = field(repr=False)

    def __post_init__(self) -> None:
        for name in ("owners", "backups"):
            array = getattr(self, name)
            if not isinstance(array, np.ndarray) or array.shape != (NUM_BUCKETS,):
                raise ValueError(f"routing table {name} must be {NUM_BUCKETS} server indices, "
                                 f"got {getattr(array, 'shape', type(array).__name__)}")
            object.__setattr__(self, name, np.ascontiguousarray(array, dtype=np.int32))
        n = len(self.addresses)
        if not isinstance(self.version, int) or self.version < 0 or n < 1:
            raise ValueError(f"routing table: version must be an int >= 0 and addresses non-empty, got "
                             f"{self.version!r} and {list(self.addresses)}")
        if self.owners.min() < 0 or self.owners.max() >= n:
            raise ValueError(f"routing table owners must index its {n} addresses")
        if self.backups.min() < NO_SERVER or self.backups.max() >= n or np.any(self.backups == self.owners):
            raise ValueError(f"routing table backups must index its {n} addresses (-1: none), never a bucket's owner")

    @classmethod
    def static(cls, addresses: Sequence[str]) -> "RoutingTable":
        return cls(0, tuple(addresses), static_owners(len(addresses)), np.full(NUM_BUCKETS, NO_SERVER, np.int32))

    @property
    def replicated(self) -> bool:
        return bool(np.any(self.backups >= 0))

    def slot(self, address: str) -> int | None:
        """The index of `address` in this table, None when it is not one of its servers."""
        return self.addresses.index(address) if address in self.addresses else None

    def owned_by(self, slot: int) -> np.ndarray:
        """bool[NUM_BUCKETS]: the buckets whose primary is server `slot`."""
        return self.owners == slot

    def backed_by(self, slot: int) -> np.ndarray:
        """bool[NUM_BUCKETS]: the buckets whose backup is server `slot`."""
        return self.backups == slot

    def changed(self, version: int, addresses: Sequence[str] | None = None, owners: np.ndarray | None = None,
                backups: np.ndarray | None = None) -> "RoutingTable":
        return RoutingTable(version, tuple(self.addresses if addresses is None else addresses),
                            self.owners if owners is None else owners, self.backups if backups is None else backups)

    # ---------------------------------------------------------------- wire and files
    def to_wire(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """(arrays, meta) of a message that carries this table."""
        return ({"routing.owners": self.owners, "routing.backups": self.backups},
                {"routing": {"version": self.version, "addresses": list(self.addresses)}})

    @classmethod
    def from_wire(cls, arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> "RoutingTable | None":
        """The table a message carries (see `to_wire`), None when it carries none."""
        info = meta.get("routing")
        if info is None:
            return None
        if not isinstance(info, dict) or "routing.owners" not in arrays or "routing.backups" not in arrays:
            raise ValueError(f"meta 'routing' must come with arrays routing.owners and routing.backups, got {info!r:.200}")
        addresses = info.get("addresses")
        if not isinstance(addresses, list) or not all(isinstance(a, str) for a in addresses):
            raise ValueError(f"meta routing.addresses must be a list of addresses, got {addresses!r:.200}")
        return cls(info.get("version"), tuple(addresses), np.asarray(arrays["routing.owners"]),
                   np.asarray(arrays["routing.backups"]))

    def to_json(self) -> str:
        return json.dumps({"version": self.version, "addresses": list(self.addresses),
                           "owners": self.owners.tolist(), "backups": self.backups.tolist()})

    @classmethod
    def from_json(cls, text: str) -> "RoutingTable":
        data = json.loads(text)
        return cls(int(data["version"]), tuple(data["addresses"]), np.asarray(data["owners"], np.int32),
                   np.asarray(data["backups"], np.int32))


def balanced_owners(owners: np.ndarray, shares: np.ndarray) -> np.ndarray:
    """Owners moving the fewest buckets from `owners` (-1: a bucket whose server leaves) such
    that server s ends with `shares[s]` buckets: each server keeps its buckets up to its share;
    the others go, in bucket order, to the servers furthest below theirs."""
    shares = np.asarray(shares, np.int64)
    if shares.sum() != NUM_BUCKETS:
        raise ValueError(f"shares must add up to {NUM_BUCKETS}, got {int(shares.sum())}")
    new = np.full(NUM_BUCKETS, NO_SERVER, np.int32)
    held = np.zeros(len(shares), np.int64)
    for b in range(NUM_BUCKETS):  # 4096 steps at a scale event, never per key
        s = int(owners[b])
        if 0 <= s < len(shares) and held[s] < shares[s]:
            new[b] = s
            held[s] += 1
    for b in np.flatnonzero(new == NO_SERVER):
        s = int(np.argmax(shares - held))
        new[b] = s
        held[s] += 1
    return new


def even_shares(staying: Sequence[bool]) -> np.ndarray:
    """NUM_BUCKETS split as evenly as possible over the servers marked staying (0 for the rest)."""
    count = int(sum(staying))
    if count < 1:
        raise ValueError("at least one server must stay")
    shares = np.zeros(len(staying), np.int64)
    places = np.flatnonzero(np.asarray(staying, bool))
    shares[places] = NUM_BUCKETS // count
    shares[places[:NUM_BUCKETS % count]] += 1
    return shares


def plan_servers(table: RoutingTable, addresses: Sequence[str], replicas: int = 1) -> RoutingTable:
    """The table (version + 1) that moves the fewest buckets from `table` so that `addresses`
    serve them all evenly. Its servers are `table`'s followed by the new ones (indices stay
    put while buckets move; servers leaving own nothing in it: `compact` drops them). With
    `replicas` 2 every bucket gets a backup on the next staying server."""
    addresses = tuple(addresses)
    if len(set(addresses)) != len(addresses) or not addresses:
        raise ValueError(f"addresses must be distinct and non-empty, got {list(addresses)}")
    union = table.addresses + tuple(a for a in addresses if a not in table.addresses)
    staying = [a in addresses for a in union]
    owners = balanced_owners(table.owners, even_shares(staying))
    return RoutingTable(table.version + 1, union, owners, backups_for(owners, staying, replicas))


def backups_for(owners: np.ndarray, staying: Sequence[bool], replicas: int) -> np.ndarray:
    """Each bucket's backup with `replicas` 2: the next staying server after its owner (none
    with one staying server, or one replica)."""
    places = np.flatnonzero(np.asarray(staying, bool))
    if replicas < 2 or len(places) < 2:
        return np.full(NUM_BUCKETS, NO_SERVER, np.int32)
    position = np.searchsorted(places, owners)
    return places[(position + 1) % len(places)].astype(np.int32)


def compact(table: RoutingTable) -> RoutingTable:
    """The same placement (version + 1) without the servers that hold no bucket."""
    used = sorted(set(np.unique(table.owners).tolist()) | set(np.unique(table.backups[table.backups >= 0]).tolist()))
    index = np.full(len(table.addresses), NO_SERVER, np.int32)
    index[used] = np.arange(len(used), dtype=np.int32)
    backups = np.where(table.backups >= 0, index[np.maximum(table.backups, 0)], NO_SERVER).astype(np.int32)
    return RoutingTable(table.version + 1, tuple(table.addresses[i] for i in used), index[table.owners], backups)
