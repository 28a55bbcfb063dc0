"""Runs the DLRM end-to-end training benchmark (hybridrec vs torch.nn.EmbeddingBag vs TorchRec);
same as `hybridrec bench e2e`. Example: python bench/e2e.py --json"""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from a checkout

from hybridrec.benchmarks.e2e import main  # noqa: E402

if __name__ == "__main__":
    main()
