"""One trainer's part of PICASSO's sharded embedding tables (the hybrid strategy, §III-A): the
embedding tables are split among the trainers, the dense part is data-parallel.

Every trainer (torchrun rank) owns a shard of every table: the keys that the one global route
hash of (table, key) (`hashing.route`, the PS client's) sends to its rank, in in-process
`EmbeddingStore`s (admission, eviction and the fused optimizers as everywhere). A step looks its
batch's keys up from their owners in lookup rounds (hybridrec.picasso.lookup_rounds) and sends
their gradients back to them (hybridrec.picasso.gradient_rounds), where the fused optimizer
applies the sum over all trainers, divided by their number: a step of W trainers on W batches
of B rows is the step one process takes on the W*B rows together (DDP averages the dense
gradients alike).

PICASSO's optimisations are switches of `strategy.picasso`: packing (§III-B:
hybridrec.picasso.packs, the fused kernels of hybridrec.picasso.packing), D-interleaving
(micro-batches, hybridrec.picasso.interleaving), K-interleaving (`k_groups`: packs whose
collectives are pipelined), and the HybridHash hot/cold cache (§III-D), a hot-row policy that
the `hot_cold` consistency attaches from outside (`attach_hot_rows`,
hybridrec.picasso.hybrid_hash) and that reads and writes `hot_sets`.

Lookups, updates and `close_connection()` are collectives: every trainer makes them in the same
order (the training loop runs in lockstep). A lookup runs where the dense model asks for its
inputs (`inputs`), after every trainer knows it has a batch; trainers that evaluate fewer
batches than others answer the others' lookups when they close their connection. Checkpoints
hold each trainer's shard (`stage`, then the leader's `save` assembles them) and load into any
number of trainers (`load`). The number of native kernel calls, collectives and torch
operations on the embedding path is counted per training step (`facts()["ops_per_step"]`,
PICASSO Table V).
"""
from __future__ import annotations

import dataclasses
import shutil
import threading
from pathlib import Path

import torch

from hybridrec.embedding import EmbeddingStore
from hybridrec.embedding.checkpoint import load_resharded
from hybridrec.embedding.hashing import table_route_id
from hybridrec.embedding.inputs import EmbeddingInputs
from hybridrec.picasso.collectives import Collectives, OpCounts
from hybridrec.picasso.gradient_rounds import PackedBackward, ShardedFunction, update_packed, update_unpacked
from hybridrec.picasso import switches
from hybridrec.picasso.hot_rows import HotSet
from hybridrec.picasso.interleaving import CommThread, cut, part_round
from hybridrec.picasso.lookup_rounds import Part, Step, lookup_round
from hybridrec.picasso.packs import make_packs, table_columns
from hybridrec.ps.client import shard_directory


class ShardedTables:
    """This trainer's shards of every table of a job (`tables`, hybridrec.job.tables.JobTables)
    among the trainers of `world`, with the switches of `options` (the config's strategy.picasso)."""

    def __init__(self, options, tables, world):
        self.options, self.tables, self.world = options, tables, world
        self.names = tables.sparse_names
        # one partition per store: the packed kernels serve a pack's tables in parallel instead
        self.stores = {name: EmbeddingStore(dataclasses.replace(config, num_threads=1))
                       for name, config in tables.all_tables().items()}
        self.packing = options.packing
        self.packs = make_packs(tables, self.stores, options.split_packs, options.k_groups) if self.packing else []
        self.unpacked = [] if self.packing else [(side, table, cols) for side, mapping in
                                                 (("deep", tables.deep_map), ("wide", tables.wide_map))
                                                 for table, cols in table_columns(tables.sparse_names, mapping).items()]
        self.sides = [side for side, mapping in (("deep", tables.deep_map), ("wide", tables.wide_map)) if mapping]
        self.pipelined = options.k_groups > 1
        self.comm = Collectives(world)
        self.ops, self.eval_ops, self.steps = OpCounts(), OpCounts(), 0
        self.dropped = 0
        self.hot_sets = [HotSet.empty(p) for p in self.packs]
        self.hot_policy = None  # HybridHash, when the hot_cold consistency attached it
        self.interleaving, self.interleaving_reason = switches.interleaving(options.interleaving,
                                                                            options.micro_batches, world.size)
        # every collective of this group runs on one thread, in the order asked for, so the lookup
        # of the next micro-batch may run while the dense model computes
        self.thread = CommThread(self.interleaving and world.size > 1)
        self.kernel_lock = threading.Lock()  # numba's workqueue layer runs one parallel kernel at a time
        self._anchor = torch.zeros(0, requires_grad=True)
        self._staged: Path | None = None

    def attach_hot_rows(self, policy) -> None:
        """Let `policy` (HybridHash) choose the hot rows: it counts hits in every training lookup
        (`record_hits`), runs `after_step` after every update, writes the hot rows back before a
        checkpoint (`write_back`), starts again after a load (`reset`) and adds its `facts()`."""
        self.hot_policy = policy

    # ------------------------------------------------------------ a step
    def micro_batches(self, step: Step, batch) -> list:
        """D-interleaving: (looked, part) pairs of the batch's micro-batches, whose embedding
        gradients the update sums (one update per batch); the first part's lookup starts now, and
        each later one while the dense model computes the part before it."""
        parts = self.options.micro_batches if self.interleaving and step.train else 1
        return cut(step, batch, parts, self._start_part)

    def _start_part(self, step: Step, index: int):
        return self.thread.submit(lookup_round, self, step.parts[index], step.train, False)

    def inputs(self, looked: Step | Part, batch, requires_grad: bool) -> EmbeddingInputs:
        """The dense model's inputs of a step (or of one of its parts): its lookup round's rows,
        as tensors whose backward sends the gradients toward their owners."""
        if isinstance(looked, Part):
            step, rnd = looked.step, part_round(looked, self._start_part)
        else:
            step = looked
            rnd = self.thread.call(lookup_round, self, batch, looked.train and requires_grad, False)
        if rnd.train:
            step.rounds.append(rnd)
        if self.packing:
            outputs = [rnd.outputs[side] for side in self.sides]
            if rnd.train:
                made = ShardedFunction.apply(self._anchor, PackedBackward(self, step, rnd), tuple(self.sides),
                                             *outputs)
                made = made if isinstance(made, tuple) else (made,)
            else:
                made = tuple(torch.from_numpy(o) for o in outputs)
            out = dict(zip(self.sides, made))
            rnd.ops.torch += 1
        else:
            out = rnd.outputs
        wide = out.get("wide")
        if wide is not None:
            wide = wide.view(wide.shape[0], wide.shape[1])
            rnd.ops.torch += 1
        if rnd.train:
            self.ops.add(rnd.ops)
        return EmbeddingInputs(out.get("deep"), wide)

    def update(self, step: Step) -> int:
        """Every trainer's gradients of the step to the owners, one optimizer step per table (and
        the hot rows' AllReduced step); returns the updates dropped (rows evicted meanwhile)."""
        ops = OpCounts()
        dropped = self.thread.call(update_packed if self.packing else update_unpacked, self, step, ops)
        if self.hot_policy is not None:
            self.thread.call(self.hot_policy.after_step, ops)
        self.ops.add(ops)
        self.steps += 1
        self.dropped += dropped
        return dropped

    def close_connection(self) -> None:
        """Answer the other trainers' lookups, looking up nothing, until every trainer closed."""
        if self.world.size == 1:
            return
        while not self.thread.call(lookup_round, self, None, False, True).all_closing:
            pass

    # ------------------------------------------------------------ checkpoints
    def stage(self, root: Path, step: int) -> None:
        """Every trainer, before the leader assembles checkpoint `step` under `root`: the hot rows
        written back to their owners, then this trainer's shard of every table written to
        <root>/.sharded-step-<step>/shard-<rank>-of-<W>/<table>/, where the leader's `save` takes
        it from (all trainers must see the same file system, as PS servers writing their shards
        do)."""
        self._staged = Path(root) / f".sharded-step-{step:09d}"
        self.thread.call(self._stage_shard, self._staged)

    def _stage_shard(self, staged: Path) -> None:
        if self.hot_policy is not None:
            self.hot_policy.write_back()
        shard = shard_directory(staged, self.world.rank, self.world.size)
        shutil.rmtree(shard, ignore_errors=True)
        for table, store in self.stores.items():
            store.save(shard / table)

    def written_back(self) -> dict:
        """{table: store} of this trainer's shard, the hot rows written back to their owners first
        (every trainer calls it at the same step): what a publisher reads."""
        if self.hot_policy is not None:
            self.thread.call(self.hot_policy.write_back)
        return dict(self.stores)

    def save(self, directory: Path) -> None:
        """The leader: move every trainer's staged shard into the checkpoint's `directory`
        (<directory>/shard-<rank>-of-<W>/<table>/, the layout PS servers write)."""
        staged, self._staged = self._staged, None
        directory = Path(directory)
        if staged is None and self.world.size == 1:  # nobody else holds a shard: written in place
            self.thread.call(self._stage_shard, directory)
            return
        if staged is None:
            raise RuntimeError("sharded: save() before stage(): every trainer stages its shard first")
        directory.mkdir(parents=True, exist_ok=True)
        expected = {shard_directory(directory, r, self.world.size).name for r in range(self.world.size)}
        for shard in sorted(staged.glob("shard-*-of-*")):
            if shard.name in expected:
                shard.replace(directory / shard.name)
        shutil.rmtree(staged, ignore_errors=True)
        missing = sorted(expected - {p.name for p in directory.iterdir()})
        if missing:
            raise RuntimeError(f"sharded: the shards {missing} were not staged for {directory}; every trainer "
                               f"writes its shard under the checkpoint root, which they must all see")

    def load(self, directory: Path) -> None:
        """This trainer's keys (by the route hash for this number of trainers) from every shard of
        a checkpoint written by any number of trainers (`load_resharded`); no collective, so the
        leader may load while choosing a checkpoint and the others after it chose."""
        directory = Path(directory)
        shards = sorted(p for p in directory.glob("shard-*-of-*") if p.is_dir())
        if not shards:
            raise ValueError(f"{directory}: no shard-*-of-* directories; not a checkpoint of the sharded placement")
        loaded = {table: load_resharded([s / table for s in shards], self.world.rank, self.world.size,
                                        table_route_id(table), capacity=store.config.capacity, num_threads=1)
                  for table, store in self.stores.items()}
        self.stores = loaded
        for pack in self.packs:
            pack.bind(self.stores)
        self.hot_sets = [HotSet.empty(p) for p in self.packs]
        if self.hot_policy is not None:
            self.hot_policy.reset()

    def expire(self, step: int, now: float) -> int:
        """This trainer's shard of every table with `expire_after`, swept on the thread that runs
        the lookups (so none is in flight); the rows dropped."""
        return self.thread.call(lambda: sum(store.expire(step, now) for store in self.stores.values()
                                            if store.config.expire_after is not None))

    # ------------------------------------------------------------ facts
    def facts(self) -> dict:
        out = {"interleaving": {"on": self.interleaving, "why": self.interleaving_reason},
               "packs": [{"side": p.side, "dim": p.dim, "tables": len(p.tables)} for p in self.packs]
               if self.packing else len(self.unpacked),
               "ops_per_step": self.ops.as_dict(self.steps),
               "embedding_rows": {side: sum(len(self.stores[t]) for t in self._side_tables(side))
                                  for side in self.sides}}
        if self.hot_policy is not None:
            out.update(self.hot_policy.facts())
        return out

    def _side_tables(self, side: str) -> list[str]:
        mapping = self.tables.deep_map if side == "deep" else self.tables.wide_map
        return sorted(set(mapping.values()))

    def close(self) -> None:
        self.thread.close()
