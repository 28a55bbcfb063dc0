"""Tests of the benchmark harness at tiny sizes: the workload has the promised shape and
skew, every system really trains, the embedding and e2e benchmarks print valid JSON
with the documented keys, and every `hybridrec bench` mode and developer script has --help.
No timing is asserted: throughput figures only have to be positive numbers."""
from __future__ import annotations

import json
import math
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch

from hybridrec.benchmarks import e2e, embedding, tiers
from hybridrec.benchmarks.peers import SYSTEM_NAMES, HybridrecSystem, TorchEmbeddingBagSystem, \
    TorchRecSystem, parse_system_names
from hybridrec.benchmarks.timing import SystemResult, Throughput, summarize
from hybridrec.benchmarks.workload import (WorkloadShape, dense_ids_per_field,
                                           make_dense_batches, make_sparse_batches, mix64)
from hybridrec.cli import BENCH_TOOLS, BENCHMARKS

REPO = pathlib.Path(__file__).resolve().parents[2]
TINY = ["--batch-size", "64", "--fields", "3", "--dim", "4", "--capacity", "2000",
        "--warmup", "1", "--batches", "2", "--repeats", "2"]
TINY_SHAPE = WorkloadShape(batch_size=64, fields=3, dim=4, capacity=2000)


def _positive_rate(value) -> bool:
    return isinstance(value, float) and math.isfinite(value) and value > 0


def _check_system_entry(summary: dict, name: str, unit: str) -> None:
    """A measured system has a positive median; an absent one is null with a reason."""
    value = summary[f"{name}_{unit}"]
    if value is None:
        assert name in summary["errors"], f"{name} is null without an error"
    else:
        assert _positive_rate(value)
        assert len(summary[f"{name}_{unit}_runs"]) == summary["settings"]["repeats"]


def _single_json_line(output: str) -> dict:
    lines = [line for line in output.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected exactly one line on stdout, got {lines!r}"
    return json.loads(lines[0])


# ---- workload ---------------------------------------------------------------------------

def test_mix64_is_injective_and_salt_dependent():
    values = np.concatenate([np.arange(100_000, dtype=np.uint64),
                             np.array([2**64 - 1, 2**63], dtype=np.uint64)])
    mixed = mix64(values, salt=3)
    assert len(np.unique(mixed)) == len(values)
    assert not np.array_equal(mixed, mix64(values, salt=4))


def test_mix64_rejects_out_of_range_salt():
    with pytest.raises(ValueError, match="salt"):
        mix64(np.arange(3, dtype=np.uint64), salt=-1)


def test_keys_are_zipf_skewed_and_spread_over_uint64():
    shape = WorkloadShape(batch_size=4096, fields=2, dim=4, capacity=100_000)
    keys = make_sparse_batches(shape, 2)[0].keys
    assert keys.dtype == np.uint64 and keys.shape == (2, 4096)
    distinct, counts = np.unique(keys[0], return_counts=True)
    # Zipf(1.2): the hottest key alone is ~18% of draws; a uniform draw would be ~0.02%.
    assert counts.max() / keys.shape[1] > 0.1
    high_half = np.mean(distinct >= np.uint64(2**63))
    assert 0.3 < high_half < 0.7, "keys should cover the whole uint64 range"
    assert not np.intersect1d(keys[0], keys[1]).size, "fields must not share keys"


def test_dense_ids_are_a_per_field_dictionary_of_the_keys():
    batches = make_sparse_batches(TINY_SHAPE, 4)
    keys = np.stack([batch.keys for batch in batches])
    ids = np.stack([batch.dense_ids for batch in batches])
    for field in range(TINY_SHAPE.fields):
        pairs = np.unique(np.stack([keys[:, field].ravel(), ids[:, field].ravel().astype(np.uint64)]),
                          axis=1)
        # one id per key and one key per id
        assert len(np.unique(pairs[0])) == pairs.shape[1] == len(np.unique(pairs[1]))
    assert ids.min() >= 0 and ids.max() < TINY_SHAPE.capacity


def test_dense_ids_refuse_more_distinct_keys_than_capacity():
    keys = np.arange(30, dtype=np.uint64).reshape(1, 1, 30)
    with pytest.raises(ValueError, match="capacity=10"):
        dense_ids_per_field(keys, capacity=10)


@pytest.mark.parametrize("field, value", [("batch_size", 0), ("dim", -1), ("capacity", 0)])
def test_workload_shape_names_bad_sizes(field, value):
    arguments = dict(batch_size=4, fields=2, dim=4, capacity=10)
    arguments[field] = value
    with pytest.raises(ValueError, match=f"{field} must be an integer >= 1, got {value}"):
        WorkloadShape(**arguments)


def test_dense_batches_look_like_criteo():
    batch = make_dense_batches(batch_size=512, n_dense=13, n_batches=1)[0]
    assert batch.dense.shape == (512, 13) and batch.dense.dtype == np.float32
    assert batch.dense.min() >= 0  # log1p of counts
    assert set(np.unique(batch.labels)) == {0.0, 1.0}


# ---- command line -----------------------------------------------------------------------

@pytest.mark.parametrize("option, value, message", [
    ("--batch-size", "0", "--batch-size: must be an integer >= 1, got 0"),
    ("--repeats", "x", "--repeats: must be an integer >= 1, got 'x'"),
    ("--zipf", "1.0", "--zipf: must be a number > 1, got 1.0"),
    ("--systems", "torch,tensorflow", "--systems: systems must be a comma-separated subset"),
])
def test_bad_options_are_rejected_with_the_option_and_value(option, value, message, capsys):
    with pytest.raises(SystemExit):
        embedding.main([option, value])
    assert message in capsys.readouterr().err


def test_parse_system_names_keeps_order_and_rejects_empty():
    assert parse_system_names("torchrec, torch") == ("torchrec", "torch")
    with pytest.raises(ValueError, match="subset"):
        parse_system_names(" , ")


# ---- systems ----------------------------------------------------------------------------

def _build_or_skip(system_class):
    try:
        return system_class(TINY_SHAPE)
    except ImportError as error:
        pytest.skip(f"{system_class.name} is not available: {error}")


@pytest.mark.parametrize("system_class", [HybridrecSystem, TorchEmbeddingBagSystem,
                                          TorchRecSystem])
def test_each_system_pools_and_applies_its_update(system_class):
    torch.manual_seed(0)
    system = _build_or_skip(system_class)
    batch = make_sparse_batches(TINY_SHAPE, 1)[0]
    prepared = system.prepare(batch)
    before = system.pooled(prepared)
    assert before.shape == (TINY_SHAPE.batch_size, TINY_SHAPE.fields, TINY_SHAPE.dim)
    before.backward(torch.ones_like(before))
    system.step()
    after = system.pooled(prepared).detach()
    # Adagrad moves every looked-up weight against a positive gradient.
    assert torch.all(after < before.detach())
    assert system.bytes_per_row() > 0


def _assert_train_alike(first, second, batches) -> None:
    """Both systems give the same pooled rows before every step and after the last one,
    when trained on the same batches with the same upstream gradient."""
    gradient = torch.randn(TINY_SHAPE.batch_size, TINY_SHAPE.fields, TINY_SHAPE.dim)
    for batch in batches:
        inputs = (first.prepare(batch), second.prepare(batch))
        outputs = (first.pooled(inputs[0]), second.pooled(inputs[1]))
        torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-5, atol=1e-6)
        for system, output in zip((first, second), outputs):
            output.backward(gradient)
            system.step()
    torch.testing.assert_close(first.pooled(inputs[0]), second.pooled(inputs[1]),
                               rtol=1e-5, atol=1e-6)


def test_torch_and_torchrec_peers_do_the_same_adagrad_work():
    """The comparison is fair only if both peers train identically: same start, same
    gradients, so the same rows after every step."""
    torch.manual_seed(0)
    torch_peer = TorchEmbeddingBagSystem(TINY_SHAPE)
    torchrec_peer = _build_or_skip(TorchRecSystem)
    weights = torchrec_peer.collection.state_dict()
    with torch.no_grad():
        for field, name in enumerate(TINY_SHAPE.feature_names):
            weights[f"embedding_bags.table_{name}.weight"].copy_(torch_peer.bags[field].weight)
    _assert_train_alike(torch_peer, torchrec_peer, make_sparse_batches(TINY_SHAPE, 3))


def test_hybridrec_does_the_same_adagrad_work_as_the_torch_peer():
    """hybridrec's hashed uint64 rows, started from the torch peer's values for the same
    keys, must stay equal to the peer's dense-id rows through several training steps."""
    torch.manual_seed(0)
    hybridrec = _build_or_skip(HybridrecSystem)
    torch_peer = TorchEmbeddingBagSystem(TINY_SHAPE)
    batches = make_sparse_batches(TINY_SHAPE, 3)
    with torch.no_grad():  # give the torch peer hybridrec's initial row of every key
        for field, name in enumerate(TINY_SHAPE.feature_names):
            keys = np.concatenate([batch.keys[field] for batch in batches])
            ids = np.concatenate([batch.dense_ids[field] for batch in batches])
            rows = hybridrec.collection.stores[f"table_{name}"].pull(keys, insert=True)
            torch_peer.bags[field].weight[torch.from_numpy(ids)] = torch.from_numpy(rows)
    _assert_train_alike(hybridrec, torch_peer, batches)


# ---- reports ----------------------------------------------------------------------------

def test_summary_ratios_pair_repetitions():
    results = [SystemResult("hybridrec", Throughput((4.0, 9.0, 2.0)), bytes_per_row=96),
               SystemResult("torch", Throughput((2.0, 3.0, 2.0))),
               SystemResult("torchrec", error="ImportError: no fbgemm")]
    summary = summarize(results, "lookups_per_s", SYSTEM_NAMES, settings={})
    assert summary["hybridrec_lookups_per_s"] == 4.0
    assert summary["hybridrec_over_torch"] == 2.0  # median of 2, 3, 1
    assert summary["torchrec_lookups_per_s"] is None
    assert summary["hybridrec_over_torchrec"] is None
    assert summary["errors"] == {"torchrec": "ImportError: no fbgemm"}
    assert summary["bytes_per_row"] == 96


@pytest.mark.parametrize("bench_module, unit", [(embedding, "lookups_per_s"),
                                             (e2e, "samples_per_s")])
def test_benchmark_prints_one_json_line_with_documented_keys(bench_module, unit, capsys):
    returned = bench_module.main([*TINY, "--json"])
    summary = _single_json_line(capsys.readouterr().out)
    assert summary == json.loads(json.dumps(returned))
    for name in SYSTEM_NAMES:
        _check_system_entry(summary, name, unit)
    assert _positive_rate(summary[f"torch_{unit}"])
    for key in ("bytes_per_row", "hybridrec_over_torch", "hybridrec_over_torchrec"):
        assert key in summary
    if summary[f"hybridrec_{unit}"] is not None:
        assert summary["bytes_per_row"] >= 4 * summary["settings"]["dim"]  # at least the weights


def test_bench_tiers_with_a_dense_step_loses_no_row_and_reports_the_step(capsys):
    report = tiers.main(["--batches", "4", "--segment", "2", "--batch-size", "128", "--memory-fraction", "0.5",
                         "--eviction-capacity", "300", "--dense-ms", "1", "--json"])
    assert report["lost_rows"] == 0 and report["tiered"]["rows_on_disk"] > 0
    assert report["dense_step"]["width"] >= 8 and report["dense_step"]["ms"] > 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["dense_step"] == report["dense_step"]


def test_e2e_reports_the_dlrm_top_mlp_input():
    summary = e2e.main([*TINY, "--systems", "torch"])
    fields, dim = 3, 4
    assert summary["top_mlp_input"] == dim + (fields + 1) * fields // 2
    assert summary["settings"]["top_mlp"][0] == summary["top_mlp_input"]


def test_e2e_measures_the_systems_asked_for_with_the_dense_only_floor(capsys):
    returned = e2e.main([*TINY, "--systems", "hybridrec,dense_only", "--wide-fields", "0", "--json"])
    summary = _single_json_line(capsys.readouterr().out)
    assert summary == json.loads(json.dumps(returned))
    assert _positive_rate(summary["dense_only_samples_per_s"])
    assert len(summary["dense_only_samples_per_s_runs"]) == summary["settings"]["repeats"]
    _check_system_entry(summary, "hybridrec", "samples_per_s")
    assert _positive_rate(summary["hybridrec_over_dense_only"])
    assert summary["torch_samples_per_s"] is None  # not asked for
    assert summary["wide"] is None


def test_e2e_refuses_an_unknown_system_naming_the_allowed_ones(capsys):
    with pytest.raises(SystemExit):
        e2e.main([*TINY, "--systems", "hybridrec,dense"])
    error = capsys.readouterr().err
    assert "--systems" in error and "dense_only" in error and "'hybridrec,dense'" in error


def test_the_dense_only_system_has_no_lookup_and_no_update():
    system = e2e.FixedEmbeddings(TINY_SHAPE)
    pooled = system.pooled(system.prepare(make_sparse_batches(TINY_SHAPE, 1)[0]))
    assert pooled.shape == (TINY_SHAPE.batch_size, TINY_SHAPE.fields, TINY_SHAPE.dim)
    before = pooled.detach().clone()
    pooled.backward(torch.ones_like(pooled))
    system.step()
    assert system.table.grad is None
    torch.testing.assert_close(system.pooled(None).detach(), before)


@pytest.mark.parametrize("name", sorted({**BENCHMARKS, **BENCH_TOOLS}))
def test_every_bench_mode_has_help_from_the_command_line(name):
    completed = subprocess.run([sys.executable, "-m", "hybridrec.cli", "bench", name, "--help"],
                               capture_output=True, text=True, timeout=120, cwd=REPO)
    assert completed.returncode == 0, completed.stderr
    assert f"hybridrec bench {name}" in completed.stdout


def test_a_bench_mode_runs_from_the_command_line():
    completed = subprocess.run(
        [sys.executable, "-m", "hybridrec.cli", "bench", "embedding", *TINY, "--systems", "torch", "--json"],
        capture_output=True, text=True, timeout=120, cwd=REPO)
    assert completed.returncode == 0, completed.stderr
    assert _positive_rate(_single_json_line(completed.stdout)["torch_lookups_per_s"])


@pytest.mark.parametrize("script", sorted((REPO / "scripts" / "dev").glob("*.py")), ids=lambda p: p.name)
def test_developer_scripts_import_and_have_help(script):
    completed = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True,
                               timeout=120, cwd=REPO)
    assert completed.returncode == 0, completed.stderr
    assert "usage:" in completed.stdout


def _dev_script_report(name: str, *args: str) -> dict:
    """The one JSON line a developer script prints at a tiny size."""
    completed = subprocess.run([sys.executable, str(REPO / "scripts" / "dev" / name), "--batch-size", "64", *args],
                               capture_output=True, text=True, timeout=300, cwd=REPO)
    assert completed.returncode == 0, completed.stderr
    return _single_json_line(completed.stdout)


def test_the_cpu_budget_script_reports_its_terms_and_a_bound_of_at_most_one():
    report = _dev_script_report("e2e_cpu_budget.py", "--batches", "3", "--warmup", "1", "--rounds", "1")
    times = [value for key, value in report.items() if key.endswith("_ms")]
    assert len(times) == 5 and all(value >= 0 for value in times)
    assert 0 < report["bound_over_dense_only"] <= 1


def test_the_phase_timing_script_reports_finite_times():
    report = _dev_script_report("embedding_phases.py", "--capacity", "4000", "--batches", "2", "--warmup", "1")
    assert len(report) == 8 and all(_positive_rate(value) for value in report.values())
