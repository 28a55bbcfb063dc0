"""The prediction server's HTTP API, an ASGI application (Starlette), run by uvicorn (`hybridrec
serve`) or inside a Ray Serve replica:

    POST /predict   {"rows": [{column: value, ...}, ...]} or {"lines": ["a line of the data file", ...]}
                    -> {"scores": [...], "version": V} ({"scores": [[...], ...], "tasks": [...]} for
                    several tasks)
    GET  /health    {"status": "ok", "version": V}
    GET  /version   the version served: number, step, stream position, kind, precision, source,
                    rows per table, whether it is pinned, the versions available
    GET  /metrics   Prometheus text
    POST /rollback  {"version": V} (default: the newest older than the one served): serve it, pinned
    POST /follow    follow the newest version again

A request that cannot be answered gets HTTP 400 and {"error": "<one line>"} (401 without the
token off loopback); the server goes on. Everything but /health needs the token when one is set.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import time

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from hybridrec.bundle.format import BundleError
from hybridrec.serving.batching import Job, MicroBatcher
from hybridrec.serving.keeper import VersionKeeper
from hybridrec.serving.metrics import ServerMetrics
from hybridrec.serving.options import ServeOptions
from hybridrec.serving.predictor import Predictor


class BadRequest(Exception):
    """A request the server refuses (HTTP 400) with a one-line reason."""


def _json(data, status: int = 200) -> Response:
    return Response(orjson.dumps(data, option=orjson.OPT_SERIALIZE_NUMPY), status, media_type="application/json")


class PredictionService:
    """The handlers and their state: the version keeper, the micro-batcher and the metrics."""

    def __init__(self, options: ServeOptions, token: str | None = None, predictor=Predictor):
        import torch

        torch.set_num_threads(options.threads)
        self.options, self.token = options, token
        self.keeper = VersionKeeper(options.bundle, options.version, options.poll_seconds, predictor)
        self.metrics = ServerMetrics()
        self.metrics.version.set(self.keeper.version)
        self.batcher = MicroBatcher(self.keeper, self.metrics, options.batch_wait_ms, options.max_batch_rows)
        self._started = False

    async def startup(self) -> None:
        if not self._started:
            self._started = True
            self.batcher.start()
            self.keeper.start()

    async def shutdown(self) -> None:
        self.keeper.stop()
        await self.batcher.stop()

    # ------------------------------------------------------------------ requests
    def _authorised(self, request: Request) -> bool:
        if self.token is None:
            return True
        given = request.headers.get("authorization", "")
        return hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode())

    async def _body(self, request: Request) -> bytes:
        limit = self.options.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise BadRequest(f"the request body has {declared} bytes; the limit is {limit} (--max-body-bytes)")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise BadRequest(f"the request body is over the limit of {limit} bytes (--max-body-bytes)")
            chunks.append(chunk)
        return b"".join(chunks)

    def _job(self, body: bytes) -> Job:
        try:
            payload = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise BadRequest(f"the body is not JSON ({str(exc).splitlines()[0]})") from None
        if not isinstance(payload, dict) or len(payload.keys() & {"rows", "lines"}) != 1:
            raise BadRequest('the body is a JSON object with one key, "rows" (a list of {column: value}) or '
                             '"lines" (a list of lines in the data file\'s format)')
        unknown = sorted(set(payload) - {"rows", "lines"})
        if unknown:
            raise BadRequest(f"unknown key {unknown[0]!r}; the body has \"rows\" or \"lines\"")
        kind = "rows" if "rows" in payload else "lines"
        items = payload[kind]
        if not isinstance(items, list) or not items:
            raise BadRequest(f'"{kind}" is a non-empty list, got {type(items).__name__ if items else "nothing"}')
        if len(items) > self.options.max_request_rows:
            raise BadRequest(f"{len(items)} {kind} in one request; the limit is {self.options.max_request_rows} "
                             f"(--max-request-rows)")
        if kind == "lines" and not all(isinstance(line, str) for line in items):
            raise BadRequest('"lines" holds strings, each a line of the data file')
        return Job(kind, items, asyncio.get_running_loop().create_future())

    async def predict(self, request: Request) -> Response:
        started = time.perf_counter()
        batcher = self.batcher
        batcher.reading += 1
        submitted = False
        try:
            if not self._authorised(request):
                return self._error("predict", 401, "unauthorised", "this server needs the job's token: "
                                   "Authorization: Bearer <token> (python -m hybridrec.comm.auth http-token)")
            job = self._job(await self._body(request))
            batcher.reading -= 1
            submitted = True
            await batcher.submit(job)
        except BadRequest as exc:
            return self._error("predict", 400, "bad_request", str(exc))
        finally:
            if not submitted:
                batcher.reading -= 1
        if job.error is not None:
            return self._error("predict", 400, "bad_row", job.error)
        scores = job.scores
        predictor_columns = scores.shape[1]
        body = {"scores": scores[:, 0] if predictor_columns == 1 else scores, "version": job.version}
        if predictor_columns > 1:
            body["tasks"] = self.keeper.current.task_names
        self.metrics.requests.labels("predict", "200").inc()
        self.metrics.latency.labels("predict").observe(time.perf_counter() - started)
        self.metrics.version.set(self.keeper.version)
        return _json(body)

    def _error(self, endpoint: str, status: int, reason: str, message: str) -> Response:
        self.metrics.requests.labels(endpoint, str(status)).inc()
        self.metrics.errors.labels(endpoint, reason).inc()
        return _json({"error": message.replace("\n", " ")}, status)

    async def health(self, request: Request) -> Response:
        return _json({"status": "ok", "version": self.keeper.version})

    async def version(self, request: Request) -> Response:
        if not self._authorised(request):
            return self._error("version", 401, "unauthorised", "this server needs the job's token")
        return _json({**self.keeper.current.version.describe(), "pinned": self.keeper.pinned,
                      "available": self.keeper.available(), "swaps": self.keeper.swaps})

    async def metrics_text(self, request: Request) -> Response:
        if not self._authorised(request):
            return self._error("metrics", 401, "unauthorised", "this server needs the job's token")
        self.metrics.version.set(self.keeper.version)
        self.metrics.swaps.set(self.keeper.swaps)
        return Response(self.metrics.text(), media_type=self.metrics.content_type)

    async def rollback(self, request: Request) -> Response:
        if not self._authorised(request):
            return self._error("rollback", 401, "unauthorised", "this server needs the job's token")
        try:
            body = await self._body(request)
            payload = orjson.loads(body) if body.strip() else {}
            wanted = payload.get("version") if isinstance(payload, dict) else payload
            if wanted is not None and (isinstance(wanted, bool) or not isinstance(wanted, int)):
                raise BadRequest(f'"version" is an integer, got {wanted!r}')
            loop = asyncio.get_running_loop()
            number = await loop.run_in_executor(None, self.keeper.pin, wanted)
        except (BadRequest, BundleError) as exc:
            return self._error("rollback", 400, "bad_request", str(exc))
        except orjson.JSONDecodeError:
            return self._error("rollback", 400, "bad_request", 'the body is a JSON object {"version": V}')
        self.metrics.version.set(number)
        return _json({"version": number, "pinned": True})

    async def follow(self, request: Request) -> Response:
        if not self._authorised(request):
            return self._error("follow", 401, "unauthorised", "this server needs the job's token")
        try:
            number = await asyncio.get_running_loop().run_in_executor(None, self.keeper.follow)
        except BundleError as exc:
            return self._error("follow", 400, "bad_request", str(exc))
        return _json({"version": number, "pinned": False})

    def routes(self) -> list[Route]:
        return [Route("/predict", self.predict, methods=["POST"]), Route("/health", self.health, methods=["GET"]),
                Route("/version", self.version, methods=["GET"]),
                Route("/metrics", self.metrics_text, methods=["GET"]),
                Route("/rollback", self.rollback, methods=["POST"]), Route("/follow", self.follow, methods=["POST"])]


def build_app(service: PredictionService) -> Starlette:
    @contextlib.asynccontextmanager
    async def lifespan(app):
        await service.startup()
        try:
            yield
        finally:
            await service.shutdown()

    return Starlette(routes=service.routes(), lifespan=lifespan)
