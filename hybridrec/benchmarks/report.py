"""`hybridrec bench report`: the results table of docs/benchmarks.md, made from docs/results/.

The table sits between two marker lines of the page (BEGIN, END); this command rewrites what is
between them from the result files (results.py), one row per file: the result (linked to the
page's `## <bench>` section when there is one), its command, its figures and note, and the commit
and date it was measured at. Rows follow the order of the benches' sections on the page, then
the result names. `--check` only compares, for tests and CI.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hybridrec.benchmarks.results import CHECKOUT, RESULTS, load_results
from hybridrec.errors import UserError

BEGIN = "<!-- results table: made by `hybridrec bench report` from docs/results/*.json; edit those files, not this -->"
END = "<!-- end of the results table -->"
HEADER = "| result | command | figures | measured at |\n|---|---|---|---|"


def format_value(value) -> str:
    """A figure as the table shows it: integers and numbers of a thousand or more with thousands
    separators, other floats as written when short (0.72864, 2.0), else to 4 significant digits
    (a measured 0.91513528 is 0.9151), None as n/a, text as it is."""
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        written = repr(value)
        return written if len(written.lstrip("-0.").replace(".", "")) <= 5 else f"{value:.4g}"
    if isinstance(value, str):
        return value
    return json.dumps(value)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _row(result: dict, sections: list[str]) -> str:
    name = result["name"]
    title = f"[{name}](#{result['bench']})" if result["bench"] in sections else name
    figures = "; ".join(f"{label} **{format_value(value)}**" for label, value in result["figures"].items())
    if result.get("note"):
        figures += f". {result['note']}"
    measured = f"{result['commit']}, {result['date']}" + (", carried over" if result.get("carried_over") else "")
    return f"| {title} | `{_cell(result['command'])}` | {_cell(figures)} | {measured} |"


def sections_of(page: str) -> list[str]:
    """The names of the page's `## name` sections in page order (their anchors are the names)."""
    return [line[3:].strip() for line in page.splitlines() if line.startswith("## ")]


def results_table(results: list[dict], sections: list[str] = ()) -> str:
    """The table's rows in the order of their benches' sections (then by name); results whose bench
    has no section come last."""
    order = {name: position for position, name in enumerate(sections)}
    ranked = sorted(results, key=lambda r: (order.get(r["bench"], len(order)), r["name"]))
    return "\n".join([HEADER, *(_row(result, sections) for result in ranked)])


def regenerate(page: str, results: list[dict], doc_name: str = "the page") -> str:
    """`page` with the text between BEGIN and END replaced by the table of `results`."""
    start, end = page.find(BEGIN), page.find(END)
    if start < 0 or end < start:
        raise UserError(f"{doc_name}: no results table markers; it needs a line {BEGIN!r} and, after it, {END!r}")
    table = results_table(results, sections_of(page))
    return page[:start + len(BEGIN)] + "\n" + table + "\n" + page[end:]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hybridrec bench report",
        description="Rewrite the results table of docs/benchmarks.md from the result files in docs/results/ "
                    "(written by `hybridrec bench NAME ... --record`).")
    parser.add_argument("--results", type=Path, default=CHECKOUT / RESULTS, metavar="DIR",
                        help="directory of result files (default: docs/results/ of this checkout)")
    parser.add_argument("--doc", type=Path, default=CHECKOUT / "docs" / "benchmarks.md", metavar="FILE",
                        help="the page holding the table (default: docs/benchmarks.md of this checkout)")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 when the table differs from what the result files give")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.doc.is_file():
        raise UserError(f"--doc {args.doc}: no such file")
    if not args.results.is_dir():
        raise UserError(f"--results {args.results}: no such directory")
    results = load_results(args.results)
    page = args.doc.read_text()
    made = regenerate(page, results, str(args.doc))
    if made == page:
        print(f"{args.doc}: the results table is current ({len(results)} results)")
        return 0
    if args.check:
        print(f"{args.doc}: the results table differs from {args.results}; run `hybridrec bench report`",
              file=sys.stderr)
        return 1
    args.doc.write_text(made)
    print(f"{args.doc}: results table made from {len(results)} result files in {args.results}")
    return 0
