"""hybridrec.train: the one training loop, its data sources, model assembly, checkpoints,
metrics and reporting."""
