"""Tests of `hybridrec bench e2e` with threads: the JSON keys of both models, the pipelined
hybridrec system, and that the pipelined bench step trains what the plain one trains."""
import json

import numpy as np
import torch

from hybridrec.benchmarks import e2e
from hybridrec.benchmarks.peers import HybridrecSystem
from hybridrec.benchmarks.timing import TimingPlan
from hybridrec.benchmarks.workload import WorkloadShape, make_dense_batches, make_sparse_batches

TINY = ["--batch-size", "64", "--fields", "3", "--dim", "4", "--capacity", "2000",
        "--warmup", "1", "--batches", "2", "--repeats", "2"]
KEYS = ("hybridrec_samples_per_s", "hybridrec_pipelined_samples_per_s", "hybridrec_bf16_samples_per_s",
        "torch_samples_per_s", "dense_only_samples_per_s", "hybridrec_over_dense_only", "hybridrec_over_torch",
        "hybridrec_over_torchrec", "hybridrec_over_hybridrec_pipelined", "threads", "pipeline")


def test_threads_json_has_both_models_with_the_documented_keys(capsys):
    returned = e2e.main([*TINY, "--threads", "2", "--wide-fields", "5", "--wide-capacity", "3000", "--json"])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert len(lines) == 1
    summary = json.loads(lines[0])
    assert summary == json.loads(json.dumps(returned))
    for part in (summary, summary["wide"]):
        for key in KEYS:
            assert key in part, key
        assert part["threads"] == 2
        assert part["hybridrec_samples_per_s"] > 0 and part["dense_only_samples_per_s"] > 0
        assert 0 < part["pipeline"]["shared_row_fraction"] <= 1
    assert summary["wide"]["settings"]["mlp"] == [5 * 4 + 13, 512, 256, 1]
    assert summary["top_mlp_input"] == 4 + (3 + 1) * 3 // 2


def test_with_threads_the_pipelined_step_runs_beside_the_default_one(capsys):
    summary = e2e.main([*TINY, "--threads", "2", "--wide-fields", "0", "--systems", "hybridrec,hybridrec_pipelined"])
    assert summary["pipeline"]["shared_row_fraction"] > 0  # figures only the pipelined step has
    assert summary["hybridrec_samples_per_s"] > 0 and summary["hybridrec_over_hybridrec_pipelined"] > 0
    one_thread = e2e.main([*TINY, "--wide-fields", "0", "--systems", "hybridrec,hybridrec_pipelined"])
    assert "pipeline" not in one_thread and one_thread["hybridrec_pipelined_samples_per_s"] is None


def test_the_pipelined_bench_step_trains_what_the_plain_step_trains():
    shape = WorkloadShape(batch_size=64, fields=3, dim=4, capacity=300, zipf_exponent=1.3)
    plan = TimingPlan(warmup=2, batches=3, repeats=2)
    sparse = make_sparse_batches(shape, plan.total_batches)
    dense = make_dense_batches(shape.batch_size, 13, plan.total_batches)
    pipelines = []
    systems = []
    for system in (HybridrecSystem(shape), e2e.PipelinedHybridrec(shape)):
        run = e2e.training_step_runner(system, sparse, dense, shape, 13, plan=plan, pipelines=pipelines)
        for index in range(plan.total_batches):
            run(index)
        systems.append(system)
    for stream in pipelines:
        stream.drain(30)
        stream.close()
    plain, piped = (s.collection.stores for s in systems)
    for table in plain:
        a, b = plain[table].export(), piped[table].export()
        for field in a:
            np.testing.assert_array_equal(a[field], b[field], err_msg=f"{table} {field}")
    assert pipelines[0].figures["shared_rows"] > 0
    torch.set_num_threads(1)
