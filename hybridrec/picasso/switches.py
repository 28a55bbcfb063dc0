"""Whether PICASSO's D-interleaving can pay where a trainer runs (`strategy.picasso.interleaving:
auto`), and why: the AllToAll of one micro-batch overlaps the dense compute of the one before only
when the communication thread has a core of its own beside the torch threads; with fewer than 2
cores per trainer on its machine, the overlap becomes time-slicing and the micro-batches only add
lookup operations (PICASSO §IV-C runs it on GPU servers with dozens of cores per GPU).
"""
from __future__ import annotations

import os

CORES_PER_TRAINER = 2  # the dense compute's and the communication thread's


def machine_cores() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def interleaving(setting, micro_batches: int, world_size: int, cores: int | None = None,
                 local_trainers: int | None = None) -> tuple[bool, str]:
    """(on, the reason) for D-interleaving under `setting` (True, False or "auto")."""
    if setting is not True and setting is not False and setting != "auto":
        raise ValueError(f"strategy.picasso.interleaving must be true, false or auto, got {setting!r}")
    if micro_batches <= 1:
        return False, "micro_batches is 1: one part per batch, nothing to overlap"
    if setting != "auto":
        return bool(setting), f"strategy.picasso.interleaving is {str(setting).lower()}"
    if world_size <= 1:
        return False, "auto: one trainer, no AllToAll to overlap"
    cores = machine_cores() if cores is None else cores
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if local_trainers is None else local_trainers
    if cores < CORES_PER_TRAINER * local:
        return False, (f"auto: {cores} cores for {local} trainers on this machine; an AllToAll thread would share "
                       f"a core with the dense compute it is to overlap, and {micro_batches} micro-batches "
                       f"add lookup operations (set strategy.picasso.interleaving: true to force it)")
    return True, f"auto: {cores} cores for {local} trainers on this machine"
