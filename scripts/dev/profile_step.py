"""Where hybridrec's embedding step spends its time, function by function, numba kernels included.

A developer tool, not a `hybridrec bench` mode: it profiles hybridrec alone (no peer, no ratio)
and needs `perf`. `perf` samples numba's JIT code but cannot name it: the code lives in anonymous
memory. This script builds the `hybridrec bench embedding` workload and step for hybridrec alone
(`embedding_step_runner`), warms it up, writes /tmp/perf-<pid>.map (the symbol map `perf report`
reads for JIT code: the address, size and name of every function numba has compiled in this
process), then runs `perf record` on itself while it trains for --seconds and prints the top of
`perf report`. Sampling uses the cpu-clock event, so it works in VMs without hardware counters;
the percentages are shares of this process's samples.

Example: python scripts/dev/profile_step.py --seconds 4 --top 20
"""
import argparse
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # run from a checkout

from hybridrec.benchmarks.timing import number_above, positive_int  # noqa: E402


def readable(symbol: str) -> str:
    """numba's mangled `_ZN9hybridrec9embedding7kernels6dedupeB...` as `hybridrec.embedding.kernels.dedupe`."""
    match = re.search(r"_ZN((?:\d+[A-Za-z_][A-Za-z0-9_]*)+)", symbol)
    if not match:
        return symbol[:80]
    parts, rest = [], match.group(1)
    while rest and rest[0].isdigit():
        length = int(re.match(r"\d+", rest).group())
        digits = len(str(length))
        parts.append(rest[digits:digits + length])
        rest = rest[digits + length:]
    name = ".".join(parts).replace("_3c", "<").replace("_3e", ">")
    return f"{name} [parfor body]" if "numba_parfor_gufunc" in name else name


def write_perf_map() -> int:
    """Writes /tmp/perf-<pid>.map for every function numba has compiled or loaded from its cache."""
    from numba.core.registry import cpu_target

    engine = cpu_target.target_context.codegen()._engine
    addresses = {}
    for symbol in list(engine._defined_symbols):
        address = engine.get_function_address(symbol)
        if address:
            addresses[address] = symbol
    ordered = sorted(addresses)
    with open(f"/tmp/perf-{os.getpid()}.map", "w") as out:
        for i, address in enumerate(ordered):
            gap = ordered[i + 1] - address if i + 1 < len(ordered) else 4096
            out.write(f"{address:x} {min(gap, 1 << 20):x} {readable(addresses[address])}\n")
    return len(ordered)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=number_above(0, "a number of seconds"), default=4.0, help="how long to sample (default 4)")
    parser.add_argument("--top", type=positive_int, default=20, help="lines of the report to print (default 20)")
    parser.add_argument("--batch-size", type=positive_int, default=4096, help="samples per batch (default 4096)")
    args = parser.parse_args(argv)
    if shutil.which("perf") is None:
        parser.error("perf is not installed (on Debian: apt-get install linux-perf)")
    from hybridrec.benchmarks.embedding import embedding_step_runner
    from hybridrec.benchmarks.peers import HybridrecSystem
    from hybridrec.benchmarks.timing import single_thread
    from hybridrec.benchmarks.workload import WorkloadShape, make_sparse_batches

    single_thread()
    shape = WorkloadShape(batch_size=args.batch_size, fields=26, dim=16, capacity=1_000_000)
    batches = make_sparse_batches(shape, 400)
    run = embedding_step_runner(HybridrecSystem(shape), batches, shape)

    def step(i):
        run(i % len(batches))

    for i in range(10):
        step(i)
    print(f"mapped {write_perf_map()} numba functions", file=sys.stderr)
    workdir = tempfile.mkdtemp()
    data = os.path.join(workdir, "perf.data")
    try:
        recorder = subprocess.Popen(["perf", "record", "-F", "5000", "-o", data, "-p", str(os.getpid())],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.5)  # perf attaches
        end, i = time.perf_counter() + args.seconds, 10
        while time.perf_counter() < end:
            step(i)
            i += 1
        recorder.send_signal(signal.SIGINT)
        recorder.wait(timeout=60)
        report = subprocess.run(["perf", "report", "-i", data, "--no-children", "--sort", "sym", "--stdio"],
                                capture_output=True, text=True, timeout=300).stdout
    finally:
        os.unlink(f"/tmp/perf-{os.getpid()}.map")
        shutil.rmtree(workdir, ignore_errors=True)
    lines = [line for line in report.splitlines() if line.strip() and not line.startswith("#")]
    print(f"{i - 10} steps sampled")
    print("\n".join(lines[:args.top]))

if __name__ == "__main__":
    main()
