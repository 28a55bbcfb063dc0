"""The embedding parameter server: one process hosting this shard's EmbeddingStores over ZeroMQ.

Persia §4.2.2-4.2.4: each table of the shard is an `EmbeddingStore` (hash index + array-list
LRU, fused optimizer); clients route keys here with the global `route` hash. With
`shm_prefix`, every store lives in named shared memory (`<prefix>.<table>`), so a server
killed and restarted with the same prefix reattaches and keeps every update it acknowledged
(a store is written before the reply leaves).

Operations (see `hybridrec.comm.transport` for the wire format):
  ping        -> meta {pid, tables: {name: dim}}
  lookup      keys uint64[n], meta {table, insert, codec}       -> rows encoded with `codec`
  push        keys uint64[n] + grads encoded with meta codec    -> meta {dropped}
  stats       -> meta {pid, tables: {name: store.stats()}}
  checkpoint  meta {directory}: each table saved to directory/<table>
  load        meta {directory}: each table replaced by the one saved in directory/<table>
  shutdown    stop after replying

Run one with `python -m hybridrec.ps.server --port 7001 --table user:16:1000000` or call
`serve(...)` (the `hybridrec serve-ps` command does).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from hybridrec.comm.codec import Encoded, make_value_codec
from hybridrec.comm.transport import Message, Operation, Server
from hybridrec.embedding import EmbeddingStore, TableConfig
from hybridrec.embedding.memory import unlink_shared

TableSpec = TableConfig | Mapping[str, Any] | EmbeddingStore
LISTENING = " listening on "  # what `main` prints, with the address, once it serves


def _table_config(name: str, spec: TableConfig | Mapping[str, Any]) -> TableConfig:
    if isinstance(spec, TableConfig):
        return spec
    if isinstance(spec, Mapping):
        return TableConfig.from_dict(dict(spec))
    raise TypeError(
        f"tables[{name!r}] must be a TableConfig, a dict of its fields or an EmbeddingStore, "
        f"got {type(spec).__name__}"
    )


def table_shm_name(shm_prefix: str, table: str) -> str:
    """The shared-memory name of one table of a server started with `shm_prefix`."""
    return f"{shm_prefix}.{table}"


def open_stores(tables: Mapping[str, TableSpec], shm_prefix: str | None = None) -> dict[str, EmbeddingStore]:
    """One store per table; with `shm_prefix`, reattached from shared memory when it exists."""
    if not isinstance(tables, Mapping) or not tables:
        raise ValueError(f"tables must be a non-empty dict of table name -> config, got {tables!r}")
    stores = {}
    for name, spec in tables.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"table names must be non-empty strings, got {name!r}")
        if isinstance(spec, EmbeddingStore):
            stores[name] = spec
        elif shm_prefix is None:
            stores[name] = EmbeddingStore(_table_config(name, spec))
        else:
            stores[name] = EmbeddingStore.open_shared(table_shm_name(shm_prefix, name),
                                                      _table_config(name, spec))
    return stores


class EmbeddingServer:
    """The stores of one shard behind a `transport.Server`; `start()` then `wait()`/`stop()`."""

    def __init__(self, stores: dict[str, EmbeddingStore], *, host: str = "127.0.0.1",
                 port: int = 0, threads: int = 2, max_frame_bytes: int = 1 << 30):
        self.stores = dict(stores)
        self._swap = threading.Lock()  # guards replacing stores on `load`
        operations = {
            "ping": Operation(self._ping),
            "lookup": Operation(self._lookup, {"keys": "uint64"}),
            "push": Operation(self._push, arrays=None),  # keys + the codec's arrays
            "stats": Operation(self._stats),
            "checkpoint": Operation(self._checkpoint),
            "load": Operation(self._load),
            "shutdown": Operation(self._shutdown),
        }
        self.transport = Server(operations, host=host, port=port, threads=threads,
                                max_frame_bytes=max_frame_bytes)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> int:
        return self.transport.start()

    @property
    def address(self) -> str:
        return self.transport.address

    def wait(self, timeout: float | None = None) -> bool:
        return self.transport.wait(timeout)

    def stop(self, timeout: float = 5.0) -> bool:
        stopped = self.transport.stop(timeout)
        for store in self.stores.values():
            store.close()
        return stopped

    def __enter__(self) -> "EmbeddingServer":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ operations
    def _store(self, meta: dict[str, Any]) -> tuple[str, EmbeddingStore]:
        table = meta.get("table")
        with self._swap:
            store = self.stores.get(table) if isinstance(table, str) else None
        if store is None:
            raise ValueError(f"meta 'table' is {table!r}; this server holds {sorted(self.stores)}")
        return table, store

    def _ping(self, request: Message) -> Message:
        return Message("ping", meta={"pid": os.getpid(),
                                     "tables": {n: s.dim for n, s in self.stores.items()}})

    def _lookup(self, request: Message) -> Message:
        _, store = self._store(request.meta)
        insert = request.meta.get("insert", True)
        if not isinstance(insert, bool):
            raise ValueError(f"meta 'insert' must be true or false, got {insert!r}")
        codec = make_value_codec(request.meta.get("codec", "none"))
        encoded = codec.encode(store.pull(np.ascontiguousarray(request.arrays["keys"]), insert=insert))
        return Message("lookup", encoded.arrays, {"codec": codec.name, "codec_meta": encoded.meta})

    def _push(self, request: Message) -> Message:
        _, store = self._store(request.meta)
        arrays = dict(request.arrays)
        keys = arrays.pop("keys", None)
        if keys is None or keys.dtype != np.uint64:
            raise ValueError("push needs a uint64 array 'keys'")
        codec = make_value_codec(request.meta.get("codec", "none"))
        grads = codec.decode(Encoded(codec.name, arrays, request.meta.get("codec_meta", {})))
        dropped = store.push(np.ascontiguousarray(keys), np.ascontiguousarray(grads))
        return Message("push", meta={"dropped": int(dropped)})

    def _stats(self, request: Message) -> Message:
        with self._swap:
            stores = dict(self.stores)
        return Message("stats", meta={"pid": os.getpid(),
                                      "tables": {n: s.stats() for n, s in stores.items()}})

    @staticmethod
    def _directory(meta: dict[str, Any]) -> Path:
        directory = meta.get("directory")
        if not isinstance(directory, str) or not directory:
            raise ValueError(f"meta 'directory' must be a non-empty path string, got {directory!r}")
        return Path(directory)

    def _checkpoint(self, request: Message) -> Message:
        directory = self._directory(request.meta)
        with self._swap:
            for name, store in self.stores.items():
                store.save(directory / name)
        return Message("checkpoint", meta={"directory": str(directory), "tables": sorted(self.stores)})

    def _load(self, request: Message) -> Message:
        directory = self._directory(request.meta)
        missing = [name for name in self.stores if not (directory / name).is_dir()]
        if missing:
            raise ValueError(f"meta 'directory' {str(directory)!r} has no checkpoint of tables {missing}")
        # Read (and checksum) every table before replacing any, so a bad checkpoint changes nothing.
        loaded = {name: EmbeddingStore.load(directory / name) for name in self.stores}
        with self._swap:
            for name, old in list(self.stores.items()):
                shm_name = old.shm_name
                if shm_name is not None:  # the restarted server must find the loaded rows
                    old.close()
                    unlink_shared(shm_name)
                    loaded[name] = EmbeddingStore.load(directory / name, shm_name=shm_name)
                self.stores[name] = loaded[name]
        return Message("load", meta={"directory": str(directory), "tables": sorted(self.stores)})

    def _shutdown(self, request: Message) -> Message:
        self.transport.request_stop()
        return Message("shutdown", meta={"pid": os.getpid()})


def serve(host: str = "127.0.0.1", port: int = 0, tables: Mapping[str, TableSpec] | None = None,
          shm_prefix: str | None = None, threads: int = 2, *, block: bool = True,
          max_frame_bytes: int = 1 << 30) -> EmbeddingServer:
    """Serve `tables` (name -> TableConfig / dict of its fields / EmbeddingStore) on host:port.

    `port=0` picks a free port (read it from the returned server's `.address`). With
    `block=True` this returns only after a `shutdown` request, SIGTERM or Ctrl-C, with the
    server stopped; with `block=False` it returns the running server at once.
    """
    server = EmbeddingServer(open_stores(tables or {}, shm_prefix), host=host, port=port,
                             threads=threads, max_frame_bytes=max_frame_bytes)
    server.start()
    if block:
        run_until_stopped(server)
    return server


def run_until_stopped(server: EmbeddingServer, on_ready: Callable[[], None] | None = None) -> None:
    """Block until a shutdown request, SIGTERM or Ctrl-C (main thread), then stop the server.

    `on_ready` runs once the signal handlers are in place (so a SIGTERM sent right after it
    stops the server cleanly instead of killing the process).
    """
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: server.transport.request_stop())
    if on_ready is not None:
        on_ready()
    try:
        while not server.wait(0.2):  # short waits so signal handlers get to run
            pass
    finally:
        server.stop()


def launch(args: Sequence[str], *, env: Mapping[str, str] | None = None,
           startup_timeout: float = 120.0) -> tuple[subprocess.Popen, str]:
    """Start `python -m hybridrec.ps.server *args` and return (process, address) once it listens.

    The caller owns the process (kill it when done). A server that does not report within
    `startup_timeout` seconds (a cold numba cache compiles the store kernels first) is killed
    and RuntimeError is raised.
    """
    process = subprocess.Popen([sys.executable, "-m", "hybridrec.ps.server", *args],
                               stdout=subprocess.PIPE, text=True,
                               env=None if env is None else dict(env))
    ready, _, _ = select.select([process.stdout], [], [], startup_timeout)
    line = process.stdout.readline() if ready else ""
    if LISTENING not in line:
        process.kill()
        process.wait(10)
        raise RuntimeError(f"PS server {list(args)} did not start within {startup_timeout}s "
                           f"(exit code {process.returncode}, said {line!r})")
    return process, line.split(LISTENING)[1].split()[0]


def _parse_table(text: str) -> tuple[str, dict[str, Any]]:
    parts = text.split(":")
    if len(parts) != 3 or not parts[0] or not parts[1].isdigit() or not parts[2].isdigit():
        raise argparse.ArgumentTypeError(f"--table must be NAME:DIM:CAPACITY, got {text!r}")
    return parts[0], {"dim": int(parts[1]), "capacity": int(parts[2])}


def main(argv: list[str] | None = None, prog: str = "python -m hybridrec.ps.server") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port (printed on start)")
    parser.add_argument("--table", action="append", type=_parse_table, default=[],
                        metavar="NAME:DIM:CAPACITY", help="a table to serve (repeatable)")
    parser.add_argument("--tables-json", help='tables as JSON: {"name": {TableConfig fields}}')
    parser.add_argument("--optimizer", default="adagrad", help="optimizer of --table tables")
    parser.add_argument("--lr", type=float, default=None, help="learning rate of --table tables")
    parser.add_argument("--seed", type=int, default=0, help="initialisation seed of --table tables")
    parser.add_argument("--shm-name", dest="shm_prefix", help="keep tables in named shared memory")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    tables: dict[str, Any] = json.loads(args.tables_json) if args.tables_json else {}
    for name, fields in args.table:
        optimizer = {"name": args.optimizer, **({} if args.lr is None else {"lr": args.lr})}
        tables[name] = {**fields, "optimizer": optimizer, "seed": args.seed}
    if not tables:
        parser.error("give at least one --table NAME:DIM:CAPACITY or --tables-json")
    # Requests run in parallel on --threads workers; torch's own pool (used by the fp16 codec)
    # would only oversubscribe the cores, so it gets one thread per worker.
    torch.set_num_threads(1)
    server = serve(args.host, args.port, tables, args.shm_prefix, args.threads, block=False)
    run_until_stopped(server, on_ready=lambda: print(
        f"hybridrec-ps{LISTENING}{server.address} pid {os.getpid()}", flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
