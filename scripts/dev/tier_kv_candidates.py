"""The disk tier's layout against LMDB: batched writes and reads of rows by uint64 key.

    python scripts/dev/tier_kv_candidates.py [--rows 200000] [--batch 4096] [--repeats 5]

Writes --rows rows of dim 16 + Adagrad (32 float32, with count and clock) in batches of --batch,
then reads --repeats x 20 batches of random present keys, for hybridrec's own layout
(disk_tier.py: one numba call per batch over a mapped file) and for LMDB (py-lmdb's `putmulti`
and `getmulti`, its batched calls, one write transaction per batch, sync off as a tier needs no
durability between checkpoints). Prints each one's median rows/s per repetition, interleaved,
and the ratios. Needs `pip install lmdb` (not a hybridrec dependency).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import numpy as np
from numba import njit

from hybridrec.embedding import disk_tier, tier_kernels as T
from hybridrec.embedding.disk_tier import DiskTier, partitions_of
from hybridrec.embedding.hashing import index_hash

WIDTH = 32


@njit(cache=True, nogil=True)
def read_rows(tier, parts, keys, out):
    """out[i] = the row of keys[i] on the tier (one call per batch, as the lookup kernel reads)."""
    found = 0
    for i in range(keys.shape[0]):
        slot = T.tier_find(tier, parts[i], keys[i], index_hash(keys[i]))
        if slot >= 0:
            found += 1
            for j in range(out.shape[1]):
                out[i, j] = tier[2][slot, T.R_ROW + j]
    return found


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--page-budget-mb", type=int, default=None,
                   help="the tier's mapped-pages bound (disk_tier.PAGE_BUDGET) for this run")
    args = p.parse_args()
    if args.page_budget_mb is not None:
        disk_tier.PAGE_BUDGET = args.page_budget_mb << 20
    try:
        import lmdb
    except ImportError:
        sys.exit("tier_kv_candidates.py: needs the py-lmdb package (import lmdb failed), which no hybridrec extra "
                 "installs: pip install lmdb")

    rng = np.random.default_rng(0)
    keys = rng.integers(0, 2**63, args.rows, dtype=np.uint64)
    rows = rng.standard_normal((args.rows, WIDTH)).astype(np.float32)
    zeros = np.zeros(args.rows, np.int32)
    with tempfile.TemporaryDirectory() as tmp:
        tier = DiskTier(f"{tmp}/tier", args.rows, WIDTH, 1)
        env = lmdb.open(f"{tmp}/lmdb", map_size=args.rows * 400 + (64 << 20), sync=False, metasync=False,
                        writemap=True, max_dbs=0)
        warm = DiskTier(f"{tmp}/warm", 64, WIDTH, 1)  # numba's compile or cache load, before any clock
        warm.insert(keys[:8], rows[:8], zeros[:8], zeros[:8])
        read_rows(warm.tier, np.zeros(8, np.int64), keys[:8], np.empty((8, WIDTH), np.float32))
        warm.close()
        batches = range(0, args.rows, args.batch)
        start = time.perf_counter()
        for lo in batches:
            tier.insert(keys[lo:lo + args.batch], rows[lo:lo + args.batch], zeros[:args.batch], zeros[:args.batch])
        ours_write = args.rows / (time.perf_counter() - start)
        start = time.perf_counter()
        for lo in batches:
            with env.begin(write=True) as txn:
                records = [(k.tobytes(), r.tobytes()) for k, r in zip(keys[lo:lo + args.batch], rows[lo:lo + args.batch])]
                txn.cursor().putmulti(records)
        lmdb_write = args.rows / (time.perf_counter() - start)
        ours, theirs = [], []
        out = np.empty((args.batch, WIDTH), np.float32)
        parts = np.zeros(args.batch, np.int64)
        for _ in range(args.repeats):
            picks = [rng.choice(keys, args.batch) for _ in range(20)]
            start = time.perf_counter()
            for pick in picks:
                partitions_of(pick, 1, parts)
                assert read_rows(tier.tier, parts, pick, out) == args.batch
            ours.append(20 * args.batch / (time.perf_counter() - start))
            start = time.perf_counter()
            for pick in picks:
                with env.begin() as txn:
                    got = txn.cursor().getmulti([k.tobytes() for k in pick])
                    np.frombuffer(b"".join(v for _, v in got), np.float32)
            theirs.append(20 * args.batch / (time.perf_counter() - start))
        tier.close()
        env.close()
    read_ratio = statistics.median(a / b for a, b in zip(ours, theirs))
    print(f"writes: ours {ours_write:,.0f} rows/s, LMDB {lmdb_write:,.0f} rows/s: ours / LMDB {ours_write / lmdb_write:.2f}")
    print(f"reads:  ours {statistics.median(ours):,.0f} rows/s, LMDB {statistics.median(theirs):,.0f} rows/s: "
          f"ours / LMDB {read_ratio:.2f} (median of {args.repeats} paired repetitions)")


if __name__ == "__main__":
    main()
