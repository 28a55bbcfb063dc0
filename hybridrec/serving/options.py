"""The options of `hybridrec serve`, shared by the command line and the Ray Serve deployment."""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util

from hybridrec.errors import UserError


@dataclasses.dataclass(frozen=True)
class ServeOptions:
    """How a prediction server answers (one per server process or Ray Serve replica)."""

    bundle: str
    version: int | None = None  # pinned at start; None: the newest, followed as new ones appear
    poll_seconds: float = 0.2  # how often the directory of versions is looked at
    batch_wait_ms: float = 2.0  # how long a micro-batch waits for requests still being read
    max_batch_rows: int = 4096  # rows of one model call
    max_request_rows: int = 10_000
    max_body_bytes: int = 16 << 20
    threads: int = 1  # torch threads of the model call


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("bundle", metavar="BUNDLE_DIR", help="a bundle (hybridrec export) or a directory of "
                        "versions (train.publish_dir), whose newest version is served and followed")
    parser.add_argument("--port", type=int, default=8000, help="TCP port (0: any free port, printed at start)")
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind; off loopback a job key is needed "
                        "(HYBRIDREC_AUTH_KEY_FILE or HYBRIDREC_AUTH_KEY) and requests carry its token")
    parser.add_argument("--version", type=int, metavar="V", help="serve version V and stay on it (POST /follow "
                        "follows the newest again)")
    parser.add_argument("--poll-seconds", type=float, default=0.2, help="how often the directory is looked at for "
                        "new versions (default 0.2)")
    parser.add_argument("--batch-wait-ms", type=float, default=2.0, help="the longest a micro-batch waits for "
                        "requests that arrived but are still being read (default 2; 0: never wait)")
    parser.add_argument("--max-batch-rows", type=int, default=4096, help="rows scored in one model call")
    parser.add_argument("--max-request-rows", type=int, default=10_000, help="rows one request may carry")
    parser.add_argument("--max-body-bytes", type=int, default=16 << 20, help="bytes one request body may have")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the model call (default 1: the "
                        "HTTP layer needs a core too)")
    parser.add_argument("--ray", metavar="ADDRESS", help="run as a Ray Serve deployment on the Ray cluster at "
                        "ADDRESS or `auto` (needs hybridrec[ray])")
    parser.add_argument("--replicas", type=int, default=1, help="--ray: replicas of the deployment")
    parser.add_argument("--timeout", type=float, metavar="SECONDS", help="stop after this long (default: never)")


def options_from(args) -> ServeOptions:
    from hybridrec.errors import UserError

    for name in ("poll_seconds", "batch_wait_ms"):
        if getattr(args, name) < 0:
            raise UserError(f"--{name.replace('_', '-')}: {getattr(args, name)} is negative; give a number >= 0")
    for name in ("max_batch_rows", "max_request_rows", "max_body_bytes", "threads", "replicas"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')}: {getattr(args, name)}; give an integer >= 1")
    return ServeOptions(args.bundle, args.version, args.poll_seconds, args.batch_wait_ms, args.max_batch_rows,
                        args.max_request_rows, args.max_body_bytes, args.threads)


def require_serve_extra() -> None:
    missing = [m for m in ("starlette", "uvicorn", "prometheus_client", "orjson") if importlib.util.find_spec(m) is None]
    if missing:
        raise UserError(f"hybridrec serve needs {', '.join(missing)}: pip install 'hybridrec[serve]'")


def http_token(host: str) -> str | None:
    """The token requests must carry: the job key's, when one is configured (required off loopback)."""
    from hybridrec.comm.auth import AuthError, server_key

    try:
        key = server_key(host)
    except AuthError as exc:
        raise UserError(f"hybridrec serve --host {host}: {exc}") from None
    return None if key is None else key.http_token()
