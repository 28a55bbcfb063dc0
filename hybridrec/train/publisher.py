"""Publishing model versions for serving while a job trains (`train.publish_dir`).

At the steps `due` names (`train.publish_every`: steps, or seconds as '<N>s', the leader's clock
for trainers in lockstep) the trainer calls `publish` with every update applied. Training stops
only for the consistent copy: the dense state and, per table, the rows changed since the last
version with the keys that left it (`embedding.changes.ChangeTracker`, one pass over the row
metadata under the table's lock), or every row for a full version (the first one of a run, every
`train.publish_full_every`-th, and any after a table restarted its count of lookups). A
background thread quantizes them (`train.publish_precision`), writes version N+1 atomically
(`bundle.format.write_version`: a temporary directory renamed whole, so a trainer killed at any
moment leaves the last complete version and a temporary directory the next publisher removes),
and deletes versions older than the `train.publish_keep_full`-th newest full one. A publish
waits for the write before it, so at most one copy is in flight.

The tables must live in the trainer processes (`placement.stores()`): the local placement, DES's
field_sharded (each trainer holds some tables) and PICASSO's sharded (each trainer a shard of
every table; the hot rows are written back first). With several trainers every one copies its
own tables and the leader gathers the copies and writes the version.
"""
from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import numpy as np

from hybridrec.bundle.format import (TablePart, complete_versions, read_manifest, remove_interrupted, version_path,
                                     write_version)
from hybridrec.bundle.job import job_fields, now
from hybridrec.bundle.precision import quantize, stored_precision
from hybridrec.config import ConfigError
from hybridrec.embedding.changes import Changes, ChangeTracker

IN_PROCESS_PLACEMENTS = ("local", "field_sharded", "sharded")


def merged(parts: list[Changes]) -> Changes:
    """One table's changes from the trainers that hold parts of it."""
    if len(parts) == 1:
        return parts[0]
    keys = np.concatenate([p.keys for p in parts])
    return Changes(keys, np.concatenate([p.weights for p in parts]),
                   np.setdiff1d(np.concatenate([p.deleted for p in parts]), keys), parts[0].full)


class DeltaPublisher:
    def __init__(self, cfg, tables, world):
        t = cfg.train
        placement = str(cfg.strategy.resolved["placement"])
        if placement not in IN_PROCESS_PLACEMENTS:
            raise ConfigError(f"train.publish_dir: publishing reads the tables in the trainer processes (placements "
                              f"{', '.join(IN_PROCESS_PLACEMENTS)}); this job's placement is '{placement}', whose "
                              f"tables live on PS servers: publish its checkpoints with hybridrec export instead")
        self.world = world
        self.root = Path(t.publish_dir)
        every = t.publish_every
        self.every_steps = every if isinstance(every, int) else None
        self.every_seconds = float(every.strip()[:-1]) if isinstance(every, str) else None
        self.full_every, self.keep_full, self.precision = t.publish_full_every, t.publish_keep_full, t.publish_precision
        self.tables = tables
        self.side = {**{name: "deep" for name in tables.deep}, **{name: "wide" for name in tables.wide}}
        self.fields = job_fields(cfg, tables, t.publish_precision, f"training of {cfg.train.output_dir}")
        newest = None
        if world.leader:
            self.root.mkdir(parents=True, exist_ok=True)
            remove_interrupted(self.root)
            newest = max(complete_versions(self.root), default=0)
        self.number = world.broadcast(newest)  # versions go on from the newest in the directory
        self.since_full = None  # versions since the last full one this run published (None: none yet)
        self.trackers: dict[str, ChangeTracker] = {}
        self._last = time.monotonic()
        self.last_step: int | None = None  # the training step of the last version this run published
        self._writer: threading.Thread | None = None
        self._failure: BaseException | None = None
        self.published: list[int] = []

    def due(self, step: int) -> bool:
        """Whether a version is due after `step` (every trainer gets the same answer)."""
        if self.every_steps is not None:
            return step % self.every_steps == 0
        return self.world.broadcast(time.monotonic() - self._last >= self.every_seconds)

    def publish(self, step: int, dense_state: dict, placement, stream_position=None) -> int:
        """Copy the model as it is now (every trainer its own tables) and write it as the next
        version in the background (the leader); returns its number."""
        self.wait()
        stores = placement.stores()
        for name, store in stores.items():
            if name not in self.trackers:
                self.trackers[name] = ChangeTracker(store)
        restart = any(self.trackers[name].must_start_over(store) for name, store in stores.items())
        full = (self.since_full is None or self.since_full + 1 >= self.full_every
                or any(self.world.gather(restart)))
        mine = {name: self.trackers[name].take(store, full) for name, store in stores.items()}
        everyone = self.world.gather(mine) if self.world.grouped else [mine]
        positions = self.world.gather(stream_position)
        self.number += 1
        number = self.number
        self.since_full = 0 if full else self.since_full + 1
        self._last = time.monotonic()
        self.last_step = int(step)
        if not self.world.leader:
            return number
        configs = self.tables.all_tables()
        parts = [(name, configs[name], merged([held[name] for held in everyone if name in held]))
                 for name in configs]
        dense = {k: v.detach().cpu().clone() for k, v in dense_state["model"].items()}
        manifest = {**self.fields, "version": number, "kind": "full" if full else "delta",
                    "base": None if full else number - 1, "step": int(step),
                    "stream_position": positions if any(p is not None for p in positions) else None,
                    "created": now()}
        self._writer = threading.Thread(target=self._write, args=(number, manifest, dense, parts),
                                        name="hybridrec-publish", daemon=True)
        self._writer.start()
        return number

    def _write(self, number: int, manifest: dict, dense: dict, parts) -> None:
        try:
            tables = []
            for name, config, changes in parts:
                stored = stored_precision(self.precision, config.dim)
                tables.append(TablePart(name, config.dim, self.side[name], config.pooling, stored, changes.keys,
                                        quantize(changes.weights, stored), changes.deleted))
            write_version(version_path(self.root, number), manifest, dense, tables)
            self.published.append(number)
            self._prune()
        except BaseException as exc:  # noqa: BLE001 - raised in the training thread at the next publish
            self._failure = exc

    def _prune(self) -> None:
        """Delete the versions older than the keep_full-th newest full version."""
        versions = complete_versions(self.root)
        fulls = [n for n, path in versions.items() if read_manifest(path).get("kind") == "full"]
        if len(fulls) <= self.keep_full:
            return
        oldest_kept = sorted(fulls)[-self.keep_full]
        for n, path in versions.items():
            if n < oldest_kept:
                shutil.rmtree(path, ignore_errors=True)

    def wait(self) -> None:
        """Wait for the version being written; raise what writing it raised."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise RuntimeError(f"train.publish_dir: writing a version failed: {failure}") from failure
