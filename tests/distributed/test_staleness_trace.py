"""A real job records the staleness of its lookups: final_metrics.json's histogram of the steps of
every trainer each lookup may have missed (and ps_async's of its dense pulls), and the traces the
staleness lab replays: the replay reads exactly the job's lookups, its dense copies as the job's
pulls found them (the PS shards' versions), with the pushes applied in each shard's order, and its
embedding rows as each PS store held them when it served the job's lookup, each store's updates
applied in that store's order (the stores' numbers)."""
import json

import torch
from helpers import finish, start_launch, write_config

from hybridrec.config import load_config
from hybridrec.lab import emulate, parse
from hybridrec.lab.trace import RecordedSchedule
from hybridrec.persia.staleness import DENSE_TRACE_FILE, TRACE_FILE
from hybridrec.train.checkpoint import latest_checkpoint, model_state, read_dense


def test_an_async_job_records_its_staleness_and_the_lab_replays_it(tmp_path):
    config = write_config(tmp_path, threads=1)
    log = tmp_path / "launch.log"
    code = finish(start_launch(config, log, "--set", "strategy.dense=ps_async", "--set",
                               "data.synthetic.train_rows=16384"), log)
    assert code == 0, log.read_text()[-3000:]
    run = tmp_path / "run"
    metrics = json.loads((run / "final_metrics.json").read_text())
    lookups = metrics["staleness_cross"]["count"]
    assert lookups == 16384 // 256  # every training lookup of both trainers
    assert metrics["staleness_cross"]["max"] <= metrics["samples"]
    assert metrics["dense_staleness_cross"]["count"] == lookups
    assert (run / TRACE_FILE).is_file() and (run / DENSE_TRACE_FILE).is_file()
    # the model the trainers scored and the leader saved is the PS's final one, every push applied
    checkpoint = latest_checkpoint(run)
    saved, final = read_dense(checkpoint)["model"], model_state(checkpoint)
    assert all(torch.equal(saved[name], final[name]) for name in final)
    schedule = RecordedSchedule.from_job(run)
    plan = schedule.dense_plan()  # the PS shards numbered every push once, in the order they applied them
    assert (plan.source, plan.shards) == ("versions", 2) and sum(map(len, plan.order)) == 2 * lookups
    cfg = load_config(config, ["data.synthetic.train_rows=16384"])
    replayed = emulate(cfg, parse("async:tau=1000000,tau_dense=1000000"), 2, schedule)
    replay = replayed.result
    assert len(replayed.embeddings.read_counts) == lookups and replay["samples"] == metrics["samples"]
    # every step computed on what its pull read, every shard applied the pushes in its own order
    assert replayed.dense.pushed == plan.order and replayed.dense.reads == plan.reads
    assert 0.5 < replay["auc"] < 1
    # the embedding side as each PS store (a table on one server) numbered it: every update of both
    # trainers once in the order of each store it reached, and each lookup replayed on what each
    # store had applied when it served the job's lookup (unless the job's lookups admit no order
    # that never takes a store's count back: its two servers answer one lookup at two instants)
    stores = schedule.embedding_plan()
    assert stores is not None and {shard for _, shard in stores.columns} == {0, 1}
    assert all(len(set(order)) == len(order) <= lookups for order in stores.order)
    assert set().union(*map(set, stores.order)) == {(w, i) for w in range(2) for i in range(lookups // 2)}
    assert len(stores.reads) == lookups and replayed.embeddings.landed == [len(o) for o in stores.order]
    if stores.inversions == 0:
        assert replayed.embeddings.departures == 0 and replayed.embeddings.read_counts == stores.reads


def test_a_sync_job_of_two_trainers_looks_up_no_batch_before_both_trainers_updates_of_the_step_before(tmp_path):
    """Sync reads no stale row: not even the other trainer's update of the step before may still be
    unacknowledged when a lookup is sent (the histogram counts each lookup's most such steps)."""
    config = write_config(tmp_path, threads=1)
    log = tmp_path / "launch.log"
    code = finish(start_launch(config, log, "--set", "strategy.consistency=sync", "--set",
                               "data.synthetic.train_rows=16384"), log)
    assert code == 0, log.read_text()[-3000:]
    metrics = json.loads((tmp_path / "run" / "final_metrics.json").read_text())
    assert metrics["staleness_cross"]["count"] == 16384 // 256
    assert metrics["staleness_cross"]["max"] == 0
