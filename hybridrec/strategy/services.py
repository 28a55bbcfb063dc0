"""The typed services a placement offers the other axes, as objects (hybridrec.axes.Service names
them and declares which value offers and which requires each).

A placement's `services` is a `Services`: PS servers' endpoints and clients (`ps`, the ps
placement), the owners' shards (`shards`, the sharded placement: PICASSO's tables, which the
hot_cold consistency gives its hot-row policy), this trainer's fields (`fields`, the
field_sharded placement, which the des dense sync computes its first layers from), and the flags
`background_lookups`, `whole_batches` and `wire`. A consistency or a dense sync asks for what it
requires by name (`services.ps_endpoints("dense ps_async")`), which raises a `MissingService`
naming the service and its user when the placement lacks it (the config refuses such a
combination at load time, so that is a bug); nothing reaches into a placement's attributes.
The strategy checks that every placement offers exactly what hybridrec.axes declares for it.
"""
from __future__ import annotations

from dataclasses import dataclass

from hybridrec.axes import Service
from hybridrec.des.fields import FieldShare
from hybridrec.picasso.sharded_tables import ShardedTables
from hybridrec.ps.client import PSClient


class MissingService(RuntimeError):
    """A value asked for a service its placement does not offer."""


@dataclass(frozen=True)
class PSEndpoints:
    """The job's PS servers as its trainers reach them: their addresses, the embedding workers'
    (none: the trainers talk to the servers directly, HET's route), a client's options, and the
    group PSs of Hierarchical Training the launcher started (group-major; none without them)."""

    ps: tuple[str, ...]
    embedding_workers: tuple[str, ...]
    timeout: float
    retries: int
    value_codec: str
    group_ps: tuple[str, ...] = ()

    @property
    def route(self) -> str:
        return "embedding_workers" if self.embedding_workers else "direct"

    def client(self) -> PSClient:
        """A client of every PS shard, of its own (one per thread), with the job's value codec."""
        return PSClient(self.ps, timeout=self.timeout, retries=self.retries, value_codec=self.value_codec)

    def clock_client(self) -> PSClient:
        """A client of PS shard 0, which keeps the worker clocks (SSP)."""
        return PSClient(self.ps[:1], timeout=self.timeout, retries=self.retries)


@dataclass(frozen=True)
class Services:
    ps: PSEndpoints | None = None
    shards: ShardedTables | None = None
    fields: FieldShare | None = None
    background_lookups: bool = False  # lookups may run off the training thread
    whole_batches: bool = False  # every trainer reads every row
    wire: bool = False  # IDs and rows cross a wire the codecs encode

    def offered(self) -> frozenset[Service]:
        held = {Service.PS_ENDPOINTS: self.ps is not None, Service.SHARD_MAP: self.shards is not None,
                Service.FIELD_MAP: self.fields is not None, Service.BACKGROUND_LOOKUPS: self.background_lookups,
                Service.WHOLE_BATCHES: self.whole_batches, Service.WIRE: self.wire}
        return frozenset(service for service, offered in held.items() if offered)

    def ps_endpoints(self, user: str) -> PSEndpoints:
        return _need(self.ps, Service.PS_ENDPOINTS, user)

    def shard_map(self, user: str) -> ShardedTables:
        return _need(self.shards, Service.SHARD_MAP, user)

    def field_map(self, user: str) -> FieldShare:
        return _need(self.fields, Service.FIELD_MAP, user)

    def need_background_lookups(self, user: str) -> None:
        _need(self.background_lookups or None, Service.BACKGROUND_LOOKUPS, user)


def _need(service, name: Service, user: str):
    if service is None:
        raise MissingService(f"{user} needs the placement's {name} service, which this placement does not offer "
                             f"(hybridrec.axes should have refused the combination: a bug)")
    return service
