"""DES (Distributed Equivalent Substitution, Rong et al., 2020): the weight-rich first layers of a
model split by field among the trainers, computed as partial results summed by one AllReduce.

    substitution.py   the model-side split: each trainer's block and the replicated upper layers

The `field_sharded` placement and the `des` dense sync (hybridrec.strategy) plug it in.
"""
