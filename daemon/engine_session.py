"""The engine session: the one local engine rank a daemon serves, over its engine socket.

Hops (1) and (3) in, (7) and (8) out, of the sequence in docs/design.md: the plugin's Attach maps the engine's KV memory and registers it
with NIXL; its Register / PrefillDone / Abort go to the decode or prefill side; their answers
go back through :meth:`DaemonContext.to_engine`. This module alone writes
``ctx.attached``. A re-attach (new memory) fails everything tied to the old one first.

The local trust boundary (:class:`LocalTrust`, given by the worker): an Attach is bound to
the process whose ipc connection carried it (kernel credentials, :mod:`.peercred`). That
process must be the memory's exporter, the file must be its own (``daemon.kv_mapping``), and it
takes the rank only if no other live, connected process holds it (one engine per rank). The
mapped shm files are recorded (:class:`ShmLedger`) and unlinked once their exporter is gone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvpush import proto
from kvpush.daemon.context import Attached, DaemonContext
from kvpush.daemon.decode_side import DecodeSide
from kvpush.daemon.io.peercred import Holder, PeerCred, PeerTable, attach_refusal
from kvpush.daemon.prefill_side import PrefillSide
from kvpush.proto.handles import RegionError, process_start_time, shm_info
from kvpush.proto.trace import HOP_SET

log = logging.getLogger(__name__)

RegionOpener = Callable[..., Any]  # (MemoryHandle[, ShmOwner]) -> MappedRegion

RESTART_GRACE_S = 10.0  # after a daemon restart, the recorded live engine's claim on the rank
REAP_EVERY_S = 1.0  # how often exited engines' memory is looked for


def map_engine_region(memory: proto.MemoryHandle, owner: Any = None) -> Any:
    from kvpush.daemon.io.kv_mapping import open_region

    return open_region(memory, owner)


@dataclass
class LocalTrust:
    """What the real daemon knows of its local peers: the engine socket's live connections
    and the ledger of mapped shm files. Without it (the in-memory unit harness) an Attach is
    taken as it comes."""

    peers: PeerTable
    ledger: Any = None  # kvpush.daemon.io.kv_mapping.ShmLedger (None: nothing recorded)
    start_time: Callable[[int], int | None] = process_start_time
    restart_grace_s: float = RESTART_GRACE_S


class EngineSession:
    def __init__(self, ctx: DaemonContext, prefill: PrefillSide, decode: DecodeSide,
                 open_region: RegionOpener = map_engine_region, trust: LocalTrust | None = None) -> None:
        self.ctx = ctx
        self.prefill = prefill
        self.decode = decode
        self.open_region = open_region
        self.trust = trust
        self.holder: Holder | None = None  # the process holding the rank (with trust)
        self.last_reap = 0.0
        ctx.own_attached(self)
        if trust is not None and trust.ledger is not None:
            self._restore(trust, time.monotonic())

    def _restore(self, trust: LocalTrust, now: float) -> None:
        """A (re)started daemon: unlink what exited engines left, and keep the rank for the
        live engine that held it (it reconnects by itself and re-attaches, same file)."""
        trust.ledger.load()
        for path in trust.ledger.reap():
            log.info("removed %s left by an exited engine", path)
        rec = trust.ledger.latest_alive()
        if rec is not None:
            self.holder = Holder(rec.pid, rec.start_time, rec.uid, now + trust.restart_grace_s)

    def on_engine(self, ident: bytes, msg: Any, now: float, peer: PeerCred | None = None) -> None:
        ctx = self.ctx
        if isinstance(msg, proto.Heartbeat):
            ctx.wire.to_engine(ident, proto.HeartbeatAck(msg.seq, ctx.daemon_id, self.prefill.stream_min_tokens()))
            return
        if isinstance(msg, proto.Attach):
            self.on_attach(ident, msg, now, peer)
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
        elif isinstance(msg, proto.LayerProgress):
            self.prefill.on_layer_progress(msg, now)
        elif isinstance(msg, proto.LayerEvents):
            self.prefill.on_layer_events(msg)
        elif isinstance(msg, proto.Abort):
            known = self.decode.abort(msg.transfer_id, msg.attempt, msg.reason, now)
            # A prefill engine's Abort of a transfer we never saw: it gave the prefill up while
            # it could not reach us (remembered: the registration is refused at once).
            a = ctx.attached
            known = self.prefill.abort(msg.transfer_id, msg.reason, now,
                                       remember=a is not None and a.role != "decode") or known
            if not known:
                # Nothing to wait for: the blocks are already safe to reuse.
                ctx.to_engine(proto.Released(msg.transfer_id, msg.attempt))
        else:
            ctx.bad("unexpected", f"{type(msg).__name__} on the engine endpoint")
            ctx.wire.to_engine(ident, proto.Error("unexpected", f"{type(msg).__name__} not accepted here"))

    def on_attach(self, ident: bytes, msg: proto.Attach, now: float, peer: PeerCred | None = None) -> None:
        ctx = self.ctx
        owner = None
        peer_start = None
        if self.trust is not None:
            refusal, peer_start = self._refusal(msg, peer, now)
            if refusal is not None:
                ctx.bad("attach_refused", f"engine {msg.engine_id!r}: {refusal}")
                ctx.wire.to_engine(ident, proto.Error("attach_refused", refusal))
                return
            from kvpush.daemon.io.kv_mapping import ShmOwner

            assert peer is not None
            owner = ShmOwner(peer.pid, peer.uid)
        a = ctx.attached
        if a is not None and a.memory == msg.regions and a.layout == msg.layout and a.engine_id == msg.engine_id \
                and (owner is None or (self.holder is not None and self.holder.pid == owner.pid)):
            # The same engine memory again (a reconnect): keep the mapping, just follow the identity.
            a.identity = ident
            ctx.wire.to_engine(ident, proto.AttachAck(ctx.agent_name, ctx.daemon_id))
            return
        regions = self._map(ident, msg, owner)
        if regions is None:
            return
        self.detach("engine re-attached")
        registered: list[Any] = []
        try:
            for region in regions:
                ctx.transport.register(region)
                registered.append(region)
        except Exception as exc:  # e.g. mixed memory types: nothing stays registered
            for region in registered:
                ctx.transport.deregister(region)
            for region in regions:
                region.close()
            ctx.bad("attach", str(exc))
            ctx.wire.to_engine(ident, proto.Error(
                "attach", proto.codec.clip(f"cannot register engine memory: {exc}", proto.codec.REASON_MAX)))
            return
        ctx.set_attached(Attached(
            ident, msg.engine_id, msg.rank, msg.tp_size, msg.role, msg.layout, tuple(regions), now, msg.regions
        ), by=self)
        self.prefill.on_attach()
        if self.trust is not None and peer is not None and peer_start is not None:
            self.holder = Holder(peer.pid, peer_start, peer.uid)
            for region in regions:
                self._record(region)
        log.info(
            "engine %s rank %d/%d (%s) attached: %d region(s), %d bytes, %d blocks x %d tokens",
            msg.engine_id, msg.rank, msg.tp_size, msg.role, len(regions), sum(r.size for r in regions),
            msg.layout.num_blocks, msg.layout.block_size,
        )
        ctx.wire.to_engine(ident, proto.AttachAck(ctx.agent_name, ctx.daemon_id))

    def _map(self, ident: bytes, msg: proto.Attach, owner: Any) -> list[Any] | None:
        """Map every region of an Attach (all or none), each at least as large as the layout
        says; None (the engine told why) otherwise."""
        ctx = self.ctx
        sizes = msg.layout.regions
        why = ""
        if len(msg.regions) != len(sizes):
            why = f"{len(msg.regions)} memory handles for a layout of {len(sizes)} regions"
        regions: list[Any] = []
        for i, handle in enumerate(msg.regions if not why else ()):
            try:
                region = self.open_region(handle) if owner is None else self.open_region(handle, owner)
            except (OSError, RuntimeError, ValueError) as exc:  # RegionError is a ValueError
                why = f"cannot map engine memory (region {i}): {exc}"
                break
            regions.append(region)
            if sizes[i] > region.size:
                why = f"layout needs {sizes[i]} bytes in region {i}, memory has {region.size}"
                break
            if region.mem_type != regions[0].mem_type or region.device != regions[0].device:
                why = "every region of one engine rank must be on the same device"
                break
        if not why:
            return regions
        for region in regions:
            region.close()
        ctx.bad("attach", why)
        ctx.wire.to_engine(ident, proto.Error("attach", proto.codec.clip(why, proto.codec.REASON_MAX)))
        return None

    def _refusal(self, msg: proto.Attach, peer: PeerCred | None, now: float) -> tuple[str | None, int | None]:
        """Why this Attach may not take the rank (None: it may), and the sender's start time."""
        assert self.trust is not None
        if peer is None:
            return "no kernel credentials for this connection (engines attach over the ipc socket)", None
        start = self.trust.start_time
        peer_start = start(peer.pid)
        for handle in msg.regions:
            if handle.kind != "cpu_shm":
                continue
            try:
                info = shm_info(handle)
            except RegionError as exc:
                return f"memory handle: {exc}", peer_start
            if info.pid != peer.pid or info.start_time != peer_start:
                return (f"memory exported by process {info.pid}, but the Attach came from process "
                        f"{peer.pid}: an engine attaches only its own memory"), peer_start
        h = self.holder
        held = attach_refusal(h, peer, peer_start, start(h.pid) if h else None,
                              self.trust.peers.connected(h.pid) if h else False, now)
        return held, peer_start

    def _record(self, region: Any) -> None:
        from kvpush.daemon.io.kv_mapping import ShmRecord, ShmRegion

        ledger = self.trust.ledger if self.trust is not None else None
        if ledger is not None and isinstance(region, ShmRegion):
            ledger.add(ShmRecord.of(region))

    def tick(self, now: float) -> None:
        """Once a second: an attached engine whose process is gone is detached (its memory
        unmapped), and the shm files of exited engines are unlinked."""
        trust = self.trust
        if trust is None or now - self.last_reap < REAP_EVERY_S:
            return
        self.last_reap = now
        h = self.holder
        if h is not None and trust.start_time(h.pid) != h.start_time:
            self.holder = None
            if self.ctx.attached is not None:
                log.info("engine process %d exited: detaching its memory", h.pid)
                self.detach("engine process exited")
        if trust.ledger is not None:
            trust.ledger.reap()

    def shutdown(self) -> None:
        """At daemon exit: unlink what exited engines left (never a live engine's file: it
        re-attaches to the next daemon with it)."""
        if self.trust is not None and self.trust.ledger is not None:
            self.trust.ledger.reap()

    def detach(self, why: str) -> None:
        """Fail everything tied to the attached memory, then unmap it."""
        old = self.ctx.attached
        if old is None:
            return
        self.decode.fail_all(why)
        self.prefill.on_detach(why)
        # Producers must learn our new memory: drop them so the next Register re-handshakes.
        self.decode.drop_all(why)
        for region in old.regions:
            self.ctx.transport.deregister(region)
            region.close()
        self.ctx.set_attached(None, by=self)

    def unmap(self) -> None:
        """At daemon exit, after NIXL closed (its registrations went with it): unmap the
        engine's memory."""
        old = self.ctx.attached
        if old is not None:
            for region in old.regions:
                region.close()
            self.ctx.set_attached(None, by=self)

    def on_trace_report(self, msg: proto.TraceReport) -> None:
        """The engine plugin's stamps of one transfer: kept beside ours for `kvpushctl trace`."""
        if len(msg.hops) != len(msg.times_ns) or not HOP_SET.issuperset(msg.hops):
            self.ctx.bad("trace", f"malformed TraceReport for {msg.transfer_id!r}")
            return
        self.ctx.trace.extend(msg.transfer_id, list(zip(msg.hops, msg.times_ns, strict=True)))
