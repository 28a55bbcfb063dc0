"""Which HTTP layer `hybridrec serve` runs on: aiohttp's server, Starlette on uvicorn (uvloop,
httptools) and FastAPI on uvicorn, each answering POST /predict with a fixed JSON body after
parsing the request's JSON, measured by hybridrec's own load generator (a separate process, 1 and
8 keep-alive clients, 1 and 256 lines per request) in one run, servers interleaved. The layer's
own cost is what remains of a request once the model is taken out.

    python scripts/dev/http_layers.py [--repeats 3] [--seconds 3]
"""
import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LAYERS = ("aiohttp", "starlette", "fastapi")


def serve(layer: str, port: int) -> None:
    import orjson

    def answer(body: bytes) -> bytes:
        return orjson.dumps({"scores": [0.5] * len(orjson.loads(body)["lines"]), "version": 1})

    if layer == "aiohttp":
        from aiohttp import web

        async def predict(request):
            return web.Response(body=answer(await request.read()), content_type="application/json")

        app = web.Application(client_max_size=1 << 24)
        app.router.add_post("/predict", predict)
        web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)
        return
    import uvicorn
    from starlette.responses import Response

    if layer == "starlette":
        from starlette.applications import Starlette
        from starlette.routing import Route

        async def predict(request):
            return Response(answer(await request.body()), media_type="application/json")

        app = Starlette(routes=[Route("/predict", predict, methods=["POST"])])
    else:
        from fastapi import FastAPI, Request

        app = FastAPI()

        @app.post("/predict")
        async def predict(request: Request):
            return Response(answer(await request.body()), media_type="application/json")
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False, loop="uvloop",
                http="httptools")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--serve", nargs=2, metavar=("LAYER", "PORT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve[0], int(args.serve[1]))
        return
    work = Path(tempfile.mkdtemp())
    line = "\t".join(["1"] * 13 + ["68fd1e64"] * 26)
    bodies = {rows: work / f"{rows}.json" for rows in (1, 256)}
    for rows, path in bodies.items():
        path.write_text(json.dumps({"lines": [line] * rows}))
    results = {}
    for _ in range(args.repeats):
        for layer in LAYERS:
            server = subprocess.Popen([sys.executable, __file__, "--serve", layer, "18181"])
            time.sleep(2.5)
            try:
                for clients in (1, 8):
                    for rows, body in bodies.items():
                        done = subprocess.run([sys.executable, "-m", "hybridrec.benchmarks.loadgen",
                                               "http://127.0.0.1:18181", str(body), "--rows-per-request", str(rows),
                                               "--clients", str(clients), "--requests", "5000", "--seconds",
                                               str(args.seconds)], capture_output=True, text=True, timeout=120)
                        figures = json.loads(done.stdout.strip().splitlines()[-1])
                        results.setdefault((layer, clients, rows), []).append(figures)
            finally:
                server.terminate()
                server.wait(20)
    for (layer, clients, rows), runs in sorted(results.items()):
        print(f"{layer:>9} clients {clients} rows {rows:>3}: qps {statistics.median(r['qps'] for r in runs):8.0f}  "
              f"p50 {statistics.median(r['p50_ms'] for r in runs):.3f} ms  "
              f"p99 {statistics.median(r['p99_ms'] for r in runs):.3f} ms")


if __name__ == "__main__":
    main()
