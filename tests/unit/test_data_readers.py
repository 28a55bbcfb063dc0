"""Tests of the file readers: Criteo TSV, Avazu CSV, schema-driven CSV/Parquet.

Covers parsing with missing values, per-field hashing, bad rows with their line numbers,
strict mode, chunk boundaries and constant memory, rank sharding, and the real Criteo
sample when it is present."""
from pathlib import Path

import numpy as np
import pytest

from hybridrec.data import kernels
from hybridrec.data.avazu import AvazuReader
from hybridrec.data.batch import Batch
from hybridrec.data.criteo import CriteoReader
from hybridrec.data.tabular import DelimitedTextReader, ParquetReader, TabularSchema

CRITEO_SAMPLE = (Path(__file__).resolve().parents[3]
                 / "shared/data/criteo-sample/criteo_first_9999.tsv")


def criteo_line(label="0", dense=None, categorical=None) -> str:
    dense = [str(i) for i in range(13)] if dense is None else dense
    categorical = [f"{i:08x}" for i in range(26)] if categorical is None else categorical
    return "\t".join([label] + list(dense) + list(categorical)) + "\n"


def write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(lines))
    return path


def one_batch(reader) -> Batch:
    return Batch.concat(list(reader)).validate()


def ids(batch: Batch, name: str, row: int) -> list[int]:
    values, offsets = batch.feature(name)
    return values[offsets[row]:offsets[row + 1]].tolist()


def test_criteo_dense_transform_and_missing_values(tmp_path):
    dense = ["", "-5", "0", "3", "1000"] + ["1"] * 8
    categorical = ["68fd1e64", ""] + ["80e26c9b"] * 24
    same_c1 = ["68fd1e64"] + [f"{i:08x}" for i in range(25)]
    path = write(tmp_path / "c.tsv", [criteo_line("1", dense, categorical),
                                      criteo_line(categorical=same_c1)])
    batch = one_batch(CriteoReader(path, batch_size=8))
    assert len(batch) == 2 and batch.labels[:, 0].tolist() == [1.0, 0.0]
    np.testing.assert_allclose(batch.dense[0, :5], np.log1p([0, 0, 0, 3, 1000]), rtol=1e-6)
    assert batch.sparse.names == [f"C{i}" for i in range(1, 27)]
    assert len(ids(batch, "C1", 0)) == 1
    assert ids(batch, "C2", 0) == []  # empty categorical = missing ID
    assert ids(batch, "C1", 0) == ids(batch, "C1", 1)  # equal strings, equal IDs
    assert batch.sample_ids.tolist() == [0, 1]


def test_equal_strings_in_different_fields_never_collide(tmp_path):
    rows = [criteo_line(categorical=["deadbeef"] * 26), criteo_line(categorical=["deadbeef"] * 26)]
    batch = one_batch(CriteoReader(write(tmp_path / "c.tsv", rows), batch_size=2))
    per_field = [ids(batch, f"C{i}", 0)[0] for i in range(1, 27)]
    assert len(set(per_field)) == 26
    assert [ids(batch, f"C{i}", 1)[0] for i in range(1, 27)] == per_field
    # every (field, 8-hex token) pair gets its own key: 26 fields x 20000 tokens
    tokens = np.tile(np.arange(20000, dtype=np.uint32) * np.uint32(7919), 26)
    fields = np.repeat(np.arange(26, dtype=np.int64), 20000)
    assert len(np.unique(kernels.hex_token_keys(tokens, fields))) == len(tokens)


def test_bad_rows_are_skipped_counted_and_located(tmp_path, caplog):
    lines = [criteo_line()] * 2 + ["\t".join(criteo_line().split("\t")[:-1]) + "\n"]  # short
    lines += [criteo_line(), criteo_line(dense=["x1"] + ["0"] * 12)]  # line 5: not a number
    lines += [criteo_line(), criteo_line(label="2"), criteo_line()]  # line 7: bad label
    path = write(tmp_path / "bad.tsv", lines)
    reader = CriteoReader(path, batch_size=3)
    batch = one_batch(reader)
    assert batch.sample_ids.tolist() == [0, 1, 3, 5, 7]
    assert reader.bad_rows.count == 3
    assert [(b.line, b.column) for b in reader.bad_rows.examples] == [
        (3, "*"), (5, "2 (I1)"), (7, "1 (label)")]
    assert "expected 40 columns, found 39" in str(reader.bad_rows.examples[0])
    assert str(path) in caplog.text and ":5:" in caplog.text
    with pytest.raises(ValueError, match=r"bad\.tsv:2: column 2 \(I1\): not a number "
                                         r"\(value 'x1'\)"):
        list(CriteoReader(write(tmp_path / "bad.tsv", lines[3:5] + lines[:3]), 3,
                          strict=True))


def test_small_chunks_give_the_same_batches_and_read_lazily(tmp_path):
    rng = np.random.default_rng(0)
    lines = [criteo_line(str(i % 2), [str(v) if v >= 0 else "" for v in rng.integers(-3, 99, 13)],
                         [f"{v:08x}" if v else "" for v in rng.integers(0, 50, 26)])
             for i in range(600)]
    path = write(tmp_path / "c.tsv", lines)
    whole = one_batch(CriteoReader(path, batch_size=64))
    # chunks smaller than one line force the buffer to grow; odd sizes split lines anywhere
    for chunk_bytes in (64, 1000, 4097):
        chunked = one_batch(CriteoReader(path, batch_size=64, chunk_bytes=chunk_bytes))
        np.testing.assert_array_equal(chunked.sparse.values, whole.sparse.values)
        np.testing.assert_array_equal(chunked.sparse.offsets, whole.sparse.offsets)
        np.testing.assert_array_equal(chunked.dense, whole.dense)
    reader = CriteoReader(path, batch_size=4, chunk_bytes=4096)
    next(iter(reader))
    assert reader.bytes_read <= 4096 < path.stat().st_size


def test_rank_shards_are_disjoint_and_cover_the_file(tmp_path):
    path = write(tmp_path / "c.tsv", [criteo_line(str(i % 2)) for i in range(1000)])
    seen = []
    for rank in range(3):
        batches = list(CriteoReader(path, batch_size=64, rank=rank, world_size=3,
                                    chunk_bytes=5000))
        assert all(len(b) == 64 for b in batches[:-1])
        seen.append(np.concatenate([b.sample_ids for b in batches]))
    everything = np.concatenate(seen)
    assert len(everything) == 1000 and len(np.unique(everything)) == 1000
    with pytest.raises(ValueError, match="rank must be in \\[0, world_size=3\\), got 3"):
        CriteoReader(path, 8, rank=3, world_size=3)


def test_real_criteo_sample_matches_pandas():
    if not CRITEO_SAMPLE.exists():
        pytest.skip(f"Criteo sample not present at {CRITEO_SAMPLE}")
    pandas = pytest.importorskip("pandas")
    reader = CriteoReader(CRITEO_SAMPLE, batch_size=4096)
    batches = list(reader)
    assert [len(b) for b in batches] == [4096, 4096, 1807]
    batch = one_batch(batches)
    assert reader.bad_rows.count == 0
    assert batch.dense.shape == (9999, 13) and batch.sparse.num_features == 26
    frame = pandas.read_csv(CRITEO_SAMPLE, sep="\t", header=None)
    assert int(batch.labels.sum()) == int(frame[0].sum()) == 2181
    expected_dense = np.log1p(frame.iloc[:, 1:14].clip(lower=0).fillna(0).to_numpy())
    np.testing.assert_allclose(batch.dense, expected_dense, rtol=1e-6)
    present = frame.iloc[:, 14:].notna().to_numpy().T
    np.testing.assert_array_equal(batch.sparse.lengths(), present.astype(np.int64))
    # equal strings map to equal IDs: distinct counts per field agree with pandas
    for f, name in enumerate(batch.sparse.names):
        values, _ = batch.feature(name)
        assert len(np.unique(values)) == frame[14 + f].nunique()


AVAZU_HEADER = ("id,click,hour,C1,banner_pos,site_id,site_domain,site_category,app_id,"
                "app_domain,app_category,device_id,device_ip,device_model,device_type,"
                "device_conn_type,C14,C15,C16,C17,C18,C19,C20,C21\n")
AVAZU_TAIL = ",1005,0,1fbe01fe,f3845767,28905ebd,ecad2386,7801e8d9,07d7df22,a99f214a," \
             "ddd2926e,44956a24,1,2,15706,320,50,1722,0,35,-1,79\n"


def test_avazu_label_and_hour_split(tmp_path):
    hours = ["14102105", "14102205", "14102805", "14102117"]  # 21 Oct 2014 is a Tuesday
    lines = [AVAZU_HEADER] + [f"{1000 + i},{i % 2},{h}{AVAZU_TAIL}" for i, h in enumerate(hours)]
    reader = AvazuReader(write(tmp_path / "a.csv", lines), batch_size=10)
    batch = one_batch(reader)
    assert batch.labels[:, 0].tolist() == [0, 1, 0, 1] and batch.dense.shape == (4, 0)
    assert "id" not in batch.sparse.names and len(batch.sparse.names) == 23
    hour_of_day = [ids(batch, "hour:hour_of_day", r) for r in range(4)]
    weekday = [ids(batch, "hour:day_of_week", r) for r in range(4)]
    assert hour_of_day[0] == hour_of_day[1] == hour_of_day[2] != hour_of_day[3]
    assert weekday[0] == weekday[2] == weekday[3] != weekday[1]  # a week apart / next day
    assert ids(batch, "site_id", 0) == ids(batch, "site_id", 3)
    bad = write(tmp_path / "b.csv", lines[:2] + [f"9,0,1410219{AVAZU_TAIL}"])
    reader = AvazuReader(bad, batch_size=10)
    assert len(one_batch(reader)) == 1
    assert reader.bad_rows.examples[0].line == 3
    assert "YYMMDDHH" in reader.bad_rows.examples[0].reason


MULTI_SCHEMA = dict(labels=["click", "buy"], dense=["price"], categorical=["user"],
                    multi_categorical=["tags"], multi_separator="|")


def test_csv_and_parquet_with_the_same_schema_give_the_same_batches(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = [("u1", "a|b", 1.5, 1, 0), ("u2", "", 0.25, 0, 0), ("", "b|c|d", -2.0, 1, 1),
            ("u1", "a", 3.0, 0, 1)] * 5
    csv = tmp_path / "t.csv"
    csv.write_text("user,tags,price,click,buy,ignored\n" + "".join(
        f"{u},{t},{p},{c},{b},zzz\n" for u, t, p, c, b in rows))
    table = pa.table({"user": [r[0] or None for r in rows],
                      "tags": [[x for x in r[1].split("|") if x] for r in rows],
                      "price": [r[2] for r in rows], "click": [r[3] for r in rows],
                      "buy": [r[4] for r in rows]})
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=7)
    schema = TabularSchema.from_dict(MULTI_SCHEMA)
    from_csv = one_batch(DelimitedTextReader(csv, schema, batch_size=6))
    from_parquet = one_batch(ParquetReader(tmp_path / "t.parquet", schema, batch_size=6))
    assert from_csv.sparse.names == ["user", "tags"]
    assert from_csv.labels[:4].tolist() == [[1, 0], [0, 0], [1, 1], [0, 1]]
    assert from_csv.dense[:3, 0].tolist() == [1.5, 0.25, -2.0]
    assert [len(ids(from_csv, "tags", r)) for r in range(4)] == [2, 0, 3, 1]
    assert ids(from_csv, "user", 2) == [] and ids(from_csv, "user", 0) == ids(from_csv, "user", 3)
    for a, b in ((from_csv.sparse.values, from_parquet.sparse.values),
                 (from_csv.sparse.offsets, from_parquet.sparse.offsets),
                 (from_csv.dense, from_parquet.dense), (from_csv.labels, from_parquet.labels),
                 (from_csv.sample_ids, from_parquet.sample_ids)):
        np.testing.assert_array_equal(a, b)


def test_parquet_shards_are_disjoint_and_cover(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    n = 500
    pq.write_table(pa.table({"y": np.arange(n) % 2, "k": np.arange(n)}), tmp_path / "s.parquet",
                   row_group_size=77)
    schema = TabularSchema(labels=("y",), categorical=("k",))
    shards = [np.concatenate([b.sample_ids for b in ParquetReader(
        tmp_path / "s.parquet", schema, 32, rank=r, world_size=2)]) for r in range(2)]
    assert sorted(np.concatenate(shards).tolist()) == list(range(n))


def test_schema_errors_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="unknown tabular schema keys \\['label'\\]"):
        TabularSchema.from_dict({"label": ["y"]})
    with pytest.raises(ValueError, match="columns \\['x'\\] are used more than once"):
        TabularSchema(labels=("x",), dense=("x",))
    path = write(tmp_path / "t.csv", ["a,b\n", "1,2\n"])
    with pytest.raises(ValueError, match="t.csv: columns \\['c'\\] named by the schema"):
        list(DelimitedTextReader(path, TabularSchema(labels=("a",), dense=("c",)), 4))
    with pytest.raises(FileNotFoundError, match="nope.csv"):
        DelimitedTextReader(tmp_path / "nope.csv", TabularSchema(labels=("a",)), 4)


def test_dense_numbers_in_every_decimal_spelling_and_rejects_the_rest(tmp_path):
    good = ["1e3", "-2.5", ".5", "+7", "5.", "2.5E-2", ""]
    bad = ["1.2.3", "e5", "--1", "1e", "nan", "0x10"]
    path = write(tmp_path / "n.csv", ["y,x\n"] + [f"1,{v}\n" for v in good + bad])
    reader = DelimitedTextReader(path, TabularSchema(labels=("y",), dense=("x",)), 64)
    batch = one_batch(reader)
    np.testing.assert_allclose(batch.dense[:, 0], [1000, -2.5, 0.5, 7, 5, 0.025, 0], rtol=1e-6)
    assert reader.bad_rows.count == len(bad)
    assert [b.value for b in reader.bad_rows.examples] == bad[:5]


def test_crlf_endings_and_a_missing_final_newline_change_nothing(tmp_path):
    lines = [criteo_line(str(i % 2), categorical=[f"{i:08x}"] * 26) for i in range(5)]
    unix = one_batch(CriteoReader(write(tmp_path / "u.tsv", lines), batch_size=2))
    windows = "".join(lines).replace("\n", "\r\n").rstrip("\r\n")
    (tmp_path / "w.tsv").write_bytes(windows.encode())
    reader = CriteoReader(tmp_path / "w.tsv", batch_size=2, chunk_bytes=300)
    crlf = one_batch(reader)
    assert reader.bad_rows.count == 0
    np.testing.assert_array_equal(crlf.sparse.values, unix.sparse.values)
    np.testing.assert_array_equal(crlf.labels, unix.labels)
    assert [len(b) for b in CriteoReader(tmp_path / "w.tsv", 2, drop_last=True)] == [2, 2]


def test_numbers_out_of_range_are_bad_rows_with_file_and_line(tmp_path, caplog):
    criteo = [criteo_line(), criteo_line(dense=["1e400"] + ["0"] * 12), criteo_line(dense=["-1e400"] + ["0"] * 12),
              criteo_line(dense=["1e39"] + ["0"] * 12), criteo_line()]  # 1e39 counts log1p to 89.8: kept
    path = write(tmp_path / "big.tsv", criteo)
    reader = CriteoReader(path, batch_size=8)
    batch = one_batch(reader)
    assert batch.sample_ids.tolist() == [0, 3, 4] and np.isfinite(batch.dense).all()
    assert [(b.line, b.column, b.value) for b in reader.bad_rows.examples] == [(2, "2 (I1)", "1e400"),
                                                                                (3, "2 (I1)", "-1e400")]
    assert "number out of range" in str(reader.bad_rows.examples[0]) and f"{path}:2:" in caplog.text
    with pytest.raises(ValueError, match=r"big\.tsv:2: column 2 \(I1\): number out of range"):
        list(CriteoReader(path, 8, strict=True))
    schema = TabularSchema.from_dict({"labels": ["y"], "dense": ["x"], "binary_labels": False})
    csv = write(tmp_path / "t.csv", ["x,y\n", "1.5,1\n", "1e39,1\n", "2,1e39\n", "-3.5e38,0\n", "3.4e38,0\n"])
    from_csv = DelimitedTextReader(csv, schema, batch_size=8)
    assert one_batch(from_csv).sample_ids.tolist() == [0, 4]
    assert [(b.line, b.column) for b in from_csv.bad_rows.examples] == [(3, "1 (x)"), (4, "2 (y)"), (5, "1 (x)")]
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"x": [1.5, 1e39, 2.0, float("inf"), float("nan"), 3.4e38],
                             "y": [1.0, 1.0, 1e39, 0.0, 0.0, 0.0]}), tmp_path / "t.parquet")
    from_parquet = ParquetReader(tmp_path / "t.parquet", schema, batch_size=8)
    batch = one_batch(from_parquet)
    assert batch.sample_ids.tolist() == [0, 5] and np.isfinite(batch.dense).all() and np.isfinite(batch.labels).all()
    assert sorted((b.line, b.column) for b in from_parquet.bad_rows.examples) == [(2, "x"), (3, "label"), (4, "x"),
                                                                                  (5, "x")]
    assert all("number out of range" in b.reason for b in from_parquet.bad_rows.examples)
    with pytest.raises(ValueError, match=r"t\.parquet \(row\):2: column x: number out of range"):
        list(ParquetReader(tmp_path / "t.parquet", schema, batch_size=8, strict=True))
