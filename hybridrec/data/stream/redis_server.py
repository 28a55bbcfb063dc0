"""A real `redis-server` (Debian's package) started on loopback for tests and benchmarks: a free
port, its files in a temporary directory, no persistence, stopped and removed at the end."""
from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path


def redis_server_path() -> str | None:
    """The redis-server executable, or None when it is not installed."""
    return shutil.which("redis-server") or next((p for p in ("/usr/bin/redis-server", "/usr/sbin/redis-server")
                                                 if Path(p).is_file()), None)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class LocalRedis:
    """`with LocalRedis() as server:` a redis-server on 127.0.0.1:`server.port`;
    `server.url(stream)` is a stream URL for the `redis` backend and the producer."""

    def __init__(self, startup_timeout: float = 15.0) -> None:
        self.startup_timeout = startup_timeout
        self.process: subprocess.Popen | None = None
        self.port: int | None = None
        self.directory: str | None = None

    def start(self) -> "LocalRedis":
        executable = redis_server_path()
        if executable is None:
            raise FileNotFoundError("redis-server is not installed (Debian: apt-get install redis-server)")
        self.directory = tempfile.mkdtemp(prefix="hybridrec-redis-")
        for _ in range(5):  # another process may take the free port first: try another
            self.port = _free_port()
            self.process = subprocess.Popen(
                [executable, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.directory,
                 "--save", "", "--appendonly", "no", "--protected-mode", "yes", "--daemonize", "no",
                 "--logfile", str(Path(self.directory) / "redis.log")],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            if self._ready():
                return self
            self._end_process()
        self.stop()
        raise RuntimeError(f"redis-server did not start within {self.startup_timeout} s (5 ports tried)")

    def _ready(self) -> bool:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                return False
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1.0) as conn:
                    conn.sendall(b"PING\r\n")
                    if conn.recv(64).startswith(b"+PONG"):
                        return True
            except OSError:
                pass
            time.sleep(0.05)
        return False

    def url(self, stream: str) -> str:
        return f"redis://127.0.0.1:{self.port}/{stream}"

    def _end_process(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self.process = None

    def stop(self) -> None:
        self._end_process()
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None

    def __enter__(self) -> "LocalRedis":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
