"""Stream sources on their own (no training): the files and redis backends read every record once,
continue exactly after a recorded position, skip and count bad records with their place, split
the stream among trainers, and acknowledge Redis entries only when told a checkpoint covers them."""
import os
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from helpers import redis_server  # noqa: F401 (a fixture)
from hybridrec.data.criteo import CRITEO_SCHEMA
from hybridrec.data.stream import StreamContext, open_source, parse_stream_options
from hybridrec.data.stream.backends.files import file_sample_ids
from hybridrec.data.synthetic import write_synthetic

BATCH = 256


def _partition(root: Path, name: str, rows: int, seed: int, done: bool = True, bad_line: int | None = None) -> None:
    directory = root / name
    directory.mkdir(parents=True)
    write_synthetic(directory / "part-0.tsv", rows, seed=seed)
    if bad_line is not None:
        lines = (directory / "part-0.tsv").read_bytes().split(b"\n")
        lines[bad_line] = b"1\tnot-a-number" + lines[bad_line][1:]
        (directory / "part-0.tsv").write_bytes(b"\n".join(lines))
    if done:
        (directory / "_SUCCESS").touch()


def _files(root, rank=0, trainers=1, **options):
    spec = {"backend": "files", "path": str(root), "idle_timeout": 0.3, "poll_interval": 0.05, **options}
    return open_source(spec, StreamContext(CRITEO_SCHEMA, BATCH, rank=rank, trainers=trainers))


def _drain(source, train_until=None):
    """(sample ids of the batches trained, state after them) reading `source` to its idle end, or
    training only the first `train_until` batches (the rest are read but never trained)."""
    trained = []
    for index, batch in enumerate(source):
        if train_until is not None and index >= train_until:
            continue
        source.trained(batch)
        trained.append(batch.sample_ids)
    return (np.concatenate(trained) if trained else np.empty(0, np.uint64)), source.state()


def _expected(root: Path, rows: dict[str, int]) -> Counter:
    return Counter(np.concatenate([file_sample_ids(f"{name}/part-0.tsv", np.arange(n)) for name, n in rows.items()])
                   .tolist())


def test_files_reads_complete_partitions_in_name_order_and_continues_after_a_position(tmp_path):
    _partition(tmp_path, "dt=02", 700, seed=2)
    _partition(tmp_path, "dt=01", 500, seed=1)
    _partition(tmp_path, "dt=03", 300, seed=3, done=False)  # no _SUCCESS yet: not read
    source = _files(tmp_path)
    source.start(None)
    first, state = _drain(source, train_until=3)
    # batches end with their file: 256 + 244 rows of dt=01, then 256 of dt=02
    assert state["position"] == {"file": "dt=02/part-0.tsv", "row": BATCH}
    assert Counter(first.tolist()) == Counter(file_sample_ids("dt=01/part-0.tsv", np.arange(500)).tolist()
                                              + file_sample_ids("dt=02/part-0.tsv", np.arange(BATCH)).tolist())
    (tmp_path / "dt=03" / "_SUCCESS").touch()
    again = _files(tmp_path)
    again.start(state)  # a restart from the recorded position reads exactly what was not trained
    rest, final = _drain(again)
    assert Counter(first.tolist()) + Counter(rest.tolist()) == _expected(tmp_path, {"dt=01": 500, "dt=02": 700,
                                                                                   "dt=03": 300})
    assert final["records"] == 1500 and final["position"] == {"file": "dt=03/part-0.tsv", "row": None}


def test_files_bad_line_is_counted_with_file_and_line_and_the_stream_goes_on(tmp_path, caplog):
    _partition(tmp_path, "dt=01", 600, seed=1, bad_line=300)
    _partition(tmp_path, "dt=02", 200, seed=2)
    source = _files(tmp_path)
    source.start(None)
    trained, state = _drain(source)
    assert len(trained) == 799 and state["bad_records"] == 1
    assert source.bad_examples == [f"{tmp_path}/dt=01/part-0.tsv:301: column 2 (I1): not a number "
                                   "(value 'not-a-number')"]
    assert int(file_sample_ids("dt=01/part-0.tsv", np.array([300]))[0]) not in set(trained.tolist())


def test_files_rename_convention_skips_hidden_names_and_shares_split_the_files(tmp_path):
    for index in range(6):
        write_synthetic(tmp_path / f"part-{index}.tsv", 100 + index, seed=index)
    write_synthetic(tmp_path / ".part-6.tsv.tmp", 50, seed=9)  # still being written
    shares = []
    for rank in range(2):
        source = _files(tmp_path, rank=rank, trainers=2, complete="rename")
        source.start(None)
        shares.append(Counter(_drain(source)[0].tolist()))
    assert not set(shares[0]) & set(shares[1]) and all(shares)
    whole = Counter()
    for index in range(6):
        whole.update(file_sample_ids(f"part-{index}.tsv", np.arange(100 + index)).tolist())
    assert shares[0] + shares[1] == whole


def test_stream_options_are_checked_with_their_key():
    with pytest.raises(ValueError, match=r"data.stream.backend: 'kafka' is not a stream backend; allowed: "
                                         r"\['files', 'redis'\]"):
        parse_stream_options({"backend": "kafka"})
    with pytest.raises(ValueError, match="data.stream.complete"):
        parse_stream_options({"backend": "files", "path": "x", "complete": "sometimes"})
    with pytest.raises(ValueError, match="data.stream.pth: not a key of backend 'files'"):
        parse_stream_options({"backend": "files", "pth": "x"})
    with pytest.raises(ValueError, match="redis://HOST:PORT/STREAM"):
        parse_stream_options({"backend": "redis", "url": "redis://127.0.0.1:6379"})


# ------------------------------------------------------------------------------------------ redis
def _redis(server, rank=0, trainers=1, **options):
    spec = {"backend": "redis", "url": server.url("clicks"), "group": "job", "idle_timeout": 0.3,
            "poll_interval": 0.05, **options}
    return open_source(spec, StreamContext(CRITEO_SCHEMA, BATCH, rank=rank, trainers=trainers))


def _produce(server, rows=1000, seed=0, broken=()):
    from hybridrec.data.stream.backends.redis import entry_sample_ids
    from hybridrec.data.stream.producer import produce, synthetic_lines

    lines = list(synthetic_lines(rows, seed=seed))
    for index in broken:
        lines[index] = b"2" + lines[index][1:]  # label 2: not a binary label
    produced = produce(server.url("clicks"), lines, keep_ids=True)
    return produced, entry_sample_ids(produced.ids)


def test_redis_acknowledges_only_what_a_checkpoint_covers_and_a_restart_trains_the_rest(redis_server):
    import redis

    produced, ids = _produce(redis_server, 1000)
    client = redis.Redis(port=redis_server.port)
    source = _redis(redis_server)
    source.prepare(fresh=True)
    source.start(None)
    first, state = _drain(source, train_until=2)  # trains 2 batches, reads the rest, then "crashes"
    assert client.xpending("clicks", "job")["pending"] == 1000  # nothing acknowledged without a checkpoint
    source.commit(state)
    assert client.xpending("clicks", "job")["pending"] == 1000 - 2 * BATCH
    source.close()
    again = _redis(redis_server)
    again.prepare(fresh=False)
    again.start(state)  # reads its pending entries first: those after the checkpoint's position
    rest, final = _drain(again)
    assert Counter(first.tolist()) + Counter(rest.tolist()) == Counter(ids.tolist())
    assert final["records"] == 1000
    again.commit(final)
    assert client.xpending("clicks", "job")["pending"] == 0


def test_redis_pending_entries_a_checkpoint_covers_are_skipped_after_a_crash(redis_server):
    produced, ids = _produce(redis_server, 600)
    source = _redis(redis_server)
    source.prepare(fresh=True)
    source.start(None)
    trained, state = _drain(source)  # everything trained, the checkpoint written, the acknowledgement lost
    source.close()
    again = _redis(redis_server)
    again.start(state)
    rest, final = _drain(again)
    assert len(rest) == 0 and final["records"] == 600
    import redis

    assert redis.Redis(port=redis_server.port).xpending("clicks", "job")["pending"] == 0


def test_redis_bad_entry_is_counted_with_its_id_and_acknowledged_with_the_rest(redis_server):
    produced, ids = _produce(redis_server, 700, broken=(350,))
    redis_client = __import__("redis").Redis(port=redis_server.port)
    redis_client.xadd("clicks", {"label": "1", "I1": "3", "C1": "68fd1e64"})  # a field map
    source = _redis(redis_server)
    source.prepare(fresh=True)
    source.start(None)
    trained, state = _drain(source)
    assert len(trained) == 700 and state["bad_records"] == 1
    assert source.bad_examples == [f"clicks entry {produced.ids[350].decode()}: column 1 (label): label is not a "
                                   "number (or not 0/1 where labels are binary) (value '2')"]
    source.commit(state)
    assert redis_client.xpending("clicks", "job")["pending"] == 0


def test_redis_consumers_of_one_group_share_the_entries(redis_server):
    produced, ids = _produce(redis_server, 2000)
    sources = [_redis(redis_server, rank=r, trainers=2) for r in range(2)]
    sources[0].prepare(fresh=True)
    got = Counter()
    iterators = []
    for source in sources:
        source.start(None)
        iterators.append(iter(source))
    active = list(range(2))
    while active:  # alternate, as two trainers would
        for r in list(active):
            batch = next(iterators[r], None)
            if batch is None:
                active.remove(r)
                continue
            sources[r].trained(batch)
            got.update(batch.sample_ids.tolist())
    assert got == Counter(ids.tolist())
    assert all(s.state()["records"] > 0 for s in sources)


def test_producer_rate_and_synthetic_rows(redis_server):
    from hybridrec.data.stream.producer import parse_rate, produce, synthetic_lines

    produced = produce(redis_server.url("paced"), synthetic_lines(3000, seed=1), rate=parse_rate("10000/s"),
                       chunk=500)
    assert produced.count == 3000 and produced.seconds >= 0.25
    with pytest.raises(ValueError, match="--rate"):
        parse_rate("fast")


def test_redis_field_maps_parse_by_the_schema_and_lag_follows_the_event_time(redis_server):
    import time

    import redis

    from hybridrec.data.tabular import TabularSchema

    schema = TabularSchema(labels=("click",), categorical=("user", "item"), dense=("price",), event_time="ts",
                           column_names=("click", "user", "item", "price", "ts"))
    client = redis.Redis(port=redis_server.port)
    now = time.time()
    for i in range(10):
        client.xadd("events", {"click": str(i % 2), "user": f"u{i}", "item": "i7", "price": "1.5",
                               "ts": str(now - 3600 + i)})
    client.xadd("events", {"line": f"1,u99,i8,2.0,{now - 60}"})  # a line in the schema's column order
    source = open_source({"backend": "redis", "url": redis_server.url("events"), "idle_timeout": 0.3,
                          "poll_interval": 0.05}, StreamContext(schema, 4))
    source.prepare(fresh=True)
    source.start(None)
    trained, state = _drain(source)
    assert len(trained) == 11 and state["bad_records"] == 0
    assert 55 <= source.lag()["lag_seconds"] < 120  # behind the newest record's ts, not its entry's time


def test_data_stream_command_writes_a_file_or_synthetic_rows(redis_server, tmp_path, capsys):
    import redis

    from hybridrec.cli import main

    source = tmp_path / "rows.tsv"
    write_synthetic(source, 120, seed=3)
    assert main(["data", "stream", "--to", redis_server.url("cli"), "--from", str(source)]) == 0
    assert main(["data", "stream", "--to", redis_server.url("cli"), "--synthetic", "80", "--rate", "100000/s"]) == 0
    assert redis.Redis(port=redis_server.port).xlen("cli") == 200
    assert "wrote 80 entries" in capsys.readouterr().out
    assert main(["data", "stream", "--to", redis_server.url("cli")]) == 2  # neither --from nor --synthetic
    assert main(["data", "stream", "--to", "redis://127.0.0.1:6379", "--synthetic", "5"]) == 2  # no stream named


def test_an_unreachable_redis_is_one_clear_error(capsys):
    pytest.importorskip("redis")
    import socket

    from hybridrec.cli import main

    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    assert main(["data", "stream", "--to", f"redis://127.0.0.1:{port}/s", "--synthetic", "5"]) == 2
    assert f"cannot use Redis at 127.0.0.1:{port}" in capsys.readouterr().err
