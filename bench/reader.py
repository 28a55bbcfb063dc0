"""Runs the Criteo reader benchmark (hybridrec CriteoReader vs pandas.read_csv);
same as `hybridrec bench reader`. Example: python bench/reader.py --synthetic 200000 --json"""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from a checkout

from hybridrec.benchmarks.reader import main  # noqa: E402

if __name__ == "__main__":
    main()
