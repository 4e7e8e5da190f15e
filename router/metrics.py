"""The router's Prometheus metrics (``GET /metrics``): one private registry per router.

Every series, its labels and its meaning: docs/metrics.md (tests/integration/test_metrics.py
checks it against a live router both ways).
"""

from __future__ import annotations

import aiohttp
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    disable_created_metrics,
    generate_latest,
)

from kvpush.proto.buildinfo import build_info

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
CAUSES = ("status", "timeout", "connect", "other")


def cause_of(exc: BaseException | None) -> str:
    """A leg failure's cause label (a closed vocabulary: labels never come from the wire)."""
    if exc is None:
        return "status"
    if isinstance(exc, TimeoutError | aiohttp.ServerTimeoutError):
        return "timeout"
    if isinstance(exc, aiohttp.ClientConnectionError):
        return "connect"
    return "other"


class RouterMetrics:
    def __init__(self) -> None:
        # No *_created series (as the daemon): they double the scrape and are undocumented
        # noise. Process-wide, which the router process owns.
        disable_created_metrics()
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("kvpush_router_requests", "Requests answered", ["path", "code"], registry=r)
        self.legs_failed = Counter("kvpush_router_legs_failed", "Legs that failed, by cause", ["leg", "cause"],
                                   registry=r)
        for leg in ("prefill", "decode"):
            for c in CAUSES:
                self.legs_failed.labels(leg, c)
        self.legs_resent = Counter("kvpush_router_legs_resent", "Legs sent again over a fresh connection: "
                                   "the engine had closed their pooled one before reading them", ["leg"],
                                   registry=r)
        for leg in ("prefill", "decode"):
            self.legs_resent.labels(leg)
        self.in_flight = Gauge("kvpush_router_in_flight", "Legs in progress per engine", ["pool", "url"],
                               registry=r)
        self.ttft = Histogram("kvpush_router_ttft_seconds", "Request in to first byte of the answer",
                              ["stream"], buckets=LATENCY_BUCKETS, registry=r)
        self.latency = Histogram("kvpush_router_request_seconds", "Request in to last byte", ["stream"],
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.first_tokens = Counter("kvpush_router_first_tokens", "Streamed answers by the leg their first "
                                    "token came from", ["source"], registry=r)
        for src in ("prefill", "decode"):
            self.first_tokens.labels(src)
        self.first_token_mismatches = Counter(
            "kvpush_router_first_token_mismatches", "Streams whose decode leg did not start with the prefill "
            "leg's token: continued from the token sent, by the decode engine alone", registry=r)
        self.draining = Gauge("kvpush_router_draining", "1 once shutdown began", registry=r)
        Info("kvpush_build", "What is installed: kvpush version, wire protocol, python, nixl",
             registry=r).info(build_info())

    def leg_failed(self, leg: str, exc: BaseException | None) -> None:
        self.legs_failed.labels(leg, cause_of(exc)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
