"""The decode side of one daemon: registrations, links to prefill daemons, counting.

Hops 2–3 and 7–8 of a request (see the sequence diagram in docs/design.md): the engine's Register
becomes one PeerRegister per prefill rank that holds some of our heads; each of those
producers' NIXL notifications is counted by the completion counter
(:mod:`kvpush.daemon.counter`), which alone decides Received / ReceiveFailed / Released.
The counter owns everything about a registration (attempt, producers, deadline); this module
owns the producer links (:mod:`kvpush.daemon.peers`) and the polling hints.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from kvpush import proto
from kvpush.daemon import counter as ctr
from kvpush.daemon.checks import bounded_s, check_blocks
from kvpush.daemon.context import DaemonContext
from kvpush.daemon.handshake import compat_error, make_hello
from kvpush.daemon.peers import Link, LinkAction, LinkEvent, Producer, link_step
from kvpush.daemon.planner import PlanError, producer_fanout
from kvpush.proto.notif import Notification

log = logging.getLogger(__name__)


def _reason(text: str) -> str:
    """A reason as it leaves: it may quote a producer's or the engine's words (a refusal,
    a WriteFailedNotice, an abort), so it is clipped to stay decodable."""
    return proto.codec.clip(text, proto.codec.REASON_MAX)

RECV_POLL_MAX_S = 0.0001  # poll cap while a producer said Writing and its notification is missing
RECV_FALLBACK_S = 0.01  # poll cap while receiving otherwise (no WRITE announced yet)
CANCEL_GRACE_MAX_S = 3.0  # after a registration's deadline, how long its producers may take to confirm a cancel
HINT_WINDOW_S = 0.02  # how long a completed WRITE keeps the tight poll if its notification never shows


class DecodeSide:
    def __init__(self, ctx: DaemonContext) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg
        # A timed-out registration's producers get a short grace to confirm a cancel: a live one
        # answers in a round trip, and only then is a Fail safe (see kvpush.daemon.counter).
        self.counter = ctr.CompletionCounter(cancel_grace_s=min(CANCEL_GRACE_MAX_S, self.cfg.peer_timeout_s))
        self.producers: dict[str, Producer] = {}  # endpoint -> prefill daemon
        self.hinted: dict[str, float] = {}  # transfer -> poll tightly until (monotonic)

    @property
    def handshaking(self) -> bool:
        """A producer link is being set up: our NIXL connection to it needs our progress."""
        return any(p.state is Link.HANDSHAKING for p in self.producers.values())

    @property
    def receiving(self) -> int:
        """Live registrations (the loop polls NIXL while there are any): the counter's own count."""
        return self.counter.live_count()

    # ------------------------------------------------------------------ engine

    def on_register(self, msg: proto.Register, now: float) -> None:
        """Remember what we expect (in the counter), forward it to the producers once accepted."""
        a = self.ctx.attached
        assert a is not None
        tid = msg.transfer_id
        self.ctx.trace.stamp(tid, "d.daemon.register_in")

        def refuse(why: str) -> None:
            self.ctx.bad("register", why)
            self.ctx.to_engine(proto.ReceiveFailed(tid, msg.attempt, _reason(why)))

        if self.ctx.draining:
            return refuse("daemon is draining")
        why = check_blocks(a.layout, msg.block_ids, msg.num_tokens, "register", msg.first_token)
        if why:
            return refuse(why)
        if msg.prefill_tp_size <= 0 or len(msg.prefill_endpoints) != msg.prefill_tp_size:
            return refuse(f"{len(msg.prefill_endpoints)} prefill endpoints for prefill TP {msg.prefill_tp_size}")
        try:
            fanout = producer_fanout(a.layout, a.tp_size, msg.prefill_tp_size, a.rank)
        except PlanError as exc:
            return refuse(str(exc))
        ended = self.counter.registration(tid, msg.attempt)
        if ended is not None and not ended.live:
            # Its outcome was told: silence would leave the engine waiting out its timeout,
            # and repeating the outcome could vouch for blocks nobody wrote.
            return refuse(f"attempt {msg.attempt} of this transfer already ended "
                          f"({ended.state.name.lower()}); register a new attempt")
        prev = self.counter.registration(tid) if self.counter.live(tid) else None
        if prev is not None and prev.attempt > msg.attempt:
            return refuse(f"attempt {msg.attempt} is older than attempt {prev.attempt}")
        if prev is not None and prev.attempt == msg.attempt:
            return  # duplicate registration
        timeout_ms = int(bounded_s(msg.timeout_ms, self.cfg.register_timeout_s) * 1000)
        forwards = tuple(
            proto.PeerRegister(tid, msg.attempt, msg.block_ids, msg.num_tokens, a.rank, a.tp_size, dests,
                               timeout_ms, msg.first_token)
            for _, dests in fanout
        )
        endpoints = tuple(msg.prefill_endpoints[r] for r, _ in fanout)
        # The counter answers Accepted, which forwards the registrations (apply).
        self.apply(ctr.Expect(
            tid, msg.attempt, len(fanout), now, now + timeout_ms / 1000.0,
            endpoints=endpoints, ranks=tuple(r for r, _ in fanout), forwards=forwards,
        ))

    def abort(self, tid: str, attempt: int, reason: str, now: float) -> bool:
        """The engine gives up on a registration; False if we hold none."""
        if not self.counter.live(tid):
            return False
        self.apply(ctr.Abort(tid, attempt, reason, now))
        return True

    # ------------------------------------------------------------------ producer links

    def send(self, endpoint: str, msg: Any) -> None:
        """Send to a prefill daemon, dialling and handshaking first if needed."""
        peer = self.producers.get(endpoint)
        if peer is None:
            now = time.monotonic()
            peer = Producer(endpoint, since=now, last_seen=now)
            try:
                peer.node = self.ctx.wire.open_producer(endpoint)
            except ValueError as exc:
                peer.error = _reason(str(exc))
                self._fail_waiting(endpoint, f"cannot connect to {endpoint}: {exc}")
                return
            self.producers[endpoint] = peer
            self.ctx.wire.to_producer(endpoint, make_hello(self.ctx, reply=False))
        if peer.state is Link.READY:
            self.ctx.wire.to_producer(endpoint, msg)
        else:
            peer.queued.append(msg)

    def on_producer(self, endpoint: str, msg: Any, now: float) -> None:
        peer = self.producers.get(endpoint)
        if peer is None:
            return  # a link we already dropped: its late frames mean nothing
        peer.last_seen = now
        if isinstance(msg, proto.Hello):
            if not msg.reply:
                return
            why = compat_error(self.ctx, msg)
            if not why:
                try:
                    agent = self.ctx.transport.add_peer(msg.agent_metadata)
                except Exception as exc:
                    why = str(exc)
            if why:
                self._link(peer, LinkEvent.REFUSED, f"prefill daemon {endpoint}: {why}")
                return
            peer.agent_name, peer.layout, peer.rank, peer.tp_size = agent, msg.layout, msg.rank, msg.tp_size
            peer.engine_id, peer.region_bases = msg.engine_id, msg.region_bases
            log.info("prefill peer %s (%s rank %d) handshaken", endpoint, msg.engine_id, msg.rank)
            self._link(peer, LinkEvent.HELLO_OK, "")
        elif isinstance(msg, proto.Error):
            if peer.state is not Link.READY:
                self._link(peer, LinkEvent.REFUSED, f"prefill daemon {endpoint} refused: {msg.message}")
            elif msg.code == "handshake":
                # A new daemon on the same endpoint (restarted): it knows nothing of us or of
                # what we registered. Fail those transfers now; the next one re-handshakes.
                self._link(peer, LinkEvent.HANDSHAKE_LOST, f"prefill daemon {endpoint} restarted (handshake lost)")
            else:
                log.warning("prefill daemon %s: %s: %s", endpoint, msg.code, msg.message)
        elif isinstance(msg, proto.Writing):
            self._on_writing(msg, now)
        elif isinstance(msg, proto.WriteFailedNotice):
            self._producer_result(msg.transfer_id, msg.attempt, endpoint, msg.reason, now, failed=True,
                                  may_land=msg.may_land)
        elif isinstance(msg, proto.CancelConfirmed):
            self._producer_result(msg.transfer_id, msg.attempt, endpoint, "", now, failed=False)

    def _link(self, peer: Producer, event: LinkEvent, why: str) -> None:
        """Move a producer link through the table and carry out its actions."""
        peer.state, actions = link_step(peer.state, event)
        for act in actions:
            if act is LinkAction.FLUSH:
                queued, peer.queued = peer.queued, []
                for m in queued:
                    self.ctx.wire.to_producer(peer.endpoint, m)
            elif act is LinkAction.PING:
                peer.last_ping = time.monotonic()
                self.ctx.wire.to_producer(peer.endpoint, proto.Heartbeat(int(peer.last_ping * 1000)))
            elif act is LinkAction.FAIL_WAITING:
                peer.error = _reason(why)
                log.warning("%s", why)
                # A ready link gone silent while its connection stayed open (a partition): a
                # WRITE it posted may arrive when the link heals. A producer whose connection
                # closed died (its kernel closed the sockets after sending what they held, long
                # before peer_timeout_s); a refused or timed-out handshake never had a
                # registration forwarded.
                may_land = event is LinkEvent.SILENT and not self.ctx.wire.connection_closed(
                    peer.endpoint, peer.last_seen)
                self._fail_waiting(peer.endpoint, why, may_land=may_land)
            elif act is LinkAction.CLOSE:
                self.drop(peer)

    def drop(self, peer: Producer) -> None:
        if self.producers.get(peer.endpoint) is peer:
            del self.producers[peer.endpoint]
            self.ctx.wire.close_producer(peer.endpoint)
        peer.queued.clear()

    def revoke(self, allowed: set[str]) -> None:
        """The allowlist changed: drop links to nodes no longer in it (their waiters fail)."""
        for p in [p for p in self.producers.values() if p.node and p.node not in allowed]:
            self._link(p, LinkEvent.REFUSED, f"prefill node {p.node!r} was removed from the allowlist")

    def drop_all(self, why: str) -> None:
        """Forget every link (our memory changed, or we stop): the next Register re-handshakes."""
        if self.producers:
            log.info("dropping %d prefill link(s): %s", len(self.producers), why)
        for p in list(self.producers.values()):
            self.drop(p)

    def _fail_waiting(self, endpoint: str, why: str, *, may_land: bool = False) -> None:
        now = time.monotonic()
        for tid, attempt, idx in self.counter.waiting_on(endpoint):
            self.apply(ctr.ProducerFailed(tid, attempt, idx, why, now, ctr.Cause.PEER_LOST, may_land))

    def _producer_result(self, tid: str, attempt: int, endpoint: str, reason: str, now: float, *,
                         failed: bool, may_land: bool = False) -> None:
        idx = self.counter.producer_index(tid, endpoint, attempt)
        if idx is None:
            return  # answers for superseded attempts resolve through the same endpoints
        if failed:
            self.apply(ctr.ProducerFailed(tid, attempt, idx, reason, now, may_land=may_land))
        else:
            self.apply(ctr.CancelConfirmed(tid, attempt, idx, now))

    # ------------------------------------------------------------------ notifications

    def _on_writing(self, msg: proto.Writing, now: float) -> None:
        """A producer posted (done=False) or completed (done=True) a WRITE to us: poll NIXL
        tightly until its notification shows, or take it now."""
        tid = msg.transfer_id
        if not self.counter.live(tid):
            return
        if msg.done:
            self.take_notifications(now)
        if self.counter.live(tid):  # in flight, or the notification trails
            window = HINT_WINDOW_S if msg.done else self.cfg.write_timeout_s
            self.hinted[tid] = max(self.hinted.get(tid, 0.0), now + window)

    def take_notifications(self, now: float) -> bool:
        """Count every notification NIXL holds (drives its progress); True if there was one."""
        got = False
        for agent, payload in self.ctx.transport.notifications():
            got = True
            self.on_notification(agent, payload, now)
        return got

    def on_notification(self, agent: str, payload: bytes, now: float) -> None:
        n = Notification.decode(payload)
        if n is None:
            self.ctx.bad("notification", f"malformed notification from {agent}")
            return
        reg = self.counter.registration(n.transfer_id) if self.counter.live(n.transfer_id) else None
        if reg is None or reg.attempt != n.attempt or n.producer_rank not in reg.ranks:
            return  # stale attempt or unknown transfer: ignored by design
        idx = reg.ranks.index(n.producer_rank)
        prod = self.producers.get(reg.endpoints[idx])
        if prod is None or prod.agent_name != agent:
            self.ctx.bad("notification", f"notification for {n.transfer_id} from unexpected agent {agent}")
            return
        self.ctx.metrics.notification()
        self.ctx.trace.stamp(n.transfer_id, "d.daemon.notif_seen")
        self.apply(ctr.Notified(n.transfer_id, n.attempt, idx, now))

    def poll_cap(self, now: float) -> float:
        """How long the loop may sleep between NIXL polls while registrations are live."""
        for tid in [t for t, until in self.hinted.items() if now > until or not self.counter.live(t)]:
            del self.hinted[tid]
        if not self.receiving:
            return self.cfg.poll_max_s
        return min(self.cfg.poll_max_s, RECV_POLL_MAX_S if self.hinted else RECV_FALLBACK_S)

    # ------------------------------------------------------------------ the core's actions

    def apply(self, event: Any) -> None:
        for act in self.counter.handle(event):
            tid = act.transfer_id
            if isinstance(act, ctr.Fail | ctr.Release) and act.unsafe:
                # Blocks a WRITE may still land in must not go back to the engine while our
                # NIXL agent can receive: fence (the engine then sees its daemon gone).
                self.ctx.fence(f"transfer {tid} attempt {act.attempt}: "
                               f"{getattr(act, 'reason', 'aborted')}; a producer's WRITE may still arrive")
                return
            if isinstance(act, ctr.Accepted):
                self.ctx.trace.stamp(tid, "d.daemon.register_forwarded")
                for ep, fwd in zip(act.endpoints, act.forwards, strict=True):
                    self.send(ep, fwd)
            elif isinstance(act, ctr.Complete):
                self.ctx.metrics.transfer_finished("decode", "ok")
                self.ctx.trace.stamp(tid, "d.daemon.received_sent")
                self.ctx.to_engine(proto.Received(tid, act.attempt))
                self._history(tid, act.attempt, "ok", "")
            elif isinstance(act, ctr.Fail):
                self.ctx.metrics.transfer_finished("decode", "failed")
                if act.cause is ctr.Cause.TIMEOUT:
                    self.ctx.metrics.timeout("deadline")
                self.ctx.trace.stamp(tid, "d.daemon.receive_failed")
                reason = _reason(act.reason)
                self.ctx.to_engine(proto.ReceiveFailed(tid, act.attempt, reason))
                self._history(tid, act.attempt, "failed", reason)
            elif isinstance(act, ctr.Release):
                self.ctx.to_engine(proto.Released(tid, act.attempt))
            elif isinstance(act, ctr.SendCancel):
                reg = self.counter.registration(tid)
                if reg is not None and reg.attempt == act.attempt:
                    for ep in reg.endpoints:
                        peer = self.producers.get(ep)
                        if peer is not None and peer.state is Link.READY:
                            self.ctx.wire.to_producer(ep, proto.Cancel(tid, act.attempt, _reason(act.reason)))

    def _history(self, tid: str, attempt: int, result: str, error: str) -> None:
        reg = self.counter.registration(tid)
        now = time.monotonic()
        self.ctx.history.add({
            "transfer_id": tid, "attempt": attempt, "side": "decode", "result": result, "error": error,
            "latency_ms": round((now - reg.since) * 1e3, 3) if reg else None, "at": now,
            "producers": len(reg.endpoints) if reg else None,
        })

    # ------------------------------------------------------------------ time, ops, shutdown

    def tick(self, now: float) -> None:
        self.apply(ctr.Tick(now))
        for p in list(self.producers.values()):
            event = p.due(now, self.cfg.peer_timeout_s)
            if event is LinkEvent.HANDSHAKE_TIMEOUT:
                self.ctx.metrics.timeout("peer")
                self._link(p, event, f"prefill daemon {p.endpoint} did not answer the handshake in "
                                     f"{self.cfg.peer_timeout_s:.1f}s")
            elif event is LinkEvent.SILENT:
                self.ctx.metrics.timeout("peer")
                self._link(p, event, f"prefill daemon {p.endpoint} silent for {self.cfg.peer_timeout_s:.1f}s")
            elif event is not None:
                self._link(p, event, "")
        for s, n in self.counter.counts().items():
            self.ctx.metrics.set_pending("decode", s, n)

    def cancel(self, tid: str, why: str, now: float) -> bool:
        """Fail a live registration as if every producer failed; False if there is none."""
        reg = self.counter.registration(tid) if self.counter.live(tid) else None
        if reg is None:
            return False
        for idx in range(len(reg.endpoints)):
            self.apply(ctr.ProducerFailed(tid, reg.attempt, idx, why, now, ctr.Cause.ABORTED))
        return True

    def fail_all(self, why: str) -> None:
        now = time.monotonic()
        for info in self.counter.pending(now):
            self.cancel(info.transfer_id, why, now)
