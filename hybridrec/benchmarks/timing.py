"""Timing and reporting shared by the benchmarks: one thread, warm-up, interleaved timed
repetitions, medians, paired ratios, and the one-line JSON / small table report.

A shared, noisy machine makes a lone wall-clock figure meaningless, so every benchmark runs
each system several times on the same inputs, interleaving the systems within every
repetition, and reports the median rate per system plus the median of per-repetition ratios.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Sequence


def _int_at_least(minimum: int) -> Callable[[str], int]:
    """argparse type: an integer >= minimum, with an error naming the value and the rule."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            shown = repr(text) if value is None else value
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {shown}")
        return value

    return parse


positive_int = _int_at_least(1)
non_negative_int = _int_at_least(0)


def number_above(bound: float, what: str = "a number") -> Callable[[str], float]:
    """argparse type: a float > bound, with an error naming the value and the rule."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = None
        if value is None or not value > bound:
            shown = repr(text) if value is None else value
            raise argparse.ArgumentTypeError(f"must be {what} > {bound:g}, got {shown}")
        return value

    return parse


@dataclass(frozen=True)
class TimingPlan:
    """How a system is measured: `warmup` untimed batches, then `repeats` timed
    repetitions of `batches` batches each (every repetition on fresh batches)."""

    warmup: int
    batches: int
    repeats: int

    def __post_init__(self) -> None:
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if self.batches < 1:
            raise ValueError(f"batches must be >= 1, got {self.batches}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")

    @property
    def total_batches(self) -> int:
        """Batches a workload must provide: warm-up ones plus one fresh set per repetition."""
        return self.warmup + self.batches * self.repeats


def add_timing_arguments(parser: argparse.ArgumentParser, *, warmup: int, batches: int,
                         repeats: int) -> None:
    """Adds --warmup, --batches and --repeats with the given defaults, and --json."""
    parser.add_argument("--warmup", type=non_negative_int, default=warmup,
                        help=f"untimed warm-up batches per system (default {warmup})")
    parser.add_argument("--batches", type=positive_int, default=batches,
                        help=f"batches per timed repetition (default {batches})")
    parser.add_argument("--repeats", type=positive_int, default=repeats,
                        help=f"timed repetitions per system; the median is reported "
                             f"(default {repeats})")
    parser.add_argument("--json", action="store_true", help="print one JSON line only")


def timing_plan_from_args(args: argparse.Namespace) -> TimingPlan:
    return TimingPlan(warmup=args.warmup, batches=args.batches, repeats=args.repeats)


def single_thread() -> None:
    """Pins torch and numba to one thread so every system gets the same single core."""
    import torch

    torch.set_num_threads(1)
    try:
        import numba

        numba.set_num_threads(1)
    except (ImportError, ValueError):
        pass  # numba absent, or its thread pool was fixed smaller already: still one thread


@dataclass(frozen=True)
class Throughput:
    """Items per second of each timed repetition, and their median."""

    rates: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.rates)


def warm_up(run_batch: Callable[[int], None], plan: TimingPlan) -> None:
    """Runs the untimed warm-up batches 0..warmup-1."""
    for index in range(plan.warmup):
        run_batch(index)


def measure_interleaved(runners: dict[str, Callable[[int], None]], plan: TimingPlan,
                        items_per_batch: int) -> dict[str, Throughput]:
    """Times every runner's repetitions interleaved: repetition r runs each system in turn
    (the order rotates every repetition) on batch indices warmup + r*batches ...
    warmup + (r+1)*batches - 1, so each repetition sees fresh data and a burst of load from
    other processes on a shared machine hits all systems of that repetition alike.
    Call `warm_up` on each runner first.
    """
    names = list(runners)
    rates: dict[str, list[float]] = {name: [] for name in names}
    for repetition in range(plan.repeats):
        first = plan.warmup + repetition * plan.batches
        shift = repetition % len(names) if names else 0
        for name in names[shift:] + names[:shift]:
            run_batch = runners[name]
            start = time.perf_counter()
            for index in range(first, first + plan.batches):
                run_batch(index)
            elapsed = time.perf_counter() - start
            rates[name].append(plan.batches * items_per_batch / elapsed)
    return {name: Throughput(tuple(rates[name])) for name in names}


@dataclass(frozen=True)
class SystemResult:
    """What one system achieved, or why it could not be measured."""

    name: str
    throughput: Throughput | None = None
    bytes_per_row: float | None = None
    error: str | None = None


def paired_ratio(numerator: Throughput | None, denominator: Throughput | None) -> float | None:
    """Median over repetitions of numerator_rate[r] / denominator_rate[r] (both measured in
    the same interleaved repetition), or None when either side was not measured."""
    if numerator is None or denominator is None:
        return None
    return statistics.median(a / b for a, b in zip(numerator.rates, denominator.rates))


def summarize(results: Sequence[SystemResult], unit: str, all_names: Sequence[str],
              settings: dict) -> dict:
    """One flat dict for the JSON line: `<system>_<unit>` medians (None when a system was
    not selected or not available), the per-repetition rates, `<a>_over_<b>` paired ratios
    (`paired_ratio`) for every pair in `all_names` order, the
    hybridrec store's bytes per row, errors by system, and the settings of the run."""
    throughputs = {name: None for name in all_names}
    throughputs.update({result.name: result.throughput for result in results})
    summary: dict = {f"{name}_{unit}": throughput.median if throughput else None
                     for name, throughput in throughputs.items()}
    summary.update({f"{name}_{unit}_runs": list(throughput.rates)
                    for name, throughput in throughputs.items() if throughput})
    summary.update({f"{first}_over_{second}": paired_ratio(throughputs[first],
                                                           throughputs[second])
                    for position, first in enumerate(all_names)
                    for second in all_names[position + 1:]})
    by_name = {result.name: result for result in results}
    hybridrec = by_name.get("hybridrec")
    summary["bytes_per_row"] = hybridrec.bytes_per_row if hybridrec else None
    summary["errors"] = {result.name: result.error for result in results if result.error}
    summary["settings"] = settings
    return summary


def print_summary(summary: dict, unit: str, all_names: Sequence[str], *, as_json: bool,
                  title: str) -> None:
    """Exactly one JSON line when `as_json`, otherwise a small human-readable table."""
    if as_json:
        print(json.dumps(summary, sort_keys=True))
        return
    print(title)
    for name in all_names:
        value = summary[f"{name}_{unit}"]
        shown = f"{value:,.0f}" if value is not None else "n/a"
        print(f"  {name:<10} {shown:>16} {unit.replace('_per_s', '/s')} (median)")
    for key, value in summary.items():
        if "_over_" in key:
            print(f"  {key:<26} {value:.3f}" if value is not None else f"  {key:<26} n/a")
    print(f"  hybridrec bytes per row    {summary['bytes_per_row']}")
    for name, error in summary["errors"].items():
        print(f"  {name} unavailable: {error}")
