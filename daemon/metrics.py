"""A device daemon's Prometheus metrics: one registry per accelerator daemon.

Each worker owns a private ``CollectorRegistry`` (not the global one) so that tests can run
several workers in one process and the supervisor can merge the children's text by device.
The worker renders it on an ops ``OpsRequest(cmd="metrics")``; the supervisor serves the
merged result on ``/metrics``. Every metric carries ``device`` (e.g. "cuda0").

Every series, its labels and its meaning: docs/metrics.md (tests/integration/test_metrics.py
checks it against a live daemon both ways). Names: one prefix, base units, ``_total``.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

WRITE_LATENCY_BUCKETS: tuple[float, ...] = (
    1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)


class DaemonMetrics:
    """The metrics one worker updates; methods are cheap enough for the poll loop."""

    def __init__(self, device: str) -> None:
        self.device = device
        # *_created series double the scrape and say nothing a restart counter does not;
        # the switch is process-wide, which is fine in a worker process that owns it.
        disable_created_metrics()
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.pending = Gauge("kvpush_pending_rendezvous",
                             "Unfinished transfers, by side and core state",
                             ["device", "side", "state"], registry=r)
        self.in_flight = Gauge("kvpush_transfers_in_flight", "WRITEs posted and not finished",
                               ["device"], registry=r).labels(device)
        self.bytes_written = Counter("kvpush_written_bytes", "Bytes of completed WRITEs",
                                     ["device"], registry=r).labels(device)
        self.write_latency = Histogram("kvpush_write_latency_seconds",
                                       "Seconds from posting a WRITE to its completion",
                                       ["device"], buckets=WRITE_LATENCY_BUCKETS,
                                       registry=r).labels(device)
        self.notifications = Counter("kvpush_notifications", "NIXL notifications counted",
                                     ["device"], registry=r).labels(device)
        self.timeouts = Counter("kvpush_timeouts", "Timeouts by kind", ["device", "kind"],
                                registry=r)
        self.failures = Counter("kvpush_failures", "Failures by cause", ["device", "cause"],
                                registry=r)
        self.peers = Gauge("kvpush_peers", "Peer daemons by state", ["device", "state"],
                           registry=r)
        self.transfers = Counter("kvpush_transfers", "Finished transfers by side and result",
                                 ["device", "side", "result"], registry=r)
        self.held_blocks = Gauge("kvpush_held_blocks", "Prefill source blocks held, by rendezvous state",
                                 ["device", "state"], registry=r)
        self.held_oldest = Gauge("kvpush_unclaimed_oldest_seconds",
                                 "Age of the oldest hold no decode side registered for (0: none)",
                                 ["device"], registry=r).labels(device)
        self.lease_expired = Counter("kvpush_lease_expired", "Holds released by their lease, by registrations seen",
                                     ["device", "registered"], registry=r)
        self.layer_frames = Counter("kvpush_layer_progress_frames",
                                    "LayerProgress frames taken from the engine (prefill, layer-wise)",
                                    ["device"], registry=r).labels(device)
        self.lease_expired_blocks = Counter("kvpush_lease_expired_blocks", "Source blocks held until their lease",
                                            ["device"], registry=r).labels(device)

    def set_pending(self, side: str, state: str, n: int) -> None:
        self.pending.labels(self.device, side, state).set(n)

    def set_in_flight(self, n: int) -> None:
        self.in_flight.set(n)

    def write_done(self, nbytes: int, latency_s: float) -> None:
        """A WRITE completed: count its bytes and its latency."""
        self.bytes_written.inc(nbytes)
        self.write_latency.observe(latency_s)

    def notification(self, n: int = 1) -> None:
        self.notifications.inc(n)

    def timeout(self, kind: str) -> None:
        self.timeouts.labels(self.device, kind).inc()

    def failure(self, cause: str) -> None:
        self.failures.labels(self.device, cause).inc()

    def set_peers(self, state: str, n: int) -> None:
        self.peers.labels(self.device, state).set(n)

    def transfer_finished(self, side: str, result: str) -> None:
        self.transfers.labels(self.device, side, result).inc()

    def set_held(self, blocks_by_state: dict[str, int], oldest_unregistered_s: float) -> None:
        for state, n in blocks_by_state.items():
            self.held_blocks.labels(self.device, state).set(n)
        self.held_oldest.set(oldest_unregistered_s)

    def lease_expiry(self, registered: str, blocks: int) -> None:
        self.lease_expired.labels(self.device, registered).inc()
        self.lease_expired_blocks.inc(blocks)

    def render(self) -> str:
        """Prometheus text exposition of this worker's registry."""
        return generate_latest(self.registry).decode()
