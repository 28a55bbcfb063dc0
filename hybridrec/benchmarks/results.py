"""Result files: what a bench measured, recorded with where and when, for the results table.

One file per result, `docs/results/<name>.json` in the checkout whose code was measured:

    {"name": "embedding", "bench": "embedding",
     "command": "hybridrec bench embedding --json", "arguments": ["--json"],
     "figures": {"hybridrec / torch": 5.64, ...},   # what the results table shows, labelled
     "note": "...",                                # optional: what bounds or qualifies the figures
     "commit": "a07ba0c", "date": "2026-11-23",    # `git rev-parse` of the checkout; "unknown" outside git
     "carried_over": false,                        # true: copied from the docs, not recorded by this code
     "host": {"cpus": 2, "load_average": 1.4},
     "report": {...}}                              # the bench's whole JSON report, when it has one

`hybridrec bench NAME ... --record[=LABEL]` writes `<NAME>.json` (`<NAME>-<LABEL>.json`) from
the report the bench returns and its module's `headline(report)`; code that is not a bench
mode calls `record_result` itself. Recording again overwrites: the table shows the current
figure, and git keeps the earlier ones. `hybridrec bench report` (report.py) makes the table.
"""
from __future__ import annotations

import datetime
import json
import math
import os
import re
import shlex
import subprocess
from pathlib import Path
from typing import Sequence

import hybridrec
from hybridrec.errors import UserError

CHECKOUT = Path(hybridrec.__file__).resolve().parents[1]  # the checkout (or site-packages) holding the code
RESULTS = Path("docs") / "results"
NAME = re.compile(r"[a-z0-9][a-z0-9_.-]*")
MEASURED_CODE = ("hybridrec", "configs")  # uncommitted changes here make a result's commit "-dirty"
REQUIRED = ("name", "bench", "command", "figures", "commit", "date")


def default_directory() -> Path:
    """docs/results/ of the checkout holding the code being run; UserError outside a checkout."""
    if not (CHECKOUT / "docs").is_dir():
        raise UserError(f"--record writes docs/results/ of a hybridrec checkout, and the code running is not in "
                        f"one ({CHECKOUT}); run from a clone of the repository")
    return CHECKOUT / RESULTS


def checkout_commit(root: Path = CHECKOUT) -> str:
    """The short commit of the git checkout at `root`, with "-dirty" when its code or configs have
    uncommitted changes; "unknown" when `root` is not the top of a git checkout."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30,
                              check=True).stdout.strip()

    try:
        if Path(git("rev-parse", "--show-toplevel")).resolve() != root.resolve():
            return "unknown"
        commit = git("rev-parse", "--short=7", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no", "--", *MEASURED_CODE)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{commit}-dirty" if dirty else commit


def _plain(value):
    """JSON-safe: NaN and infinities become None (result files are strict JSON)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def record_result(name: str, *, bench: str, command: str, figures: dict, arguments: Sequence[str] = (),
                  report: dict | None = None, note: str | None = None, directory: Path | None = None) -> Path:
    """Writes (or overwrites) `<directory>/<name>.json` (default: docs/results/ of this checkout)
    with the figures, the command that produced them, this checkout's commit and today's date
    (UTC); returns the file's path."""
    if not NAME.fullmatch(name):
        raise UserError(f"result name {name!r}: use lower-case letters, digits, '.', '_' and '-'")
    if not figures:
        raise UserError(f"result {name!r}: no figures to record")
    directory = default_directory() if directory is None else Path(directory)
    result = {"name": name, "bench": bench, "command": command, "arguments": list(arguments),
              "figures": _plain(figures), "commit": checkout_commit(),
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"), "carried_over": False,
              "host": {"cpus": os.cpu_count(), "load_average": round(os.getloadavg()[0], 2)}}
    if note:
        result["note"] = note
    if report is not None:
        result["report"] = _plain(report)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.json"
    path.write_text(json.dumps(result, indent=1, allow_nan=False) + "\n")
    return path


def split_record_flag(argv: Sequence[str]) -> tuple[list[str], str | None]:
    """(the bench's own arguments, the label of `--record[=LABEL]`: "" for a bare --record, None
    when it is absent)."""
    label, rest = None, []
    for argument in argv:
        if argument == "--record":
            label = ""
        elif argument.startswith("--record="):
            label = argument.removeprefix("--record=")
            if not NAME.fullmatch(label):
                raise UserError(f"--record={label}: a label is lower-case letters, digits, '.', '_' and '-'")
        else:
            rest.append(argument)
    return rest, label


def record_bench(bench: str, module, arguments: Sequence[str], report: dict, label: str = "",
                 directory: Path | None = None) -> Path:
    """Records what `hybridrec bench <bench> <arguments>` returned, with the figures its module's
    `headline(report)` picks (every bench mode has one; tests/unit/test_results.py checks)."""
    return record_result(f"{bench}-{label}" if label else bench, bench=bench,
                         command=shlex.join(["hybridrec", "bench", bench, *arguments]), arguments=arguments,
                         figures=module.headline(report), report=report, directory=directory)


def load_results(directory: Path) -> list[dict]:
    """Every result file in `directory`, in name order; UserError naming a file that is not a
    result."""
    results = []
    for path in sorted(Path(directory).glob("*.json"), key=lambda p: p.stem):
        try:
            result = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}:{exc.lineno}: not JSON: {exc.msg}") from None
        missing = [key for key in REQUIRED if key not in (result if isinstance(result, dict) else {})]
        if missing:
            raise UserError(f"{path}: a result file needs {', '.join(REQUIRED)}; missing {', '.join(missing)}")
        if result["name"] != path.stem:
            raise UserError(f"{path}: name {result['name']!r} differs from the file's name {path.stem!r}")
        results.append(result)
    return results


def pick(source: dict | None, labels: dict[str, str], prefix: str = "") -> dict:
    """{prefix + label: source[key]} for the labels whose key `source` holds with a value: what a
    bench's `headline(report)` is usually made of."""
    source = source or {}
    return {prefix + label: source[key] for label, key in labels.items() if source.get(key) is not None}
