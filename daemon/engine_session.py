"""The engine session: the one local engine rank a daemon serves, over its engine socket.

Hops 1 and 9 of a request: the plugin's Attach maps the engine's KV memory and registers it
with NIXL; its Register / PrefillDone / Abort go to the decode or prefill side; their answers
go back through :meth:`DaemonContext.to_engine`. This module alone writes
``ctx.attached``. A re-attach (new memory) fails everything tied to the old one first.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from kvpush import proto
from kvpush.daemon.context import Attached, DaemonContext
from kvpush.daemon.decode_side import DecodeSide
from kvpush.daemon.prefill_side import PrefillSide
from kvpush.proto.trace import HOP_SET

log = logging.getLogger("kvpush.worker")

RegionOpener = Callable[[proto.MemoryHandle], Any]


def _open_region(memory: proto.MemoryHandle) -> Any:
    from kvpush.daemon.memory import open_region

    return open_region(memory)


class EngineSession:
    def __init__(self, ctx: DaemonContext, prefill: PrefillSide, decode: DecodeSide,
                 open_region: RegionOpener = _open_region) -> None:
        self.ctx = ctx
        self.prefill = prefill
        self.decode = decode
        self.open_region = open_region

    def on_engine(self, ident: bytes, msg: Any, now: float) -> None:
        ctx = self.ctx
        if isinstance(msg, proto.Heartbeat):
            ctx.wire.to_engine(ident, proto.HeartbeatAck(msg.seq, ctx.daemon_id))
            return
        if isinstance(msg, proto.Attach):
            self.on_attach(ident, msg, now)
            return
        if ctx.attached is None or ident != ctx.attached.identity:
            ctx.bad("not_attached", f"{type(msg).__name__} before Attach")
            ctx.wire.to_engine(ident, proto.Error("not_attached", "send Attach first"))
            return
        if isinstance(msg, proto.TraceReport):
            self.on_trace_report(msg)
        elif isinstance(msg, proto.Register):
            self.decode.on_register(msg, now)
        elif isinstance(msg, proto.PrefillDone):
            self.prefill.on_prefill_done(msg, now)
        elif isinstance(msg, proto.Abort):
            known = self.decode.abort(msg.transfer_id, msg.attempt, msg.reason, now)
            known = self.prefill.abort(msg.transfer_id, msg.reason, now) or known
            if not known:
                # Nothing to wait for: the blocks are already safe to reuse.
                ctx.to_engine(proto.Released(msg.transfer_id, msg.attempt))
        else:
            ctx.bad("unexpected", f"{type(msg).__name__} on the engine endpoint")
            ctx.wire.to_engine(ident, proto.Error("unexpected", f"{type(msg).__name__} not accepted here"))

    def on_attach(self, ident: bytes, msg: proto.Attach, now: float) -> None:
        ctx = self.ctx
        a = ctx.attached
        if a is not None and a.memory == msg.memory and a.layout == msg.layout and a.engine_id == msg.engine_id:
            # The same engine memory again (a reconnect): keep the mapping, just follow the identity.
            a.identity = ident
            ctx.wire.to_engine(ident, proto.AttachAck(ctx.agent_name, ctx.daemon_id))
            return
        try:
            region = self.open_region(msg.memory)
        except (OSError, RuntimeError, ValueError) as exc:  # RegionError is a ValueError
            ctx.bad("attach", str(exc))
            ctx.wire.to_engine(ident, proto.Error("attach", f"cannot map engine memory: {exc}"))
            return
        if msg.layout.region_size > region.size:
            region.close()
            ctx.bad("attach", "layout larger than memory")
            ctx.wire.to_engine(ident, proto.Error(
                "attach", f"layout needs {msg.layout.region_size} bytes, memory has {region.size}"))
            return
        self.detach("engine re-attached")
        ctx.transport.register(region)
        ctx.attached = Attached(
            ident, msg.engine_id, msg.rank, msg.tp_size, msg.role, msg.layout, region, now, msg.memory
        )
        self.prefill.on_attach()
        log.info(
            "engine %s rank %d/%d (%s) attached: %d bytes, %d blocks x %d tokens",
            msg.engine_id, msg.rank, msg.tp_size, msg.role, region.size, msg.layout.num_blocks, msg.layout.block_size,
        )
        ctx.wire.to_engine(ident, proto.AttachAck(ctx.agent_name, ctx.daemon_id))

    def detach(self, why: str) -> None:
        """Fail everything tied to the attached memory, then unmap it."""
        old = self.ctx.attached
        if old is None:
            return
        self.decode.fail_all(why)
        self.prefill.on_detach(why)
        # Producers must learn our new memory: drop them so the next Register re-handshakes.
        self.decode.drop_all(why)
        self.ctx.transport.deregister(old.region)
        old.region.close()
        self.ctx.attached = None

    def on_trace_report(self, msg: proto.TraceReport) -> None:
        """The engine plugin's stamps of one transfer: kept beside ours for `kvpushctl trace`."""
        if len(msg.hops) != len(msg.times_ns) or not HOP_SET.issuperset(msg.hops):
            self.ctx.bad("trace", f"malformed TraceReport for {msg.transfer_id!r}")
            return
        self.ctx.trace.extend(msg.transfer_id, list(zip(msg.hops, msg.times_ns, strict=True)))
