"""What a run shows while it trains: a progress bar on a terminal, a progress line every few
seconds otherwise (a log file, a pipe, a distributed job's leader, whose launcher shows the lines
as a bar of its own when it writes to a terminal: hybridrec.parallel.progress_relay).

Both start their clock after the first step: the first step of a fresh process compiles the
numba kernels (seconds), and a rate measured over it would promise an ETA of hours. The lines'
rate and ETA are those of the steps since the line before (tqdm's bar smooths likewise), so the
kernels a later step still compiles weigh in one line only. A progress
line is `progress: step 120/1000 (12%), 245,760 samples, 8,123 samples/s, eta 1m48s, loss 0.4567,
auc 0.7123` (`?` for a total the data does not tell; `parse_progress_line` reads one back).
"""
from __future__ import annotations

import re
import sys
import time
from typing import TextIO

PROGRESS_PREFIX = "progress: "
_LINE = re.compile(r"progress: step (?P<step>\d+)/(?P<total>\d+|\?)(?: \(\d+%\))?(?P<rest>.*)")


def duration(seconds: float) -> str:
    """'1h02m', '3m05s' or '42s'."""
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


def progress_line(step: int, total: int | None, samples: int, rate: float | None, eta: float | None,
                  figures: dict) -> str:
    """One progress line (see the module doc); `figures`: the running loss, AUC and the like."""
    parts = [f"{PROGRESS_PREFIX}step {step}/{'?' if total is None else total}"
             + (f" ({100 * step // total}%)" if total else ""), f"{samples:,} samples"]
    if rate is not None:
        parts.append(f"{rate:,.0f} samples/s")
    if eta is not None:
        parts.append(f"eta {duration(eta)}")
    parts += [f"{key} {value}" for key, value in figures.items()]
    return ", ".join(parts)


def parse_progress_line(line: str) -> dict | None:
    """(step, total or None, the rest of the line) of a progress line, None for any other line."""
    match = _LINE.fullmatch(line.strip())
    if match is None:
        return None
    total = None if match["total"] == "?" else int(match["total"])
    return {"step": int(match["step"]), "total": total, "rest": match["rest"].lstrip(", ")}


class ProgressLines:
    """A progress line to `stream` at most every `every_s` seconds, and one after the last step."""

    def __init__(self, total: int | None, initial: int = 0, every_s: float = 10.0, stream: TextIO | None = None):
        self.total, self.step, self.every_s = total, initial, every_s
        self.stream = stream if stream is not None else sys.stderr
        self.samples = 0
        self.figures: dict = {}
        self._clock: tuple[float, int, int] | None = None  # (time, step, samples) at the line before
        self._printed = 0.0
        self._last_printed_step = initial

    def update(self, step: int, samples: int) -> None:
        self.step, self.samples = step, samples
        now = time.perf_counter()
        if self._clock is None:  # the first step: a line without a rate, and the clock starts
            self._clock, self._printed = (now, step, samples), now
            self._print()
        elif now - self._printed >= self.every_s or step == self.total:
            self._printed = now
            self._print()

    def set_figures(self, **figures) -> None:
        self.figures.update(figures)

    def write(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def _rate_and_eta(self, now: float) -> tuple[float | None, float | None]:
        then, step, samples = self._clock
        elapsed, steps = now - then, self.step - step
        if elapsed <= 0 or steps <= 0:
            return None, None
        eta = (self.total - self.step) * elapsed / steps if self.total is not None else None
        return (self.samples - samples) / elapsed, eta

    def _print(self) -> None:
        now = time.perf_counter()
        rate, eta = self._rate_and_eta(now)
        self._clock = (now, self.step, self.samples)
        self._last_printed_step = self.step
        self.write(progress_line(self.step, self.total, self.samples, rate, eta, self.figures))

    def close(self) -> None:
        if self._clock is not None and self._last_printed_step != self.step:
            self._print()


class ProgressBar:
    """A tqdm bar whose rate and ETA count from the end of the first step."""

    def __init__(self, total: int | None, initial: int = 0, stream: TextIO | None = None):
        from tqdm import tqdm

        self._bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, leave=True, file=stream)
        self._first = True

    def update(self, step: int, samples: int) -> None:
        bar = self._bar
        if self._first:  # the clock starts now: the first step held the kernels' compilation
            self._first = False
            bar.reset(total=bar.total)
            bar.n = bar.last_print_n = bar.initial = step
            bar.refresh()
            return
        bar.update(step - bar.n)

    def set_figures(self, **figures) -> None:
        self._bar.set_postfix(figures)

    def write(self, text: str) -> None:
        self._bar.write(text)

    def close(self) -> None:
        self._bar.close()


def progress_display(total: int | None, initial: int, every_s: float, launched: bool = False):
    """A bar when the stream is a terminal, else progress lines; the stream is stderr, or stdout
    for a trainer of a process group (`launched`), whose launcher reads it."""
    stream = sys.stdout if launched else sys.stderr
    if stream.isatty():
        return ProgressBar(total, initial, stream)
    return ProgressLines(total, initial, every_s, stream)
