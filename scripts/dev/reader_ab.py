"""The Criteo reader of two checkouts on the same file, in CPU seconds: one worker process per
checkout (PYTHONPATH=<checkout>, one thread each) makes full passes of `CriteoReader` over the
file on request, the two taking turns, and the script reports each one's median rows per CPU
second and the median of the paired ratios B/A. CPU time of the worker, not wall time: on a
shared, loaded machine a wall clock measures the neighbours too. `hybridrec bench reader`
stays the measurement against pandas; this compares two versions of the reader.

    python scripts/dev/reader_ab.py CHECKOUT_A CHECKOUT_B FILE [--rounds 20]
"""
import argparse
import os
import statistics
import subprocess
import sys

WORKER = r"""
import sys, time
from hybridrec.benchmarks.timing import single_thread
from hybridrec.data.criteo import CriteoReader
single_thread()
reader = CriteoReader(sys.argv[1], 4096)
sum(len(b) for b in reader)  # compiles (or loads) the kernels
print("ready", flush=True)
for _ in sys.stdin:
    start = time.process_time()
    rows = sum(len(b) for b in reader)
    print(rows, time.process_time() - start, flush=True)
"""


def worker(checkout: str, path: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": checkout, "OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1"}
    process = subprocess.Popen([sys.executable, "-c", WORKER, path], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True, env=env, cwd=checkout)
    if process.stdout.readline().strip() != "ready":
        raise SystemExit(f"the worker of {checkout} did not start")
    return process


def one_pass(process: subprocess.Popen) -> float:
    """Rows per CPU second of one full pass."""
    process.stdin.write("go\n")
    process.stdin.flush()
    rows, seconds = process.stdout.readline().split()
    return int(rows) / float(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("a", help="checkout A (the baseline)")
    parser.add_argument("b", help="checkout B")
    parser.add_argument("path", help="a Criteo-layout TSV file")
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    workers = [worker(args.a, args.path), worker(args.b, args.path)]
    rates: list[list[float]] = [[], []]
    try:
        for round_ in range(args.rounds):
            order = (0, 1) if round_ % 2 == 0 else (1, 0)  # neither side always goes first
            for side in order:
                rates[side].append(one_pass(workers[side]))
    finally:
        for process in workers:
            process.stdin.close()
            process.wait(timeout=60)
    ratios = [b / a for a, b in zip(*rates)]
    print(f"{os.path.basename(args.path)}: A {statistics.median(rates[0]):,.0f} rows per CPU s, "
          f"B {statistics.median(rates[1]):,.0f}; B/A median {statistics.median(ratios):.3f} "
          f"(quartiles {statistics.quantiles(ratios, n=4)[0]:.3f}-{statistics.quantiles(ratios, n=4)[2]:.3f}, "
          f"{args.rounds} rounds)")


if __name__ == "__main__":
    main()
