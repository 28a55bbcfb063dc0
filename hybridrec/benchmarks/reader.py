"""`hybridrec bench reader`: rows/s of the Criteo reader against pandas.read_csv.

For each TSV file (Criteo layout) it times, in one run and on the same file, full passes of
(a) `CriteoReader` producing Batches (parse, log1p of the dense values, per-field hashing of
the categoricals, feature-major layout), (b) `pandas.read_csv(sep="\\t", header=None)` with
the C engine and (c) with the pyarrow engine when pyarrow is installed. Peers only parse into
a DataFrame: they do less work than the reader. One thread each (pyarrow's pool is set to
one CPU). One untimed warm-up pass per system, then `--repeats` repetitions in which the
systems take turns (`timing.measure_interleaved`); reported are the median rows/s per system
and the median of the per-repetition ratios.

`--synthetic ROWS` first writes a synthetic Criteo-style TSV of that many rows (to
`--synthetic-path`) and adds it to the files. `--quoted` also measures a copy of each file with
every field in double quotes (RFC 4180, as R's write.csv or pandas with QUOTE_ALL write them;
`<name>.quoted<suffix>` next to `--synthetic-path`), which the reader and pandas both unquote. `--json` prints one JSON line:
{"benchmark": "reader", "files": [{"path", "rows", "bytes", "hybridrec_rows_per_s",
"pandas_c_rows_per_s", "pandas_pyarrow_rows_per_s", "hybridrec_over_pandas_c",
"hybridrec_over_pandas_pyarrow"}, ...]}.
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from hybridrec.benchmarks.results import pick
from hybridrec.benchmarks.timing import (TimingPlan, measure_interleaved, paired_ratio,
                                         positive_int, single_thread, warm_up)

CRITEO_SAMPLE = (Path(__file__).resolve().parents[3]
                 / "shared/data/criteo-sample/criteo_first_9999.tsv")


def measure_file(path: Path, batch_size: int, repeats: int) -> dict:
    """The figures of one file (see the module docstring for the keys)."""
    import pandas

    from hybridrec.data.criteo import CriteoReader

    reader = CriteoReader(path, batch_size)
    runners = {
        "hybridrec": lambda _: sum(len(batch) for batch in reader),
        "pandas_c": lambda _: pandas.read_csv(path, sep="\t", header=None, engine="c"),
    }
    try:
        import pyarrow

        pyarrow.set_cpu_count(1)
        runners["pandas_pyarrow"] = lambda _: pandas.read_csv(path, sep="\t", header=None,
                                                              engine="pyarrow")
    except ImportError:
        pass
    plan = TimingPlan(warmup=1, batches=1, repeats=repeats)
    for run in runners.values():
        warm_up(run, plan)
    rows = reader.count_rows()
    rates = measure_interleaved(runners, plan, items_per_batch=rows)
    ours = rates["hybridrec"]
    return {"path": str(path), "rows": rows, "bytes": path.stat().st_size,
            "bad_rows": reader.bad_rows.count,
            "hybridrec_rows_per_s": ours.median,
            "pandas_c_rows_per_s": rates["pandas_c"].median,
            "pandas_pyarrow_rows_per_s": rates["pandas_pyarrow"].median
            if "pandas_pyarrow" in rates else None,
            "hybridrec_over_pandas_c": paired_ratio(ours, rates["pandas_c"]),
            "hybridrec_over_pandas_pyarrow": paired_ratio(ours, rates.get("pandas_pyarrow"))}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybridrec bench reader", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="*", type=Path,
                        help="Criteo-layout TSV files (default: the shared Criteo sample "
                             "when present; --synthetic adds its file to these)")
    parser.add_argument("--batch-size", type=positive_int, default=4096)
    parser.add_argument("--repeats", type=positive_int, default=5,
                        help="timed passes per system; the median is reported (default 5)")
    parser.add_argument("--synthetic", type=positive_int, metavar="ROWS",
                        help="also write and measure a synthetic Criteo-style TSV of ROWS rows")
    parser.add_argument("--synthetic-path", type=Path,
                        default=Path(tempfile.gettempdir()) / "hybridrec_synthetic_criteo.tsv")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic file")
    parser.add_argument("--quoted", action="store_true",
                        help="also measure a copy of each file with every field quoted (RFC 4180)")
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    return parser


def quoted_copy(path: Path, directory: Path) -> Path:
    """A copy of the TSV `path` with every field in double quotes, in `directory`."""
    import csv

    out = directory / f"{path.stem}.quoted{path.suffix}"
    with open(path, newline="") as source, open(out, "w", newline="") as target:
        writer = csv.writer(target, delimiter="\t", quoting=csv.QUOTE_ALL, lineterminator="\n")
        writer.writerows(csv.reader(source, delimiter="\t", quoting=csv.QUOTE_NONE))
    return out


def _format_rate(rate: float | None) -> str:
    return "-" if rate is None else f"{rate:,.0f}"


def headline(report: dict) -> dict:
    """The figures of the results table: per file, the reader's rows/s over each pandas engine's."""
    figures = {}
    for row in report["files"]:
        figures.update(pick(row, {"hybridrec / pandas C": "hybridrec_over_pandas_c",
                                  "hybridrec / pandas pyarrow": "hybridrec_over_pandas_pyarrow"},
                            f"{Path(row['path']).name}: "))
    return figures


def main(argv: list[str] | None = None) -> dict:
    args = _parser().parse_args(argv)
    single_thread()
    paths = list(args.paths)
    if not paths and CRITEO_SAMPLE.exists():
        paths.append(CRITEO_SAMPLE)
    if not paths and args.synthetic is None:
        raise SystemExit(f"no file given, no --synthetic, and the Criteo sample "
                         f"{CRITEO_SAMPLE} is absent")
    for path in paths:
        if not path.is_file():
            raise SystemExit(f"data file {str(path)!r} does not exist")
    if args.synthetic is not None:
        from hybridrec.data.synthetic import write_synthetic

        write_synthetic(args.synthetic_path, args.synthetic, seed=args.seed)
        paths.append(args.synthetic_path)
    if args.quoted:
        paths += [quoted_copy(path, args.synthetic_path.parent) for path in paths]
    results = {"benchmark": "reader", "batch_size": args.batch_size, "repeats": args.repeats,
               "files": [measure_file(path, args.batch_size, args.repeats) for path in paths]}
    if args.json:
        print(json.dumps(results))
        return results
    print(f"{'file':<40} {'rows':>9} {'hybridrec rows/s':>17} {'pandas C':>12} "
          f"{'pandas pyarrow':>15} {'x C':>6} {'x pyarrow':>10}")
    for row in results["files"]:
        print(f"{Path(row['path']).name:<40} {row['rows']:>9,} "
              f"{_format_rate(row['hybridrec_rows_per_s']):>17} "
              f"{_format_rate(row['pandas_c_rows_per_s']):>12} "
              f"{_format_rate(row['pandas_pyarrow_rows_per_s']):>15} "
              f"{row['hybridrec_over_pandas_c']:>6.2f} "
              f"{(row['hybridrec_over_pandas_pyarrow'] or float('nan')):>10.2f}")
    return results


if __name__ == "__main__":
    main()
