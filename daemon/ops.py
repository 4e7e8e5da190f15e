"""Answers to ops requests (`kvpushctl`): what is pending and why, peers, transfers.

Read-mostly views of a worker's state as JSON-like dicts; `cancel` and `drain`
are the only commands that change anything, and they go through the same pure
cores as wire events do.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, is_dataclass
from typing import TYPE_CHECKING, Any

from kvpush import proto

if TYPE_CHECKING:
    from kvpush.daemon.worker import Worker


def _info(obj: Any, now: float) -> dict[str, Any]:
    d = asdict(obj) if is_dataclass(obj) else dict(obj)
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, tuple):
            v = list(v)
        if isinstance(v, float):
            v = round(v, 4)
        out[k] = v
    return out


def status(w: Worker) -> dict[str, Any]:
    import psutil

    a = w.attached
    now = time.monotonic()
    proc = psutil.Process()
    return {
        "device": w.cfg.name,
        "pid": os.getpid(),
        "daemon_id": w.daemon_id,
        "version": proto.PROTOCOL_VERSION,
        "backend": w.cfg.backend,
        "agent": w.agent_name,
        "uptime_s": round(now - w.started, 1),
        "draining": w.draining,
        "peer_endpoint": w.peer_endpoint,
        "engine_socket": w.cfg.engine_socket,
        "rss_bytes": proc.memory_info().rss,
        "cpu_s": round(sum(proc.cpu_times()[:2]), 3),
        "engine": None
        if a is None
        else {
            "engine_id": a.engine_id,
            "rank": a.rank,
            "tp_size": a.tp_size,
            "role": a.role,
            "memory_bytes": a.region.size,
            "blocks": a.layout.num_blocks,
            "block_size": a.layout.block_size,
            "attached_s": round(now - a.since, 1),
        },
        "peers": {
            "producers": len(w.producers),
            "consumers": len(w.consumers),
        },
        "pending": {"prefill": w.rdv.counts(), "decode": w.counter.counts()},
        "in_flight": len(w.in_flight),
        "rejected_inputs": w.errors,
    }


def pending(w: Worker) -> dict[str, Any]:
    now = time.monotonic()
    rows = [{"side": "prefill", **_info(p, now)} for p in w.rdv.pending(now)]
    rows += [{"side": "decode", **_info(p, now)} for p in w.counter.pending(now)]
    return {"device": w.cfg.name, "pending": rows}


def peers(w: Worker) -> dict[str, Any]:
    now = time.monotonic()
    rows = [p.describe(now, "producer") for p in w.producers.values()]
    rows += [p.describe(now, "consumer") for p in w.consumers.values()]
    return {"device": w.cfg.name, "peers": rows}


def transfers(w: Worker) -> dict[str, Any]:
    now = time.monotonic()
    live = [
        {
            "transfer_id": f.transfer_id,
            "attempt": f.attempt,
            "dest_rank": f.dest_rank,
            "side": "prefill",
            "bytes": f.nbytes,
            "descriptors": f.descriptors,
            "age_s": round(now - f.started, 3),
            "result": "in_flight",
        }
        for f in w.in_flight.values()
    ]
    recent = [{**h, "age_s": round(now - h["at"], 3)} for h in reversed(w.history.items)]
    for r in recent:
        r.pop("at", None)
    return {"device": w.cfg.name, "in_flight": live, "recent": recent}


def trace(w: Worker, tid: str) -> dict[str, Any]:
    """One transfer's stamps on this daemon (its own and its engine plugin's)."""
    return {"device": w.cfg.name, **w.trace.view(tid)}


def handle_ops(w: Worker, req: proto.OpsRequest) -> proto.OpsReply:
    now = time.monotonic()
    if req.cmd == "status":
        return proto.OpsReply(True, status(w))
    if req.cmd == "pending":
        return proto.OpsReply(True, pending(w))
    if req.cmd == "peers":
        return proto.OpsReply(True, peers(w))
    if req.cmd == "transfers":
        return proto.OpsReply(True, transfers(w))
    if req.cmd == "trace":
        return proto.OpsReply(True, trace(w, req.arg))
    if req.cmd == "metrics":
        return proto.OpsReply(True, {"text": w.metrics.render()})
    if req.cmd == "drain":
        w.draining = True
        return proto.OpsReply(True, {"draining": True, "pending": status(w)["pending"]})
    if req.cmd == "cancel":
        tid = req.arg
        if not tid:
            return proto.OpsReply(False, {}, "cancel needs a transfer ID")
        found = w.cancel(tid, "cancelled by operator", now)
        if not found:
            return proto.OpsReply(False, {}, f"transfer {tid!r} is not pending here")
        return proto.OpsReply(True, {"cancelled": tid})
    return proto.OpsReply(False, {}, f"unknown command {req.cmd!r}")
