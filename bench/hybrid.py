"""Runs the distributed sync vs hybrid vs async benchmark (real PS / embedding / NN worker jobs);
same as `hybridrec bench hybrid`. Example: python bench/hybrid.py --runs 3 --json"""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from a checkout

from hybridrec.benchmarks.hybrid import main  # noqa: E402

if __name__ == "__main__":
    main()
