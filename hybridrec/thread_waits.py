"""How torch's OpenMP threads wait between parallel regions: passively (they sleep at once)
unless the user set OMP_WAIT_POLICY.

OpenMP's default lets an idle thread spin for a while before it sleeps, and a thread at a
region's barrier spins until its peers arrive. A training step runs hundreds of small parallel
regions, so on a machine whose cores other work shares (a peer thread descheduled) the spinning
takes the cores from the step itself and from every other process: the step's CPU and wall time
grow tens of times over (docs/benchmarks.md, speedups). On cores nothing else wants, spinning
answers the next region sooner and a small step runs faster: set OMP_WAIT_POLICY=ACTIVE there.
OpenMP reads the policy when torch loads it, so `configure` runs before anything in the package imports torch; a program that imported
torch before hybridrec keeps the policy it started with.
"""
from __future__ import annotations

import os

POLICY = "OMP_WAIT_POLICY"


def configure() -> str:
    """Set OMP_WAIT_POLICY to PASSIVE unless it is set; the policy in force for this process and
    the processes it starts."""
    return os.environ.setdefault(POLICY, "PASSIVE")
