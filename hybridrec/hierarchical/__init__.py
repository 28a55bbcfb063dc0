"""Hierarchical Training (Huang et al., 2021): trainers in groups, each group training one dense copy
without locks (Hogwild), groups kept near a centre copy by elastic averaging; operators placed on
trainers and group parameter servers by a cost model.

    shared_copy.py          a group's Hogwild copy of the dense parameters in shared memory
    elastic_averaging.py    the background elastic averaging with the centre on the PS servers
    operator_placement.py   the cost model and placement of `hybridrec plan`
    fc_split.py             vertical and horizontal splits of fully connected layers
    net_transformation.py   a model cut into units that run on group PSs
    group_ps.py             the group PS process that runs the placed units
    group_servers.py        a trainer's links to its group's PSs
    remote_wire.py          the compressed wire between trainers and group PSs

The `groups` and `easgd` dense syncs (hybridrec.strategy.dense) plug it into the training loop.
"""
