"""DeepFM (Guo et al., 2017): an FM and an MLP sharing the same feature embeddings.

logits = first-order term + FM pairwise term + task head(MLP([deep embeddings, dense]))

It is Wide & Deep with the FM second-order term added to the wide side, so it reuses
`WideAndDeep` and only switches that term on; the hyper-parameters are the same.
"""

from __future__ import annotations

from hybridrec.models.wide_deep import WideAndDeep


class DeepFM(WideAndDeep):
    """Wide & Deep plus the FM pairwise-interaction term on the deep embeddings."""

    adds_pairwise_interaction = True
