"""hybridrec.parallel: distributed strategies built on the embedding engine and the PS.

`tables` derives a job's embedding tables from its config (what every role agrees on);
`nn_worker` is the torchrun entry of Persia-style training; `launch` starts every role of a
job on one machine.
"""
