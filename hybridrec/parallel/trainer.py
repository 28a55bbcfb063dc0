"""One trainer process of a distributed job, as torchrun starts it: joins the process group
(gloo on CPU, NCCL on GPU) and runs the one training loop (hybridrec.train.trainer) as its rank.

Each rank reads its share of the training data; the strategy in the config decides where the
embeddings live (the addresses given here) and how the dense parameters are synchronised. A
trainer group that torchrun restarts (--max-restarts) continues from the newest checkpoint.
Rank 0 writes metrics.jsonl and final_metrics.json.

    python -m torch.distributed.run --nproc-per-node 2 -m hybridrec.parallel.trainer CONFIG \\
        --ps tcp://127.0.0.1:7001,tcp://127.0.0.1:7002 --embedding-workers tcp://127.0.0.1:7101
"""
from __future__ import annotations

import argparse
import datetime
import faulthandler
import gc
import os
import signal
import sys
import warnings

# torchrun's agent, read before the slow imports below: an agent killed while they run signals
# nobody (the death request is made after them), so main() compares it with the parent it finds
PARENT_AT_START = os.getppid()

import torch
import torch.distributed as dist

from hybridrec.axes import server_roles
from hybridrec.comm.transport import check_addresses
from hybridrec.config import load_config
from hybridrec.kernel_cache import announce_compilation
from hybridrec.parallel.host import die_with_parent
from hybridrec.train.checkpoint import latest_checkpoint
from hybridrec.train.trainer import train


def join_process_group(backend: str) -> None:
    """`init_process_group` for a worker started by torchrun, in a key space of its own per restart.

    With torchrun's default env:// rendezvous, a worker group restarted after a failure
    (--max-restarts) can fail to connect its gloo pairs or hang in init (torch 2.13, with any
    script). Joining through the agent's store under a prefix named after the restart count keeps
    each attempt's keys apart, so that is what trainers do.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend)  # not under a torchrun agent: the usual env:// setup
        return
    timeout = datetime.timedelta(minutes=10)  # how long a collective may wait for a slow rank
    world = int(os.environ["WORLD_SIZE"])
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, False, timeout=timeout)
    store = dist.PrefixStore(f"hybridrec/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", base)
    dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]), world_size=world, timeout=timeout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybridrec.parallel.trainer", description=__doc__.split("\n")[0])
    parser.add_argument("config")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    parser.add_argument("--ps", default="",
                        help="PS addresses, comma-separated, in shard order (none: the placement runs no PS servers)")
    parser.add_argument("--embedding-workers", default="",
                        help="embedding worker addresses, in rank order (none: talk to the PS servers directly)")
    parser.add_argument("--group-ps", default="",
                        help="Hierarchical Training's group PS addresses, group-major (strategy.ht.group_ps per group)")
    again = parser.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    again.add_argument("--overwrite", action="store_true", help="start over, deleting an earlier run's checkpoints")
    args = parser.parse_args(argv)
    if os.environ.get("TORCHELASTIC_RUN_ID"):  # started by torchrun's agent: die with it, even when it is killed
        die_with_parent(parent=PARENT_AT_START)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID` prints every thread's stack
    if os.environ.get("RANK", "0") == "0":  # the leader says so for all: they compile alike
        announce_compilation("trainer")
    try:
        cfg = load_config(args.config, args.set)
        ps_addresses, ew_addresses, group_ps = ([a for a in given.split(",") if a]
                                                for given in (args.ps, args.embedding_workers, args.group_ps))
        ps_addresses = check_addresses(ps_addresses, "--ps") if ps_addresses else []
        ew_addresses = check_addresses(ew_addresses, "--embedding-workers") if ew_addresses else []
        group_ps = check_addresses(group_ps, "--group-ps") if group_ps else []
        if "ps_servers" in server_roles(cfg.strategy.resolved) and not ps_addresses:
            raise ValueError(f"--ps: strategy.placement {cfg.strategy.placement!r} keeps its tables on PS servers; "
                             "give their addresses (tcp://host:port, comma-separated)")
    except ValueError as error:  # ConfigError too
        parser.error(str(error))
    if not cfg.strategy.distributed:
        parser.error(f"{args.config}: strategy.placement is 'local'; trainers under torchrun need a remote "
                     "placement (--set strategy.preset=persia)")
    # after a failure torchrun restarts the whole group: continue from the newest checkpoint
    # (none yet: start over, keeping what the PS tables learnt)
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    if restarted and latest_checkpoint(cfg.train.output_dir) is None:
        args.overwrite, args.resume = True, False
    elif restarted:
        args.overwrite, args.resume = False, True
    backend = "nccl" if torch.cuda.is_available() and cfg.train.device != "cpu" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    # DDP warns that the multi-task head's [T, H, 1] weight gets a gradient whose strides differ
    # from its bucket's in a size-1 dimension: the same memory order, nothing to fix
    warnings.filterwarnings("ignore", message="Grad strides do not match bucket view strides")
    join_process_group(backend)
    try:
        result = train(cfg, resume=args.resume, overwrite=args.overwrite,
                       endpoints={"ps": ps_addresses, "embedding_workers": ew_addresses, "group_ps": group_ps})
        if dist.get_rank() == 0:  # the whole result is in final_metrics.json; the launcher prints its summary
            print(f"final step {result['step']}: test auc {result.get('auc', float('nan')):.5f}, logloss "
                  f"{result.get('logloss', float('nan')):.5f} ({cfg.train.output_dir}/final_metrics.json)", flush=True)
    finally:
        # DDP's reducer sits in reference cycles: collect it (and the gloo work it holds) while the
        # interpreter is alive; freed during finalisation, its tensors take the GIL and the process
        # aborts ("terminate called without an active exception", SIGABRT after a finished job)
        gc.collect()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # the job is done and every file is written and closed: skip interpreter finalisation, where
    # torch's C++ teardown has aborted finished trainers now and then
    os._exit(exit_code)
