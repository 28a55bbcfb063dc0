"""DES (Distributed Equivalent Substitution, Rong et al., 2020): the weight-rich first layers of a
model split by field among the trainers, computed as partial results summed by one AllReduce.

    substitution.py   the model-side split: each trainer's block and the replicated upper layers
    fields.py         which trainer owns which fields (dealt by table size), a trainer's share and
                      its input and wire counts
    partial_sums.py   the one AllReduce of the partial results per step, and its ring's wire bytes

The `field_sharded` placement and the `des` dense sync (hybridrec.strategy) plug it in.
"""
