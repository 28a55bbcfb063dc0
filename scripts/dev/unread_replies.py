"""What a client that sends lookups and never reads their replies costs a PS server: the
server process's RSS growth after one DEALER sends `--requests` lookups of 16,384 keys of a
64-wide table (4 MiB replies each) without reading, and how long another client's ping then
takes. Run it on two checkouts to compare (PYTHONPATH=<checkout>); each run starts its own
`serve-ps` on loopback and kills it at the end.

    PYTHONPATH=$PWD python scripts/dev/unread_replies.py [--requests 80] [--runs 3]
"""
import argparse
import statistics
import time

import numpy as np
import zmq

from hybridrec.comm.transport import Client, Message, encode_frames
from hybridrec.ps.server import launch

KEYS, DIM = 16_384, 64


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return int(next(line for line in status if line.startswith("VmRSS:")).split()[1]) * 1024


def lookup(request_id: int) -> list:
    keys = np.arange(KEYS, dtype=np.uint64) + request_id * KEYS
    return encode_frames(Message("lookup", {"keys": keys}, {"table": "t", "insert": False}), request_id)


def one_run(requests: int) -> tuple[float, float]:
    """(MiB the server grew, ms of another client's ping)."""
    process, address = launch(["--table", f"t:{DIM}:100000"])
    greedy = zmq.Context.instance().socket(zmq.DEALER)
    greedy.setsockopt(zmq.LINGER, 0)
    greedy.setsockopt(zmq.RCVHWM, 1)  # what it does not read stays at the server
    greedy.setsockopt(zmq.RCVBUF, 1 << 16)
    try:
        greedy.connect(address)
        with Client(address, timeout=60) as polite:
            polite.request("lookup", {"keys": np.arange(KEYS, dtype=np.uint64)}, {"table": "t", "insert": False})
            before = rss(process.pid)
            for request_id in range(1, requests + 1):
                greedy.send_multipart(lookup(request_id))
            time.sleep(5)
            began = time.perf_counter()
            polite.request("ping")
            ping_ms = (time.perf_counter() - began) * 1000
            return (rss(process.pid) - before) / 2**20, ping_ms
    finally:
        greedy.close()
        process.kill()
        process.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=80)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    runs = [one_run(args.requests) for _ in range(args.runs)]
    grown = [g for g, _ in runs]
    print(f"{args.requests} unread lookups ({args.requests * KEYS * DIM * 4 / 2**20:.0f} MiB of replies): server grew "
          f"{' / '.join(f'{g:.0f}' for g in grown)} MiB (median {statistics.median(grown):.0f}); "
          f"another client's ping {statistics.median(p for _, p in runs):.1f} ms (median)")


if __name__ == "__main__":
    main()
