"""Answers to ops requests (`kvpushctl`): what is pending and why, peers, transfers.

Read-mostly views of a worker's state as the typed replies of :mod:`kvpush.proto.ops`
(the contract its clients parse); `cancel` and `drain` are the only commands that change
anything, and they go through the same pure cores as wire events do.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

from kvpush import proto
from kvpush.proto import ops as po
from kvpush.proto.trace import ClockPair

if TYPE_CHECKING:
    from kvpush.daemon.device_daemon import Worker


def _r(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else round(x, digits)


def _counts(w: Worker) -> po.PendingCounts:
    return po.PendingCounts(prefill=w.prefill.rdv.counts(), decode=w.decode.counter.counts())


def status(w: Worker) -> po.StatusReply:
    import psutil

    a = w.ctx.attached
    now = time.monotonic()
    proc = psutil.Process()
    engine = None
    if a is not None:
        engine = po.EngineInfo(
            engine_id=a.engine_id, rank=a.rank, tp_size=a.tp_size, role=a.role,
            memory_bytes=a.nbytes, blocks=a.layout.num_blocks,
            block_size=a.layout.block_size, attached_s=round(now - a.since, 1),
        )
    return po.StatusReply(
        device=w.cfg.name,
        pid=os.getpid(),
        daemon_id=w.ctx.daemon_id,
        version=proto.PROTOCOL_VERSION,
        backend=w.cfg.backend,
        agent=w.ctx.agent_name,
        uptime_s=round(now - w.ctx.started, 1),
        draining=w.ctx.draining,
        peer_endpoint=w.ctx.peer_endpoint,
        peer_auth="insecure" if w.ctx.auth is None else "curve",
        node="" if w.ctx.auth is None else w.ctx.auth.me.name,
        engine_socket=w.cfg.engine_socket,
        rss_bytes=proc.memory_info().rss,
        cpu_s=round(sum(proc.cpu_times()[:2]), 3),
        engine=engine,
        peers=po.PeerCounts(producers=len(w.decode.producers), consumers=len(w.prefill.consumers)),
        pending=_counts(w),
        in_flight=len(w.prefill.in_flight),
        rejected_inputs=w.ctx.errors,
    )


def pending(w: Worker) -> po.PendingReply:
    now = time.monotonic()
    rows: list[po.PrefillPending | po.DecodePending] = [
        po.PrefillPending(
            transfer_id=p.transfer_id, attempt=p.attempt, state=p.state, blocks=p.blocks,
            registered=p.registered, expected=p.expected, writes_in_flight=p.writes_in_flight,
            age=round(p.age, 4), deadline=_r(p.deadline),
        )
        for p in w.prefill.rdv.pending(now)
    ]
    rows += [
        po.DecodePending(
            transfer_id=p.transfer_id, attempt=p.attempt, state=p.state, notified=p.notified,
            resolved=p.resolved, producers=p.producers, age=round(p.age, 4),
            deadline=round(p.deadline, 4),
        )
        for p in w.decode.counter.pending(now)
    ]
    return po.PendingReply(device=w.cfg.name, pending=tuple(rows))


def peers(w: Worker) -> po.PeersReply:
    now = time.monotonic()
    rows = [p.describe(now) for p in w.decode.producers.values()]
    rows += [p.describe(now) for p in w.prefill.consumers.values()]
    return po.PeersReply(device=w.cfg.name,
                         peers=tuple(po.PeerRow.from_data(r, f"peers[{i}]") for i, r in enumerate(rows)))


_RECENT: dict[str, type[po.RecentWrite | po.RecentReceive]] = {
    "prefill": po.RecentWrite, "decode": po.RecentReceive}


def _recent(h: dict[str, Any], now: float, i: int) -> po.RecentWrite | po.RecentReceive:
    row = {k: v for k, v in h.items() if k != "at"}
    row["age_s"] = round(now - h["at"], 3)
    return _RECENT[h["side"]].from_data(row, f"recent[{i}]")


def transfers(w: Worker) -> po.TransfersReply:
    now = time.monotonic()
    live = tuple(
        po.LiveWrite(
            transfer_id=f.transfer_id, attempt=f.attempt, dest_rank=f.dest_rank,
            bytes=f.nbytes, descriptors=f.descriptors, age_s=round(now - f.started, 3),
        )
        for f in w.prefill.in_flight.values()
    )
    recent = tuple(_recent(h, now, i) for i, h in enumerate(reversed(w.ctx.history.items)))
    return po.TransfersReply(device=w.cfg.name, in_flight=live, recent=recent)


def trace(w: Worker, tid: str) -> po.TraceReply:
    """One transfer's stamps on this daemon (its own and its engine plugin's)."""
    view = w.ctx.trace.view(tid)
    clock = ClockPair(**view["clock"])
    if "events" in view:
        return po.TraceReply(device=w.cfg.name, clock=clock, transfer_id=view["transfer_id"],
                             events=tuple((hop, t) for hop, t in view["events"]))
    return po.TraceReply(device=w.cfg.name, clock=clock, recent=tuple(view["recent"]))


def _ok(data: po.OpsData) -> proto.OpsReply:
    return proto.OpsReply(True, data.to_data())


def _refuse(why: str) -> proto.OpsReply:
    return proto.OpsReply(False, {}, why)


def handle_ops(w: Worker, req: proto.OpsRequest) -> proto.OpsReply:
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
        w.prefill.report_held(time.monotonic())
        return _ok(po.MetricsReply(text=w.ctx.metrics.render()))
    if req.cmd == "drain":
        w.ctx.draining = True
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
