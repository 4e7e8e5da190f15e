"""The per-request timeline: hop names (the contract) and a bounded ring of stamps.

Why it exists: a request crosses nine hops in four processes (router, two engines, two
daemons); when TTFT is slow, an operator must see which hop took the time. Every hop
stamps ``time.monotonic_ns()`` under the request's ``transfer_id``. CLOCK_MONOTONIC is one
clock for every process of a host, so stamps of one node compare directly; across hosts
``kvpushctl trace`` converts them with each process's (monotonic, wall) pair, so their
uncertainty is the hosts' wall-clock (NTP/PTP) offset.

Recording is always on: a stamp is one dict lookup and one list append, and the ring holds
at most ``max_transfers`` timelines of ``max_events`` stamps (oldest evicted first), so
memory is bounded whatever the traffic.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Hops in the order a healthy push request crosses them. The prefix says who stamps it.
HOPS: tuple[str, ...] = (
    # router
    "router.request_in",
    "router.legs_sent",
    # decode engine plugin (scheduler half, then worker half)
    "d.plugin.claim",
    "d.plugin.register_published",
    # decode daemon
    "d.daemon.register_in",
    "d.daemon.register_forwarded",
    # prefill daemon / prefill engine plugin
    "p.daemon.register_in",
    # layer-wise: the first progress frame, the first group WRITE posted and landed, the last frame
    "p.daemon.layers_in",
    "p.daemon.group_posted",
    "p.daemon.group_done",
    "p.daemon.layers_last_in",
    "p.plugin.prefill_finished",
    "p.plugin.prefill_done_published",
    "p.daemon.prefill_done_in",
    "p.daemon.planned",
    "p.daemon.write_posted",
    "p.daemon.write_done",
    "p.daemon.sent",
    "p.plugin.sent_seen",
    "router.prefill_answered",
    "router.prefill_first_token",  # the prefill leg's token, sent to a streaming client
    # decode daemon / plugin again
    "d.daemon.notif_seen",
    "d.daemon.received_sent",
    "d.plugin.received_seen",
    "d.plugin.finished_recving",
    "d.plugin.first_decode_step",
    "router.decode_first_byte",
    # failure paths (no order implied)
    "p.daemon.send_failed",
    "d.daemon.receive_failed",
    "d.plugin.load_failed",
    "p.plugin.send_failed_seen",
    "router.first_token_recovery",
    "router.prefill_resent",  # a leg its engine closed unread on a pooled connection, sent again
    "router.decode_resent",
)
HOP_SET = frozenset(HOPS)
# Where a daemon's part of a transfer ends: its timeline is complete (an export may read it).
END_HOPS = frozenset({"p.daemon.sent", "p.daemon.send_failed", "d.daemon.received_sent",
                      "d.daemon.receive_failed"})

MAX_TRANSFERS = 4096
MAX_EVENTS = 64


def now_ns() -> int:
    return time.monotonic_ns()


@dataclass(frozen=True, slots=True)
class ClockPair:
    """One process's monotonic and wall clocks read together: converts its stamps to wall time."""

    monotonic_ns: int
    wall_ns: int

    @classmethod
    def read(cls) -> ClockPair:
        return cls(time.monotonic_ns(), time.time_ns())


class TraceRing:
    """Bounded timelines keyed by transfer ID. Not thread-safe (one owner thread).

    ``sink``, if set, is handed a copy of a timeline when an :data:`END_HOPS` hop is stamped
    (the optional OpenTelemetry export, kvpush.common.otel); it must not block."""

    __slots__ = ("max_transfers", "max_events", "_t", "sink")

    def __init__(self, max_transfers: int = MAX_TRANSFERS, max_events: int = MAX_EVENTS) -> None:
        if max_transfers <= 0 or max_events <= 0:
            raise ValueError("max_transfers and max_events must be positive")
        self.max_transfers = max_transfers
        self.max_events = max_events
        self._t: OrderedDict[str, list[tuple[str, int]]] = OrderedDict()
        self.sink: Callable[[str, list[tuple[str, int]]], None] | None = None

    def stamp(self, transfer_id: str, hop: str, t_ns: int | None = None) -> None:
        events = self._t.get(transfer_id)
        if events is None:
            if len(self._t) >= self.max_transfers:
                self._t.popitem(last=False)
            events = self._t[transfer_id] = []
        if len(events) < self.max_events:
            events.append((hop, time.monotonic_ns() if t_ns is None else t_ns))
        if self.sink is not None and hop in END_HOPS:
            self.sink(transfer_id, list(events))

    def stamp_first(self, transfer_id: str, hop: str) -> None:
        """Stamp ``hop`` unless it already is: a stream's per-group hops keep their first time,
        so a deep model's hundreds of groups cannot push a transfer's end out of its timeline."""
        events = self._t.get(transfer_id)
        if events is None or all(h != hop for h, _ in events):
            self.stamp(transfer_id, hop)

    def stamp_latest(self, transfer_id: str, hop: str) -> None:
        """Stamp ``hop`` with now, replacing an earlier stamp of it (a stream's last frame)."""
        events = self._t.get(transfer_id)
        if events is not None:
            for i in range(len(events) - 1, -1, -1):
                if events[i][0] == hop:
                    del events[i]
                    break
        self.stamp(transfer_id, hop)

    def extend(self, transfer_id: str, events: list[tuple[str, int]]) -> None:
        for hop, t in events:
            self.stamp(transfer_id, hop, t)

    def get(self, transfer_id: str) -> list[tuple[str, int]]:
        return list(self._t.get(transfer_id, ()))

    def pop(self, transfer_id: str) -> list[tuple[str, int]]:
        return self._t.pop(transfer_id, [])

    def recent(self, n: int = 20) -> list[str]:
        """The ``n`` most recently started transfer IDs, newest first."""
        out = []
        for tid in reversed(self._t):
            out.append(tid)
            if len(out) >= n:
                break
        return out

    def view(self, transfer_id: str, recent: int = 50) -> dict[str, Any]:
        """The JSON answer every stamping process gives to "trace": one transfer's stamps
        (or, without an ID, the most recent IDs) with the clock pair that converts them."""
        clock = ClockPair.read()
        out: dict[str, Any] = {"clock": {"monotonic_ns": clock.monotonic_ns, "wall_ns": clock.wall_ns}}
        if not transfer_id:
            out["recent"] = self.recent(recent)
        else:
            out["transfer_id"] = transfer_id
            out["events"] = [[hop, t] for hop, t in self.get(transfer_id)]
        return out

    def __len__(self) -> int:
        return len(self._t)

    def __contains__(self, transfer_id: object) -> bool:
        return transfer_id in self._t


@dataclass(frozen=True, slots=True)
class Row:
    """One stamp of a merged timeline."""

    t_ns: int
    source: str  # which process: "router", "daemon cpu0", ...
    hop: str


def merge(rows: list[Row]) -> list[tuple[Row, float, float]]:
    """Sort by time; each row with ms since the first stamp and since the previous one."""
    rows = sorted(rows, key=lambda r: (r.t_ns, HOPS.index(r.hop) if r.hop in HOP_SET else len(HOPS)))
    if not rows:
        return []
    t0 = rows[0].t_ns
    out = []
    prev = t0
    for r in rows:
        out.append((r, (r.t_ns - t0) / 1e6, (r.t_ns - prev) / 1e6))
        prev = r.t_ns
    return out


def breakdown(events: dict[str, int]) -> dict[str, float]:
    """Per-segment ms of one request from its first stamp of each hop (missing hops skipped).

    Segments follow the push path: what each process added between two consecutive hops.
    """
    seq = [(h, events[h]) for h in HOPS if h in events]
    seq.sort(key=lambda x: x[1])
    out: dict[str, float] = {}
    for (a, ta), (b, tb) in zip(seq, seq[1:], strict=False):
        out[f"{a} -> {b}"] = round((tb - ta) / 1e6, 3)
    return out
