"""`hybridrec bench ps`: embedding PS lookup throughput over loopback vs an in-process gather.

Starts `--servers` PS processes on 127.0.0.1, fills one table with `--rows` keys, then times,
on the same batches of `--batch` distinct keys, interleaved within every repetition:
  gather  a plain numpy gather of the same rows from an in-process float32 array (the ceiling);
  store   `EmbeddingStore.pull` in-process (hash probe + gather, no network);
  ps      `PSClient.lookup` through the servers (dedup, route, ZeroMQ, reassembly);
  keyed   (with `--job-key`) the same through servers of their own that have a job key, as
          `hybridrec launch` gives every job by default: CURVE encrypts every frame.
Reports GB/s of float32 embedding payload handed to the caller (keys * dim * 4 bytes; with
`--codec fp16` the wire carries about half of that), PS GB/s per server process, and the
median over repetitions of the paired ratios ps/gather and ps/store (and keyed/ps).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics

import numpy as np

from hybridrec.benchmarks.results import pick
from hybridrec.benchmarks.timing import (
    TimingPlan, add_timing_arguments, measure_interleaved, paired_ratio, positive_int,
    single_thread, timing_plan_from_args, warm_up,
)
from hybridrec.comm.auth import AUTH_KEY_ENV, AUTH_KEY_FILE_ENV, JobKey
from hybridrec.embedding import EmbeddingStore
from hybridrec.ps.client import PSClient
from hybridrec.ps.server import launch

TABLE = "bench"
PRELOAD_CHUNK = 1 << 16


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybridrec bench ps", description=__doc__.split("\n")[0])
    parser.add_argument("--servers", type=positive_int, default=1, help="PS processes (default 1)")
    parser.add_argument("--server-threads", type=positive_int, default=1,
                        help="worker threads per PS process (default 1)")
    parser.add_argument("--dim", type=positive_int, default=64, help="embedding width (default 64)")
    parser.add_argument("--rows", type=positive_int, default=200_000,
                        help="keys in the table (default 200000)")
    parser.add_argument("--batch", type=positive_int, default=16_384,
                        help="distinct keys per lookup (default 16384)")
    parser.add_argument("--codec", choices=["none", "fp16"], default="none",
                        help="value codec on the wire (default none)")
    parser.add_argument("--keys-per-request", type=positive_int, default=16_384,
                        help="largest request the client sends to one server (default 16384)")
    parser.add_argument("--job-key", action="store_true",
                        help="also time servers that have a job key (CURVE), interleaved with the keyless ones")
    parser.add_argument("--seed", type=int, default=0)
    add_timing_arguments(parser, warmup=3, batches=10, repeats=5)
    return parser


def make_batches(rows: int, batch: int, count: int, seed: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """The table's keys and `count` batches of row indices (distinct within a batch)."""
    if batch > rows:
        raise ValueError(f"--batch {batch} must not exceed --rows {rows}")
    rng = np.random.default_rng(seed)
    keys = np.arange(1, rows + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)  # odd: distinct
    return keys, [rng.choice(rows, size=batch, replace=False) for _ in range(count)]


def check_rows(served: np.ndarray, expected: np.ndarray, codec: str) -> None:
    """The PS must hand back the in-process rows (within fp16 rounding with that codec)."""
    bound = 0.0 if codec == "none" else np.abs(expected).max(axis=1, keepdims=True) * 2.0**-10
    if served.shape != expected.shape or np.any(np.abs(served - expected) > bound):
        raise RuntimeError("the PS returned rows that differ from the in-process store's")


def _servers(args: argparse.Namespace, capacity: int, key: JobKey | None) -> list:
    """`--servers` PS processes (process, address), with `key` or none."""
    env = {name: value for name, value in os.environ.items() if name not in (AUTH_KEY_ENV, AUTH_KEY_FILE_ENV)}
    env["NUMBA_NUM_THREADS"] = "1"
    if key is not None:
        env[AUTH_KEY_ENV] = key.secret
    return [launch(["--port", "0", "--threads", str(args.server_threads), "--table", f"{TABLE}:{args.dim}:{capacity}"],
                   env=env) for _ in range(args.servers)]


def run(args: argparse.Namespace, plan: TimingPlan) -> dict:
    keys, batches = make_batches(args.rows, args.batch, plan.total_batches, args.seed)
    capacity = -(-2 * args.rows // args.servers)  # room for the route's imbalance
    keys_of = {"ps": None, **({"keyed": JobKey.new()} if args.job_key else {})}
    processes = []
    try:
        clients = {}
        with contextlib.ExitStack() as stack:
            for name, key in keys_of.items():
                started = _servers(args, capacity, key)
                processes += started
                clients[name] = stack.enter_context(PSClient(
                    [address for _, address in started], timeout=60, value_codec=args.codec,
                    max_keys_per_request=args.keys_per_request, key=key))
                for start in range(0, args.rows, PRELOAD_CHUNK):
                    clients[name].lookup(TABLE, keys[start:start + PRELOAD_CHUNK])
            store = EmbeddingStore(dim=args.dim, capacity=2 * args.rows)
            table = store.pull(keys)  # the same initial rows, as one plain array
            batch_keys = [keys[batch] for batch in batches]
            runners = {
                "gather": lambda i: table[batches[i]],
                "store": lambda i: store.pull(batch_keys[i], insert=False),
                **{name: (lambda i, c=client: c.lookup(TABLE, batch_keys[i], insert=False))
                   for name, client in clients.items()},
            }
            for name in clients:
                check_rows(runners[name](0), table[batches[0]], args.codec)
            for runner in runners.values():
                warm_up(runner, plan)
            rates = measure_interleaved(runners, plan, items_per_batch=args.batch)
    finally:
        for process, _ in processes:
            process.kill()
            process.wait(10)
    gb = args.dim * 4 / 1e9  # payload GB per key
    keyed = {"keyed_gb_per_s": rates["keyed"].median * gb,
             "keyed_over_ps": paired_ratio(rates["keyed"], rates["ps"])} if args.job_key else {}
    return {
        "gather_gb_per_s": rates["gather"].median * gb,
        "store_gb_per_s": rates["store"].median * gb,
        "ps_gb_per_s": rates["ps"].median * gb,
        "ps_gb_per_s_per_server": rates["ps"].median * gb / args.servers,
        "ps_over_gather": paired_ratio(rates["ps"], rates["gather"]),
        "ps_over_store": paired_ratio(rates["ps"], rates["store"]),
        "ps_gb_per_s_runs": [rate * gb for rate in rates["ps"].rates],
        **keyed,
        "settings": {name: getattr(args, name) for name in
                     ("servers", "server_threads", "dim", "rows", "batch", "codec",
                      "keys_per_request", "job_key", "seed", "warmup", "batches", "repeats")},
    }


def headline(report: dict) -> dict:
    """The figures of the results table: the PS's payload rate over the gather's and the store's."""
    return pick(report, {"PS / gather": "ps_over_gather", "PS / in-process store": "ps_over_store"})


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    single_thread()
    summary = run(args, timing_plan_from_args(args))
    if args.json:
        print(json.dumps(summary, sort_keys=True))
    else:
        print(f"PS lookup over loopback, {args.servers} server(s), dim {args.dim}, "
              f"{args.batch} keys per lookup, codec {args.codec}")
        for name in ("gather", "store", "ps"):
            print(f"  {name:<8} {summary[f'{name}_gb_per_s']:8.3f} GB/s (median)")
        print(f"  ps per server process   {summary['ps_gb_per_s_per_server']:.3f} GB/s")
        print(f"  ps / gather (ceiling)   {summary['ps_over_gather']:.3f}")
        print(f"  ps / in-process store   {summary['ps_over_store']:.3f}")
        if args.job_key:
            print(f"  keyed (CURVE) / ps      {summary['keyed_over_ps']:.3f} ({summary['keyed_gb_per_s']:.3f} GB/s)")
        print(f"  ps runs GB/s: {', '.join(f'{r:.3f}' for r in summary['ps_gb_per_s_runs'])}"
              f" (spread {statistics.pstdev(summary['ps_gb_per_s_runs']):.3f})")
    return summary
