"""How a training process splits its CPU threads between the dense part (torch's intra-op threads)
and the embedding pipeline of the pipelined local step (`train.threads`, `train.pipeline`).

`threads: auto` is every CPU this process may use for a one-process job (the local placement),
and 1 per trainer for a job of several processes, which share the machine with each other and
with PS servers. Torch's intra-op threads and the plain step's numba kernels both get all
`threads`: the plain step runs its embedding kernels and its dense step one after the other,
each on every core. The pipelined step runs when `pipeline` is true (local placement only). Its
thread then does all embedding work with `embedding` numba threads (1), and torch keeps `dense`
= all `threads`, so the dense step, the critical path, runs on as many threads as without the
pipeline, and the embedding thread shares the cores with it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from hybridrec.config import ConfigError


@dataclass(frozen=True)
class ThreadSplit:
    total: int  # train.threads as resolved
    dense: int  # torch intra-op threads
    embedding: int  # numba threads of the embedding pipeline's kernels (0: no pipeline)

    @property
    def pipelined(self) -> bool:
        return self.embedding > 0


def available_cpus() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def thread_split(train, placement: str) -> ThreadSplit:
    """The split for the train section `train` of a job whose strategy places embeddings `placement`."""
    local = placement == "local"
    total = (available_cpus() if local else 1) if train.threads == "auto" else train.threads
    if train.pipeline and not local:
        raise ConfigError(f"train.pipeline is true, but strategy.placement is {placement!r}: the pipelined step is "
                          f"the local placement's (allowed: true with placement local; false otherwise)")
    return ThreadSplit(total, total, 1 if train.pipeline else 0)
