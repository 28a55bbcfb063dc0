"""Benchmarks that compare hybridrec with torch.nn.EmbeddingBag and TorchRec in one run."""
