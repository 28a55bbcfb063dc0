"""Runs the PS lookup throughput benchmark (loopback PS vs in-process gather and store).
Example: python bench/ps_throughput.py --servers 1 --json"""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from a checkout

from hybridrec.benchmarks.ps_throughput import main  # noqa: E402

if __name__ == "__main__":
    main()
