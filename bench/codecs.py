"""Runs the wire-codec experiment (id_codec none/unique x value_codec none/fp16 under the hybrid
discipline, on real jobs); same as `hybridrec bench hybrid --codecs`.
Example: python bench/codecs.py --runs 2 --json"""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from a checkout

from hybridrec.benchmarks.hybrid import main  # noqa: E402

if __name__ == "__main__":
    main(["--codecs", *sys.argv[1:]])
