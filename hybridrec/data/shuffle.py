"""A shuffle buffer for streaming readers: training rows in a seeded random order without
holding the data set in memory.

`ShuffleBuffer(source, size, batch_size, seed)` holds up to `size` rows. Once `size` more have
arrived on top of them, the 2 x `size` rows are permuted together (one gather per array, no
per-row Python): `size` of them leave in batches of `batch_size`, the rest stay and mix with
the next rows. At the end of the source what is held leaves permuted. A row therefore moves
by up to a few buffer lengths from its place in the file; a buffer at least as large as the
data set shuffles it whole.

The order depends on the seed and the source only, and is the same on every pass (epoch), so
a resumed run that skips the batches it already trained on sees exactly the rest.
"""
from __future__ import annotations

from typing import Iterable, Iterator

import numpy as np

from hybridrec.data.batch import Batch, rebatch


class ShuffleBuffer:
    """The rows of `source` (re-iterable `Batch`es) in a seeded, buffer-local random order."""

    def __init__(self, source: Iterable[Batch], size: int, batch_size: int, seed: int = 0) -> None:
        for name, value, minimum in (("size", size, 1), ("batch_size", batch_size, 1), ("seed", seed, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
        self.source = source
        self.size = size
        self.batch_size = batch_size
        self.seed = seed

    def __iter__(self) -> Iterator[Batch]:
        return rebatch(self._mixed(), self.batch_size)

    def _mixed(self) -> Iterator[Batch]:
        rng = np.random.default_rng(self.seed)
        held: list[Batch] = []
        rows = 0
        for batch in self.source:
            held.append(batch)
            rows += len(batch)
            if rows >= 2 * self.size:
                pool = Batch.concat(held)
                order = rng.permutation(rows)
                yield pool.take_rows(order[self.size:])
                held, rows = [pool.take_rows(order[:self.size])], self.size
        if rows:
            pool = Batch.concat(held)
            yield pool.take_rows(rng.permutation(rows))
