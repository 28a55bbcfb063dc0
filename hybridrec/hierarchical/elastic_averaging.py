"""Elastic averaging (EASGD) of a dense copy with a centre copy on the PS servers, in the
background (ShadowSync): the training step never waits for it.

One sync, with x the local copy and c the centre:
    d = alpha * (x - c);   x <- x - d;   c <- c + d
The centre lives in the PS servers' dense store, initialised with plain SGD at lr 1, so pushing
-d as a gradient adds d to it; concurrent syncs of other copies interleave on the servers as
they arrive (asynchronous EASGD). The local copy is changed in place while training threads
or processes keep updating it, as in the paper's Hogwild groups.
"""
from __future__ import annotations

import threading

import numpy as np
import torch

CENTRE_OPTIMIZER = {"name": "sgd", "lr": 1.0, "weight_decay": 0.0}  # a push of -d adds d to the centre


def elastic_delta(local: dict[str, np.ndarray], centre: dict[str, np.ndarray], alpha: float) -> dict[str, np.ndarray]:
    """d = alpha * (local - centre) per parameter."""
    return {name: (alpha * (local[name] - centre[name])).astype(np.float32) for name in centre}


class ElasticSync:
    """Syncs `params` (name -> tensor, changed in place) with the centre behind `client` (a PS
    client of its own: this thread is its only user) every time `due()` says so; `poke()`
    wakes it after a step. Counts syncs and the bytes they moved.

    `slices`: local name -> (centre name, dim, start, stop) for a tensor that is a slice of a
    centre parameter (a part of a split FC layer, hybridrec.hierarchical.fc_split): it syncs with that
    slice of the centre; the push carries zeros elsewhere."""

    def __init__(self, params: dict[str, torch.Tensor], client, alpha: float, due, poll_seconds: float = 0.05,
                 slices: dict[str, tuple[str, int, int, int]] | None = None):
        self.params, self.client, self.alpha, self.due = params, client, alpha, due
        self.slices = dict(slices or {})
        self.poll_seconds = poll_seconds
        self.syncs = 0
        self.bytes = 0
        self.error: BaseException | None = None
        self._wake, self._stop = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, name="elastic-sync", daemon=True)

    def start(self) -> "ElasticSync":
        self._thread.start()
        return self

    def poke(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"the elastic averaging thread failed: {self.error}") from self.error
        self._wake.set()

    def _where(self, name: str) -> tuple[str, tuple]:
        """The centre parameter a local tensor syncs with, and the index of its part of it."""
        if name not in self.slices:
            return name, (Ellipsis,)
        centre, dim, start, stop = self.slices[name]
        return centre, (slice(None),) * dim + (slice(start, stop),)

    def sync_once(self) -> None:
        where = {name: self._where(name) for name in self.params}
        centre = self.client.dense_pull(sorted({c for c, _ in where.values()}))
        local = {name: self.params[name].detach().numpy().copy() for name in self.params}
        delta = elastic_delta(local, {name: centre[c][index] for name, (c, index) in where.items()}, self.alpha)
        push = {c: np.zeros_like(value, dtype=np.float32) for c, value in centre.items()}
        for name, (c, index) in where.items():
            push[c][index] -= delta[name]
        self.client.dense_push(push)
        for name, d in delta.items():
            # through .data: a forward of the training thread may hold this parameter for its
            # backward, and a change autograd tracked would fail that backward
            self.params[name].data.sub_(torch.from_numpy(d))
        self.syncs += 1
        self.bytes += 2 * sum(value.nbytes for value in push.values())  # the centre pulled, -d pushed

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._wake.wait(self.poll_seconds)
                self._wake.clear()
                if not self._stop.is_set() and self.due():
                    self.sync_once()
        except BaseException as error:  # reported to the training thread at its next poke
            self.error = error

    def stop(self, timeout: float = 60.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self.error is not None:
            raise RuntimeError(f"the elastic averaging thread failed: {self.error}") from self.error
