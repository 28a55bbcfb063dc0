"""hybridrec.parallel: the processes of a distributed job.

`roles` declares every server role once (PS server, embedding worker, HT's group PS, the
prediction server: command, entry, count, addresses) and builds a job's roles; `host` holds the
plumbing every launcher shares (ports, job ids, the job key, shared memory, dying with the
launcher). `launch` runs the roles on this machine under `supervisor` (or on emulated hosts,
`emulated_hosts`), `ray_launch` on a Ray cluster (`ray_roles` runs inside its actors;
`ray_emulated` builds a Ray cluster across emulated hosts). `trainer` is the torchrun entry of a
trainer (it joins the process group and runs the one training loop); no trainer starts a server.
"""
