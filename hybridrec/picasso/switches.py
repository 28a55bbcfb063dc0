"""Whether PICASSO's D-interleaving can pay where a trainer runs (`strategy.picasso.interleaving:
auto`), and why: the AllToAll of one micro-batch overlaps the dense compute of the one before only
when the communication thread has a core of its own beside the torch threads; with fewer than 2
cores per trainer on its machine, the overlap becomes time-slicing and the micro-batches only add
lookup operations (PICASSO §IV-C runs it on GPU servers with dozens of cores per GPU).

The trainers that share a machine's cores are counted machine-wide: the launcher puts the job's
trainers on this machine in HYBRIDREC_MACHINE_TRAINERS (`hybridrec launch`: all of them, emulated
hosts included, since network namespaces share the cores; `--ray`: the trainer actors on the same
machine). LOCAL_WORLD_SIZE, torchrun's count, is the fallback: it counts the trainers of one
torchrun, which is one emulated host's.
"""
from __future__ import annotations

import os

CORES_PER_TRAINER = 2  # the dense compute's and the communication thread's
MACHINE_TRAINERS_ENV = "HYBRIDREC_MACHINE_TRAINERS"


def machine_cores() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def machine_trainers() -> tuple[int, str]:
    """(the job's trainers sharing this machine's cores, where that count comes from)."""
    for name, source in ((MACHINE_TRAINERS_ENV, "the launcher's count of the job's trainers on this machine"),
                         ("LOCAL_WORLD_SIZE", "torchrun's local world size")):
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 0:
            return int(value), f"{source}, {name}"
    return 1, "no launcher's count: this trainer alone"


def interleaving(setting, micro_batches: int, world_size: int, cores: int | None = None,
                 local_trainers: int | None = None) -> tuple[bool, str]:
    """(on, the reason) for D-interleaving under `setting` (True, False or "auto");
    `local_trainers`: the trainers sharing the `cores` (default: `machine_trainers()`)."""
    if setting is not True and setting is not False and setting != "auto":
        raise ValueError(f"strategy.picasso.interleaving must be true, false or auto, got {setting!r}")
    if micro_batches <= 1:
        return False, "micro_batches is 1: one part per batch, nothing to overlap"
    if setting != "auto":
        return bool(setting), f"strategy.picasso.interleaving is {str(setting).lower()}"
    if world_size <= 1:
        return False, "auto: one trainer, no AllToAll to overlap"
    cores = machine_cores() if cores is None else cores
    local, source = machine_trainers() if local_trainers is None else (local_trainers, "given")
    counted = f"{cores} cores for {local} trainers on this machine ({source})"
    if cores < CORES_PER_TRAINER * local:
        return False, (f"auto: {counted}; an AllToAll thread would share a core with the dense compute it is "
                       f"to overlap, and {micro_batches} micro-batches add lookup operations (set "
                       f"strategy.picasso.interleaving: true to force it)")
    return True, f"auto: {counted}"
