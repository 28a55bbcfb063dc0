"""How `hybridrec launch` shows a distributed job's progress: the leader trainer writes progress
lines (hybridrec.train.progress) to its stdout, which the supervisor reads like every role's
output. On a terminal the relay draws them as one progress bar (the trainer's samples/s, ETA, loss
and AUC beside it) with every other line printed above the bar; anywhere else (a log file, a pipe)
the lines pass through as they are, `[nn] progress: step ...`, like any other line."""
from __future__ import annotations

from typing import TextIO

from hybridrec.train.progress import parse_progress_line


def is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a stream without isatty, or closed
        return False


class ProgressRelay:
    """Writes the supervisor's lines (`relay(name, line)`) to `out`, progress lines as a bar when
    `out` is a terminal; `close()` ends the bar."""

    def __init__(self, out: TextIO):
        self.out = out
        self.terminal = is_terminal(out)
        self._bar = None

    def __call__(self, name: str, line: str) -> None:
        progress = parse_progress_line(line) if self.terminal else None
        if progress is None:
            text = f"[{name}] {line}"
            if self._bar is not None:
                self._bar.write(text, file=self.out)
            else:
                self.out.write(text + "\n")
                self.out.flush()
            return
        if self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(total=progress["total"], initial=progress["step"], unit="step", file=self.out,
                             dynamic_ncols=True, desc=f"[{name}]")
        elif progress["total"] != self._bar.total:
            self._bar.total = progress["total"]
        self._bar.set_postfix_str(progress["rest"], refresh=False)
        self._bar.update(progress["step"] - self._bar.n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
