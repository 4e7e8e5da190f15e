"""The prefill side of one daemon: decode peers that dial us, the rendezvous, our WRITEs.

Hops (3), (4), (5) and (8) of a request (the sequence in docs/design.md): the engine's PrefillDone and the
decode daemons' PeerRegisters meet in the rendezvous core (:mod:`kvpush.daemon.core.rendezvous`),
whose StartWrite actions become NIXL WRITEs with a notification; their completion releases
the engine's blocks. This module owns the consumer records, the rendezvous core, the WRITEs
in flight and the prepared descriptor lists; it talks to ZeroMQ and NIXL only through the
context's ports.
"""

from __future__ import annotations

import enum
import logging
import math
import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from kvpush import proto
from kvpush.common.machine import drive
from kvpush.daemon.context import DaemonContext
from kvpush.daemon.core import quotas
from kvpush.daemon.core import rendezvous as rv
from kvpush.daemon.core.checks import (
    bounded_s,
    check_binding,
    check_blocks,
    check_progress,
    progress_events,
)
from kvpush.daemon.core.group_pairs import pair_groups, plan_pairs
from kvpush.daemon.core.peers import Consumer
from kvpush.daemon.core.planner import PlanError, addresses, block_pattern, plan, unwritten
from kvpush.daemon.handshake import compat_error, make_hello, refusal
from kvpush.daemon.io.layer_gate import EventError, LayerGate
from kvpush.daemon.trust.peerauth import endpoint_host
from kvpush.proto.groups import GroupsError, parse
from kvpush.proto.notif import KEY_BYTES, Notification
from kvpush.proto.params import MAX_SECRET

log = logging.getLogger(__name__)



# Poll cap while one of our WRITEs is in flight. NIXL runs without UCX's progress thread, so a
# WRITE over TCP moves bytes only while we poll it: backing off like an idle loop would cap a
# 16 MiB WRITE at a few socket buffers per sleep (measured: half the raw NIXL rate).
WRITE_POLL_MAX_S = 0.0001
# A WRITE this large is announced to its consumer before it is posted, smaller ones after.
# Posting pushes bytes into the socket until it is full, so a large post lasts longer than the
# hint's flight (~1.5 ms for 16 MiB over a veth, the hint ~0.5 ms), and a consumer that only
# starts polling after it leaves the sender stalled on a full socket meanwhile (16 MiB
# isolated across the lab's veth: +8 % rate). A small post is over before the hint lands: an
# early hint only wakes the consumer to compete for the CPU with our post (it cost same-host
# TTFT). The tiny model's transfers in the TTFT benchmark stay below it (4 MiB at 2000 tokens).
EARLY_HINT_MIN_BYTES = 8 << 20
LOST_REMEMBERED = 1024  # evicted consumers remembered (handshake_lost, not unauthenticated)
BACKLOG_REASON = "sent while this daemon did not run: its engine may have given it up and freed the blocks"


def _reason(text: str) -> str:
    """A reason as it leaves: it may quote a peer's or the engine's words (an abort's or a
    cancel's reason), so it is clipped to stay decodable."""
    return proto.codec.clip(text, proto.codec.REASON_MAX)


class _Seen(enum.Enum):
    """What the prefill side knows of a routing id that has no consumer (any more)."""

    LOST = "lost"  # we evicted it: its late frames are handshake_lost
    LOST_SAID = "lost_said"  # ... and that was logged
    REFUSED = "refused"  # its Hello was refused: its frames are unauthenticated


@dataclass
class InFlight:
    """One posted WRITE, until NIXL says it is done or failed (or it times out)."""

    transfer_id: str
    attempt: int
    dest_rank: int
    peer: str  # the consumer's key
    handle: Any
    nbytes: int
    descriptors: int
    started: float
    prepped: bool = False  # posted from prepared descriptor lists (by index)
    group: int = 0  # a layer group's WRITE (StartGroupWrite.group), 0: the final one
    streamed: int = 0  # final WRITE: the parts group WRITEs had landed (it skipped them)


class PrefillSide:
    def __init__(self, ctx: DaemonContext) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.rdv = rv.Rendezvous(
            quota=quotas.Quota(self.cfg.max_transfers_per_peer, self.cfg.max_blocks_per_peer),
            max_groups=self.cfg.max_layer_groups, max_group_writes=self.cfg.max_layer_writes_in_flight,
            max_group_writes_total=self.cfg.max_layer_writes_total)
        self.consumers: dict[bytes, Consumer] = {}  # routing id -> decode daemon
        self.in_flight: dict[int, InFlight] = {}
        self._local_prep: dict[tuple[bytes, bytes], Any] = {}  # pattern -> prepared local dlist
        self._lease_said: set[rv.Cause] = set()  # lease expiries already logged, by cause
        self.layer_events = 0  # LayerEvents pool size of the attached engine (0: none)
        # GPU: a frame's groups wait here until the engine's event fired (CPU frames pass through)
        self.gate: LayerGate[rv.LayersReady] = LayerGate(self.cfg.max_event_waiting, self.cfg.max_event_wait_s)
        # Routing ids without a consumer that we know something of (bounded, oldest dropped).
        self._lost: OrderedDict[bytes, _Seen] = OrderedDict()
        # True while the loop reads what the engine wrote while this daemon did not run (for
        # proto.ENGINE_DEAD_AFTER_MIN_S or more): see on_prefill_done.
        self.backlog = False
        self.backlog_failed = 0  # PrefillDones and LayerProgress frames of the last backlog

    # ------------------------------------------------------------------ engine

    def on_prefill_done(self, msg: proto.PrefillDone, now: float) -> None:
        a = self.ctx.attached
        assert a is not None
        why = "daemon is draining" if self.ctx.draining else check_blocks(
            a.layout, msg.block_ids, msg.num_tokens, "prefill", 0, msg.kv_groups) or check_binding(msg.bind_node, msg.bind_secret, "prefill")
        if why:
            self.ctx.bad("prefill", why)
            self.ctx.to_engine(proto.SendFailed(msg.transfer_id, 0, why))
            # The transfer can never be written now (e.g. a hybrid engine's lists without one
            # KV cache group): a decode side registered for it is told at once, and a later
            # registration is refused at once, instead of either waiting out its deadline.
            self.apply(rv.Aborted(msg.transfer_id, None, why, "local", now))
            return
        self.ctx.trace.stamp(msg.transfer_id, "p.daemon.prefill_done_in")
        lease = bounded_s(msg.lease_ms, self.cfg.lease_s)
        if self.backlog:
            # Written while we did not run: the engine may have given us up since and freed these
            # blocks. Remembered as failed (its registration is refused at once), never written.
            self.backlog_failed += 1
            self.apply(rv.Aborted(msg.transfer_id, None, BACKLOG_REASON, "local", now))
            self.apply(rv.Prefilled(msg.transfer_id, msg.block_ids, msg.num_tokens, now, now + lease,
                                    kv_groups=msg.kv_groups))
            return
        self.apply(rv.Prefilled(msg.transfer_id, msg.block_ids, msg.num_tokens, now, now + lease,
                                msg.bind_node, msg.bind_secret, msg.epoch if msg.streamed else -1, msg.kv_groups))

    def on_layer_progress(self, msg: proto.LayerProgress, now: float) -> None:
        """Check a LayerProgress against the attached layout and the configured bounds (a bad
        frame is refused whole, with an Error to the engine) and feed its chunks to the
        rendezvous, which posts group WRITEs to registered decode sides. A frame naming a GPU
        event waits in the gate until that event fired: on a GPU the layers are only queued
        when the frame is sent (what the gate drops, the seal's final WRITE covers)."""
        a = self.ctx.attached
        assert a is not None
        self.ctx.metrics.layer_frames.inc()
        why = check_progress(a.layout, msg, self.cfg.max_progress_chunks, self.layer_events)
        if why:
            self.ctx.bad("progress", why)
            self.ctx.to_engine(proto.Error("progress", why))
            return
        if self.backlog:  # its blocks may be freed (see on_prefill_done); the seal, if any, writes all
            self.backlog_failed += 1
            return
        self._layers_ready(self.gate.admit(msg.event, progress_events(msg, now, self.cfg.lease_s), now))

    def _layers_ready(self, events: list[rv.LayersReady]) -> None:
        for ev in events:
            self.ctx.trace.stamp_first(ev.transfer_id, "p.daemon.layers_in")
            self.ctx.trace.stamp_latest(ev.transfer_id, "p.daemon.layers_last_in")
            self.apply(ev)

    def on_layer_events(self, msg: proto.LayerEvents) -> None:
        """The engine's GPU event pool: LayerProgress may name ``1 .. len(handles)``. One that
        cannot be opened turns GPU streaming off for this engine (frames naming events are
        dropped, counted; the seal writes everything)."""
        self.layer_events = len(msg.handles)
        try:
            self.gate.open_pool(msg.handles, msg.device)
        except EventError as exc:
            self.ctx.bad("events", str(exc))

    def abort(self, tid: str, reason: str, now: float, *, remember: bool = False) -> bool:
        """The local engine (or an operator) gives up on a transfer; False if we hold none.
        ``remember``: the engine gave up a prefill we never saw (it could not reach us): a
        tombstone refuses its registration at once, instead of letting it wait its deadline
        for a PrefillDone that will never come."""
        if not self.rdv.live(tid):
            if remember and self.rdv.info(tid) is None:
                self.apply(rv.Aborted(tid, None, reason, "local", now))
            return False
        self.apply(rv.Aborted(tid, None, reason, "local", now))
        return True

    def on_attach(self) -> None:
        """A (new) engine memory is registered: prepare lists for every known consumer."""
        for c in self.consumers.values():
            self._prep(c)

    def on_detach(self, why: str) -> None:
        self.gate.reset()
        self.fail_all(why)
        self.wait_in_flight(self.cfg.write_timeout_s)
        self.release_preps()

    # ------------------------------------------------------------------ peers

    def on_peer(self, ident: bytes, msg: Any, now: float, node: str = "") -> None:
        """``node``: the authenticated sender's name (ZAP), "" only with insecure_peers."""
        if isinstance(msg, proto.Hello):
            self.on_hello(ident, msg, now, node)
            return
        peer = self.consumers.get(ident)
        if peer is None and self._handshake_lost(ident, node):
            self.ctx.wire.to_consumer(ident, proto.Error("handshake", "handshake lost: send Hello again"))
            return
        if peer is None or peer.node != node:
            self.ctx.bad("unauthenticated", f"{type(msg).__name__} from a peer without handshake")
            self.ctx.wire.to_consumer(ident, proto.Error("handshake", "send Hello first"))
            return
        peer.last_seen = now
        if isinstance(msg, proto.Heartbeat):
            self.ctx.wire.to_consumer(ident, proto.HeartbeatAck(msg.seq, self.ctx.daemon_id))
        elif isinstance(msg, proto.PeerRegister):
            self.on_peer_register(peer, msg, now)
        elif isinstance(msg, proto.Cancel):
            self.apply(rv.Aborted(msg.transfer_id, msg.attempt, msg.reason, "peer", now, peer.key))
        else:
            self.ctx.bad("unexpected", f"{type(msg).__name__} on the peer endpoint")
            self.ctx.wire.to_consumer(ident, proto.Error("unexpected", f"{type(msg).__name__} not accepted here"))

    def on_hello(self, ident: bytes, msg: proto.Hello, now: float, node: str = "") -> None:
        """A decode daemon introduces itself (first contact or after a restart).

        Authenticated, it may only claim an endpoint on a host its certificate lists, and
        only replace (evict) a peer of its own identity."""
        # An identity violation is never explained; a layout mismatch is, to an allowlisted node.
        bad_identity = self._identity_error(msg, node)
        why = (bad_identity or self._role_error() or ("a Hello reply where a Hello was expected" if msg.reply else "")
               or compat_error(self.ctx, msg))
        if why:
            self.ctx.bad("handshake", why)
            self._remember(ident, _Seen.REFUSED)
            told = refusal(why, self._allowed(node) and not bad_identity)
            self.ctx.wire.to_consumer(ident, proto.Error("incompatible", told))
            return
        # The same endpoint under a new identity is a restarted peer: evict the old one.
        for old in [p for p in self.consumers.values() if p.endpoint == msg.endpoint and p.routing_id != ident]:
            self.evict(old, "peer restarted", now)
        if ident not in self.consumers:  # a new session: within its identity's session cap
            over = quotas.session_refusal(len(self._sessions_of(node)), self.cfg.max_sessions_per_peer)
            if over:
                self.ctx.bad("handshake", over)
                self.ctx.wire.to_consumer(ident, proto.Error("overloaded", over))
                return
        old = self.consumers.get(ident)
        if old is not None and (old.agent_name != msg.agent_name or old.node != node):
            self.evict(old, "peer re-handshook", now)
        elif old is not None:
            self._unprep(old)  # its memory may have moved: prepared again below
        try:
            name = self.ctx.transport.add_peer(msg.agent_metadata)
        except Exception as exc:
            self.ctx.bad("handshake", str(exc))
            self.ctx.wire.to_consumer(ident, proto.Error("handshake", refusal(str(exc), self._allowed(node))))
            return
        peer = self.consumers[ident] = Consumer(
            ident, msg.endpoint, name, msg.layout, msg.region_bases, msg.rank, msg.tp_size, msg.engine_id,
            since=now, last_seen=now, node=node, mem_type=msg.mem_type, device=msg.device,
        )
        log.info("decode peer %s (%s rank %d) handshaken", msg.endpoint, msg.engine_id, msg.rank)
        self.ctx.wire.to_consumer(ident, make_hello(self.ctx, reply=True))
        self._prep(peer)  # after the reply: off the peer's critical path

    def _role_error(self) -> str:
        """A daemon serving a decode engine only dials out: it answers no Hello, so no peer
        learns its engine's NIXL metadata or region addresses (issue 28: an allowlisted node
        read and wrote a decode engine's KV with them)."""
        a = self.ctx.attached
        if a is not None and a.role == "decode":
            return "this daemon serves a decode engine: decode daemons only dial out"
        return ""

    def _handshake_lost(self, ident: bytes, node: str) -> bool:
        """A known peer without a handshake here: one we evicted (silent while it was frozen,
        then its queued Heartbeats, Cancels and PeerRegisters arrive), or, authenticated, one
        that handshook with this daemon before it restarted. Counted as ``handshake_lost`` (it
        re-handshakes when told), not as ``unauthenticated``: that stays for peers that never
        authenticated, so an operator's security alert does not fire on a peer that paused."""
        seen = self._lost.get(ident)
        if seen is _Seen.REFUSED or (seen is None and not self._allowed(node)):
            return False  # its Hello was refused here, or it is a stranger: unauthenticated
        self.ctx.metrics.failure("handshake_lost")
        if seen is not _Seen.LOST_SAID:  # once per connection: a frozen peer's backlog is one event
            self._remember(ident, _Seen.LOST_SAID)
            log.warning("decode peer %s (%s) sent traffic without a handshake here (evicted while silent, "
                        "or this daemon restarted): told to send Hello again", ident.hex(), node or "insecure")
        return True

    def _remember(self, ident: bytes, seen: _Seen) -> None:
        self._lost[ident] = seen
        self._lost.move_to_end(ident)
        while len(self._lost) > LOST_REMEMBERED:
            self._lost.popitem(last=False)

    def _allowed(self, node: str) -> bool:
        """An authenticated peer still in the allowlist (it may learn why it was refused)."""
        return bool(node) and self.ctx.auth is not None and self.ctx.auth.allow.named(node) is not None

    def _identity_error(self, msg: proto.Hello, node: str) -> str:
        auth = self.ctx.auth
        if auth is None:
            return ""  # insecure_peers: every peer is anonymous
        cert = auth.allow.named(node)
        if cert is None:
            return f"peer {node!r} is not in the allowlist"
        if not cert.may("decode"):
            return f"peer {node!r} is not allowed the decode role (its certificate's roles: {', '.join(cert.roles)})"
        if endpoint_host(msg.endpoint) not in cert.hosts:
            return f"peer {node!r} claims endpoint {msg.endpoint} on a host its certificate does not list"
        taken = [p for p in self.consumers.values() if p.endpoint == msg.endpoint and p.node != node]
        if taken:
            return f"endpoint {msg.endpoint} belongs to peer {taken[0].node!r}"
        return ""

    def revoke(self, allowed: set[str], now: float) -> None:
        """The allowlist changed: drop every consumer whose node is no longer in it."""
        for c in [c for c in self.consumers.values() if c.node and c.node not in allowed]:
            self.evict(c, f"node {c.node!r} was removed from the allowlist", now)

    def on_peer_register(self, peer: Consumer, msg: proto.PeerRegister, now: float) -> None:
        if self.ctx.draining:
            why = "producer is draining"
        elif msg.dest_rank != peer.rank or msg.dest_tp_size != peer.tp_size:
            why = f"registration for rank {msg.dest_rank}/{msg.dest_tp_size} from peer rank {peer.rank}/{peer.tp_size}"
        elif msg.expected_dests == 0:
            why = "expected_dests must be positive"
        elif len(msg.secret) > MAX_SECRET:
            why = f"secret of {len(msg.secret)} chars exceeds {MAX_SECRET}"
        elif len(msg.key) != KEY_BYTES:  # the decode side counts only a notification tagged with it
            why = f"notification key of {len(msg.key)} bytes, not {KEY_BYTES}"
        else:
            why = check_blocks(peer.layout, msg.block_ids, msg.num_tokens, "peer register", msg.first_token,
                               msg.kv_groups)
        # The decode side gives up at its deadline even with a WRITE in flight, so the last
        # WRITE must start early enough to finish (or time out) before then.
        margin = self.cfg.write_timeout_s + 1.0
        deadline = bounded_s(msg.timeout_ms, self.cfg.register_timeout_s)
        if not why and deadline <= margin:  # it could never be written: say so, not silence
            why = (f"registration timeout {deadline:.1f}s leaves no time to write: it must exceed this "
                   f"prefill daemon's write_timeout_s + 1 ({margin:.1f}s); raise the decode engine's timeout_ms")
        if why:
            self.ctx.bad("register", why)
            self.ctx.wire.to_consumer(
                peer.routing_id, proto.WriteFailedNotice(msg.transfer_id, msg.attempt, self.ctx.rank, why))
            return
        peer.transfers += 1
        self.ctx.trace.stamp(msg.transfer_id, "p.daemon.register_in")
        self.apply(rv.Registered(
            msg.transfer_id, msg.attempt, peer.key, msg.dest_rank, msg.expected_dests, msg.block_ids,
            msg.num_tokens, now, now + max(0.0, deadline - margin), msg.first_token, peer.node, msg.secret,
            self.worth_streaming(peer, msg.num_tokens - msg.first_token), msg.key, msg.kv_groups,
        ))

    def stream_min_tokens(self) -> int:
        """Layerwise "auto": the shortest prompt worth streaming to any decode peer we know
        (HeartbeatAck.stream_min_tokens); 0: any (no peer yet, or one not measured yet)."""
        return min((self._stream_floor(c) for c in self.consumers.values()), default=0)

    def worth_streaming(self, peer: Consumer, num_tokens: int) -> bool:
        """Layerwise "auto": would a whole WRITE of ``num_tokens`` tokens to ``peer`` take
        ``layerwise_min_transfer_ms`` or more at the rate WRITEs to it recently moved?"""
        return num_tokens >= self._stream_floor(peer)

    def _stream_floor(self, peer: Consumer) -> int:
        """The fewest tokens whose whole WRITE to ``peer`` takes ``layerwise_min_transfer_ms``
        at its measured rate; 0 (stream anything) for a peer not measured yet: its first
        WRITEs measure it."""
        me, least = self.ctx.attached, self.cfg.layerwise_min_transfer_ms
        if me is None or least <= 0 or not peer.rate.samples:
            return 0
        return math.ceil(least / 1e3 * peer.rate.bps / (me.layout.block_bytes / me.layout.block_size))

    def _sessions_of(self, node: str) -> list[Consumer]:
        return [c for c in self.consumers.values() if c.node == node] if node else []

    def consumer(self, key: str) -> Consumer | None:
        try:
            return self.consumers.get(bytes.fromhex(key))
        except ValueError:
            return None

    def evict(self, peer: Consumer, why: str, now: float) -> None:
        self.consumers.pop(peer.routing_id, None)
        self._remember(peer.routing_id, _Seen.LOST)
        self._unprep(peer)
        log.warning("decode peer %s evicted: %s", peer.endpoint, why)
        self.ctx.metrics.failure("peer_lost")
        self.apply(rv.PeerLost(peer.key, now))
        # Keep the NIXL agent until its in-flight WRITEs finished (they fail or complete).
        if not any(f.peer == peer.key for f in self.in_flight.values()):
            try:
                self.ctx.transport.remove_peer(peer.agent_name)
            except Exception as exc:
                log.warning("remove_peer %s: %s", peer.agent_name, exc)

    # ------------------------------------------------------------------ prepared lists

    def _prep(self, peer: Consumer) -> None:
        """Prepare NIXL descriptor lists for WRITEs to this consumer, once per (regions, peer):
        a WRITE is then two index arrays (no descriptors built per transfer). Layouts whose
        plans are not block-periodic (different block sizes) keep the per-transfer path."""
        me = self.ctx.attached
        if me is None or peer.prepped is not None:
            return
        pattern = block_pattern(me.layout, peer.layout, self.cfg.max_prepped_descriptors)
        if pattern is None:
            return
        key = (pattern.src_off.tobytes(), pattern.length.tobytes())
        try:
            local = self._local_prep.get(key)
            if local is None:
                descs = pattern.src_list()
                descs[:, 0] = addresses(descs[:, 0], me.bases)
                local = self._local_prep[key] = self.ctx.transport.prep_local(descs)
            descs = pattern.dst_list()
            descs[:, 0] = addresses(descs[:, 0], peer.region_bases)
            peer.prepped = (pattern, local, self.ctx.transport.prep_remote(
                peer.agent_name, descs, mem_type=peer.mem_type, device=peer.device))
        except Exception as exc:  # the per-transfer path still works
            log.warning("cannot prepare descriptor lists for %s (%s); WRITEs build their own", peer.endpoint, exc)

    def release_preps(self) -> None:
        for c in self.consumers.values():
            self._unprep(c)
        for h in self._local_prep.values():
            try:
                self.ctx.transport.release_prepped(h)
            except Exception as exc:
                log.warning("release of a prepared local list: %s", exc)
        self._local_prep.clear()

    def forget_preps(self) -> None:
        """Our NIXL agent was replaced (a rotation; host memory is mapped at a new address too):
        the prepared lists died with the old agent and name old addresses. Dropped, not released
        (the new agent never knew them); WRITEs build new ones."""
        for c in self.consumers.values():
            c.prepped = None
        self._local_prep.clear()

    def _unprep(self, peer: Consumer) -> None:
        if peer.prepped is not None:
            try:
                self.ctx.transport.release_prepped(peer.prepped[2])
            except Exception as exc:
                log.warning("release of %s's prepared list: %s", peer.endpoint, exc)
            peer.prepped = None

    # ------------------------------------------------------------------ WRITEs

    def start_write(self, a: rv.StartWrite, now: float) -> list[Any]:
        """Post the final WRITE (with its notification); what the rendezvous must hear when it
        could not be posted (its follow-up event)."""
        me = self.ctx.attached
        peer = self.consumer(a.peer)
        err = ""
        if me is None:
            err = "no engine attached"
        elif peer is None:
            err = "decode peer is gone"
        planned = None  # a hybrid's plan with state pairs (part of a page each): fresh descriptors
        if not err and a.src_kv_groups:  # hybrid: each group's blocks the decode side needs
            assert me is not None and peer is not None
            try:
                pairs = pair_groups(a.src_block_ids, a.src_kv_groups, a.dst_block_ids, a.dst_kv_groups,
                                    num_tokens=a.num_tokens, dst_first_token=a.dst_first_token,
                                    block_size=me.layout.block_size,
                                    kinds=tuple(parse(d) for d in me.layout.kv_groups))
                if pairs.partial:
                    planned = plan_pairs(me.layout, peer.layout, pairs)
            except (PlanError, GroupsError) as exc:
                err = f"plan: {exc}"
                self.ctx.metrics.failure("plan")
            else:
                a = replace(a, src_block_ids=pairs.src, dst_block_ids=pairs.dst,
                            num_tokens=len(pairs.src) * me.layout.block_size, dst_first_token=0, written=())
        if not err:
            assert me is not None and peer is not None
            notif = Notification.signed(a.key, a.transfer_id, a.attempt, me.rank).encode()
            tr = self.ctx.transport
            try:
                prepped = peer.prepped is not None and planned is None
                if prepped:
                    assert peer.prepped is not None
                    pattern, local_h, remote_h = peer.prepped
                    sb, db = pattern.block_pairs(me.layout, a.src_block_ids, a.dst_block_ids, a.num_tokens,
                                                 a.dst_first_token)
                    keep = None
                    if a.written:  # layer groups already landed there: only the rest goes now
                        keep = unwritten(pattern, int(sb.shape[0]), a.dst_first_token // me.layout.block_size,
                                         ((p.layer_lo, p.layer_hi, p.first_block, len(p.src_block_ids), p.end_token)
                                          for p in a.written), me.layout.block_size, a.num_tokens)
                    li, ri = pattern.indices(sb, db, keep)
                    nbytes = (int(pattern.length.sum()) * int(sb.shape[0]) if keep is None
                              else int((pattern.length[:, None] * keep).sum()))
                    ndesc = int(li.shape[0])

                    def post() -> Any:
                        return tr.write_prepped(peer.agent_name, local_h, li, remote_h, ri, notif, nbytes=nbytes)
                else:
                    p = planned if planned is not None else plan(
                        me.layout, a.src_block_ids, peer.layout, a.dst_block_ids, a.num_tokens,
                        dst_first_token=a.dst_first_token)
                    nbytes, ndesc = p.nbytes, len(p)
                    local = np.stack((addresses(p.src_off, me.bases), p.length), axis=1)
                    remote = np.stack((addresses(p.dst_off, peer.region_bases), p.length), axis=1)

                    def post() -> Any:
                        return tr.write(peer.agent_name, local, remote, notif, remote_mem_type=peer.mem_type,
                                        remote_device=peer.device)
                self.ctx.trace.stamp(a.transfer_id, "p.daemon.planned")
                # The consumer polls NIXL tightly while this is in flight (over TCP a WRITE lands
                # only as the receiver progresses): told after the post, or before a large one
                # (EARLY_HINT_MIN_BYTES says why).
                hint = proto.Writing(a.transfer_id, a.attempt, me.rank, False)
                early = nbytes >= EARLY_HINT_MIN_BYTES
                if early:
                    self.ctx.wire.to_consumer(peer.routing_id, hint)
                h = post()
                self.ctx.trace.stamp(a.transfer_id, "p.daemon.write_posted")
            except PlanError as exc:
                err = f"plan: {exc}"
                self.ctx.metrics.failure("plan")
            except Exception as exc:
                err = f"NIXL: {exc}"
                self.ctx.metrics.failure("nixl")
            else:
                if not early:
                    self.ctx.wire.to_consumer(peer.routing_id, hint)
                self.in_flight[id(h)] = InFlight(
                    a.transfer_id, a.attempt, a.dest_rank, a.peer, h, nbytes, ndesc, now, prepped,
                    streamed=len(a.written) if prepped else 0)
                self.ctx.metrics.set_in_flight(len(self.in_flight))
                return []
        return [rv.WriteFailed(a.transfer_id, a.attempt, a.dest_rank, err, now)]

    def start_group_write(self, a: rv.StartGroupWrite, now: float) -> list[Any]:
        """Post one layer group's WRITE (no notification) from the prepared lists: the entries
        of each part's layers, over its blocks. A consumer without prepared lists (different
        block sizes) gets nothing now: the seal's final WRITE covers everything for it (it
        ignores ``written`` there), so the group is answered done at once. Returns what the
        rendezvous must hear now (its follow-up events)."""
        me = self.ctx.attached
        peer = self.consumer(a.peer)
        if me is None or peer is None:
            return [rv.WriteFailed(a.transfer_id, a.attempt, a.dest_rank,
                                   "no engine attached" if me is None else "decode peer is gone", now,
                                   group=a.group)]
        if peer.prepped is None:
            return [rv.WriteDone(a.transfer_id, a.attempt, a.dest_rank, now, group=a.group)]
        pattern, local_h, remote_h = peer.prepped
        try:
            li, ri, nbytes = pattern.group_indices(
                ((p.layer_lo, p.layer_hi, p.first_block, p.src_block_ids) for p in a.parts),
                a.dst_first_token // me.layout.block_size, a.dst_block_ids)
            if not li.shape[0]:  # nothing of it is the destination's (a prefix hit there)
                return [rv.WriteDone(a.transfer_id, a.attempt, a.dest_rank, now, group=a.group)]
            h = self.ctx.transport.write_prepped(peer.agent_name, local_h, li, remote_h, ri, b"", nbytes=nbytes)
        except PlanError as exc:
            self.ctx.metrics.failure("plan")
            return [rv.WriteFailed(a.transfer_id, a.attempt, a.dest_rank, f"plan: {exc}", now, group=a.group)]
        except Exception as exc:
            self.ctx.metrics.failure("nixl")
            return [rv.WriteFailed(a.transfer_id, a.attempt, a.dest_rank, f"NIXL: {exc}", now, group=a.group)]
        self.ctx.trace.stamp_first(a.transfer_id, "p.daemon.group_posted")
        # The consumer polls tightly while a WRITE to it is in flight (over TCP it lands only
        # as the receiver progresses): until this group's done hint, or its write timeout.
        self.ctx.wire.to_consumer(peer.routing_id, proto.Writing(a.transfer_id, a.attempt, me.rank, False, a.group))
        self.in_flight[id(h)] = InFlight(a.transfer_id, a.attempt, a.dest_rank, a.peer, h, nbytes,
                                         int(li.shape[0]), now, True, a.group)
        self.ctx.metrics.set_in_flight(len(self.in_flight))
        return []

    def poll_cap(self) -> float:
        """How long the loop may sleep between NIXL polls (our WRITEs in flight poll tightly)."""
        busy = self.in_flight or self.gate.waiting  # a GPU event we wait on fires without a message
        return min(self.cfg.poll_max_s, WRITE_POLL_MAX_S) if busy else self.cfg.poll_max_s

    def progress(self, now: float) -> bool:
        """Poll every WRITE in flight (drives NIXL progress); True if one finished."""
        activity = False
        if self.gate.waiting:
            ready = self.gate.poll(now)
            activity = bool(ready)
            self._layers_ready(ready)
        for key, f in list(self.in_flight.items()):
            state = self.ctx.transport.state(f.handle)
            if state == "pending":
                if now - f.started > self.cfg.write_timeout_s:
                    self.ctx.metrics.timeout("write")
                    self._finish(key, f, now, f"WRITE timed out after {self.cfg.write_timeout_s:.1f}s",
                                 rv.Cause.WRITE_TIMEOUT)
                    activity = True
                continue
            activity = True
            self._finish(key, f, now, "" if state == "done" else "NIXL reported a transfer error")
        return activity

    def wait_in_flight(self, limit_s: float) -> None:
        end = time.monotonic() + limit_s
        while self.in_flight and time.monotonic() < end:
            self.progress(time.monotonic())
            time.sleep(0.001)

    def _finish(self, key: int, f: InFlight, now: float, error: str,
                cause: rv.Cause = rv.Cause.WRITE_FAILED) -> None:
        try:
            self.ctx.transport.release(f.handle)
        except Exception as exc:
            if not error:
                error = str(exc)
            else:  # cannot cancel: NIXL may still read the source blocks; keep waiting
                log.error("WRITE %s could not be cancelled (%s); holding its blocks", f.transfer_id, exc)
                return
        del self.in_flight[key]
        self.ctx.metrics.set_in_flight(len(self.in_flight))
        lat = now - f.started
        peer = self.consumer(f.peer)
        if peer is not None and not error:
            peer.rate.note(f.nbytes, lat)
        if f.group and not error:  # a landed group is summed up in its final WRITE's row
            self.ctx.trace.stamp_first(f.transfer_id, "p.daemon.group_done")
            if peer is not None:  # its consumer stops polling tightly for it
                self.ctx.wire.to_consumer(peer.routing_id, proto.Writing(f.transfer_id, f.attempt, self.ctx.rank,
                                                                         True, f.group))
            self.ctx.metrics.write_done(f.nbytes, lat)
            self.apply(rv.WriteDone(f.transfer_id, f.attempt, f.dest_rank, now, group=f.group))
            return
        self.ctx.history.add({
            "transfer_id": f.transfer_id, "attempt": f.attempt, "dest_rank": f.dest_rank, "side": "prefill",
            "bytes": f.nbytes, "descriptors": f.descriptors, "prepped": f.prepped, "latency_ms": round(lat * 1e3, 3),
            "result": "ok" if not error else "failed", "error": error, "age_s": 0.0, "at": now,
            **self._stream_summary(f),
        })
        if error:
            self.ctx.metrics.failure("nixl")
            self.apply(rv.WriteFailed(f.transfer_id, f.attempt, f.dest_rank, error, now, cause, group=f.group))
            return
        self.ctx.trace.stamp(f.transfer_id, "p.daemon.write_done")
        if peer is not None:  # wake the decode daemon: its notification has landed
            self.ctx.wire.to_consumer(peer.routing_id, proto.Writing(f.transfer_id, f.attempt, self.ctx.rank, True))
        self.ctx.metrics.write_done(f.nbytes, lat)
        self.apply(rv.WriteDone(f.transfer_id, f.attempt, f.dest_rank, now))

    def _stream_summary(self, f: InFlight) -> dict[str, Any]:
        """What ``kvpushctl transfers`` shows of a WRITE's stream, from the transfer's stamps:
        the first group's lag behind its layers' frame, and the tail (the last frame, or the
        seal when nothing streamed, to this final WRITE's end)."""
        stamps: dict[str, int] = {}
        for hop, t in self.ctx.trace.get(f.transfer_id):  # each hop's first (layers_last_in: its only)
            stamps.setdefault(hop, t)

        def ms(a: str, b: str) -> float | None:
            return round((stamps[b] - stamps[a]) / 1e6, 3) if a in stamps and b in stamps else None

        lag = ms("p.daemon.layers_in", "p.daemon.group_posted")
        if f.group:
            return {"group": f.group, "mode": "group", "groups": 0, "first_group_lag_ms": lag, "tail_ms": None}
        end = time.monotonic_ns()
        last = stamps.get("p.daemon.layers_last_in" if f.streamed else "p.daemon.prefill_done_in")
        return {"group": 0, "mode": "layerwise" if f.streamed else "whole", "groups": f.streamed,
                "first_group_lag_ms": lag if f.streamed else None,
                "tail_ms": round((end - last) / 1e6, 3) if last is not None else None}

    # ------------------------------------------------------------------ the core's actions

    def apply(self, event: Any) -> None:
        """Feed the rendezvous one event and carry out its actions, in order; a WRITE that
        could not be posted is told to it after the batch (:func:`kvpush.common.machine.drive`)."""
        drive(self.rdv, event, self._carry_out)

    def _carry_out(self, act: Any) -> list[Any] | None:
        if isinstance(act, rv.StartWrite):
            return self.start_write(act, time.monotonic())
        if isinstance(act, rv.StartGroupWrite):
            return self.start_group_write(act, time.monotonic())
        if isinstance(act, rv.ReleaseBlocks):
            # The prefill engine keys its held blocks by transfer ID alone.
            msg: Any = (proto.Sent(act.transfer_id, 0) if act.ok
                        else proto.SendFailed(act.transfer_id, 0, _reason(act.reason)))
            self.ctx.metrics.transfer_finished("prefill", "ok" if act.ok else "failed")
            if act.cause in (rv.Cause.LEASE_EXPIRED, rv.Cause.UNCLAIMED):
                self._lease_ended(act)
            # Stamped before it leaves: the timeline stays causal across processes.
            self.ctx.trace.stamp(act.transfer_id, "p.daemon.sent" if act.ok else "p.daemon.send_failed")
            self.ctx.to_engine(msg)
        elif isinstance(act, rv.NotifyFailure):
            if act.cause in (rv.Cause.QUOTA, rv.Cause.UNBOUND):  # an insider's doing, or a bug
                self.ctx.bad("register", act.reason)
            peer = self.consumer(act.peer)
            if peer is not None:
                self.ctx.wire.to_consumer(peer.routing_id, proto.WriteFailedNotice(
                    act.transfer_id, act.attempt, self.ctx.rank, _reason(act.reason),
                    may_land=act.cause is rv.Cause.WRITE_TIMEOUT))
        elif isinstance(act, rv.ConfirmCancel):
            peer = self.consumer(act.peer)
            if peer is not None:
                self.ctx.wire.to_consumer(peer.routing_id, proto.CancelConfirmed(
                    act.transfer_id, act.attempt, self.ctx.rank))
        return None

    def _lease_ended(self, act: rv.ReleaseBlocks) -> None:
        """Blocks held for the whole lease: count them, and say so once per cause (a router or
        decode engine that never registers would otherwise just starve this engine quietly)."""
        unclaimed = act.cause is rv.Cause.UNCLAIMED
        self.ctx.metrics.lease_expiry("none" if unclaimed else "partial", len(act.block_ids))
        if act.cause in self._lease_said:
            return
        self._lease_said.add(act.cause)
        lease = self.cfg.lease_s
        if unclaimed:
            log.warning("transfer %s: %d source blocks held for their whole lease (<= %.0f s) and no decode side "
                        "registered: is the decode engine using kvpush, and does the router send both legs? "
                        "(further cases: kvpush_lease_expired_total{registered=\"none\"})",
                        act.transfer_id, len(act.block_ids), lease)
        else:
            log.warning("transfer %s: lease ended before every decode rank registered; %d source blocks released "
                        "(further cases: kvpush_lease_expired_total{registered=\"partial\"})",
                        act.transfer_id, len(act.block_ids))

    def report_held(self, now: float) -> None:
        """Held source blocks by state, and the oldest hold nobody registered for (at scrape time:
        O(transfers), not on the loop)."""
        by_state = dict.fromkeys((rv.State.WAIT_REGISTER, rv.State.WRITING, rv.State.DRAINING), 0)
        oldest = 0.0
        for p in self.rdv.pending(now):
            if p.blocks:
                by_state[p.state] = by_state.get(p.state, 0) + p.blocks
                if p.state is rv.State.WAIT_REGISTER and p.attempt < 0:
                    oldest = max(oldest, p.age)
        self.ctx.metrics.set_held({str(k): v for k, v in by_state.items()}, oldest)

    # ------------------------------------------------------------------ time, ops, shutdown

    def tick(self, now: float) -> None:
        self.apply(rv.Tick(now))
        timeout = self.cfg.peer_timeout_s
        for c in list(self.consumers.values()):
            if now - c.last_seen > timeout:
                self.ctx.metrics.timeout("peer")
                self.evict(c, f"silent for {timeout:.1f}s", now)
        for s, n in self.rdv.counts().items():
            if s not in rv.TOMBSTONES:  # finished transfers are not pending
                self.ctx.metrics.set_pending("prefill", s, n)

    def resumed(self, gap: float, now: float) -> None:
        """After ``gap`` seconds without running: if our engine may have declared us dead
        (``proto.ENGINE_DEAD_AFTER_MIN_S``), it freed the blocks of its sends, and vLLM may have
        reused them. A transfer whose prefill we hold and have not started writing must then
        never be written (its registration may be waiting in our sockets): fail it now, before
        any message is handled. WRITEs already posted read their blocks while the engine still
        held them, as at any post."""
        if gap < proto.ENGINE_DEAD_AFTER_MIN_S:
            return
        why = f"this daemon did not run for {gap:.1f}s: its engine may have freed the blocks"
        held = [i.transfer_id for i in self.rdv.pending(now) if i.state is rv.State.WAIT_REGISTER]
        if held:
            log.warning("%s; failing %d held transfer(s) not yet written", why, len(held))
        for tid in held:
            self.apply(rv.Aborted(tid, None, why, "local", now))

    def fail_all(self, why: str) -> None:
        now = time.monotonic()
        for info in self.rdv.pending(now):
            self.apply(rv.Aborted(info.transfer_id, None, why, "local", now))
