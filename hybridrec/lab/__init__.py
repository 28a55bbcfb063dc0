"""The staleness lab: W workers of one job emulated exactly in one process, on the real engine,
under sync, Persia's hybrid, async, HET, SSP and Hierarchical Training (EASGD), with the reads and
updates interleaved by a seeded schedule or by the staleness a real job recorded.

`emulate(cfg, parse("hybrid:tau=4"), workers=16, Schedule(seed))` trains and evaluates one run;
`hybridrec bench staleness` sweeps them. Start with `emulator.py`.
"""
from hybridrec.lab.disciplines import NAMES, Discipline, parse
from hybridrec.lab.emulator import Emulation, emulate
from hybridrec.lab.schedule import Schedule

__all__ = ["NAMES", "Discipline", "Emulation", "Schedule", "emulate", "parse"]
