"""DES (issue 22) on real process groups: N trainer processes (gloo, spawned here) run the one
training loop with `strategy.preset: des` and are held to one process training the same model on
the same global batches with the local placement:

- for LR, FM, Wide&Deep and DeepFM on 2 and 3 trainers: the logits of every training step, the
  losses, the test metrics, and after the run every parameter: the dense model's (and its
  optimizer's state) and every embedding row (weights and optimizer state), all within float
  tolerance;
- every collective the trainers ran is logged and counted: the only float tensors that crossed
  between them are the [B, P] partial results (P = the partial results' width, never an
  embedding row), one AllReduce per step, and each trainer's tables hold its own fields only;
- a run checkpointed and resumed ends where the uninterrupted run ends; the end-to-end path
  through `hybridrec train` (torchrun) works, and `hybridrec eval` reads a DES checkpoint.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import pickle
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hybridrec.config import parse_config
from hybridrec.embedding import EmbeddingStore
from hybridrec.train import step as train_step
from hybridrec.train.trainer import train
from hybridrec.train.checkpoint import latest_checkpoint

torch.set_num_threads(1)

BATCH, STEPS, FIELDS, DIM, HIDDEN, TEST_ROWS = 128, 4, 5, 4, 8, 256
MODELS = {"lr": {}, "fm": {}, "wide_deep": {"hidden": [HIDDEN, 4]}, "deepfm": {"hidden": [HIDDEN]}}
PARTIAL_WIDTH = {"lr": 1, "fm": 1 + 2 * DIM, "wide_deep": 1 + HIDDEN, "deepfm": 1 + 2 * DIM + HIDDEN}


def job(name: str, output_dir: Path, strategy: dict | None = None, **train) -> dict:
    return {
        "seed": 5,
        "data": {"format": "synthetic", "batch_size": BATCH,
                 "synthetic": {"n_categorical": FIELDS - 2, "n_multi_hot": 2, "multi_hot_max_length": 3,
                               "n_dense": 3, "vocab_size": 400, "train_rows": BATCH * STEPS, "test_rows": TEST_ROWS,
                               "id_weight_std": 0.5}},
        "model": {"name": name, "embedding_dim": DIM, "hparams": MODELS[name]},
        "embedding": {"default": {"capacity": 4000, "optimizer": {"name": "adagrad", "lr": 0.1}},
                      "wide": {"optimizer": {"name": "ftrl", "lr": 0.2}}},
        "train": {"progress": False, "log_every": 1, "dense_optimizer": {"name": "adam", "lr": 0.01},
                  "output_dir": str(output_dir), **train},
        **({"strategy": strategy} if strategy else {}),
    }


# ---------------------------------------------------------------------------------- the processes
def _summary(value):
    """What a collective's object payload is, without its values."""
    if isinstance(value, dict):
        return {str(k): _summary(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_summary(v) for v in value[:3]]
    if torch.is_tensor(value) or isinstance(value, np.ndarray):
        return f"{type(value).__name__}{tuple(value.shape)}"
    return type(value).__name__


def _log_collectives(log: list) -> None:
    """Record every torch.distributed call the trainer makes (the library calls them through the
    module, so patching the module's names sees them all)."""
    for name in ("all_reduce", "all_gather", "all_gather_object", "broadcast", "broadcast_object_list", "send",
                 "recv", "isend", "irecv", "reduce_scatter", "all_to_all", "all_to_all_single", "gather",
                 "gather_object", "scatter", "reduce", "all_gather_into_tensor", "reduce_scatter_tensor"):
        original = getattr(dist, name, None)
        if original is None:
            continue

        def wrapped(*args, _original=original, _name=name, **kwargs):
            tensors = [a for a in args if torch.is_tensor(a)]
            if tensors:
                log.append({"op": _name, "dtype": str(tensors[0].dtype), "shape": list(tensors[0].shape),
                            "bytes": tensors[0].numel() * tensors[0].element_size()})
            else:
                payload = args[1] if _name == "all_gather_object" else args[0] if args else None
                log.append({"op": _name, "object": _summary(payload), "bytes": len(pickle.dumps(payload))})
            return _original(*args, **kwargs)

        setattr(dist, name, wrapped)


@contextlib.contextmanager
def training_logits():
    """The logits of every training step the loop takes meanwhile, in a list."""
    logits: list = []
    original = train_step.logits_of

    def capture(module, inputs, batch, device):
        out = original(module, inputs, batch, device)
        if torch.is_grad_enabled():
            logits.append(out.detach().cpu().numpy().copy())
        return out

    train_step.logits_of = capture
    try:
        yield logits
    finally:
        train_step.logits_of = original


_last_placement: list = [None]


def _watch_placement() -> None:
    """Keep the placement the next job builds (to list the tables this trainer held)."""
    from hybridrec.strategy.placement import field_sharded

    cls = field_sharded.FieldShardedPlacement
    if getattr(cls, "_watched", False):
        return
    original = cls.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        _last_placement[0] = self

    cls.__init__, cls._watched = init, True


def _worker(rank: int, size: int, port: int, jobs: list, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=size)
    torch.set_num_threads(1)
    log: list = []
    _log_collectives(log)
    records = []
    try:
        for cfg_data, resume in jobs:
            _watch_placement()
            start = len(log)
            with training_logits() as logits:
                result = train(parse_config(cfg_data), resume=resume, overwrite=not resume)
            held = sorted(table for collection in _last_placement[0].collections.values()
                          for table in collection.stores)
            records.append({"result": result, "logits": logits, "collectives": log[start:], "tables": held})
    except BaseException:
        dist.destroy_process_group()
        raise
    Path(out, f"rank{rank}.pkl").write_bytes(pickle.dumps(records))
    # every job's collectives have returned on both ranks and the results are written: the worker
    # leaves without the interpreter's teardown, in which a rank aborted once ("terminate called
    # without an active exception", SIGABRT) after its peer had gone
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_des(size: int, jobs: list, tmp: Path) -> list[list[dict]]:
    """Run `jobs` ((config data, resume) pairs) one after the other on `size` spawned trainers;
    per rank, per job: result, training logits, collectives."""
    out = tmp / f"ranks-{size}"
    out.mkdir(parents=True, exist_ok=True)
    mp.start_processes(_worker, args=(size, _free_port(), jobs, str(out)), nprocs=size, start_method="spawn")
    return [pickle.loads((out / f"rank{r}.pkl").read_bytes()) for r in range(size)]


def run_local(cfg_data: dict) -> tuple[dict, list]:
    with training_logits() as logits:
        return train(parse_config(cfg_data), overwrite=True), logits


# ---------------------------------------------------------------------------------- comparisons
def losses(output_dir) -> list[float]:
    lines = Path(output_dir, "metrics.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if r.get("split") == "train"]


def dense_state(output_dir) -> dict:
    return torch.load(latest_checkpoint(output_dir) / "dense.pt", weights_only=True)


def tables(output_dir) -> dict[str, dict]:
    root = latest_checkpoint(output_dir) / "embeddings"
    out = {}
    for path in sorted(root.glob("*/*")):
        exported = EmbeddingStore.load(path).export()
        order = np.argsort(exported["keys"])
        out[f"{path.parent.name}/{path.name}"] = {k: v[order] for k, v in exported.items() if k in
                                                  ("keys", "weights", "state")}
    return out


def assert_same_training(local_dir, local_result, local_logits, des_dir, des_result, des_logits, label):
    assert des_result["step"] == local_result["step"] == STEPS, label
    assert len(des_logits) == len(local_logits) == STEPS, label
    for step, (a, b) in enumerate(zip(des_logits, local_logits)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5, err_msg=f"{label}: logits of step {step + 1}")
    np.testing.assert_allclose(losses(des_dir), losses(local_dir), rtol=1e-5, atol=1e-6, err_msg=f"{label}: losses")
    for key in ("auc", "logloss"):
        assert des_result[key] == pytest.approx(local_result[key], abs=2e-5), (label, key)
    ours, theirs = dense_state(des_dir), dense_state(local_dir)
    assert ours["model"].keys() == theirs["model"].keys(), label
    for name, value in theirs["model"].items():
        np.testing.assert_allclose(ours["model"][name], value, rtol=1e-4, atol=2e-5, err_msg=f"{label}: {name}")
    assert ours["optimizer"]["state"].keys() == theirs["optimizer"]["state"].keys(), label
    for index, entries in theirs["optimizer"]["state"].items():
        for key, value in entries.items():
            np.testing.assert_allclose(ours["optimizer"]["state"][index][key], value, rtol=1e-4, atol=1e-6,
                                       err_msg=f"{label}: optimizer state {index}.{key}")
    ours, theirs = tables(des_dir), tables(local_dir)
    assert ours.keys() == theirs.keys(), label
    for name, table in theirs.items():
        np.testing.assert_array_equal(ours[name]["keys"], table["keys"], err_msg=f"{label}: keys of {name}")
        for part in ("weights", "state"):  # adaptive steps (Adagrad, FTRL) magnify summation-order rounding
            np.testing.assert_allclose(ours[name][part], table[part], rtol=1e-3, atol=1e-4,
                                       err_msg=f"{label}: {part} of table {name}")


@pytest.fixture(scope="module")
def local_runs(tmp_path_factory):
    """Each model trained by one process with the local placement: (output dir, result, logits)."""
    root = tmp_path_factory.mktemp("local")
    return {name: (root / name, *run_local(job(name, root / name))) for name in MODELS}


DES_PARAMETERS = re.compile(r"(first_order|first_order_dense|first_order_bias|interaction\.weight|fc|fc_dense|"
                            r"fc_bias|mlp_rest\..+|head\..+)")


def check_collectives(collectives: list, name: str, label: str) -> int:
    """Every collective a trainer ran; returns the float bytes it put on the wire (before the ring)."""
    assert not [c for c in collectives if c["op"] not in ("all_reduce", "all_gather_object", "broadcast_object_list")]
    floats = [c for c in collectives if "shape" in c and c["dtype"] != "torch.int32"]
    # the only float tensors: the [b, P] partial results, one AllReduce per step and per test batch
    assert all(c["op"] == "all_reduce" and len(c["shape"]) == 2 and c["shape"][1] == PARTIAL_WIDTH[name]
               for c in floats), (label, floats)
    assert len([c for c in floats if c["shape"][0] == BATCH]) == STEPS + TEST_ROWS // BATCH, label
    flags = [c for c in collectives if "shape" in c and c["dtype"] == "torch.int32"]
    # the loop's "every trainer has a batch, and some batch holds rows" (World.all_have_any_rows)
    assert all(c["shape"] in ([1], [2]) for c in flags), label
    # the objects: progress, flags, facts and, for the checkpoint, the first-layer blocks and their
    # optimizer state, by parameter name: no array of rows anywhere
    for c in collectives:
        if "object" in c:
            text = json.dumps(c["object"])
            assert "ndarray" not in text, (label, c)
            for tensors in re.findall(r'"tensors": (\{[^{}]*(?:\{[^{}]*\}[^{}]*)*\})', text):
                assert all(DES_PARAMETERS.fullmatch(key) for key in json.loads(tensors)), (label, tensors)
    return sum(c["bytes"] for c in floats)


@pytest.mark.parametrize("size", [2, 3])
def test_des_on_n_trainers_trains_what_one_process_trains(tmp_path, local_runs, size):
    jobs = [(job(name, tmp_path / name, {"preset": "des"}), False) for name in MODELS]
    if size == 2:  # and a run checkpointed at step 2 and resumed, which must end where the others end
        cut = job("deepfm", tmp_path / "cut", {"preset": "des"}, max_steps=2, checkpoint_every=2)
        jobs += [(cut, False), ({**cut, "train": {**cut["train"], "max_steps": None}}, True)]
    ranks = run_des(size, jobs, tmp_path)
    for index, name in enumerate(MODELS):
        label = f"{name} on {size} trainers"
        local_dir, local_result, local_logits = local_runs[name]
        leader = ranks[0][index]
        assert leader["result"]["strategy"]["preset"] == "des" and leader["result"]["trainers"] == size
        assert leader["result"]["samples"] == local_result["samples"] == BATCH * STEPS, label
        for rank in range(1, size):  # the replicated layers compute the same logits on every trainer
            for a, b in zip(ranks[rank][index]["logits"], leader["logits"]):
                np.testing.assert_array_equal(a, b, err_msg=f"{label}: rank {rank}")
        assert_same_training(local_dir, local_result, local_logits, tmp_path / name, leader["result"],
                             leader["logits"], label)

        # each trainer holds the tables of its own fields only, and together every row once
        owners = leader["result"]["fields_by_trainer"]
        assert len(owners) == size and all(owners) and len(set(sum(owners, []))) == len(sum(owners, [])) == FIELDS
        for rank in range(size):
            held = ranks[rank][index]["tables"]
            assert held and all(table.removesuffix(":wide") in owners[rank] for table in held), (label, rank, held)
        des = leader["result"]["des"]
        rows = des["embedding_rows_by_trainer"]
        for side, count in local_result["embedding_rows"].items():
            assert sum(r.get(side, 0) for r in rows) == count, (label, side, rows)

        # every collective of the job, counted: the only float tensors that crossed between the
        # trainers are the partial results; no embedding row, gradient or key did
        assert des["partial_width"] == PARTIAL_WIDTH[name], label
        payload = BATCH * PARTIAL_WIDTH[name] * 4
        for rank in range(size):
            sent = check_collectives(ranks[rank][index]["collectives"], name, label)
            assert sent == STEPS * payload + TEST_ROWS * PARTIAL_WIDTH[name] * 4, label  # training + test batches
        assert des["allreduces_per_step"] == 1 and des["allreduce_payload_bytes_per_step"] == payload
        assert des["wire_bytes_per_step"] == 2 * (size - 1) * payload  # ring AllReduce, each byte once
        assert leader["result"]["bytes_per_sample"] == pytest.approx(des["wire_bytes_per_step"] / BATCH)

    if size == 2:
        assert ranks[0][4]["result"]["step"] == 2 and ranks[0][5]["result"]["step"] == STEPS
        whole, resumed = dense_state(tmp_path / "deepfm"), dense_state(tmp_path / "cut")
        for key, value in whole["model"].items():
            np.testing.assert_allclose(resumed["model"][key], value, rtol=1e-6, atol=1e-7, err_msg=key)
        ours, theirs = tables(tmp_path / "cut"), tables(tmp_path / "deepfm")
        for table, values in theirs.items():
            np.testing.assert_array_equal(ours[table]["keys"], values["keys"])
            np.testing.assert_allclose(ours[table]["weights"], values["weights"], rtol=1e-6, atol=1e-7)
        assert ranks[0][5]["result"]["auc"] == pytest.approx(ranks[0][3]["result"]["auc"], abs=1e-6)
