"""The prediction server's Prometheus metrics (GET /metrics, text format 0.0.4): requests and
errors by endpoint and status, request latency and micro-batch size histograms, rows scored, the
version served, version swaps, and IDs looked up and IDs the tables did not hold."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
disable_created_metrics()  # the *_created series only repeat the start time
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384)


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("hybridrec_requests", "HTTP requests answered", ["endpoint", "code"], registry=registry)
        self.errors = Counter("hybridrec_request_errors", "requests answered with an error", ["endpoint", "reason"],
                              registry=registry)
        self.latency = Histogram("hybridrec_request_seconds", "time from a request's arrival to its answer",
                                 ["endpoint"], buckets=LATENCY_BUCKETS, registry=registry)
        self.batch_rows = Histogram("hybridrec_batch_rows", "rows per model call (micro-batch)",
                                    buckets=BATCH_BUCKETS, registry=registry)
        self.rows = Counter("hybridrec_rows_scored", "rows scored", registry=registry)
        self.version = Gauge("hybridrec_version", "the bundle version being served", registry=registry)
        self.swaps = Gauge("hybridrec_version_swaps", "moves to another version since the start",
                           registry=registry)
        self.lookups = Counter("hybridrec_id_lookups", "IDs looked up in the tables", registry=registry)
        self.missing = Counter("hybridrec_id_lookups_missing", "IDs the tables do not hold (scored with zeros)",
                               registry=registry)

    def text(self) -> bytes:
        return generate_latest(self.registry)
