"""The sharded placement (PICASSO, issue 19) on real process groups: N trainer processes (gloo,
spawned here) each train on their part of the same global batches that one process trains on
whole with the local placement, and must end with the same model:

- 2 trainers, sharded, equal the local run within float tolerance (dense parameters, every
  embedding row's weights and optimizer state), with multi-hot features (sum and mean pooling),
  a table shared by two features, wide and deep tables, under SGD and Adagrad; with packing on
  and off (the plain per-table lookup), and D-interleaved in micro-batches (one update per
  batch), with and without K-interleaving's pipelined groups;
- the fused Unique&Partition routes every key where the global route hash (the PS client's)
  sends it, and packing cuts the operations of a step by more than 5x;
- after every step of hot_cold, every trainer's copy of a hot row is identical, and equal to the
  owner's row in the same run without the cache;
- a checkpoint written by 2 trainers loads into 1 and into 3 (each takes the keys the route
  hash gives it; every row comes back).
Every 2-trainer task runs in one spawn of two processes (starting them costs more than the tasks).
"""
from __future__ import annotations

import os
import pickle
import socket
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hybridrec.config import parse_config
from hybridrec.data.synthetic import SyntheticConfig, SyntheticReader
from hybridrec.embedding.hashing import route, table_route_id
from hybridrec.job.tables import job_tables
from hybridrec.strategy import build_strategy
from hybridrec.strategy.placement.sharded import ShardedPlacement
from hybridrec.embedding.stream import ReadyBatch
from hybridrec.strategy.world import World
from hybridrec.train.setup import dense_model, seed_everything
from hybridrec.train.step import forward_backward

torch.set_num_threads(1)

BATCH, STEPS, DIM = 64, 4, 4  # rows per trainer and step


def job(optimizer: str = "adagrad", strategy: dict | None = None, batch: int = BATCH, model: str = "deepfm") -> dict:
    lr = {"adagrad": 0.1, "sgd": 0.05}[optimizer]
    return {
        "seed": 7,
        "data": {"format": "synthetic", "batch_size": batch,
                 "synthetic": {"n_categorical": 5, "n_multi_hot": 2, "multi_hot_max_length": 4, "n_dense": 3,
                               "vocab_size": 200, "train_rows": 4096, "test_rows": 256, "id_weight_std": 0.5}},
        "model": {"name": model, "embedding_dim": DIM, "hparams": {"hidden": [8]}},
        "embedding": {"default": {"capacity": 4000, "optimizer": {"name": optimizer, "lr": lr}},
                      "shared": {"pair": {"features": ["C1", "C2"]}},
                      "per_feature": {"M1": {"pooling": "mean"}},
                      "wide": {"optimizer": {"name": optimizer, "lr": lr * 2}}},
        "train": {"progress": False, "threads": 1, "dense_optimizer": {"name": "adam", "lr": 0.01}},
        **({"strategy": strategy} if strategy else {}),
    }


def global_batches(cfg_data: dict, world_size: int, steps: int = STEPS) -> list:
    """`steps` global batches of world_size * BATCH rows."""
    syn = cfg_data["data"]["synthetic"]
    config = SyntheticConfig(**{k: v for k, v in syn.items() if k not in ("train_rows", "test_rows")})
    reader = SyntheticReader(config, syn["train_rows"], BATCH * world_size, seed=cfg_data["seed"])
    out = []
    for batch in reader:
        out.append(batch)
        if len(out) == steps:
            return out
    raise AssertionError("not enough rows")


def train_steps(cfg_data: dict, world: World, batches: list, on_step=None, finish=None) -> dict:
    """Train on `batches` (this trainer's parts) step by step as the loop does, then call
    `finish(placement)` if given; the final dense parameters and this trainer's embedding rows
    {table: {key: (weights, state)}}."""
    cfg = parse_config(cfg_data)
    seed_everything(cfg.seed, 1, True)
    tables = job_tables(cfg)
    strategy = build_strategy(cfg, tables, world)
    placement = strategy.placement
    model = dense_model(cfg, tables)
    dense = strategy.make_dense(model)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    connection = placement.connect()
    try:
        for index, batch in enumerate(batches):
            ready = ReadyBatch(index, batch, connection.lookup(connection.prepare(batch), train=True), 0)
            dense.begin_step()
            inputs, _, _ = forward_backward(placement, dense, ready, loss_fn, torch.device("cpu"))
            connection.update(ready.looked, inputs.gradients())
            dense.finish_step()
            if on_step is not None:
                on_step(index, placement)
    finally:
        connection.close()
    if finish is not None:
        finish(placement)
    out = {"dense": {k: v.detach().numpy().copy() for k, v in model.state_dict().items()},
           "rows": rows_of(placement), "facts": placement.facts()}
    placement.close()
    return out


def rows_of(placement) -> dict:
    if isinstance(placement, ShardedPlacement):
        stores = placement.shards.stores
    else:  # the local placement
        stores = {t: s for c in placement.collections.values() for t, s in c.stores.items()}
    out = {}
    for table, store in stores.items():
        e = store.export()
        out[table] = {int(k): (w, s) for k, w, s in zip(e["keys"], e["weights"], e["state"])}
    return out


def merged(parts: list[dict]) -> dict:
    out: dict = {}
    for part in parts:
        for table, rows in part.items():
            assert not set(rows) & set(out.get(table, {})), f"{table}: a key on two trainers"
            out.setdefault(table, {}).update(rows)
    return out


def assert_same_model(got: dict, want: dict, rtol=2e-4, atol=2e-6) -> None:
    for name, value in want["dense"].items():
        np.testing.assert_allclose(got["dense"][name], value, rtol=rtol, atol=atol, err_msg=name)
    assert set(got["rows"]) == set(want["rows"])
    for table, rows in want["rows"].items():
        assert set(got["rows"][table]) == set(rows), table
        keys = sorted(rows)
        for part in (0, 1):
            np.testing.assert_allclose(np.stack([got["rows"][table][k][part] for k in keys]),
                                       np.stack([rows[k][part] for k in keys]), rtol=rtol, atol=atol,
                                       err_msg=f"{table} {'weights' if part == 0 else 'state'}")


# ---------------------------------------------------------------------------------- the processes
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, size: int, port: int, tasks: list, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=size)
    torch.set_num_threads(1)
    # DDP's note on the multi-task head's [T, H, 1] gradient strides (the trainer filters it too)
    warnings.filterwarnings("ignore", message="Grad strides do not match bucket view strides")
    try:
        results = [TASKS[task](rank, size, payload) for task, payload in tasks]
    except BaseException:
        dist.destroy_process_group()
        raise
    Path(out, f"rank{rank}.pkl").write_bytes(pickle.dumps(results))
    os._exit(0)  # as test_des_distributed's workers: no interpreter teardown, where a gloo rank has aborted


def run_ranks(size: int, tasks: list, tmp: Path) -> list:
    """Run `tasks` ((name, payload) pairs) one after the other on `size` spawned trainers (one
    spawn: starting the processes costs more than the tasks); per task, each rank's result."""
    out = tmp / f"ranks-{size}-{os.urandom(3).hex()}"
    out.mkdir(parents=True)
    mp.start_processes(_worker, args=(size, _free_port(), tasks, str(out)), nprocs=size, start_method="spawn")
    per_rank = [pickle.loads((out / f"rank{r}.pkl").read_bytes()) for r in range(size)]
    return [[per_rank[r][t] for r in range(size)] for t in range(len(tasks))]


def _my_batches(cfg_data: dict, rank: int, size: int) -> list:
    return [b.slice_rows(rank * BATCH, (rank + 1) * BATCH) for b in global_batches(cfg_data, size)]


def _train_task(rank: int, size: int, cfg_data: dict) -> dict:
    return train_steps(cfg_data, World(rank, size), _my_batches(cfg_data, rank, size))


def _hot_task(rank: int, size: int, cfg_datas: tuple) -> list:
    """The hot_cold job and the same job without the cache, step by step side by side: after each
    step, this trainer's hot rows, and its own rows of every key (owner's view) in the sync job."""
    hot_cfg, sync_cfg = cfg_datas
    world = World(rank, size)
    batches = _my_batches(hot_cfg, rank, size)
    snapshots: list = [{} for _ in batches]

    def hot_step(index, placement):
        snapshots[index]["hot"] = {(pack.tables[t], int(k)): np.array(row)
                                   for pack, hot in zip(placement.shards.packs, placement.shards.hot_sets)
                                   for t in range(len(pack.tables))
                                   for k, row in zip(hot.table_meta(t).view(np.uint64)[:, 0], hot.table_rows(t))}
        snapshots[index]["hit_rate"] = placement.facts()["hot_hit_rate"]

    def sync_step(index, placement):
        snapshots[index]["owned"] = rows_of(placement)

    train_steps(hot_cfg, world, batches, hot_step)
    train_steps(sync_cfg, world, batches, sync_step)
    return snapshots


def _write_checkpoint_task(rank: int, size: int, payload: tuple) -> dict:
    cfg_data, directory = payload

    def write_checkpoint(placement) -> None:
        placement.stage(Path(directory).parent, 1)
        dist.barrier()
        if rank == 0:
            placement.save(Path(directory))
        dist.barrier()

    trained = train_steps(cfg_data, World(rank, size), _my_batches(cfg_data, rank, size), finish=write_checkpoint)
    return {"rows": trained["rows"]}


TASKS = {"train": _train_task, "hot": _hot_task, "write": _write_checkpoint_task}


# ---------------------------------------------------------------------------------- the tests
def local_reference(cfg_data: dict, size: int) -> dict:
    return train_steps(cfg_data, World(), global_batches(cfg_data, size))


SHARDED = {"preset": "picasso", "consistency": "sync"}
VARIANTS = {  # (optimizer, strategy.picasso)
    "sgd, packed": ("sgd", {"interleaving": False}),
    "sgd, unpacked": ("sgd", {"packing": False, "interleaving": False}),
    "adagrad, packed": ("adagrad", {"interleaving": False}),
    "adagrad, unpacked, micro-batched": ("adagrad", {"packing": False, "interleaving": True, "micro_batches": 2}),
    "adagrad, micro-batched": ("adagrad", {"interleaving": True, "micro_batches": 3}),
    "adagrad, micro-batched, pipelined groups, split packs": ("adagrad", {"interleaving": True, "micro_batches": 2,
                                                                          "k_groups": 3, "split_packs": True}),
}
HOT = {"interleaving": False, "warmup_iters": 1, "flush_iters": 1, "hot_rows": 40}


@pytest.fixture(scope="module")
def two_trainers(tmp_path_factory):
    """Every 2-trainer task in one spawn: the variants' training, the hot_cold job beside the same
    job without the cache, and a checkpoint written by both trainers."""
    tmp = tmp_path_factory.mktemp("sharded")
    directory = tmp / "checkpoint" / "embeddings"
    tasks = [("train", job(opt, {**SHARDED, "picasso": picasso})) for opt, picasso in VARIANTS.values()]
    tasks.append(("hot", (job("adagrad", {"preset": "picasso", "picasso": HOT}),
                          job("adagrad", {**SHARDED, "picasso": HOT}))))
    tasks.append(("write", (job("adagrad", {**SHARDED, "picasso": {"interleaving": False}}), str(directory))))
    results = run_ranks(2, tasks, tmp)
    return {"train": dict(zip(VARIANTS, results[:len(VARIANTS)])), "hot": results[-2], "write": results[-1],
            "directory": directory, "tmp": tmp}


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_two_sharded_trainers_train_the_model_one_local_process_trains(two_trainers, optimizer):
    want = local_reference(job(optimizer), 2)
    for name, ranks in two_trainers["train"].items():
        if not name.startswith(optimizer):
            continue
        got = {"dense": ranks[0]["dense"], "rows": merged([r["rows"] for r in ranks])}
        for r in ranks[1:]:  # DDP keeps the replicas identical
            for k, v in r["dense"].items():
                np.testing.assert_array_equal(v, ranks[0]["dense"][k])
        try:
            assert_same_model(got, want)
        except AssertionError as error:
            raise AssertionError(f"{name}: {error}") from None
        for rank, r in enumerate(ranks):  # each trainer holds the keys the route hash gives it
            for table, rows in r["rows"].items():
                keys = np.array(sorted(rows), np.uint64)
                assert (route(keys, table_route_id(table), 2) == rank).all(), (name, table)


def test_packing_on_and_off_give_the_same_outputs_and_gradients():
    """One process (a world of one): the packed kernels and the per-table operations make the same
    embedding inputs and give the stores the same gradients, step after step."""
    results = {}
    for packing in (True, False):
        data = job("adagrad", {**SHARDED, "picasso": {"packing": packing, "interleaving": False}})
        outputs = []
        cfg = parse_config(data)
        seed_everything(cfg.seed, 1, True)
        tables = job_tables(cfg)
        placement = build_strategy(cfg, tables, World()).placement
        connection = placement.connect()
        for batch in global_batches(data, 1):
            step = connection.lookup(batch, train=True)
            inputs = placement.inputs(step, batch, requires_grad=True)
            loss = inputs.deep.square().sum() + (inputs.wide * torch.arange(inputs.wide.shape[1])).sum()
            loss.backward()
            outputs.append((inputs.deep.detach().numpy().copy(), inputs.wide.detach().numpy().copy()))
            connection.update(step, {})
        connection.close()
        results[packing] = (outputs, rows_of(placement), placement.facts()["ops_per_step"])
    for (deep_a, wide_a), (deep_b, wide_b) in zip(results[True][0], results[False][0]):
        np.testing.assert_array_equal(deep_a, deep_b)
        np.testing.assert_array_equal(wide_a, wide_b)
    assert_same_model({"dense": {}, "rows": results[True][1]}, {"dense": {}, "rows": results[False][1]},
                      rtol=1e-6, atol=1e-7)


def test_unique_partition_routes_by_the_global_route_hash_and_packing_cuts_the_operations():
    from hybridrec.picasso import packing as P

    data = job("adagrad", {**SHARDED, "picasso": {"interleaving": False}})
    data["data"]["synthetic"].update(n_categorical=26, n_multi_hot=0)
    data["embedding"].pop("shared")
    data["embedding"].pop("per_feature")
    cfg = parse_config(data)
    placement = ShardedPlacement(cfg, job_tables(cfg), World())
    batch = global_batches(data, 1, steps=1)[0]
    sp = batch.sparse
    for world in (2, 3, 5):
        for pack, hot in zip(placement.shards.packs, placement.shards.hot_sets):
            T = len(pack.tables)
            slots, send = np.empty(len(sp.values), np.int64), np.empty(len(sp.values), np.uint64)
            counts = np.empty((world, T), np.int64)
            n = P.unique_partition(sp.values, sp.offsets, sp.batch_size, pack.positions(sp.names), pack.tab_seg,
                                   pack.table_index, pack.salts, world, hot.index_keys, hot.index_tables,
                                   hot.index_rows, slots, send, counts, np.empty(T, np.int64), np.empty(T, np.int64))
            start = 0
            for w in range(world):
                for t, table in enumerate(pack.tables):
                    keys = send[start:start + counts[w, t]]
                    assert (route(keys, table_route_id(table), world) == w).all()
                    start += counts[w, t]
            assert start == n
    # operations per step, packing on and off (PICASSO Table V): at least 5x fewer with packing
    ops = {}
    for packing in (True, False):
        data["strategy"]["picasso"] = {"packing": packing, "interleaving": False}
        cfg = parse_config(data)
        placement = ShardedPlacement(cfg, job_tables(cfg), World())
        connection = placement.connect()
        step = connection.lookup(batch, train=True)
        inputs = placement.inputs(step, batch, requires_grad=True)
        (inputs.deep.sum() + inputs.wide.sum()).backward()
        connection.update(step, {})
        ops[packing] = placement.facts()["ops_per_step"]["total"]
    assert ops[False] >= 5 * ops[True], ops


def test_hot_rows_are_identical_on_every_trainer_and_equal_the_owners_rows_without_the_cache(two_trainers):
    ranks = two_trainers["hot"]
    seen_hot = 0
    for step in range(STEPS):
        hot = [r[step]["hot"] for r in ranks]
        assert set(hot[0]) == set(hot[1])
        for key in hot[0]:
            np.testing.assert_array_equal(hot[0][key], hot[1][key])  # every copy identical
        owned = merged([r[step]["owned"] for r in ranks])
        for (table, key), row in hot[0].items():
            weights, state = owned[table][key]  # the row the owner holds without the cache
            np.testing.assert_allclose(row, np.concatenate([weights, state]), rtol=1e-5, atol=1e-6)
        seen_hot += len(hot[0])
        assert len(hot[0]) == (HOT["hot_rows"] if step >= HOT["warmup_iters"] - 1 else 0)
    assert seen_hot > 0
    assert ranks[0][-1]["hit_rate"] > 0.05


def test_a_checkpoint_of_two_trainers_loads_into_one_and_into_three(two_trainers):
    data = job("adagrad", {**SHARDED, "picasso": {"interleaving": False}})
    directory = two_trainers["directory"]
    assert sorted(p.name for p in directory.iterdir()) == ["shard-0000-of-0002", "shard-0001-of-0002"]
    want = merged([r["rows"] for r in two_trainers["write"]])
    cfg = parse_config(data)
    loaded = {}
    for size in (1, 3):  # loading reads files only: the trainers of a world of 3 are made here, in turn
        loaded[size] = []
        for rank in range(size):
            placement = build_strategy(cfg, job_tables(cfg), World(rank, size)).placement
            placement.load(directory)
            loaded[size].append({"rows": rows_of(placement)})
    for size, ranks in loaded.items():
        got = merged([r["rows"] for r in ranks])
        assert_same_model({"dense": {}, "rows": got}, {"dense": {}, "rows": want}, rtol=0, atol=0)
        for rank, r in enumerate(ranks):
            for table, rows in r["rows"].items():
                keys = np.array(sorted(rows), np.uint64)
                assert (route(keys, table_route_id(table), size) == rank).all()
