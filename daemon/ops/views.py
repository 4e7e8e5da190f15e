"""Answers to ops requests (`kvpushctl`): what is pending and why, peers, transfers.

Read-mostly views of one daemon as the typed replies of :mod:`kvpush.proto.ops` (the
contract its clients parse). Ops sees the daemon only through a :class:`DaemonView`, which
the worker builds from its parts (:meth:`kvpush.daemon.device_daemon.DeviceDaemon.ops_view`): the
facts ops may read and the two commands it may give (`cancel`, `drain`), which go through
the same pure cores as wire events do. Ops never holds the worker nor reaches into a core,
so this module imports nothing of the daemon's composition.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvpush import proto
from kvpush.daemon.context import Attached
from kvpush.proto import ops as po
from kvpush.proto.trace import ClockPair


@dataclass(frozen=True)
class DaemonView:
    """What ops may see of one daemon, and the two commands it may give."""

    device: str
    backend: str
    engine_socket: str
    daemon_id: str
    agent: Callable[[], str]  # a decode daemon's agent is replaced on a revocation (a new name)
    started: float
    peer_endpoint: str
    peer_auth: str  # "insecure" or "curve"
    node: str  # this node's authenticated name ("" when insecure)
    engine: Callable[[], Attached | None]
    draining: Callable[[], bool]
    rejected_inputs: Callable[[], int]
    counts: Callable[[], tuple[dict[str, int], dict[str, int]]]  # (prefill, decode) per state
    prefill_pending: Callable[[float], list[Any]]  # rendezvous PendingInfo, oldest first
    decode_pending: Callable[[float], list[Any]]  # counter PendingInfo, oldest first
    peer_counts: Callable[[], tuple[int, int]]  # (producers, consumers)
    peer_rows: Callable[[float], list[dict[str, Any]]]
    writes_in_flight: Callable[[], list[Any]]  # prefill_side.Flight
    recent: Callable[[], list[dict[str, Any]]]  # finished transfers, oldest first
    trace: Callable[[str], dict[str, Any]]
    metrics_text: Callable[[], str]
    drain: Callable[[], None]
    cancel: Callable[[str, str, float], bool]  # (transfer, why, now) -> found


def _r(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else round(x, digits)


def _counts(w: DaemonView) -> po.PendingCounts:
    prefill, decode = w.counts()
    return po.PendingCounts(prefill=prefill, decode=decode)


def status(w: DaemonView) -> po.StatusReply:
    import psutil

    a = w.engine()
    now = time.monotonic()
    proc = psutil.Process()
    engine = None
    if a is not None:
        engine = po.EngineInfo(
            engine_id=a.engine_id, rank=a.rank, tp_size=a.tp_size, role=a.role,
            memory_bytes=a.nbytes, blocks=a.layout.num_blocks,
            block_size=a.layout.block_size, attached_s=round(now - a.since, 1),
        )
    producers, consumers = w.peer_counts()
    return po.StatusReply(
        device=w.device,
        pid=os.getpid(),
        daemon_id=w.daemon_id,
        version=proto.PROTOCOL_VERSION,
        backend=w.backend,
        agent=w.agent(),
        uptime_s=round(now - w.started, 1),
        draining=w.draining(),
        peer_endpoint=w.peer_endpoint,
        peer_auth=w.peer_auth,
        node=w.node,
        engine_socket=w.engine_socket,
        rss_bytes=proc.memory_info().rss,
        cpu_s=round(sum(proc.cpu_times()[:2]), 3),
        engine=engine,
        peers=po.PeerCounts(producers=producers, consumers=consumers),
        pending=_counts(w),
        in_flight=len(w.writes_in_flight()),
        rejected_inputs=w.rejected_inputs(),
    )


def pending(w: DaemonView) -> po.PendingReply:
    now = time.monotonic()
    rows: list[po.PrefillPending | po.DecodePending] = [
        po.PrefillPending(
            transfer_id=p.transfer_id, attempt=p.attempt, state=p.state, blocks=p.blocks,
            registered=p.registered, expected=p.expected, writes_in_flight=p.writes_in_flight,
            age=round(p.age, 4), deadline=_r(p.deadline),
        )
        for p in w.prefill_pending(now)
    ]
    rows += [
        po.DecodePending(
            transfer_id=p.transfer_id, attempt=p.attempt, state=p.state, notified=p.notified,
            resolved=p.resolved, producers=p.producers, age=round(p.age, 4),
            deadline=round(p.deadline, 4),
        )
        for p in w.decode_pending(now)
    ]
    return po.PendingReply(device=w.device, pending=tuple(rows))


def peers(w: DaemonView) -> po.PeersReply:
    rows = w.peer_rows(time.monotonic())
    return po.PeersReply(device=w.device,
                         peers=tuple(po.PeerRow.from_data(r, f"peers[{i}]") for i, r in enumerate(rows)))


_RECENT: dict[str, type[po.RecentWrite | po.RecentReceive]] = {
    "prefill": po.RecentWrite, "decode": po.RecentReceive}


def _recent(h: dict[str, Any], now: float, i: int) -> po.RecentWrite | po.RecentReceive:
    row = {k: v for k, v in h.items() if k != "at"}
    row["age_s"] = round(now - h["at"], 3)
    return _RECENT[h["side"]].from_data(row, f"recent[{i}]")


def transfers(w: DaemonView) -> po.TransfersReply:
    now = time.monotonic()
    live = tuple(
        po.LiveWrite(
            transfer_id=f.transfer_id, attempt=f.attempt, dest_rank=f.dest_rank,
            bytes=f.nbytes, descriptors=f.descriptors, age_s=round(now - f.started, 3), group=f.group,
        )
        for f in w.writes_in_flight()
    )
    recent = tuple(_recent(h, now, i) for i, h in enumerate(reversed(w.recent())))
    return po.TransfersReply(device=w.device, in_flight=live, recent=recent)


def trace(w: DaemonView, tid: str) -> po.TraceReply:
    """One transfer's stamps on this daemon (its own and its engine plugin's)."""
    view = w.trace(tid)
    clock = ClockPair(**view["clock"])
    if "events" in view:
        return po.TraceReply(device=w.device, clock=clock, transfer_id=view["transfer_id"],
                             events=tuple((hop, t) for hop, t in view["events"]))
    return po.TraceReply(device=w.device, clock=clock, recent=tuple(view["recent"]))


def _ok(data: po.OpsData) -> proto.OpsReply:
    return proto.OpsReply(True, data.to_data())


def _refuse(why: str) -> proto.OpsReply:
    return proto.OpsReply(False, {}, why)


def handle_ops(w: DaemonView, req: proto.OpsRequest) -> proto.OpsReply:
    now = time.monotonic()
    if req.cmd == "status":
        return _ok(status(w))
    if req.cmd == "pending":
        return _ok(pending(w))
    if req.cmd == "peers":
        return _ok(peers(w))
    if req.cmd == "transfers":
        return _ok(transfers(w))
    if req.cmd == "trace":
        return _ok(trace(w, req.arg))
    if req.cmd == "metrics":
        return _ok(po.MetricsReply(text=w.metrics_text()))
    if req.cmd == "drain":
        w.drain()
        return _ok(po.DrainReply(draining=True, pending=_counts(w)))
    if req.cmd == "cancel":
        tid = req.arg
        if not tid:
            return _refuse("cancel needs a transfer ID")
        found = w.cancel(tid, "cancelled by operator", now)
        if not found:
            return _refuse(f"transfer {proto.codec.clip(tid)!r} is not pending here")
        return _ok(po.CancelReply(cancelled=tid))
    return _refuse(f"unknown command {req.cmd!r}")
