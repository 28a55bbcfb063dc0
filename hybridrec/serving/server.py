"""`hybridrec serve`: the prediction server in this process, on uvicorn (uvloop and httptools
where installed), or as a Ray Serve deployment with `--ray`.

Off loopback the server needs the job key (the PS servers' HYBRIDREC_AUTH_KEY_FILE or
HYBRIDREC_AUTH_KEY) and every request but /health must carry its HTTP token
(`Authorization: Bearer <token>`, `python -m hybridrec.comm.auth http-token` prints it).
"""
from __future__ import annotations

import importlib.util
import socket
import sys
import threading

from hybridrec.errors import UserError
from hybridrec.serving.options import ServeOptions, http_token, options_from, require_serve_extra


def bound_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)  # connections wait in the backlog until the server accepts them
    except OSError as exc:
        sock.close()
        raise UserError(f"hybridrec serve: cannot listen on {host}:{port} ({exc.strerror})") from None
    return sock


def serve(options: ServeOptions, host: str, port: int, timeout: float | None = None, ready=None,
          predictor=None) -> None:
    """Run the server until interrupted (or `timeout` seconds); `ready(port)` is called once it
    listens. `predictor(version)`: what scores a version (default `Predictor`)."""
    require_serve_extra()
    import uvicorn

    from hybridrec.serving.app import PredictionService, build_app

    service = PredictionService(options, http_token(host), **({} if predictor is None else {"predictor": predictor}))
    sock = bound_socket(host, port)
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    http = "httptools" if importlib.util.find_spec("httptools") else "h11"
    config = uvicorn.Config(build_app(service), loop=loop, http=http, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    if timeout is not None:
        threading.Timer(timeout, lambda: setattr(server, "should_exit", True)).start()
    bound = sock.getsockname()[1]
    print(f"hybridrec serve: version {service.keeper.version} of {options.bundle} on http://{host}:{bound} "
          f"({'pinned' if service.keeper.pinned else 'following new versions'})", flush=True)
    if ready is not None:
        ready(bound)
    server.run(sockets=[sock])


def main(args) -> int:
    options = options_from(args)
    if args.ray is not None:
        from hybridrec.serving.ray_serve import serve_on_ray

        return serve_on_ray(options, args.ray, args.replicas, args.host, args.port, args.timeout)
    serve(options, args.host, args.port, args.timeout)
    return 0


def run(argv: list[str], prog: str = "hybridrec serve") -> int:
    """`hybridrec serve` from its arguments: the entry a launcher's server role runs in a process of
    its own (hybridrec.parallel.roles: `entry`, ready once it prints its "hybridrec serve:" line)."""
    import argparse

    from hybridrec.serving.options import add_serve_arguments

    parser = argparse.ArgumentParser(prog=prog)
    add_serve_arguments(parser)
    try:
        return main(parser.parse_args(argv))
    except UserError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # python -m hybridrec.serving.server BUNDLE --port P ...
    sys.exit(run(sys.argv[1:], "python -m hybridrec.serving.server"))
