"""`hybridrec predict`: a data file in the training data's own format scored in a stream, and the
predictions CSV that it and `hybridrec eval --predictions` write.

The file is read in chunks of whole lines (constant memory whatever its size) and parsed by the
bundle's feature pipeline; the CSV has a header (`score`, or `score_<task>` per task) and one line
per data row of the file, in order. A row the pipeline rejects (a wrong column count, a dense value
that is not a number) gets an empty score and is reported on stderr with its file and line, or
stops the run with `strict`; blank lines are not rows.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from hybridrec.bundle import chain
from hybridrec.bundle.features import FeatureSpec, RowError
from hybridrec.data import kernels
from hybridrec.data.tabular import PARQUET_SUFFIXES, describe_bad_line
from hybridrec.errors import UserError
from hybridrec.serving.predictor import Predictor

REPORTED_BAD_ROWS = 5


class PredictionsWriter:
    """A predictions CSV: the header, then one line per row (an empty field where a row has no score)."""

    def __init__(self, path, columns: list[str]):
        self.path = Path(path)
        self.handle = open(self.path, "w", newline="")
        self.handle.write(",".join(columns) + "\n")
        self.rows = 0

    def write(self, scores: np.ndarray) -> None:
        """Rows of float scores [n, tasks]; NaN is written as an empty field."""
        text = np.char.mod("%.9g", scores.astype(np.float64))
        text[np.isnan(scores)] = ""
        self.handle.write("".join(",".join(row) + "\n" for row in text.tolist()))
        self.rows += len(scores)

    def close(self) -> None:
        self.handle.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def line_chunks(handle, chunk_bytes: int, schema):
    """(numpy uint8 buffer of whole records, each ending in a newline outside quotes) chunk by
    chunk."""
    carry = b""
    while True:
        data = handle.read(chunk_bytes)
        if not data:
            if carry:
                yield np.frombuffer(carry + b"\n", np.uint8)
            return
        data = carry + data
        end = kernels.complete_records(np.frombuffer(data, np.uint8), len(data), ord(schema.delimiter),
                                       schema.quote_byte) - 1
        if end < 0:
            carry = data
            continue
        carry = data[end + 1:]
        yield np.frombuffer(data[:end + 1], np.uint8)


def _first_line(path: Path) -> bytes:
    with open(path, "rb") as handle:
        for line in handle:
            if line.strip(b"\r\n"):
                return line.rstrip(b"\r\n")
    return b""


def predict_file(bundle, data, out, version: int | None = None, strict: bool = False,
                 chunk_bytes: int = 4 << 20, batch_rows: int = 4096, log=sys.stderr) -> dict:
    """Score every row of `data` with the bundle version `bundle` names and write the CSV `out`;
    returns {rows, scored, bad_rows, version}."""
    data = Path(data)
    if not data.is_file():
        raise UserError(f"--data: file {str(data)!r} does not exist")
    if data.suffix.lower() in PARQUET_SUFFIXES:
        raise UserError(f"--data: {data} is Parquet; hybridrec predict reads delimited text files (the formats of "
                        f"data.format criteo, avazu, synthetic and tabular CSV/TSV)")
    predictor = Predictor(chain.load(chain.resolve(bundle, version)))
    features: FeatureSpec = predictor.features
    schema = features.schema
    where = str(data)
    first_line = 1
    if schema.header:
        header = _first_line(data).decode("utf-8", errors="replace")
        layout = features.layout(schema.split_header(header), where)
    else:
        first = _first_line(data).decode("utf-8", errors="replace")
        layout = features.layout_for_fields(len(schema.split_header(first)), where)
    rows = scored = bad_total = 0
    with open(data, "rb") as handle, PredictionsWriter(out, predictor.score_columns) as writer:
        if schema.header:
            handle.readline()
            first_line = 2
        first_row = 0
        for buffer in line_chunks(handle, chunk_bytes, schema):
            batch, bad, records, lines = features.parse(layout, buffer, len(buffer), first_row)
            scores = np.full((records, len(predictor.score_columns)), np.nan, np.float32)
            is_row = np.zeros(records, bool)
            if batch is not None:
                at = batch.sample_ids.astype(np.int64) - first_row
                for start in range(0, len(batch), batch_rows):
                    part = batch.take_rows(np.arange(start, min(start + batch_rows, len(batch))))
                    scores[at[start:start + len(part)]] = predictor.score_batch(part)
                is_row[at] = True
                scored += len(batch)
            if len(bad):
                is_row[bad[:, 0]] = True
                for i in range(len(bad)):
                    found = describe_bad_line(where, layout.columns, buffer, bad[i], first_line)
                    if strict:
                        raise RowError(f"bad row at {found} (--strict: the first bad row stops the run)")
                    if bad_total + i < REPORTED_BAD_ROWS:
                        print(f"hybridrec predict: {found}: written with an empty score", file=log)
                bad_total += len(bad)
            writer.write(scores[is_row])
            rows += int(is_row.sum())
            first_row += records
            first_line += lines
    return {"rows": rows, "scored": scored, "bad_rows": bad_total, "version": predictor.number}


def checkpoint_predictions(cfg, checkpoint, out) -> dict:
    """`hybridrec eval --predictions`: the test rows of `cfg`'s data scored by checkpoint
    `checkpoint` as training's evaluation scores them (the checkpoint's tables in this process,
    the lookup that evaluation uses), written as `predict` writes its CSV; {rows}."""
    import torch

    from hybridrec.job.sources import build_sources
    from hybridrec.train.evaluation import load_local
    from hybridrec.train.step import logits_of

    sources = build_sources(cfg.data, cfg.seed, with_best_auc=False)
    model, placement, _ = load_local(cfg, checkpoint)
    model.eval()
    device = next(model.parameters(), torch.empty(0)).device
    labels = sources.label_names
    columns = ["score"] if len(labels) == 1 else [f"score_{t}" for t in labels]
    connection = placement.connect()
    try:
        with PredictionsWriter(out, columns) as writer, torch.no_grad():
            for batch in sources.test:
                looked = connection.lookup(connection.prepare(batch), train=False)
                inputs = placement.inputs(looked, batch, requires_grad=False)
                writer.write(torch.sigmoid(logits_of(model, inputs, batch, device)).cpu().numpy())
    finally:
        connection.close()
    return {"rows": writer.rows}
