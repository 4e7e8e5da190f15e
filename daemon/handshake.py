"""The Hello both directions of a peer link exchange, and the one check of a peer's Hello.

Both sides of the daemon (the prefill side answering, the decode side dialling) build and
check Hellos here, so "compatible" means the same thing in both directions and the byte-level
rule is the planner's own (:func:`kvpush.daemon.core.planner.check_compatible`).
"""

from __future__ import annotations

from kvpush import proto
from kvpush.daemon.context import DaemonContext
from kvpush.daemon.core.planner import PlanError, check_compatible
from kvpush.proto.codec import clip

REFUSED = "handshake refused"


def make_hello(ctx: DaemonContext, *, reply: bool) -> proto.Hello:
    """This daemon's Hello (only with an engine attached: it carries the engine's layout).

    Only the dialling side (a decode daemon, the WRITE target) sends its NIXL metadata and
    region addresses: push needs the destination writable by its producer and nothing more.
    The reply (a prefill daemon's) carries neither, so a node that says Hello to a prefill
    daemon learns nothing with which to read or write its engine's KV: the target receives
    the WRITEs' notifications without ever loading the producer's metadata (measured with
    UCX over shm and TCP: tests/security/test_least_reach.py)."""
    a = ctx.attached
    assert a is not None
    return proto.Hello(
        ctx.agent_name, b"" if reply else ctx.transport.metadata(), a.layout, () if reply else a.bases,
        proto.PROTOCOL_VERSION,
        a.layout.compat_key(), a.engine_id, a.rank, a.tp_size, ctx.peer_endpoint, reply,
        a.regions[0].mem_type, a.regions[0].device,
    )


def compat_error(ctx: DaemonContext, msg: proto.Hello) -> str:
    """Why a peer's Hello cannot be accepted here, or ``""``."""
    a = ctx.attached
    if a is None:
        return "this daemon has no engine attached yet"
    if msg.version != proto.PROTOCOL_VERSION:
        return f"protocol version {msg.version} (this side speaks {proto.PROTOCOL_VERSION})"
    if msg.compat != msg.layout.compat_key():
        return "compatibility hash does not match the layout sent"
    if not msg.reply and len(msg.region_bases) != len(msg.layout.regions):
        return f"{len(msg.region_bases)} region bases for a layout of {len(msg.layout.regions)} regions"
    try:
        check_compatible(msg.layout, a.layout, ("there", "here"))
    except PlanError as exc:
        return str(exc)
    return ""


def refusal(reason: str, authenticated: bool) -> str:
    """What a peer whose Hello is refused is told: the one place that decides it.

    A stranger is told only :data:`REFUSED`: every precise reason names the value accepted
    here (protocol version, dtype, layers, packing, ...), so answering it would let anyone
    who reaches the port learn the accepted layout by trial. The daemon logs and counts the
    reason locally instead. An authenticated (allowlisted) peer may be told the reason.
    """
    return clip(reason) if authenticated else REFUSED
