"""Runs the embedding throughput benchmark (hybridrec vs torch.nn.EmbeddingBag vs TorchRec);
same as `hybridrec bench embedding`. Example: python bench/embedding.py --json"""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from a checkout

from hybridrec.benchmarks.embedding import main  # noqa: E402

if __name__ == "__main__":
    main()
