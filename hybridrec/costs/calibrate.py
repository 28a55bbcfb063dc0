"""`hybridrec calibrate`: the per-operation costs of this machine the cost model
(`hybridrec.costs.model`) predicts from, measured and written to a JSON calibration file.

Measured, each the median of `repeats` timings after a warm-up:
  dense      per job config: seconds per sample of the dense model's forward, backward and
             optimizer step at the config's batch size, on one torch thread (a trainer's share of
             a core), with the inputs `hybridrec plan` traces (random embeddings and features);
  kernel     seconds per key of the embedding engine's lookup plus its fused update
             (EmbeddingStore.pull then push, Zipf keys, dim 16, one thread);
  transport  a PS server on loopback: the round trip of a one-key lookup (seconds) and the bytes
             per second of a 16,384-key lookup (both ends' serialisation and copies: CPU work
             that shares the cores with the rest of a job);
  machine    the cores this process may run on.
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Callable

import numpy as np

# the configs of `hybridrec bench speedups`' pairs: what is timed by default
DEFAULT_CONFIGS = ("configs/het_synthetic.yaml", "configs/persia_synthetic.yaml", "configs/picasso_synthetic.yaml",
                   "configs/des_synthetic.yaml")
TRANSPORT_KEYS = 16_384
KERNEL_KEYS = 4_096


def _median_seconds(run: Callable[[], None], repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def dense_seconds_per_sample(cfg, repeats: int) -> float:
    """Forward + backward + the dense optimizer's step of the job's dense model, per sample."""
    import torch

    from hybridrec.hierarchical.operator_placement import sample_inputs
    from hybridrec.job.tables import job_dense_model, job_tables

    model = job_dense_model(cfg, job_tables(cfg))
    batch = cfg.data.batch_size
    inputs, grads = sample_inputs(model, batch)
    inputs = tuple(t.requires_grad_(g) if t is not None else None for t, g in zip(inputs, grads))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step():
        optimizer.zero_grad(set_to_none=True)
        model(*inputs).float().sum().backward()
        optimizer.step()

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _median_seconds(step, repeats) / batch
    finally:
        torch.set_num_threads(threads)


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
            rtt = _median_seconds(lambda: client.lookup("t", one), repeats * 10)
            bulk = _median_seconds(lambda: client.lookup("t", many), repeats)
        payload = TRANSPORT_KEYS * (8 + 16 * 4)  # keys out, rows back
        return {"round_trip_s": rtt, "bytes_per_s": payload / max(bulk - rtt, 1e-9)}
    finally:
        server.stop()


def machine_cores() -> int:
    from hybridrec.picasso.switches import machine_cores as cores

    return cores()


def calibrate(configs: list[str], repeats: int = 5, overrides: list[str] | None = None) -> dict:
    """The calibration of this machine for `configs` (paths of job configs)."""
    from hybridrec.config import load_config

    dense = {}
    for path in configs:
        cfg = load_config(path, overrides or [])
        dense[path] = {"s_per_sample": dense_seconds_per_sample(cfg, repeats), "batch_size": cfg.data.batch_size}
    return {"machine": {"cores": machine_cores()}, "kernel": {"s_per_key": kernel_seconds_per_key(repeats)},
            "transport": transport_costs(repeats), "dense": dense, "repeats": repeats,
            "date": time.strftime("%Y-%m-%d %H:%M:%S")}


def write(calibration: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(calibration, indent=1) + "\n")
    return path
