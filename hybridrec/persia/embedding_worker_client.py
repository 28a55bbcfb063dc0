"""A trainer's line to the embedding workers: put a batch's IDs, pull its pooled embeddings,
push their gradients (Persia §4.1 steps 1, 3-4 and 6), counting the payload bytes on the wire.

IDs go to this trainer's own embedding worker; pulls and pushes go to the embedding worker
named by the batch's first sample id (its first byte is that worker's rank). Not thread-safe:
one client per thread.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from hybridrec.comm.codec import decode_rows, encode_rows, make_id_codec, make_value_codec, with_prefix, without_prefix
from hybridrec.comm.transport import Client, Message, check_addresses
from hybridrec.data.batch import JaggedFeatures
from hybridrec.persia.embedding_worker import worker_of
from hybridrec.embedding.inputs import Pulled


class EmbeddingWorkerClient:
    def __init__(self, addresses: Sequence[str], put_to: int, *, id_codec: str = "unique",
                 value_codec: str = "none", timeout: float = 30.0, retries: int = 3):
        addresses = check_addresses(addresses)
        if not 0 <= put_to < len(addresses):
            raise ValueError(f"put_to must index the {len(addresses)} embedding workers, got {put_to!r}")
        self.addresses = list(addresses)
        self.put_to = put_to
        self.id_codec = make_id_codec(id_codec)
        self.value_codec = make_value_codec(value_codec)
        self._clients = [Client(a, timeout=timeout, retries=retries) for a in self.addresses]
        self.bytes_sent = 0
        self.bytes_received = 0

    def _owner(self, first_sample_id: int) -> Client:
        rank = worker_of(first_sample_id)
        if rank >= len(self._clients):
            raise ValueError(f"sample id {first_sample_id:#x} names embedding worker {rank}, "
                             f"but there are {len(self._clients)}")
        return self._clients[rank]

    def _sent(self, arrays: dict) -> None:
        self.bytes_sent += sum(a.nbytes for a in arrays.values())

    def _received(self, reply: Message) -> Message:
        self.bytes_received += sum(a.nbytes for a in reply.arrays.values())
        return reply

    def put(self, features: JaggedFeatures) -> int:
        """Buffer a batch's IDs on this NN worker's embedding worker; returns its first sample id."""
        encoded = self.id_codec.encode(features)
        self._sent(encoded.arrays)
        # a retried put at worst buffers the batch twice; the unused copy ages out of the buffer
        reply = self._clients[self.put_to].request(
            "put", encoded.arrays, {"codec": encoded.codec, "codec_meta": encoded.meta}, idempotent=True)
        return int(reply.meta["first_sample_id"])

    def pull(self, first_sample_id: int, train: bool = True) -> Pulled | None:
        """The batch's embeddings, or None when its embedding worker lost it."""
        reply = self._received(self._owner(first_sample_id).request(
            "pull", meta={"first_sample_id": first_sample_id, "train": train}, idempotent=True))
        if reply.meta.get("lost"):
            return None
        meta = reply.meta
        parts = {name: decode_rows(self.value_codec, without_prefix(reply.arrays, name, meta[name]))
                 for name in meta["parts"]}
        return Pulled(str(meta["layout"]), parts, int(meta["batch_size"]), int(meta["num_features"]),
                      versions=meta.get("versions"))

    def push(self, first_sample_id: int, grads: dict[str, np.ndarray]) -> dict:
        """Send the gradients of a pulled batch's parts (same names and shapes); returns
        {lost, dropped[, unacknowledged][, versions]}."""
        arrays, meta = {}, {"first_sample_id": first_sample_id}
        for name, grad in grads.items():
            part_arrays, meta[name] = with_prefix(encode_rows(self.value_codec, np.ascontiguousarray(grad), name), name)
            arrays.update(part_arrays)
        self._sent(arrays)
        reply = self._owner(first_sample_id).request("push", arrays, meta)  # not retried: it could apply twice
        return reply.meta

    def stats(self) -> list[dict]:
        return [client.request("stats", idempotent=True).meta for client in self._clients]

    def close(self) -> None:
        for client in self._clients:
            client.close()
