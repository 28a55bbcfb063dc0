"""The staleness lab (hybridrec.lab): one emulated worker trains the local strategy's model bit for
bit under every discipline; a seed replays a run bit for bit and another schedule changes it; and
over random schedules every read sees exactly the updates the stores applied before it, all
those its bound requires and none that were not computed yet (HET: every row served within both
of CheckValid's clock bounds)."""
import numpy as np
import pytest
import torch
from helpers import small_config, trained_state
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridrec.embedding.kernels import M_CLOCK
from hybridrec.errors import UserError
from hybridrec.lab import Schedule, emulate, parse
from hybridrec.train.trainer import train

ROWS = {"data.synthetic.train_rows": 8192, "data.synthetic.test_rows": 2048, "data.batch_size": 256,
        "train.threads": 1}
# each discipline at the bounds that allow no staleness, and (ht, easgd) with averaging that
# leaves one copy alone until its last sync
UNSTALE = ["sync", "hybrid:tau=0", "async:tau=0,tau_dense=0", "ssp:s=0", "het:s=0",
           "ht:groups=1,tau=0,alpha=1,period=1000000", "easgd:tau=0,alpha=1,period=1000000"]


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    cfg = small_config(tmp_path_factory.mktemp("lab"), "local", **ROWS)
    metrics = train(cfg, overwrite=True)
    return cfg, metrics, trained_state(cfg)


def _rows(placement):
    return {(c, t): store.export() for c, col in placement.collections.items() for t, store in col.stores.items()}


@pytest.mark.parametrize("spec", UNSTALE)
def test_one_worker_trains_the_local_model_bit_for_bit(local_run, spec):
    cfg, metrics, (dense, rows) = local_run
    run = emulate(cfg, parse(spec), 1, Schedule(3, visibility=0.5))
    state = run.model.state_dict()
    if spec.startswith(("ht", "easgd")):  # the result is the centre: compare the group's trained copy
        state = {name: torch.from_numpy(value) for name, value in run.dense.trained_copies[0].items()}
        assert run.result["elastic_syncs"] == 1  # the last one only
    else:
        assert (run.result["auc"], run.result["logloss"]) == (metrics["auc"], metrics["logloss"])
    assert state.keys() == dense.keys()
    assert all(torch.equal(state[name], dense[name]) for name in dense)
    emulated = _rows(run.placement)
    assert emulated.keys() == rows.keys()
    for table, exported in rows.items():
        for field in ("keys", "weights", "state"):
            assert np.array_equal(emulated[table][field], exported[field]), (table, field)


# rows come in blocks of 4096, dealt to the workers: 4 workers need 4 blocks
FOUR = {**ROWS, "data.synthetic.train_rows": 16384, "data.synthetic.test_rows": 1024, "data.batch_size": 512}
STALE = ["hybrid:tau=2", "async:tau=1,tau_dense=1", "ssp:s=2", "het:s=2", "ht:groups=2,tau=1,period=2"]


@pytest.mark.parametrize("spec", STALE)
def test_a_seed_replays_bit_for_bit_and_another_schedule_changes_the_run(tmp_path, spec):
    cfg = small_config(tmp_path, **FOUR)
    runs = [emulate(cfg, parse(spec), 4, Schedule(seed, visibility=0.5)) for seed in (7, 7, 8)]
    states = [run.model.state_dict() for run in runs]
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    assert runs[0].result["auc"] == runs[1].result["auc"]
    assert not all(torch.equal(states[0][k], states[2][k]) for k in states[0])


class _BoundChecker:
    """Watches every embedding event of a run: each read's rows must hold exactly the updates
    applied before it (the stores' own row clocks against the applies seen), and the applies must
    satisfy the bound."""

    def __init__(self, workers: int, bound: int, lockstep: bool):
        self.workers, self.bound, self.lockstep = workers, bound, lockstep
        self.rows_of = {}  # (worker, step) -> [(store, rows)] of its update
        self.applied_rows = {}  # (id(store), row) -> updates applied
        self.computed = np.zeros(workers, np.int64)
        self.applied = np.zeros(workers, np.int64)
        self.reads = 0

    def __call__(self, event, worker, step, looked=None, applied=None):
        if event == "enqueue":
            assert step == self.computed[worker]  # each worker's steps in order
            self.rows_of[worker, step] = [(store, rows.copy()) for ahead in looked.values()
                                          for store, rows in ahead.rows_by_store()]
            self.computed[worker] += 1
        elif event == "apply":
            assert step == self.applied[worker] < self.computed[worker]  # in order, and computed first
            for store, rows in self.rows_of.pop((worker, step)):
                for row in rows.tolist():
                    self.applied_rows[id(store), row] = self.applied_rows.get((id(store), row), 0) + 1
            self.applied[worker] += 1
        else:
            self.reads += 1
            assert np.array_equal(applied, self.applied)
            # required: every update of a step before step - bound, as far as computed
            assert np.all(self.applied >= np.minimum(step - self.bound, self.computed))
            if self.lockstep:  # every earlier round was computed, none of this one
                assert np.all(self.computed == step)
            for ahead in looked.values():
                for store, rows in ahead.rows_by_store():
                    clocks = store.meta[rows, M_CLOCK]
                    expected = [self.applied_rows.get((id(store), row), 0) for row in rows.tolist()]
                    assert clocks.tolist() == expected


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(["sync", "hybrid", "async", "ssp", "ht"]), workers=st.integers(1, 4),
       bound=st.integers(0, 3), visibility=st.sampled_from([0.0, 0.3, 0.8, 1.0]), seed=st.integers(0, 2**20))
def test_every_read_sees_what_its_bound_requires_and_what_was_applied_before_it(tmp_path, name, workers, bound,
                                                                                visibility, seed):
    cfg = small_config(tmp_path, **FOUR)
    spec = name if name == "sync" else f"{name}:{'s' if name == 'ssp' else 'tau'}={bound}"
    if name == "ht":
        spec += f",groups={1 if workers % 2 else 2},period=2"
    discipline = parse(spec)
    checker = _BoundChecker(workers, discipline.bound, discipline.lockstep)
    emulate(cfg, discipline, workers, Schedule(seed, visibility=visibility), observer=checker)
    assert checker.reads > 0 and not checker.rows_of  # every update applied by the end


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(workers=st.integers(2, 4), s=st.integers(0, 3), seed=st.integers(0, 2**20))
def test_het_serves_every_row_within_both_clock_bounds_of_the_server(tmp_path, workers, s, seed):
    """CheckValid at every read: c_c <= c_s + s in the cache and c_g <= c_c + s at the server."""
    cfg = small_config(tmp_path, **{**FOUR, "data.batch_size": 128, "strategy.het.cache_rows": 150})
    served = []

    def check(event, worker, step, keys, read, cache, stores):
        for table, table_keys in keys.items():
            rows = read.rows_of[table]
            server, _ = stores[table].clocks(table_keys)
            assert np.all(cache[table].cc[rows] <= cache[table].cs[rows] + s)
            assert np.all(server <= cache[table].cc[rows] + s)
            served.append(len(rows))

    result = emulate(cfg, parse(f"het:s={s}"), workers, Schedule(seed), observer=check).result
    assert sum(served) == result["cache_reads"] > 0
    assert result["clock_gaps"]["count"] > 0


def test_the_schedule_orders_each_members_read_before_its_write_and_keeps_within_bounds():
    schedule = Schedule(5, visibility=0.5)
    for _ in range(50):
        events = schedule.hogwild([0, 1, 2])
        assert sorted(events) == sorted([("read", m) for m in range(3)] + [("write", m) for m in range(3)])
        assert all(events.index(("read", m)) < events.index(("write", m)) for m in range(3))
        seen = schedule.visible(np.array([2, 0, 5]), np.array([6, 3, 5]))
        assert np.all(seen >= [2, 0, 5]) and np.all(seen <= [6, 3, 5])
    assert np.array_equal(Schedule(5).visible(np.array([1, 2]), np.array([4, 4])), [1, 2])  # worst case
    assert np.array_equal(Schedule(5, visibility=1.0).visible(np.array([1, 2]), np.array([4, 4])), [4, 4])


@pytest.mark.parametrize("spec, message", [("hybird:tau=1", "unknown name 'hybird'"),
                                           ("hybrid:s=1", "hybrid takes tau=..."),
                                           ("ht:groups=x", "groups='x' is not a number"),
                                           ("sync:tau=2", "sync takes no parameters")])
def test_a_wrong_discipline_is_refused_naming_what_is_allowed(spec, message):
    with pytest.raises(UserError, match=message):
        parse(spec)


def test_groups_that_do_not_divide_the_workers_are_refused(tmp_path):
    with pytest.raises(UserError, match="groups 3 do not divide 4 workers"):
        emulate(small_config(tmp_path, **ROWS), parse("ht:groups=3"), 4)


def _ahead_trace(rounds: int) -> list[dict]:
    """Two trainers' recorded times (midpoints, seconds): round s's dense step ends at 10s + 5, each
    trainer's update of round s lands at 10s + 6 (trainer 0) and 10s + 7 (trainer 1); trainer 0
    reads two rounds ahead (its step t at 10(t-2) + 6.2, before trainer 1's update of round t-2
    lands), trainer 1 one round ahead (its step t at 10(t-1) + 7.5): trainer 0's read of step t
    comes before trainer 1's read of step t-1, with an update between them."""
    def pairs(mids, half):
        return np.array([(m - half, m + half) for m in mids], np.float64).reshape(-1, 2)
    reads = [[10 * (t - 2) + 6.2 for t in range(rounds)], [10 * (t - 1) + 7.5 for t in range(rounds)]]
    applies = [[10 * s + 6 + q for s in range(rounds)] for q in range(2)]
    return [{"lookups": pairs(reads[q], 0.1), "updates": pairs(applies[q], 0.4)} for q in range(2)]


@pytest.mark.parametrize("spec", [f"hybrid:tau={1 << 30}", f"async:tau={1 << 30},tau_dense={1 << 30}"])
def test_a_replay_makes_each_read_when_the_job_made_it_even_ahead_of_another_trainers_earlier_step(tmp_path, spec):
    from hybridrec.lab.trace import RecordedSchedule

    trace = _ahead_trace(16)  # FOUR's rows give 2 workers 16 rounds
    schedule = RecordedSchedule(trace)
    saw = {}
    emulate(small_config(tmp_path, **FOUR), parse(spec), 2, schedule,
            observer=lambda event, worker, step, applied=None, **_: event == "read" and
            saw.setdefault((worker, step), applied.tolist()))
    assert len(saw) == 32
    for (worker, step), applied in saw.items():
        when = trace[worker]["lookups"][step].mean()
        assert applied == [int(np.searchsorted(trace[q]["updates"].mean(axis=1), when)) for q in range(2)], (worker,
                                                                                                           step)
    assert schedule.departures == 0


def _dense_trace(rounds: int, versions: bool) -> list[dict]:
    """Two trainers' dense pulls and pushes (midpoints): trainer 1's step t pulls at 10t + 2 and
    pushes at 10t + 4, trainer 0's pulls at 10t + 1 and pushes at 10t + 13, after trainer 1's pull of
    step t + 1 (which holds trainer 1's step t, not trainer 0's). Shard 0 applies the pushes as they
    land; shard 1 applies trainer 1's step t before trainer 0's step t - 1 (they land 1 s apart, no
    pull between them). `versions`: the shards' numbers recorded, as a job records them."""
    pulls = {(0, t): 10 * t + 1 for t in range(rounds)} | {(1, t): 10 * t + 2 for t in range(rounds)}
    pushes = {(0, t): 10 * t + 13 for t in range(rounds)} | {(1, t): 10 * t + 4 for t in range(rounds)}
    shard0 = sorted(pushes, key=pushes.get)
    shard1 = sorted(pushes, key=lambda key: pushes[key] - 1.5 * (key[0] == 1))
    assert shard0 != shard1 and shard0 != sorted(pulls, key=pulls.get)
    orders = (shard0, shard1)
    trace = []
    for q in range(2):
        entry = {"lookups": np.array([(pulls[q, t] - .1, pulls[q, t] + .1) for t in range(rounds)]),
                 "updates": np.array([(pushes[q, t] - .4, pushes[q, t] + .4) for t in range(rounds)])}
        if versions:
            entry["update_versions"] = np.array([[o.index((q, t)) + 1 for o in orders] for t in range(rounds)])
            entry["lookup_versions"] = np.array([[sum(pushes[key] < pulls[q, t] for key in o) for o in orders]
                                                 for t in range(rounds)])
        trace.append(entry)
    return trace


@pytest.mark.parametrize("versions", [True, False])
def test_an_async_replay_applies_the_dense_pushes_in_each_shards_order_and_reads_what_each_pull_read(tmp_path,
                                                                                                 versions):
    """The dense copy a replayed step computes on holds exactly the pushes its pull read: each shard's
    store applies the job's pushes in that shard's order (not in the order the steps were taken),
    and each step reads every shard at the version its pull read."""
    from hybridrec.lab.trace import RecordedSchedule

    dense = _dense_trace(16, versions)
    schedule = RecordedSchedule(_ahead_trace(16), dense)
    plan = schedule.dense_plan()
    run = emulate(small_config(tmp_path, **FOUR), parse(f"async:tau={1 << 30},tau_dense={1 << 30}"), 2, schedule)
    assert (plan.source, plan.shards) == (("versions", 2) if versions else ("times", 1))
    assert run.dense.pushed == plan.order and run.dense.reads == plan.reads and len(plan.reads) == 32
    # trainer 1's pull of step 5 holds its own step 4, not trainer 0's step 4 (pulled before it)
    held = [set(order[:count]) for order, count in zip(plan.order, plan.reads[1, 5])]
    assert all((1, 4) in h and (0, 4) not in h and (0, 3) in h for h in held)
    assert run.result["schedule"]["dense_plan"] == plan.source
    # trainer 0's step t missed trainer 1's step t and its own t - 1, and on shard 1 trainer 1's t + 1
    assert run.result["dense_staleness"]["max"] == (3 if versions else 2)
    assert run.result["dense_staleness"]["count"] == 32


def _store_trace(cfg, trace: list[dict], landing, served=lambda q, i, k, when: when) -> list[dict]:
    """`trace` (lookups and updates in time) with the numbers a job's two PS servers give: every
    update reaches every store (table, server), landing on server k at `landing(worker, step, k)`;
    a lookup reads, on each store of server k, the updates landed there before `served(worker,
    step, k, its midpoint)`."""
    from hybridrec.job.tables import job_tables

    names = [f"{table}@{k}" for table in sorted(job_tables(cfg).all_tables()) for k in range(2)]
    orders = []
    for k in range(2):
        landed = sorted((landing(q, s, k), q, s) for q, t in enumerate(trace) for s in range(len(t["updates"])))
        orders.append(landed)
    out = []
    for q, t in enumerate(trace):
        numbers = [[next(n + 1 for n, (_, w, s) in enumerate(orders[k]) if (w, s) == (q, i)) for k in range(2)]
                   for i in range(len(t["updates"]))]
        reads = [[sum(when < served(q, i, k, t["lookups"][i].mean()) for when, _, _ in orders[k]) for k in range(2)]
                 for i in range(len(t["lookups"]))]
        columns = len(names) // 2
        out.append({**t, "columns": np.array(names), "update_versions": np.array([row * columns for row in numbers]),
                    "lookup_versions": np.array([row * columns for row in reads])})
    return out


def test_a_replay_applies_each_stores_updates_in_that_stores_order_and_reads_what_each_lookup_read(tmp_path):
    """The job's servers apply one step's embedding updates in orders of their own (server 1 here
    the reverse of server 0 and of the updates' midpoints): the replay splits each update into its
    stores' parts, lands each store's in that store's order, and makes every read on the updates
    each store held when the job's lookup was served there."""
    from hybridrec.lab.trace import RecordedSchedule

    cfg = small_config(tmp_path, **FOUR)
    times = _ahead_trace(16)
    trace = _store_trace(cfg, times, lambda q, s, k: 10 * s + 6 + (q if k == 0 else 1 - q))
    schedule = RecordedSchedule(trace)
    plan = schedule.embedding_plan()
    assert plan is not None and plan.inversions == 0 and len(plan.columns) == len(trace[0]["columns"])
    on = {k: plan.order[k] for k in range(2)}
    assert on[0][:2] == [(0, 0), (1, 0)] and on[1][:2] == [(1, 0), (0, 0)]  # server 1 against the midpoints
    spec = f"hybrid:tau={1 << 30}"
    run = emulate(cfg, parse(spec), 2, schedule)
    assert run.embeddings.read_counts == plan.reads and len(plan.reads) == 32
    assert run.embeddings.departures == 0 and run.embeddings.landed == [len(order) for order in plan.order]
    assert run.result["schedule"]["embedding_plan"] == "versions"
    # trainer 0's read of step 2 held its own update of step 0 on server 0, trainer 1's on server 1
    read = plan.reads[0, 2]
    assert [plan.order[k][:read[k]] for k in (0, 1)] == [[(0, 0)], [(1, 0)]]
    by_times = emulate(cfg, parse(spec), 2, RecordedSchedule(times))
    assert by_times.result["schedule"]["embedding_plan"] == "times"
    assert not torch.equal(_rows_of(run)[0], _rows_of(by_times)[0])


def test_a_read_two_servers_answered_in_opposite_orders_sees_each_store_as_it_was_then(tmp_path):
    """Server 1 answers trainer 1's lookup before trainer 0's, server 0 the other way round, with an
    update between them on each: no order of the two reads is exact on every store. The replay
    makes the later one on each store as it was (the weights its newer parts overwrote put back
    for the read), so every read still sees exactly what the job's did."""
    from hybridrec.lab.trace import RecordedSchedule

    cfg = small_config(tmp_path, **FOUR)
    trace = _store_trace(cfg, _ahead_trace(16), lambda q, s, k: 10 * s + 6 + (q if k == 0 else 1 - q),
                         served=lambda q, i, k, when: when + (0 if k == 0 else (1.4 if q == 0 else -1.0)))
    schedule = RecordedSchedule(trace)
    plan = schedule.embedding_plan()
    assert plan.inversions > 0
    run = emulate(cfg, parse(f"hybrid:tau={1 << 30}"), 2, schedule)
    assert run.embeddings.departures == 0 and run.embeddings.read_counts == plan.reads


def _rows_of(run) -> list[torch.Tensor]:
    return [torch.from_numpy(store.export()["weights"]) for c in run.placement.collections.values()
            for store in c.stores.values()]


def test_a_one_trainer_trace_with_store_numbers_replays_the_local_model_bit_for_bit(local_run):
    """Every update split into its stores' parts and landed part by part gives the model the
    local strategy trains: the parts hold each row's whole summed gradient, once."""
    from hybridrec.lab.trace import RecordedSchedule

    cfg, metrics, (dense, rows) = local_run
    steps = 8192 // 256
    times = [{"lookups": np.array([(10.0 * i, 10.0 * i + 1) for i in range(steps)]),
              "updates": np.array([(10.0 * i + 5, 10.0 * i + 6) for i in range(steps)])}]
    schedule = RecordedSchedule(_store_trace(cfg, times, lambda q, s, k: 10.0 * s + 5.5))
    run = emulate(cfg, parse(f"hybrid:tau={1 << 30}"), 1, schedule)
    assert run.embeddings.departures == 0 and schedule.embedding_plan() is not None
    assert (run.result["auc"], run.result["logloss"]) == (metrics["auc"], metrics["logloss"])
    emulated = _rows(run.placement)
    for table, exported in rows.items():
        for field in ("keys", "weights", "state"):
            assert np.array_equal(emulated[table][field], exported[field]), (table, field)
