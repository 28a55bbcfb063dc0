"""The schedule of an emulated run: every choice that decides how the W workers' steps interleave,
drawn from one seeded generator, so a run replays bit for bit from its seed.

The emulator asks the schedule, in a fixed order, for:

* `order(workers)`: the order in which the workers of a round take their steps (their reads, and
  the order in which their updates reach the shared stores);
* `visible(required, available)`: how many of each worker's computed updates a read sees. The
  discipline's bound says how many it must see (`required`, per worker); the updates computed so
  far cap it (`available`). Beyond the required ones each further update is seen with
  probability `visibility` (a run of successes: updates reach a store in order), so
  `visibility = 0` is the bound's worst case (every read misses all it may miss) and 1 is as
  fresh as causality allows;
* `apply_order(counts)`: the order in which the extra updates a read sees reach the store;
* `dense_version(required, available, ...)`: async and SSP's dense copy, as `visible` for one
  worker's count of versions;
* `next_worker(eligible)`: SSP's free-running workers: which eligible worker steps next, by
  per-worker speeds drawn once from the seed (fast workers run ahead up to the bound);
* `hogwild(members)`: one round of a Hierarchical Training group: the order of its members'
  reads and writes of the group's dense copy, each member's write after its own read.

`RecordedSchedule` (hybridrec.lab.trace) answers `visible` and `order` from a real job's recorded
staleness instead, and gives a replay the job's reads and updates in time order (`timeline`),
its embedding updates in the order each PS store applied them (`embedding_plan`) and an async
job's dense pushes in the order its PS shards applied them (`dense_plan`).
"""
from __future__ import annotations

import numpy as np

from hybridrec.errors import UserError


class Schedule:
    def __init__(self, seed: int, visibility: float = 0.0, speed_spread: float = 0.5):
        if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or seed < 0:
            raise UserError(f"schedule seed: {seed!r}; allowed: an int >= 0")
        if not 0.0 <= visibility <= 1.0:
            raise UserError(f"visibility: {visibility!r}; allowed: a probability in [0, 1]")
        if not speed_spread >= 0.0:
            raise UserError(f"speed_spread: {speed_spread!r}; allowed: a number >= 0")
        self.seed, self.visibility, self.speed_spread = int(seed), float(visibility), float(speed_spread)
        self.rng = np.random.Generator(np.random.PCG64([int(seed), 0x5CEDB1E]))
        self._speeds: np.ndarray | None = None

    def describe(self) -> dict:
        return {"kind": "seeded", "seed": self.seed, "visibility": self.visibility,
                "speed_spread": self.speed_spread}

    def order(self, workers, round_index: int = 0) -> list[int]:
        """The workers of a round in the order they step."""
        workers = list(workers)
        return [workers[i] for i in self.rng.permutation(len(workers))]

    def visible(self, required: np.ndarray, available: np.ndarray, worker: int = -1, step: int = -1) -> np.ndarray:
        """Per worker, how many of its updates a read sees: at least `required`, at most `available`."""
        required = np.minimum(np.asarray(required, np.int64), available)
        room = np.asarray(available, np.int64) - required
        if self.visibility <= 0.0 or not room.any():
            return required
        if self.visibility >= 1.0:
            return required + room
        # successes before the first failure, capped by the room: geometric(1 - p) - 1
        extra = self.rng.geometric(1.0 - self.visibility, size=room.shape) - 1
        return required + np.minimum(extra, room)

    def timeline(self) -> list[tuple[str, int, int]] | None:
        """A recorded job's reads and updates in the order they happened (`RecordedSchedule`);
        None: a seeded schedule answers the questions above one by one."""
        return None

    def embedding_plan(self):
        """A recorded job's embedding updates in the order each PS store applied them, and what
        each lookup read of each store (`hybridrec.lab.trace.EmbeddingPlan`); None: `visible`,
        `timeline` and `apply_order` decide."""
        return None

    def dense_plan(self):
        """A recorded async job's dense pushes and pulls (`hybridrec.lab.trace.DensePlan`); None:
        `dense_version` decides."""
        return None

    def note_applied(self, targets: np.ndarray, applied: np.ndarray) -> None:
        """A read was to see `targets` of each worker's updates and saw `applied` (a seeded schedule
        never asks for less than was applied before)."""

    def dense_version(self, required: int, available: int, worker: int, step: int) -> int:
        """async, SSP: the version of the central dense copy a step computes on."""
        return int(self.visible(np.array([required]), np.array([available]))[0])

    def apply_order(self, counts: np.ndarray, start: np.ndarray | None = None) -> np.ndarray:
        """Worker ids, each repeated as often as `counts` says, in the order their updates land
        (`start`: each worker's updates applied so far)."""
        ids = np.repeat(np.arange(len(counts)), np.asarray(counts, np.int64))
        return ids[self.rng.permutation(len(ids))] if len(ids) > 1 else ids

    def _speed(self, workers: int) -> np.ndarray:
        if self._speeds is None or len(self._speeds) < workers:
            self._speeds = self.rng.lognormal(0.0, self.speed_spread, size=workers)
        return self._speeds[:workers]

    def next_worker(self, eligible: list[int], workers: int) -> int:
        """SSP: the next worker to step among `eligible`, with probability proportional to its speed."""
        speeds = self._speed(workers)[eligible]
        return eligible[int(self.rng.choice(len(eligible), p=speeds / speeds.sum()))]

    def hogwild(self, members: list[int]) -> list[tuple[str, int]]:
        """One round of a group: ("read", m) and ("write", m) for every member, each member's read
        before its write, the rest interleaved at random."""
        events = [("read", m) for m in members] + [("write", m) for m in members]
        order = [events[i] for i in self.rng.permutation(len(events))]
        read = set()
        fixed, waiting = [], []
        for kind, member in order:  # a write drawn before its read waits for it
            if kind == "read":
                read.add(member)
                fixed.append((kind, member))
                fixed.extend(("write", m) for m in waiting if m == member)
                waiting = [m for m in waiting if m != member]
            elif member in read:
                fixed.append((kind, member))
            else:
                waiting.append(member)
        return fixed
