"""Smoke test of the reader benchmark: it measures every system on the given file and
reports the keys docs and scripts read from its JSON line."""
import json

import pytest

from hybridrec.benchmarks.reader import main


def test_reader_benchmark_reports_rates_and_ratios(tmp_path, capsys):
    pytest.importorskip("pandas")
    result = main(["--repeats", "1", "--synthetic", "300",
                   "--synthetic-path", str(tmp_path / "s.tsv"), "--quoted", "--json"])
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(json.dumps(result))
    synthetic = [f for f in result["files"] if f["path"] == str(tmp_path / "s.tsv")]
    assert len(synthetic) == 1 and synthetic[0]["rows"] == 300
    quoted = [f for f in result["files"] if f["path"] == str(tmp_path / "s.quoted.tsv")]  # every field in quotes
    assert len(quoted) == 1 and quoted[0]["rows"] == 300 and quoted[0]["bad_rows"] == 0
    assert synthetic[0]["hybridrec_rows_per_s"] > 0 and synthetic[0]["pandas_c_rows_per_s"] > 0
    assert synthetic[0]["hybridrec_over_pandas_c"] > 0


def test_reader_benchmark_rejects_a_missing_file(tmp_path):
    with pytest.raises(SystemExit, match="none.tsv"):
        main([str(tmp_path / "none.tsv"), "--repeats", "1"])
