"""hybridrec.parallel: the processes of a distributed job on one machine.

`trainer` is the torchrun entry of a trainer (it joins the process group and runs the one
training loop); `launch` starts every role of a job (PS servers, embedding workers, trainers)
under `supervisor`, which restarts the services that die and stops everything at the end.
"""
