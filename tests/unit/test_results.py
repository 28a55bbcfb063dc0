"""Result files and the results table of docs/benchmarks.md: `--record` writes a result with its
command, figures, commit and date; `hybridrec bench report` makes the table from the files; the
table in the repository is the one its result files give; every bench mode can be recorded."""
from __future__ import annotations

import datetime
import importlib
import json
import subprocess

import pytest

from hybridrec import cli
from hybridrec.benchmarks import het, hybrid, picasso, reader, report, results
from hybridrec.benchmarks.report import BEGIN, END
from hybridrec.errors import UserError

REPO = results.CHECKOUT
TINY = ["--batch-size", "64", "--fields", "3", "--dim", "4", "--capacity", "2000",
        "--warmup", "1", "--batches", "2", "--repeats", "2"]
PAGE = f"""# Benchmarks

{BEGIN}
an old table
{END}

## embedding

How it is measured.
"""


def _page(tmp_path, text=PAGE):
    path = tmp_path / "benchmarks.md"
    path.write_text(text)
    return path


def _record(directory, name, figures, **kwargs):
    return results.record_result(name, bench=name.split("-")[0], command=f"hybridrec bench {name} --json",
                                 arguments=["--json"], figures=figures, directory=directory, **kwargs)


def _git(root, *args):
    subprocess.run(["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                   check=True, capture_output=True, timeout=30)


def test_a_recorded_result_holds_its_command_figures_commit_and_date(tmp_path):
    path = _record(tmp_path, "embedding", {"hybridrec / torch": 5.6, "nan stays strict JSON": float("nan")},
                   report={"hybridrec_over_torch": 5.6}, note="one run")
    result = json.loads(path.read_text())
    assert path == tmp_path / "embedding.json"
    assert result["command"] == "hybridrec bench embedding --json" and result["arguments"] == ["--json"]
    assert result["figures"] == {"hybridrec / torch": 5.6, "nan stays strict JSON": None}
    assert result["commit"] == results.checkout_commit() and result["commit"] != ""
    assert result["date"] == datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    assert result["carried_over"] is False and result["note"] == "one run"
    assert result["report"] == {"hybridrec_over_torch": 5.6}
    _record(tmp_path, "embedding", {"hybridrec / torch": 6.0})  # recording again replaces the figure
    assert json.loads(path.read_text())["figures"] == {"hybridrec / torch": 6.0}


def test_the_commit_is_the_checkouts_marked_dirty_by_uncommitted_code_and_unknown_outside_git(tmp_path):
    assert results.checkout_commit(tmp_path) == "unknown"
    (tmp_path / "hybridrec").mkdir()
    (tmp_path / "hybridrec" / "code.py").write_text("x = 1\n")
    (tmp_path / "README.md").write_text("a\n")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-qm", "first")
    head = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "--short=7", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    assert results.checkout_commit(tmp_path) == head
    (tmp_path / "README.md").write_text("docs are not measured code\n")
    assert results.checkout_commit(tmp_path) == head
    (tmp_path / "hybridrec" / "code.py").write_text("x = 2\n")
    assert results.checkout_commit(tmp_path) == f"{head}-dirty"
    assert results.checkout_commit(tmp_path / "hybridrec") == "unknown"  # not the top of the checkout


def test_bad_names_and_empty_figures_are_refused(tmp_path):
    with pytest.raises(UserError, match="'Embedding Run'"):
        _record(tmp_path, "Embedding Run", {"a": 1.0})
    with pytest.raises(UserError, match="no figures"):
        _record(tmp_path, "embedding", {})
    with pytest.raises(UserError, match="--record=A B"):
        results.split_record_flag(["--json", "--record=A B"])
    assert results.split_record_flag(["--json", "--record"]) == (["--json"], "")
    assert results.split_record_flag(["--record=two-threads", "--json"]) == (["--json"], "two-threads")
    assert results.split_record_flag(["--json"]) == (["--json"], None)


def test_the_report_makes_the_table_between_the_markers_from_the_result_files(tmp_path, capsys):
    directory = tmp_path / "results"
    _record(directory, "embedding", {"hybridrec / torch": 5.642, "bytes per row": 168, "met": True})
    _record(directory, "e2e-two-threads", {"DLRM hybridrec / floor": 0.9151, "samples/s": 7591.4, "absent": None},
            note="load 1-2 | one run")
    carried = json.loads((directory / "embedding.json").read_text())
    carried.update(carried_over=True, commit="a07ba0c", date="2026-11-23")
    (directory / "embedding.json").write_text(json.dumps(carried))
    page = _page(tmp_path)
    assert report.main(["--results", str(directory), "--doc", str(page)]) == 0
    text = page.read_text()
    table = text[text.index(BEGIN) + len(BEGIN):text.index(END)].strip().splitlines()
    commit, today = results.checkout_commit(), datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    assert table[:2] == report.HEADER.splitlines()
    # the row of a bench with a section comes first and links to it; one without comes last
    assert table[2] == ("| [embedding](#embedding) | `hybridrec bench embedding --json` | hybridrec / torch "
                        "**5.642**; bytes per row **168**; met **yes** | a07ba0c, 2026-11-23, carried over |")
    assert table[3] == ("| e2e-two-threads | `hybridrec bench e2e-two-threads --json` | DLRM hybridrec / floor "
                        "**0.9151**; samples/s **7,591**; absent **n/a**. load 1-2 \\| one run | "
                        f"{commit}, {today} |")
    assert len(table) == 4
    assert text.startswith("# Benchmarks\n") and text.endswith("## embedding\n\nHow it is measured.\n")
    assert report.main(["--results", str(directory), "--doc", str(page), "--check"]) == 0
    _record(directory, "embedding", {"hybridrec / torch": 6.0})
    assert report.main(["--results", str(directory), "--doc", str(page), "--check"]) == 1
    assert "run `hybridrec bench report`" in capsys.readouterr().err
    assert page.read_text() == text  # --check writes nothing


def test_figures_are_shown_as_written_when_short_and_to_four_digits_when_measured():
    assert [report.format_value(v) for v in (0.72864, 2.0, -0.0022, 0.91513528, 1e-07, 7591.4, 12, "1.02 (0.9-1.1)")] \
        == ["0.72864", "2.0", "-0.0022", "0.9151", "1e-07", "7,591", "12", "1.02 (0.9-1.1)"]


def test_the_report_names_what_is_wrong_with_a_page_or_a_result_file(tmp_path):
    directory = tmp_path / "results"
    directory.mkdir()
    with pytest.raises(UserError, match="no results table markers"):
        report.main(["--results", str(directory), "--doc", str(_page(tmp_path, "# no table\n"))])
    (directory / "ps.json").write_text('{"name": "ps",\n "bench": }')
    with pytest.raises(UserError, match=r"ps.json:2: not JSON"):
        report.main(["--results", str(directory), "--doc", str(_page(tmp_path))])
    (directory / "ps.json").write_text(json.dumps({"name": "ps", "bench": "ps", "figures": {}}))
    with pytest.raises(UserError, match="ps.json: .* missing command, commit, date"):
        report.main(["--results", str(directory), "--doc", str(_page(tmp_path))])
    with pytest.raises(UserError, match="--results .*nowhere: no such directory"):
        report.main(["--results", str(tmp_path / "nowhere"), "--doc", str(_page(tmp_path))])


def test_the_repository_table_is_what_its_result_files_give():
    assert report.main(["--check"]) == 0, "docs/benchmarks.md's table is stale: run `hybridrec bench report`"
    page = (REPO / "docs" / "benchmarks.md").read_text()
    sections = report.sections_of(page)
    for result in results.load_results(REPO / results.RESULTS):
        assert result["bench"] in sections, f"{result['name']}: docs/benchmarks.md has no '## {result['bench']}'"
        assert result["carried_over"] or "report" in result, f"{result['name']}: recorded without its report"


@pytest.mark.parametrize("name", sorted(cli.BENCHMARKS))
def test_every_bench_mode_names_the_figures_of_its_result(name):
    module = importlib.import_module(cli.BENCHMARKS[name][0])
    assert callable(module.headline), f"bench {name} needs headline(report) for --record"


def test_record_on_the_command_line_writes_the_benchs_report_and_headline(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(results, "default_directory", lambda: tmp_path)
    assert cli.main(["bench", "embedding", *TINY, "--systems", "hybridrec,torch", "--json", "--record=tiny"]) == 0
    out, err = capsys.readouterr()
    printed = json.loads(out)  # --json still prints exactly one line
    result = json.loads((tmp_path / "embedding-tiny.json").read_text())
    assert result["bench"] == "embedding" and "--record" not in result["command"]
    assert result["command"] == "hybridrec bench embedding " + " ".join([*TINY, "--systems", "hybridrec,torch", "--json"])
    assert result["figures"]["hybridrec / torch"] == printed["hybridrec_over_torch"] > 0
    assert "hybridrec / TorchRec" not in result["figures"]  # not measured, so not shown
    assert result["report"]["hybridrec_over_torch"] == printed["hybridrec_over_torch"]
    assert "embedding-tiny.json" in err


def test_headlines_of_the_job_benches_read_their_reports():
    def runs(auc, samples_per_s, bytes_per_sample=500.0):
        return [{"auc": auc, "logloss": 0.4, "train_samples_per_s": samples_per_s, "max_staleness": 2,
                 "mean_staleness": 1.0, "bytes_per_sample": bytes_per_sample, "strategy": {"tau": 2}}]

    disciplines = hybrid.disciplines_report({"sync": runs(0.80, 100.0), "hybrid": runs(0.79, 120.0),
                                             "async": runs(0.81, 50.0)})
    figures = hybrid.headline(disciplines)
    assert figures["hybrid - sync AUC"] == pytest.approx(-0.01)
    assert figures["async / sync samples/s"] == pytest.approx(0.5) and figures["sync AUC"] == 0.80
    codecs = hybrid.codecs_report({"none/none": runs(0.8, 100.0, 400.0), "unique/none": runs(0.8, 90.0, 200.0),
                                   "unique/fp16": runs(0.8, 80.0, 100.0)})
    figures = hybrid.headline({"points": [{**codecs, "bandwidth": "100 Mbit/s"}]})
    assert figures["100 Mbit/s: unique/fp16 bytes x fewer"] == pytest.approx(4.0)
    assert figures["100 Mbit/s: target met"] is True

    jobs = {name: runs(auc, 100.0, size) for name, auc, size in
            (("bsp", 0.82, 700.0), ("no_cache", 0.82, 700.0), ("het_s100", 0.816, 140.0), ("het_sinf", 0.81, 110.0))}
    rates = {"miss_rate": {"lru": {"0.1": 0.19}, "lfu": {"0.1": 0.16}}, "ns_per_read": {"lru": 400, "lfu": 410}}
    figures = het.headline(het.report(jobs, rates))
    assert figures["s=100 bytes saved vs no cache"] == pytest.approx(0.8)
    assert figures["s=100 AUC - BSP"] == pytest.approx(-0.004) and figures["s=inf AUC - BSP"] == pytest.approx(-0.01)
    assert figures["lfu miss rate at 10%"] == 0.16 and figures["LFU misses at most LRU"] is True

    ablation = {"local": {"auc": 0.57}, "sharded": {"auc": 0.57, "ops_per_step": 1356.0, "samples_per_s": 100.0},
                "packed": {"auc": 0.57, "ops_per_step": 25.6, "samples_per_s": 270.0},
                "picasso": {"auc": 0.57, "bytes_per_sample": 880.0, "hot_hit_rate": 0.08}}
    ablation["checks"] = picasso.checks(ablation)
    ablation["scaling"] = picasso.scaling_checks({"26": {"picasso": 1500.0}, "208": {"picasso": 834.0}})
    figures = picasso.headline(ablation)
    assert figures["sharded / packed ops per step"] == pytest.approx(1356 / 25.6)
    assert figures["picasso at 208 fields / arithmetic progression"] == pytest.approx(834 / (1500 / 8))


def test_the_reader_bench_headline_names_each_file(tmp_path):
    summary = reader.main(["--repeats", "1", "--synthetic", "300", "--synthetic-path", str(tmp_path / "s.tsv")])
    figures = reader.headline(summary)
    assert figures["s.tsv: hybridrec / pandas C"] > 0
