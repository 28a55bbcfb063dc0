"""hybridrec.train: the one training loop of every strategy, its checkpoints, metrics and
reporting."""
