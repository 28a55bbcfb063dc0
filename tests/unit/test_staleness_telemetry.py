"""How a real job's lookups are told how stale they were (hybridrec.persia.staleness): each
trainer's timeline of lookups and acknowledged updates, merged into the steps of every trainer
each lookup may have missed; and the emulator's replay of such a trace (hybridrec.lab.trace)."""
import numpy as np
import pytest

from hybridrec.errors import UserError
from hybridrec.lab.trace import RecordedSchedule
from hybridrec.metrics import StalenessHistogram
from hybridrec.persia.staleness import TRACE_FILE, StalenessTelemetry, Timeline, joined, missed_steps
from hybridrec.strategy.world import World


def _timeline(lookups, updates):
    t = Timeline()
    t.lookups = [(sent, sent + 0.5) for sent in lookups]
    t.updates = [(acked - 0.5, acked) for acked in updates]
    return t


# trainer 1's first update is acknowledged late (at 12), after trainer 0's second lookup (10)
TRAINERS = [_timeline([0, 10, 20], [5, 15, 25]), _timeline([1, 11, 21], [12, 30, 31])]


def test_a_lookup_missed_the_steps_before_it_whose_update_was_not_acknowledged_when_it_was_sent():
    missed = missed_steps([t.arrays() for t in TRAINERS])
    assert missed[0].tolist() == [[0, 0], [0, 1], [0, 1]]
    assert missed[1].tolist() == [[0, 0], [0, 1], [0, 1]]


def test_the_job_reports_each_lookups_most_missed_steps_and_writes_the_trace(tmp_path):
    telemetry = StalenessTelemetry(tmp_path)
    telemetry.add(TRAINERS[0])
    facts = telemetry.facts(World())  # a world of one: trainer 0 alone
    assert facts["staleness_cross"]["buckets"] == {"0": 3}
    assert (tmp_path / TRACE_FILE).is_file()


def test_the_histogram_buckets_by_powers_of_two_and_reads_back():
    h = StalenessHistogram()
    h.add([0, 1, 2, 3, 4, 7, 8, 100])
    d = h.as_dict()
    assert d["buckets"] == {"0": 1, "1": 1, "2-3": 2, "4-7": 2, "8-15": 1, "64-127": 1}
    assert (d["count"], d["max"], d["sum"]) == (8, 100, 125)
    assert StalenessHistogram.from_dict(d).as_dict() == d
    with pytest.raises(ValueError, match=">= 0"):
        h.add([-1])


def test_a_replay_reads_what_the_jobs_reads_saw_and_lands_updates_in_the_jobs_order():
    schedule = RecordedSchedule([t.arrays() for t in TRAINERS])
    # trainer 0's step 1 was served at 10.25: trainer 0's update 0 (applied ~4.75) was in, trainer 1's (11.75) not
    assert schedule.visible(np.array([0, 0]), np.array([1, 1]), worker=0, step=1).tolist() == [1, 0]
    # within the bound's requirement and what was computed, whatever the job saw
    assert schedule.visible(np.array([1, 1]), np.array([1, 1]), worker=0, step=1).tolist() == [1, 1]
    assert schedule.order([0, 1], 2) == [0, 1]
    assert schedule.apply_order(np.array([2, 1]), np.array([0, 0])).tolist() == [0, 1, 0]


def test_a_directory_without_a_trace_is_refused_naming_the_file(tmp_path):
    with pytest.raises(UserError, match=TRACE_FILE):
        RecordedSchedule.from_job(tmp_path)


def test_lookups_of_batches_never_trained_are_left_out_and_epochs_stay_aligned():
    """At an epoch's end a trainer may look up a batch it then skips (another trainer had none):
    it has no update, missed nothing that was trained, and must not shift the next epoch's steps."""
    first = _timeline([0, 10, 20], [5, 15])  # the batch looked up at 20 was skipped
    second = _timeline([30, 40], [35, 45])
    joined_steps = joined([first, second])
    assert joined_steps["lookups"][:, 0].tolist() == [0, 10, 30, 40]
    assert len(joined_steps["updates"]) == 4
    other = _timeline([1, 11, 31, 41], [6, 16, 36, 46]).arrays()
    assert max(m.max() for m in missed_steps([joined_steps, other])) == 0


def test_the_shards_versions_are_written_with_the_times_and_cut_as_the_lookups(tmp_path):
    """ps_async's timelines carry the PS shards' versions per pull and push; the trace keeps them
    step for step with the times (a skipped batch's pull left out), and the lab reads them back."""
    from hybridrec.lab.trace import load_trace

    first, second = _timeline([0, 10, 20], [5, 15]), _timeline([30], [35])  # 20: looked up, skipped
    first.lookup_versions, first.update_versions = [[0, -1], [1, -1], [2, -1]], [[1, -1], [2, -1]]
    second.lookup_versions, second.update_versions = [[2, -1]], [[3, -1]]
    telemetry = StalenessTelemetry(tmp_path, trace_file="dense.npz")
    telemetry.add(first)
    telemetry.add(second)
    telemetry.facts(World())
    trace = load_trace(tmp_path / "dense.npz")[0]
    assert trace["lookup_versions"].tolist() == [[0, -1], [1, -1], [2, -1]]
    assert trace["update_versions"][:, 0].tolist() == [1, 2, 3] and len(trace["lookups"]) == 3
    plan = RecordedSchedule([{"lookups": trace["lookups"], "updates": trace["updates"]}], [trace]).dense_plan()
    assert plan.source == "versions" and plan.order[0] == [(0, 0), (0, 1), (0, 2)] and plan.order[1] == []


def test_the_embedding_stores_numbers_are_written_per_store_over_every_epochs_columns(tmp_path):
    """An embedding lookup's and update's numbers come per table and PS server; the trace keeps one
    column per store ("<table>@<server>"), -1 where a lookup or update did not reach it, over the
    stores of every epoch (a store first reached in the second epoch too), and the lab reads the
    stores' orders back from it."""
    from hybridrec.lab.trace import load_trace

    first, second = _timeline([0, 10], [5, 15]), _timeline([30], [35])
    first.note_versions("lookup_versions", {"a": [0, 0]})
    first.note_versions("update_versions", {"a": [1, -1]})  # the first update's keys were all on server 0
    first.note_versions("lookup_versions", {"a": [1, 0]})
    first.note_versions("update_versions", {"a": [2, 1]})
    second.note_versions("lookup_versions", {"b": [0], "a": [2, 1]})
    second.note_versions("update_versions", {"a": [3, 2], "b": [1]})
    telemetry = StalenessTelemetry(tmp_path)
    telemetry.add(first)
    telemetry.add(second)
    telemetry.facts(World())
    trace = load_trace(tmp_path / TRACE_FILE)[0]
    assert trace["columns"].tolist() == ["a@0", "a@1", "b@0"]
    assert trace["lookup_versions"].tolist() == [[0, 0, -1], [1, 0, -1], [2, 1, 0]]
    assert trace["update_versions"].tolist() == [[1, -1, -1], [2, 1, -1], [3, 2, 1]]
    plan = RecordedSchedule([trace]).embedding_plan()
    assert plan.columns == [("a", 0), ("a", 1), ("b", 0)]
    assert plan.order == [[(0, 0), (0, 1), (0, 2)], [(0, 1), (0, 2)], [(0, 2)]]
    assert plan.reads[0, 2] == {0: 2, 1: 1, 2: 0} and plan.read_order == [(0, 0), (0, 1), (0, 2)]


def test_store_numbers_that_skip_an_update_leave_the_replay_to_the_times():
    """Numbers that do not count a store's updates one after another (another client pushed, or an
    update went unnumbered) give no order: the replay falls back on midpoints."""
    t = _timeline([0, 10], [5, 15])
    t.note_versions("lookup_versions", {"a": [0]})
    t.note_versions("update_versions", {"a": [1]})
    t.note_versions("lookup_versions", {"a": [1]})
    t.note_versions("update_versions", {"a": [3]})
    assert RecordedSchedule([joined([t])]).embedding_plan() is None
