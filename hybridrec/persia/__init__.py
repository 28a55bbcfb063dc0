"""Persia (Lian et al., KDD 2022): embeddings on parameter servers reached through embedding
workers, trained asynchronously within a staleness bound while the dense part trains
synchronously (hybrid training).

    pipeline.py                 the bounded-staleness embedding pipeline (tau batches in flight)
    embedding_worker.py         the embedding worker process: IDs in, pooled rows out, gradients back
    embedding_worker_client.py  the trainer's side of it

The PS servers themselves are hybridrec.ps; the `persia` preset puts these together
(placement ps, consistency bounded, dense allreduce).
"""
