"""The backward half of PICASSO's sharded tables: the packed lookup's outputs as autograd
tensors whose gradient is turned into one gradient per sent key and per hot row
(`ShardedFunction`, `PackedBackward`, the `unstitch` kernel), and the step's update: each key's
gradient back to its owner over AllToAll, scaled by 1/W, where `owner_apply` sums them per row
and applies the fused optimizer once per step (so W trainers on W batches of B rows take the step
one process takes on the W*B rows), and the hot rows' gradients summed by one AllReduce and
applied by every trainer to its copy (`hot_apply`). Without packing, each table's gradients
travel and are pushed on their own.
"""
from __future__ import annotations

import numpy as np
import torch

from hybridrec.picasso import packing as P
from hybridrec.picasso.collectives import OpCounts
from hybridrec.picasso.lookup_rounds import Round, Step
from hybridrec.picasso.packs import store_locks


class PackedBackward:
    """What the packed lookup's autograd node calls in backward: each pack's output gradient
    turned into one gradient per sent key (and per hot row), kept in the round until the update."""

    def __init__(self, shards, step: Step, rnd: Round):
        self.shards, self.step, self.round = shards, step, rnd

    def backward(self, grads: dict) -> None:
        pl, rnd = self.shards, self.round
        sp = rnd.batch.sparse
        with pl.kernel_lock:
            for pi, (pack, pr) in enumerate(zip(pl.packs, rnd.packs)):
                grad = grads.get(pack.side)
                if grad is None:
                    continue
                hot = pl.hot_sets[pi]
                pr.send_grad = np.zeros((int(pr.counts.sum()), pack.dim), np.float32)
                hot_grad = self.step.hot_grad.get(pi)
                if hot_grad is None:
                    hot_grad = self.step.hot_grad[pi] = np.zeros((hot.total, pack.dim + 1), np.float32)
                P.unstitch(grad, sp.offsets, sp.batch_size, pr.positions, pack.seg_col, pack.tab_seg, pr.slots,
                           pack.pool_modes, np.float32(1.0 / pl.world.size), pr.send_grad, hot_grad, hot.base)
                pl.ops.native += 2


class ShardedFunction(torch.autograd.Function):
    """The packed lookup's outputs as tensors (made inside forward from numpy arrays, so autograd
    does not wrap them as views); backward hands their gradients to `PackedBackward`."""

    @staticmethod
    def forward(ctx, anchor, backward, sides, *outputs):
        ctx.backward, ctx.sides = backward, sides
        tensors = tuple(torch.from_numpy(o) for o in outputs)
        return tensors if len(tensors) > 1 else tensors[0]

    @staticmethod
    def backward(ctx, *grads):
        ctx.backward.backward({side: None if g is None else g.detach().to("cpu", torch.float32).contiguous().numpy()
                               for side, g in zip(ctx.sides, grads)})
        ctx.backward = None
        return (None, None, None) + (None,) * len(grads)


def update_packed(shards, step: Step, ops: OpCounts) -> int:
    """Every trainer's gradients of the step's keys to their owners, pack by pack (one AllToAll
    for all the step's micro-batches), each owner applying one optimizer step per row; then the
    hot rows' step. The updates dropped (rows evicted since their lookup)."""
    W, rounds = shards.world.size, step.rounds
    dropped = 0
    for pi, pack in enumerate(shards.packs):
        prs = [rnd.packs[pi] for rnd in rounds]
        for pr in prs:
            if pr.send_grad is None:  # the loss did not reach this side
                pr.send_grad = np.zeros((int(pr.counts.sum()), pack.dim), np.float32)
        send_splits = sum(pr.counts.sum(1) for pr in prs)
        recv_splits = sum(pr.recv_counts.sum(1) for pr in prs)
        if len(prs) == 1:
            send = prs[0].send_grad
        else:  # rank-major for the AllToAll: each rank's rows of every round together
            send = np.concatenate([pr.send_grad[a:b] for w in range(W) for pr in prs
                                   for a, b in [_span(pr.counts.sum(1), w)]])
            ops.native += 1
        recv, _ = shards.comm.alltoall(send, send_splits, recv_splits, ops, "train")
        if len(prs) > 1:  # back to round-major, each round's rows as its probe saw them
            per_rank = np.concatenate([[0], np.cumsum(recv_splits)])
            pieces, cursor = [[] for _ in prs], per_rank[:-1].copy()
            for w in range(W):
                for r, pr in enumerate(prs):
                    n = int(pr.recv_counts[w].sum())
                    pieces[r].append(recv[cursor[w]:cursor[w] + n])
                    cursor[w] += n
            recv = np.concatenate([np.concatenate(p) if p else np.empty((0, pack.dim), np.float32)
                                   for p in pieces])
            ops.native += 1
        sizes = [int(pr.recv_counts.sum()) for pr in prs]
        base = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        join = (lambda name: getattr(prs[0], name)) if len(prs) == 1 else \
            (lambda name: np.concatenate([getattr(pr, name) for pr in prs]))
        dropped_t = np.zeros(len(pack.tables), np.int64)
        with shards.kernel_lock, store_locks(pack.stores):
            ok = P.owner_apply(pack.arrays.table, pack.icfg, pack.fcfg, pack.opt_codes, pack.opt_params,
                               np.ascontiguousarray(recv), base, join("perm"), np.stack([pr.tspan for pr in prs]),
                               join("inverse"), join("uniq_rows"), join("uniq_keys"),
                               np.stack([pr.nuniq for pr in prs]), dropped_t)
        ops.native += 1
        if not ok:
            raise ValueError("embedding gradient contains NaN or inf; the update was refused and no row changed")
        dropped += int(dropped_t.sum())
    if any(h.total for h in shards.hot_sets):
        _update_hot(shards, step, ops)
    return dropped


def _update_hot(shards, step: Step, ops: OpCounts) -> None:
    """The hot rows' gradients summed over the trainers (one AllReduce for every pack), then
    the same optimizer step on every trainer's copy."""
    buffers = [step.hot_grad.get(pi) for pi in range(len(shards.packs))]
    buffers = [np.zeros((h.total, p.dim + 1), np.float32) if b is None else b
               for b, h, p in zip(buffers, shards.hot_sets, shards.packs)]
    flat = np.concatenate([b.ravel() for b in buffers])
    ops.native += 1
    shards.comm.allreduce(flat, ops, "train")
    start = 0
    with shards.kernel_lock:
        for pack, hot, b in zip(shards.packs, shards.hot_sets, buffers):
            summed = flat[start:start + b.size].reshape(b.shape)
            start += b.size
            if hot.total == 0:
                continue
            steps = np.array([s.step for s in pack.stores], np.int64)
            P.hot_apply(hot.arrays.table, hot.counts, hot.base, summed, pack.icfg, pack.fcfg, pack.opt_codes,
                        pack.opt_params, steps)
            ops.native += 1


def update_unpacked(shards, step: Step, ops: OpCounts) -> int:
    """The plain model-parallel update: each table's gradients to their owners, `store.push`."""
    W, dropped = shards.world.size, 0
    for ti, (side, table, _) in enumerate(shards.unpacked):
        store = shards.stores[table]
        keys, grads = [], []
        for rnd in step.rounds:
            tr = rnd.packs[ti]
            leaf_grad = None if tr.leaf is None else tr.leaf.grad
            send = (np.zeros((len(tr.order), store.dim), np.float32) if leaf_grad is None
                    else leaf_grad.numpy()[tr.order] * np.float32(1.0 / W))
            ops.native += 2
            recv, _ = shards.comm.alltoall(send, tr.counts, tr.recv_counts, ops, "train")
            keys.append(tr.recv_keys)
            grads.append(recv)
        keys = np.concatenate(keys) if len(keys) > 1 else keys[0]
        grads = np.concatenate(grads) if len(grads) > 1 else grads[0]
        dropped += store.push(np.ascontiguousarray(keys), np.ascontiguousarray(grads, np.float32))
        ops.native += 3  # probe, gradient scatter, optimizer
    return dropped


def _span(splits, w: int) -> tuple[int, int]:
    start = int(np.sum(splits[:w]))
    return start, start + int(splits[w])
