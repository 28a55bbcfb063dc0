"""hybridrec from Python: train a dense model and loss of your own over hybridrec's embedding
tables with any strategy, on pandas DataFrames or the config's files, and score DataFrames.

    from hybridrec.api import Job, ModelInputs, PooledEmbeddings

    class OverArch(torch.nn.Module):                  # as a TorchRec user writes the part above the tables
        def __init__(self, inputs: ModelInputs, hidden: int = 64): ...
        def forward(self, dense, sparse: PooledEmbeddings): ...   # -> logits [B] or [B, tasks]

    job = Job("configs/my_data.yaml", model=OverArch, hparams={"hidden": 32}, loss=my_loss)
    job.fit(train=train_df, test=test_df)             # local by default; any strategy.preset
    job.evaluate(new_df)                              # {"auc": ..., "logloss": ..., ...}
    job.predict(new_df)                               # probabilities, one per row

See docs/python-api.md; `Job` is in job.py, DataFrames in frames.py, how Python objects are named
in a config in naming.py, and the model contract in hybridrec.models.custom.
"""
from hybridrec.api.job import Job, train
from hybridrec.models.custom import ModelInputs, PooledEmbeddings

__all__ = ["Job", "ModelInputs", "PooledEmbeddings", "train"]
