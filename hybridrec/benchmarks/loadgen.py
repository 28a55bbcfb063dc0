"""The load generator of `hybridrec bench serve`: concurrent HTTP/1.1 keep-alive clients, each
sending POST /predict requests one after the other, bounded in count and in time.

It runs in a process of its own (the server's CPU time is not its CPU time) and writes raw
requests and reads answers on asyncio streams, the least work a client can do per request, so
its own cost distorts the server's figures as little as possible. Prints one JSON line: requests,
failed (not 200 or no answer), seconds, qps, rows_per_s, p50_ms, p99_ms, and the versions the
answers carried.

    python -m hybridrec.benchmarks.loadgen URL BODY_FILE --rows-per-request R --clients C
        --requests N --seconds T
"""
from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time

_VERSION = re.compile(rb'"version":\s*([0-9]+)')


def request_bytes(host: str, body: bytes, token: str | None = None) -> bytes:
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    return (f"POST /predict HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n{auth}"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


async def _client(host: str, port: int, request: bytes, budget: dict, deadline: float, latencies: list,
                  versions: dict, failures: list) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        while budget["left"] > 0 and time.perf_counter() < deadline:
            budget["left"] -= 1
            started = time.perf_counter()
            try:
                writer.write(request)
                await writer.drain()
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
                length = int(re.search(rb"(?i)content-length:\s*([0-9]+)", head).group(1))
                body = await asyncio.wait_for(reader.readexactly(length), 30)
            except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, AttributeError) as exc:
                failures.append(f"{type(exc).__name__}: {exc}")
                return
            latencies.append(time.perf_counter() - started)
            if not head.startswith(b"HTTP/1.1 200"):
                failures.append(head.split(b"\r\n", 1)[0].decode(errors="replace"))
                continue
            found = _VERSION.search(body)
            if found:
                version = int(found.group(1))
                versions[version] = versions.get(version, 0) + 1
    finally:
        writer.close()


async def run(url: str, body: bytes, rows: int, clients: int, requests: int, seconds: float,
              token: str | None = None) -> dict:
    host, port = url.split("//", 1)[1].rstrip("/").split(":")
    request = request_bytes(host, body, token)
    latencies, versions, failures = [], {}, []
    budget = {"left": requests}
    started = time.perf_counter()
    await asyncio.gather(*[_client(host, int(port), request, budget, started + seconds, latencies, versions, failures)
                           for _ in range(clients)])
    elapsed = time.perf_counter() - started
    latencies.sort()
    done = len(latencies)
    quantile = lambda q: latencies[min(done - 1, int(q * done))] * 1e3 if done else None  # noqa: E731
    return {"requests": done, "failed": len(failures), "first_failures": failures[:3], "seconds": elapsed,
            "qps": done / elapsed, "rows_per_s": done * rows / elapsed, "p50_ms": quantile(0.5),
            "p99_ms": quantile(0.99), "versions": {str(k): v for k, v in sorted(versions.items())}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybridrec.benchmarks.loadgen", description=__doc__.split("\n")[0])
    parser.add_argument("url")
    parser.add_argument("body", help="a file holding the JSON body of every request")
    parser.add_argument("--rows-per-request", type=int, required=True)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--requests", type=int, default=2000, help="at most this many requests in all")
    parser.add_argument("--seconds", type=float, default=10.0, help="and for at most this long")
    parser.add_argument("--token")
    args = parser.parse_args(argv)
    with open(args.body, "rb") as handle:
        body = handle.read()
    print(json.dumps(asyncio.run(run(args.url, body, args.rows_per_request, args.clients, args.requests,
                                     args.seconds, args.token))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
