"""The disk tier's layout against embedded key-value stores: batched writes and reads of rows by uint64 key.

    python scripts/dev/tier_kv_candidates.py [--rows 200000] [--batch 4096] [--repeats 5] [--page-budget-mb N]

Writes --rows rows of dim 16 + Adagrad (32 float32, with count and clock) in batches of --batch,
then reads --repeats x 20 batches of random present keys, for hybridrec's own layout
(disk_tier.py: one numba call per batch over mapped files, a log of records and an index, under
the tier's mapped-pages bound) and for each candidate library installed: LMDB (py-lmdb's
`putmulti` and `getmulti`, its batched calls, one write transaction per batch, sync off) and
RocksDB (rocksdict: a WriteBatch per batch, write-ahead log off, and its multi-get), sync and
logs off as a tier needs no durability between checkpoints. Prints rows/s of each (reads: median
of the repetitions, interleaved) and ours over theirs. Neither library is a hybridrec dependency
(`pip install lmdb rocksdict`); a missing one is skipped with a line saying so.
"""
from __future__ import annotations

import argparse
import statistics
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
            record = np.int64(tier[6][slot, T.X_RECORD]) - 1
            for j in range(out.shape[1]):
                out[i, j] = tier[2][record, T.R_ROW + j]
    return found


class Ours:
    name = "ours"

    def __init__(self, path, rows):
        self.tier = DiskTier(path, rows, WIDTH, 1)
        self.out = None

    def write(self, keys, rows, zeros):
        self.tier.insert(keys, rows, zeros, zeros)

    def read(self, keys):
        parts = np.zeros(keys.shape[0], np.int64)
        partitions_of(keys, 1, parts)
        out = np.empty((keys.shape[0], WIDTH), np.float32)
        self.tier.begin_write()
        found = read_rows(self.tier.tier, parts, keys, out)
        self.tier.end_write()  # its release of mapped pages, as after a lookup call
        assert found == keys.shape[0]

    def close(self):
        self.tier.close()


class Lmdb:
    name = "LMDB"

    def __init__(self, path, rows):
        import lmdb

        self.env = lmdb.open(path, map_size=rows * 400 + (64 << 20), sync=False, metasync=False, writemap=True,
                             max_dbs=0)

    def write(self, keys, rows, zeros):
        with self.env.begin(write=True) as txn:
            txn.cursor().putmulti([(k.tobytes(), r.tobytes()) for k, r in zip(keys, rows)])

    def read(self, keys):
        with self.env.begin() as txn:
            got = txn.cursor().getmulti([k.tobytes() for k in keys])
            assert len(np.frombuffer(b"".join(v for _, v in got), np.float32)) == keys.shape[0] * WIDTH

    def close(self):
        self.env.close()


class Rocks:
    name = "RocksDB"

    def __init__(self, path, rows):
        from rocksdict import Options, Rdict, WriteOptions

        self.db = Rdict(path, options=Options(raw_mode=True))
        no_log = WriteOptions()
        no_log.disable_wal = True
        self.db.set_write_options(no_log)

    def write(self, keys, rows, zeros):
        from rocksdict import WriteBatch

        batch = WriteBatch(raw_mode=True)
        for k, r in zip(keys, rows):
            batch.put(k.tobytes(), r.tobytes())
        self.db.write(batch)

    def read(self, keys):
        got = self.db.get([k.tobytes() for k in keys])
        assert len(np.frombuffer(b"".join(got), np.float32)) == keys.shape[0] * WIDTH

    def close(self):
        self.db.close()


def candidates():
    found = [Ours]
    for module, cls in (("lmdb", Lmdb), ("rocksdict", Rocks)):
        try:
            __import__(module)
            found.append(cls)
        except ImportError:
            print(f"{cls.name}: skipped, the {module} package is not installed (pip install {module})")
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

    rng = np.random.default_rng(0)
    keys = rng.integers(0, 2**63, args.rows, dtype=np.uint64)
    rows = rng.standard_normal((args.rows, WIDTH)).astype(np.float32)
    zeros = np.zeros(args.rows, np.int32)
    with tempfile.TemporaryDirectory() as tmp:
        warm = Ours(f"{tmp}/warm", 64)  # numba's compile or cache load, before any clock
        warm.write(keys[:8], rows[:8], zeros[:8])
        warm.read(keys[:8])
        warm.close()
        stores = [cls(f"{tmp}/{cls.name}", args.rows) for cls in candidates()]
        writes = {}
        for store in stores:
            start = time.perf_counter()
            for lo in range(0, args.rows, args.batch):
                store.write(keys[lo:lo + args.batch], rows[lo:lo + args.batch], zeros[lo:lo + args.batch])
            writes[store.name] = args.rows / (time.perf_counter() - start)
        reads = {store.name: [] for store in stores}
        for _ in range(args.repeats):
            picks = [rng.choice(keys, args.batch) for _ in range(20)]
            for store in stores:
                start = time.perf_counter()
                for pick in picks:
                    store.read(pick)
                reads[store.name].append(20 * args.batch / (time.perf_counter() - start))
        for store in stores:
            store.close()
    for store in stores:
        name = store.name
        line = f"{name}: writes {writes[name]:,.0f} rows/s, reads {statistics.median(reads[name]):,.0f} rows/s"
        if name != "ours":
            ratio = statistics.median(a / b for a, b in zip(reads["ours"], reads[name]))
            line += f"; ours / {name}: writes {writes['ours'] / writes[name]:.2f}, reads {ratio:.2f}"
        print(line)


if __name__ == "__main__":
    main()
