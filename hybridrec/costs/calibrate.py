"""`hybridrec calibrate`: the per-operation costs of this machine the cost model
(`hybridrec.costs.model`) predicts from, measured and written to a JSON calibration file.

Measured, each the median of `repeats` timings after a warm-up:
  dense      per job config: the dense model's forward, backward and optimizer step on one torch
             thread (a trainer's share of a core), with the inputs `hybridrec plan` traces (random
             embeddings and features), at the config's batch size and a quarter of it: seconds
             per sample and per step (the fixed dispatch cost), and its parameter count; and a
             whole training step in one process on one thread, as a trainer of a job of several
             processes runs (the local placement: data, embedding lookups and updates, dense
             step, the loop; the marginal cost per sample between a 20- and an 80-step run after
             a warm-up run);
  kernel     seconds per key of the embedding engine's lookup plus its fused update
             (EmbeddingStore.pull then push, Zipf keys, dim 16, one thread);
  transport  a PS server on loopback, in this process: the round trip of a one-key lookup (wall
             seconds: its latency; CPU seconds of both ends: what a request costs the cores
             beside a job's other work) and the bytes per CPU second of a 16,384-key lookup
             (both ends' serialisation and copies);
  machine    the cores this process may run on, and how many of them other work took while
             the calibration ran (hybridrec.costs.machine).
Every timing but the round trip's latency is in CPU seconds of this process (time.process_time),
so that the other work of a shared machine does not inflate it.
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Callable

import numpy as np

TRANSPORT_KEYS = 16_384
KERNEL_KEYS = 4_096


def _median_seconds(run: Callable[[], None], repeats: int, warmup: int = 2,
                    clock: Callable[[], float] = time.process_time) -> float:
    """The median of `repeats` timings of `run` after `warmup` untimed calls; by default in this
    process's CPU seconds (every thread's), so that other work on the machine's cores does not
    count: a job's work, not the share of the cores it got, is what the cost model needs."""
    for _ in range(warmup):
        run()
    times = []
    for _ in range(repeats):
        start = clock()
        run()
        times.append(clock() - start)
    return statistics.median(times)


def dense_costs(cfg, repeats: int) -> dict:
    """Forward + backward + the dense optimizer's step of the job's dense model at its batch size
    and at a quarter of it: the seconds per sample and per step (the fit a + b * batch through
    both), and the model's parameter count (what an allreduce moves)."""
    import torch

    from hybridrec.hierarchical.operator_placement import sample_inputs
    from hybridrec.job.tables import job_dense_model, job_tables

    model = job_dense_model(cfg, job_tables(cfg))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    def seconds(batch: int) -> float:
        inputs, grads = sample_inputs(model, batch)
        inputs = tuple(t.requires_grad_(g) if t is not None else None for t, g in zip(inputs, grads))

        def step():
            optimizer.zero_grad(set_to_none=True)
            model(*inputs).float().sum().backward()
            optimizer.step()

        return _median_seconds(step, repeats)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        big, small = cfg.data.batch_size, max(1, cfg.data.batch_size // 4)
        t_big, t_small = seconds(big), seconds(small)
    finally:
        torch.set_num_threads(threads)
    per_sample = (t_big - t_small) / (big - small) if big > small else 0.0
    if per_sample <= 0:  # no growth with the batch measured (noise on a loaded machine): all per sample
        per_sample = t_big / big
    return {"s_per_sample": per_sample, "s_per_step": max(t_big - per_sample * big, 0.0), "batch_size": big,
            "parameters": sum(p.numel() for p in model.parameters())}


def local_seconds_per_sample(config: str, overrides: list[str], steps: int = 20) -> float:
    """A whole training step of the job's model in one process (the local placement: its data
    reading, embedding lookups and updates, dense step and loop), per sample: the marginal CPU
    seconds between a run of `steps` steps and one of 4 x `steps`, after a warm-up run, so that
    neither the first compilation of the kernels nor a run's fixed costs (its start, its tables'
    first rows, its evaluation) count. It runs on one thread (`train.threads=1`), as every trainer
    of a job of several processes does: the local placement's own default takes every core, and
    torch's OpenMP threads then spin-wait in each step's many small parallel regions, CPU seconds
    that a trainer of one thread never spends."""
    import tempfile

    import torch

    from hybridrec.config import load_config
    from hybridrec.train.trainer import train

    def seconds(length: int) -> tuple[int, float]:
        with tempfile.TemporaryDirectory(prefix="hybridrec-calibrate-") as out:
            cfg = load_config(config, [*overrides, "strategy.preset=local", "train.threads=1",
                                       f"train.max_steps={length}", "data.synthetic.train_rows=16384",
                                       "data.synthetic.test_rows=4096",
                                       "train.epochs=100", "train.progress=false", f"train.output_dir={out}"])
            start = time.process_time()
            result = train(cfg, overwrite=True)
        return result["samples"], time.process_time() - start

    threads = torch.get_num_threads()
    try:
        seconds(steps)  # compiles and warms up
        (short, t_short), (long, t_long) = seconds(steps), seconds(4 * steps)
    finally:  # training set torch's threads to train.threads
        torch.set_num_threads(threads)
    if long > short and t_long > t_short:
        return (t_long - t_short) / (long - short)
    return t_long / long  # no growth measured (noise on a loaded machine): the long run's average


def kernel_seconds_per_key(repeats: int) -> float:
    from hybridrec.embedding import EmbeddingStore

    store = EmbeddingStore(dim=16, capacity=200_000, optimizer={"name": "adagrad", "lr": 0.05}, num_threads=1)
    keys = np.unique(np.random.default_rng(0).zipf(1.1, KERNEL_KEYS * 2) % 1_000_000).astype(np.uint64)[:KERNEL_KEYS]
    grads = np.ones((len(keys), 16), np.float32)

    def step():
        store.pull(keys)
        store.push(keys, grads)

    return _median_seconds(step, repeats) / len(keys)


def transport_costs(repeats: int) -> dict:
    from hybridrec.ps.client import PSClient
    from hybridrec.ps.server import serve

    server = serve(tables={"t": {"dim": 16, "capacity": 100_000}}, block=False, key=None)
    try:
        with PSClient([server.address], key=None) as client:
            one = np.array([1], np.uint64)
            many = np.arange(TRANSPORT_KEYS, dtype=np.uint64)
            client.lookup("t", many)  # inserted before anything is timed
            rtt = _median_seconds(lambda: client.lookup("t", one), repeats * 10, clock=time.perf_counter)
            rtt_cpu = _median_seconds(lambda: client.lookup("t", one), repeats * 10)
            bulk = _median_seconds(lambda: client.lookup("t", many), repeats)
        payload = TRANSPORT_KEYS * (8 + 16 * 4)  # keys out, rows back
        return {"round_trip_s": rtt, "round_trip_cpu_s": rtt_cpu, "bytes_per_s": payload / max(bulk - rtt_cpu, 1e-9)}
    finally:
        server.stop()


def machine_cores() -> int:
    from hybridrec.picasso.switches import machine_cores as cores

    return cores()


def dense_key(config: str, overrides: list[str]) -> str:
    """The calibration's name of a config under overrides (what a cost model's job refers to)."""
    return " ".join([config, *(f"--set {o}" for o in overrides)])


def calibrate(jobs: list[tuple[str, list[str]]], repeats: int = 5) -> dict:
    """The calibration of this machine for `jobs`: (config path, overrides) whose dense models
    are timed."""
    from hybridrec.config import load_config

    from hybridrec.costs.machine import MachineUse

    with MachineUse() as use:
        dense = {dense_key(path, overrides): {**dense_costs(load_config(path, overrides), repeats),
                                              "local_s_per_sample": local_seconds_per_sample(path, overrides)}
                 for path, overrides in jobs}
        kernel, transport = kernel_seconds_per_key(repeats), transport_costs(repeats)
    return {"machine": {"cores": machine_cores(), "background_cores": use.figures()["background_cores"]},
            "kernel": {"s_per_key": kernel}, "transport": transport, "dense": dense, "repeats": repeats,
            "date": time.strftime("%Y-%m-%d %H:%M:%S")}


def write(calibration: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(calibration, indent=1) + "\n")
    return path
