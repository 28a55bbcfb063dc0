"""How the trainers of a job write one checkpoint together and resume from one.

`save_together`: every trainer's updates are acknowledged (the caller drained its stream), the
dense sync gives its state on every trainer, trainers that hold their own tables stage them, and
the leader writes the checkpoint (hybridrec.train.checkpoint) with every trainer's data position.
`restore`: the leader chooses the newest checkpoint that reads whole (loading its tables), the
others follow its choice or its error; each trainer gets back its own data position.

A data position is a dict of named parts (`{"next_batch": 3}`, and on a stream `"stream"`: the
source's state); the progress record holds each part for every trainer as `<part>_by_rank`
(`next_batch_by_rank`, `stream_by_rank`), and `restore` hands each trainer its own parts back
under their names.
"""
from __future__ import annotations

import shutil
from pathlib import Path

from hybridrec.comm.transport import RemoteError
from hybridrec.config import ConfigError, JobConfig
from hybridrec.strategy.world import World
from hybridrec.train.checkpoint import (CheckpointError, checkpoint_root, complete_checkpoints, latest_checkpoint,
                                        read_dense, read_progress, remove_interrupted_writes, save_checkpoint)

POSITIONS = "next_batch_by_rank"  # every trainer's next batch of the epoch, in every progress record
BY_RANK = "_by_rank"


def open_checkpoint(out_dir: Path, resume: bool, overwrite: bool):
    """The checkpoint to resume from (None for a fresh run); refuses to mix two runs in one dir
    unless `overwrite`, which deletes the old run's checkpoints."""
    if resume and overwrite:
        raise ValueError("resume and overwrite exclude each other: continue a run or start it over")
    found = latest_checkpoint(out_dir)
    if resume and found is None:
        raise FileNotFoundError(f"--resume: no checkpoint under {out_dir / 'checkpoints'}")
    if not resume and found is not None:
        if not overwrite:
            raise FileExistsError(f"train.output_dir {str(out_dir)!r} already holds a run's checkpoints "
                                  f"({found.name}); pass --resume to continue it, --overwrite to start over "
                                  f"(deleting them), or choose another train.output_dir (--set train.output_dir=...)")
        shutil.rmtree(checkpoint_root(out_dir))
        return None
    return found


def restore(cfg: JobConfig, world: World, placement, resume: bool, overwrite: bool) -> tuple[dict | None, dict | None]:
    """(progress record with this trainer's position parts, dense state), or (None, None) for a
    fresh run: the newest checkpoint that reads whole, its embeddings loaded. The leader chooses and
    loads; the others follow its choice or its error."""
    found, chosen = None, None
    if world.leader:
        try:
            found = _load_newest_valid(cfg, world, placement, resume, overwrite)
            chosen = ("ok", None if found is None else str(found[0]))
        except Exception as exc:
            chosen = ("error", exc)
    outcome, value = world.broadcast(chosen)
    if outcome == "error":
        raise value
    if value is None:
        return None, None
    record, state = found[1:] if found is not None else (read_progress(value, cfg), read_dense(value))
    if not world.leader and placement.tables_on_trainers:
        load_embeddings(placement, Path(value))  # each trainer holds (and loads) its own tables
    world.barrier()
    mine = {key.removesuffix(BY_RANK): record.pop(key)[world.rank] for key in list(record) if key.endswith(BY_RANK)}
    return {**record, **mine}, state


def _load_newest_valid(cfg: JobConfig, world: World, placement, resume: bool,
                       overwrite: bool) -> tuple[Path, dict, dict] | None:
    """(path, progress record, dense state) of the checkpoint to resume from, its tables loaded into
    `placement`, skipping damaged ones with a word on each; None for a fresh run. Half-written
    checkpoints of dead runs are removed."""
    out_dir = Path(cfg.train.output_dir)
    for removed in remove_interrupted_writes(out_dir):
        print(f"trainer: removed {removed}, a checkpoint whose writing was interrupted", flush=True)
    newest = open_checkpoint(out_dir, resume, overwrite)
    if newest is None:
        return None
    damaged = []
    for path in complete_checkpoints(out_dir):
        try:
            record = read_progress(path, cfg)
            if len(record[POSITIONS]) != world.size:
                raise ConfigError(f"resume: {path} was written by {len(record[POSITIONS])} trainers; "
                                  f"this job has {world.size}")
            state = read_dense(path)
            load_embeddings(placement, path)
        except CheckpointError as exc:
            damaged.append(str(exc))
            print(f"trainer: {exc}", flush=True)
            continue
        if damaged or world.grouped:
            print(f"trainer: resumed from checkpoint {path} at step {record['step']}", flush=True)
        return path, record, state
    raise CheckpointError(f"resume: no checkpoint under {checkpoint_root(out_dir)} reads whole; start over with "
                          f"--overwrite. " + " ".join(damaged))


def load_embeddings(placement, path: Path) -> None:
    """The placement's tables from checkpoint `path`; CheckpointError naming the file when they are
    damaged (a PS server reports that as a remote error)."""
    try:
        placement.load(path / "embeddings")
    except (ValueError, OSError, RemoteError) as exc:
        raise CheckpointError(f"{exc}; resume from an older checkpoint or start over (--overwrite)") from None


def save_together(cfg: JobConfig, world: World, placement, dense, record: dict, position: dict) -> None:
    """Every trainer's updates are acknowledged (the caller drained its stream), then the leader
    writes the checkpoint: dense state, the placement's tables, the progress `record` and every
    trainer's data `position` (its parts as `<part>_by_rank`)."""
    positions = world.gather(position)
    state = dense.state()  # on every trainer: a dense sync may gather its parts (DES: the first-layer blocks)
    if placement.tables_on_trainers:  # each trainer writes its own tables for the leader
        placement.stage(checkpoint_root(cfg.train.output_dir), record["step"])
    world.barrier()
    if world.leader:
        by_rank = {f"{part}{BY_RANK}": [p[part] for p in positions] for part in positions[0]}
        save_checkpoint(cfg.train.output_dir, state, placement.save, {**record, **by_rank}, cfg,
                        cfg.train.keep_checkpoints)
    world.barrier()
