"""Quoted CSV fields (RFC 4180) in the delimited-text reader: quotes around fields, doubled
quotes inside, delimiters and newlines inside quotes, a quoted header; records that span lines
keep their data-row numbering and their bad rows are reported at the line they start on."""
import csv

import numpy as np
import pytest

from hybridrec.data.batch import Batch
from hybridrec.data.tabular import DelimitedTextReader, ParquetReader, TabularSchema
from hybridrec.errors import UserError

SCHEMA = {"labels": ["clicked"], "dense": ["price"], "categorical": ["city"], "multi_categorical": ["tags"]}
ROWS = [(1, "Paris, FR", 1.5, "a|b"), (0, 'say "hi"', None, "c"), (1, "two\nlines", 3.0, ""),
        (0, "plain", 4.0, "a"), (1, "", 0.5, 'q"|r,s')]


def read(path, batch_size=3, **kwargs) -> Batch:
    reader = DelimitedTextReader(path, TabularSchema.from_dict({**SCHEMA, **kwargs.pop("schema", {})}),
                                 batch_size, strict=kwargs.pop("strict", True), **kwargs)
    return Batch.concat(list(reader)).validate()


def write_csv(path, rows, quoting=csv.QUOTE_ALL):
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle, quoting=quoting)
        writer.writerow(["clicked", "city", "price", "tags"])
        writer.writerows([(c, city, "" if p is None else p, t) for c, city, p, t in rows])
    return path


@pytest.mark.parametrize("quoting", [csv.QUOTE_ALL, csv.QUOTE_MINIMAL])
def test_quoted_fields_read_as_the_values_between_the_quotes(tmp_path, quoting):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    quoted = read(write_csv(tmp_path / "q.csv", ROWS, quoting))
    # Parquet holds the same values without any quoting: the keys must be the same
    pq.write_table(pa.table({"clicked": [r[0] for r in ROWS], "city": [r[1] or None for r in ROWS],
                             "price": [r[2] for r in ROWS], "tags": [r[3] for r in ROWS]}), tmp_path / "q.parquet")
    plain = Batch.concat(list(ParquetReader(tmp_path / "q.parquet", TabularSchema.from_dict(SCHEMA), 3)))
    assert quoted.labels[:, 0].tolist() == [1, 0, 1, 0, 1]
    assert quoted.dense[:, 0].tolist() == [1.5, 0.0, 3.0, 4.0, 0.5]
    assert quoted.sample_ids.tolist() == [0, 1, 2, 3, 4]  # a record over two lines is one data row
    for a, b in ((quoted.sparse.values, plain.sparse.values), (quoted.sparse.offsets, plain.sparse.offsets)):
        np.testing.assert_array_equal(a, b)


def test_records_split_across_chunks_give_the_same_batches(tmp_path):
    rows = [(i % 2, f'c{i % 7}, "x"\n{i}', float(i), f"t{i % 3}|u") for i in range(200)]
    path = write_csv(tmp_path / "q.csv", rows)
    whole = read(path, batch_size=64)
    assert len(whole) == 200
    for chunk_bytes in (64, 333, 4097):  # smaller than a record, and boundaries inside quotes
        chunked = read(path, batch_size=64, chunk_bytes=chunk_bytes)
        for a, b in ((chunked.sparse.values, whole.sparse.values), (chunked.dense, whole.dense),
                     (chunked.sample_ids, whole.sample_ids)):
            np.testing.assert_array_equal(a, b)
    reader = DelimitedTextReader(path, TabularSchema.from_dict(SCHEMA), 64)
    assert reader.count_rows() == 200


def test_bad_rows_after_multi_line_records_name_the_line_they_start_on(tmp_path):
    path = tmp_path / "q.csv"
    path.write_text('clicked,city,price,tags\n1,"a\nb\nc",1,x\n0,ok,oops,y\n1,"x" trailing,2,z\n0,"never closed,3,w\n')
    reader = DelimitedTextReader(path, TabularSchema.from_dict(SCHEMA), 10)
    batch = Batch.concat(list(reader))
    assert batch.sample_ids.tolist() == [0]
    found = {(row.line, row.reason.split(" (")[0].split(",")[0]) for row in reader.bad_rows.examples}
    assert found == {(5, "not a number"), (6, "a quoted field is not closed"), (7, "a quoted field is not closed")}
    with pytest.raises(UserError, match=r"q\.csv:5: column 3 \(price\): not a number"):
        read(path)


def test_a_quoted_header_names_the_columns(tmp_path):
    path = tmp_path / "q.csv"
    path.write_text('"clicked","city","price","tags"\n"1","x","2","t"\n')
    assert read(path).labels.tolist() == [[1.0]]


def test_quote_null_reads_quotes_as_ordinary_characters(tmp_path):
    path = tmp_path / "q.csv"
    path.write_text('clicked,city,price,tags\n1,"x,2,t\n0,"x,3,t\n')
    batch = read(path, schema={"quote": None})
    assert batch.dense[:, 0].tolist() == [2.0, 3.0]
    assert batch.sparse.values[0] == batch.sparse.values[1]  # city (feature-major): the token '"x' both times
    with pytest.raises(ValueError, match="quote must differ from delimiter"):
        TabularSchema.from_dict({**SCHEMA, "quote": ","})
