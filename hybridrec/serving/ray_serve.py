"""`hybridrec serve --ray ADDRESS --replicas N`: the same prediction service as a Ray Serve
deployment, for traffic one machine cannot carry. Each replica holds a `PredictionService` (its
own version keeper, micro-batcher and metrics) and answers the same HTTP API through Ray Serve's
proxy on `--host:--port`; Ray spreads the requests over the replicas. Every replica reads the
bundle directory itself, so on a cluster of several machines it must be on storage they share.
"""
from __future__ import annotations

import dataclasses
import socket
import time

from hybridrec.errors import UserError
from hybridrec.serving.options import ServeOptions


class ReplicaService:
    """The body of one replica: the service's routes answered from Ray Serve's `__call__`."""

    def __init__(self, options: dict, token: str | None):
        from hybridrec.serving.app import PredictionService

        self.service = PredictionService(ServeOptions(**options), token)
        self.routes = {(route.path, method): route.endpoint for route in self.service.routes()
                       for method in route.methods or ()}

    async def __call__(self, request):
        from starlette.responses import JSONResponse

        await self.service.startup()  # in the replica's own event loop, at its first request
        handler = self.routes.get((request.url.path.rstrip("/") or "/", request.method))
        if handler is None:
            return JSONResponse({"error": f"no {request.method} {request.url.path}; see docs/serving.md"}, 404)
        return await handler(request)


def _connect(address: str) -> None:
    import ray

    if ray.is_initialized():
        return
    if address == "auto":
        try:
            ray.init(address="auto", logging_level="ERROR")
        except ConnectionError:  # no cluster on this machine: start one here
            ray.init(logging_level="ERROR", include_dashboard=False)
    else:
        ray.init(address=address, logging_level="ERROR")


def serve_on_ray(options: ServeOptions, address: str, replicas: int, host: str, port: int,
                 timeout: float | None = None) -> int:
    try:
        from ray import serve
    except ImportError:
        raise UserError("hybridrec serve --ray needs Ray Serve: pip install 'hybridrec[ray]'") from None
    from hybridrec.serving.options import http_token, require_serve_extra

    require_serve_extra()
    token = http_token(host)
    if port == 0:
        with socket.socket() as probe:
            probe.bind((host, 0))
            port = probe.getsockname()[1]
    _connect(address)
    serve.start(http_options={"host": host, "port": port})
    deployment = serve.deployment(ReplicaService, name="hybridrec-predictor", num_replicas=replicas,
                                  ray_actor_options={"num_cpus": 0})
    serve.run(deployment.bind(dataclasses.asdict(options), token), name="hybridrec", route_prefix="/")
    print(f"hybridrec serve: {options.bundle} on http://{host}:{port} (Ray Serve, {replicas} replicas)", flush=True)
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while deadline is None or time.monotonic() < deadline:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
    return 0
