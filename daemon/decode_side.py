"""The decode side of one daemon: registrations, links to prefill daemons, counting.

Hops (2), (6) and (7) of a request (the sequence in docs/design.md): the engine's Register
becomes one PeerRegister per prefill rank that holds some of our heads; each of those
producers' NIXL notifications is counted by the completion counter
(:mod:`kvpush.daemon.core.counter`), which alone decides Received / ReceiveFailed / Released.
The counter owns everything about a registration (attempt, producers, deadline, what its
producers announced, hence how tightly to poll NIXL) and its actions carry what this shell
needs to carry them out; this module owns the producer links (:mod:`kvpush.daemon.core.peers`)
and the I/O.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from typing import Any

from kvpush import proto
from kvpush.common.machine import HALT, Row, Single, drive
from kvpush.daemon.context import DaemonContext
from kvpush.daemon.core import counter as ctr
from kvpush.daemon.core import peers as pr
from kvpush.daemon.core.checks import bounded_s, check_blocks
from kvpush.daemon.core.peers import Exposure, LinkAction, PeerLinkState, Producer
from kvpush.daemon.core.planner import PlanError, producer_fanout
from kvpush.daemon.handshake import compat_error, make_hello
from kvpush.daemon.io import peer_note
from kvpush.proto.notif import KEY_BYTES, Notification
from kvpush.proto.params import MAX_SECRET

log = logging.getLogger(__name__)


def _reason(text: str) -> str:
    """A reason as it leaves: it may quote a producer's or the engine's words (a refusal,
    a WriteFailedNotice, an abort), so it is clipped to stay decodable."""
    return proto.codec.clip(text, proto.codec.REASON_MAX)

RECV_POLL_MAX_S = 0.0001  # poll cap while a producer said Writing and its notification is missing
RECV_FALLBACK_S = 0.01  # poll cap while receiving otherwise (no WRITE announced yet)
CANCEL_GRACE_MAX_S = 3.0  # after a registration's deadline, how long its producers may take to confirm a cancel


class DecodeSide:
    def __init__(self, ctx: DaemonContext) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg
        # A timed-out registration's producers get a short grace to confirm a cancel: a live one
        # answers in a round trip, and only then is a Fail safe (see kvpush.daemon.core.counter).
        self.counter = ctr.CompletionCounter(cancel_grace_s=min(CANCEL_GRACE_MAX_S, self.cfg.peer_timeout_s),
                                             write_timeout_s=self.cfg.write_timeout_s)
        self.producers: dict[str, Producer] = {}  # endpoint -> prefill daemon
        self.on_link_row: Callable[[Row], None] | None = None  # every producer link row taken (tests)
        self.rotate_due = ""  # why our NIXL agent must be replaced (a revoked node held its metadata)
        self.rotations = 0  # NIXL agents replaced so far (each name is new)
        self.exposure = Exposure()  # who holds our current agent's metadata (links dropped or not)
        self._agent_base = ctx.agent_name
        # Producers a predecessor that fenced knew lost (kvpush.daemon.io.peer_note): the first
        # link to each starts recovering, for as long as the link table would keep a lost one.
        self._note = peer_note.note_path(self.cfg.runtime_dir, self.cfg.name)
        self._lost_keep_s = max(self.cfg.register_timeout_s, 4 * self.cfg.peer_timeout_s)
        self.lost_before = peer_note.take(self._note, self._lost_keep_s, self.cfg.max_producers)
        self._lost_until = time.monotonic() + self._lost_keep_s
        if self.lost_before:
            log.warning("the daemon before this one fenced with prefill daemon(s) %s lost: registrations for them "
                        "fail at once until they answer our Hello", ", ".join(sorted(self.lost_before)))

    @property
    def handshaking(self) -> bool:
        """A producer link is being set up: our NIXL connection to it needs our progress."""
        return any(p.state is PeerLinkState.HANDSHAKING for p in self.producers.values())

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
        why = check_blocks(a.layout, msg.block_ids, msg.num_tokens, "register", msg.first_token, msg.kv_groups)
        if why:
            return refuse(why)
        if len(msg.secret) > MAX_SECRET:
            return refuse(f"secret of {len(msg.secret)} chars exceeds {MAX_SECRET}")
        if msg.prefill_tp_size <= 0 or len(msg.prefill_endpoints) != msg.prefill_tp_size:
            return refuse(f"{len(msg.prefill_endpoints)} prefill endpoints for prefill TP {msg.prefill_tp_size}")
        try:
            fanout = producer_fanout(a.layout, a.tp_size, msg.prefill_tp_size, a.rank)
        except PlanError as exc:
            return refuse(str(exc))
        # Older, repeated and already-ended attempts are the counter's rows to decide.
        timeout_ms = int(bounded_s(msg.timeout_ms, self.cfg.register_timeout_s) * 1000)
        # One fresh key per producer and attempt, told only to that producer (over CURVE): the
        # counter counts only a notification tagged with it (kvpush.proto.notif).
        keys = tuple(secrets.token_bytes(KEY_BYTES) for _ in fanout)
        forwards = tuple(
            proto.PeerRegister(tid, msg.attempt, msg.block_ids, msg.num_tokens, a.rank, a.tp_size, dests,
                               timeout_ms, msg.first_token, msg.secret, key, msg.kv_groups)
            for (_, dests), key in zip(fanout, keys, strict=True)
        )
        endpoints = tuple(msg.prefill_endpoints[r] for r, _ in fanout)
        # The counter answers Accepted, which forwards the registrations, or Refuse (apply).
        self.apply(ctr.Registered(
            tid, msg.attempt, len(fanout), now, now + timeout_ms / 1000.0,
            endpoints=endpoints, ranks=tuple(r for r, _ in fanout), forwards=forwards, keys=keys,
        ))

    def abort(self, tid: str, attempt: int, reason: str, now: float) -> bool:
        """The engine gives up on a registration; False if we hold none."""
        if not self.counter.live(tid):
            return False
        self.apply(ctr.Aborted(tid, attempt, reason, now))
        return True

    # ------------------------------------------------------------------ producer links

    def forward(self, endpoint: str, msg: proto.PeerRegister) -> list[Any]:
        """A registration for a prefill daemon: the link's table says send, queue (first
        contact, dialling it), or fail now (it is down or re-handshaking). Returns what the
        counter must hear (a registration that was not forwarded)."""
        peer = self.producers.get(endpoint)
        now = time.monotonic()
        if peer is not None:
            peer.wanted = now
        else:
            over = self._fanout_refusal()
            if over:  # registrations name endpoints; how many we dial is ours to bound
                self.ctx.bad("register", over)
                return self._fail_one(endpoint, msg, f"cannot connect to {endpoint}: {over}")
            peer = Producer(endpoint, since=now, last_seen=now, wanted=now, state=None)  # its table dials it
            if endpoint in self.lost_before:
                self.lost_before.discard(endpoint)
                if now < self._lost_until:
                    peer.lost_before = True
                    peer.error = "the daemon before this one fenced with it lost"
        return self._link(peer, pr.Forward(), "", msg)

    def _fanout_refusal(self) -> str:
        """Why one more prefill daemon may not be dialled now, or "": the endpoints come from
        the engine's registrations, i.e. from requests (``kv_transfer_params``), so the links
        (one connection, file descriptors, a handshake each) are capped by configuration."""
        if len(self.producers) >= self.cfg.max_producers:
            return f"{len(self.producers)} prefill daemons linked (max_producers {self.cfg.max_producers})"
        pending = sum(p.state is PeerLinkState.HANDSHAKING for p in self.producers.values())
        if pending >= self.cfg.max_handshaking_producers:
            return (f"{pending} prefill daemons not answering their handshake yet "
                    f"(max_handshaking_producers {self.cfg.max_handshaking_producers})")
        return ""

    def on_producer(self, endpoint: str, msg: Any, now: float) -> None:
        peer = self.producers.get(endpoint)
        if peer is None:
            return  # a link we already dropped: its late frames mean nothing
        peer.last_seen = now
        if isinstance(msg, proto.Hello):
            if not msg.reply:
                return
            # Nothing of the producer's NIXL agent is loaded (any metadata it sends is ignored):
            # the WRITE target needs none to receive WRITEs and their notifications, and this
            # daemon never initiates a transfer. Its agent name only attributes notifications.
            why = compat_error(self.ctx, msg) or ("" if msg.agent_name else "empty NIXL agent name")
            if why:
                self.apply(*self._link(peer, pr.Refused(), f"prefill daemon {endpoint}: {why}"))
                return
            peer.agent_name, peer.layout, peer.rank, peer.tp_size = msg.agent_name, msg.layout, msg.rank, msg.tp_size
            peer.engine_id = msg.engine_id
            log.info("prefill peer %s (%s rank %d) handshaken", endpoint, msg.engine_id, msg.rank)
            self.apply(*self._link(peer, pr.HelloOk(), ""))
        elif isinstance(msg, proto.Error):
            if msg.code == "handshake" and peer.state is not PeerLinkState.HANDSHAKING:
                # It restarted, or evicted us while we were frozen: it knows nothing of what we
                # registered. Fail those now and re-handshake at once (recovering: a late
                # answer to our previous connection's backlog).
                self.apply(*self._link(peer, pr.HandshakeLost(),
                                       f"prefill daemon {endpoint} lost our handshake (restarted, or evicted us): "
                                       f"{msg.message}"))
            elif peer.state is not PeerLinkState.READY:
                self.apply(*self._link(peer, pr.Refused(), f"prefill daemon {endpoint} refused: {msg.message}"))
            else:
                log.warning("prefill daemon %s: %s: %s", endpoint, msg.code, msg.message)
        elif isinstance(msg, proto.Writing):
            self._on_writing(msg, now)
        elif isinstance(msg, proto.WriteFailedNotice):
            self._producer_result(msg.transfer_id, msg.attempt, endpoint, msg.reason, now, failed=True,
                                  may_land=msg.may_land)
        elif isinstance(msg, proto.CancelConfirmed):
            self._producer_result(msg.transfer_id, msg.attempt, endpoint, "", now, failed=False)

    def _link(self, peer: Producer, event: Any, why: str, msg: Any = None) -> list[Any]:
        """Move a producer link through its table and carry out the row's actions, in order
        (a new link is a record in state None until its first row dials it). Returns what
        the counter must hear: the registrations this failed, to be applied by the caller."""
        endpoint, old = peer.endpoint, peer.state
        told: list[Any] = []

        def carry_out(act: LinkAction) -> Any:
            if act is LinkAction.DIAL:
                if not self._open(peer):
                    told.extend(self._fail_one(endpoint, msg, f"cannot connect to {endpoint}: {peer.error}"))
                    return HALT
                self.producers[endpoint] = peer
            elif act is LinkAction.QUEUE:
                peer.queued.append(msg)
            elif act is LinkAction.SEND:
                self.ctx.wire.to_producer(endpoint, msg)
            elif act is LinkAction.FAIL_NOW:
                told.extend(self._fail_one(endpoint, msg, f"prefill daemon {endpoint} is re-handshaking after it "
                                                          f"was lost ({peer.error or 'silent'}); not registered there"))
            elif act is LinkAction.FLUSH:
                queued, peer.queued = peer.queued, []
                for m in queued:
                    self.ctx.wire.to_producer(endpoint, m)
            elif act is LinkAction.PING:
                peer.last_ping = time.monotonic()
                self.ctx.wire.to_producer(endpoint, proto.Heartbeat(int(peer.last_ping * 1000)))
            elif act is LinkAction.FAIL_WAITING:
                peer.error = _reason(why)
                log.warning("%s", why)
                queued, peer.queued = peer.queued, []
                for m in queued:  # never forwarded: nothing of them can land (told first: a repeat is ignored)
                    told.extend(self._fail_one(endpoint, m, why))
                # A link gone silent (or that lost our handshake) while its connection stayed
                # open (frozen, or a partition): a WRITE it posted may arrive later. Silent (or
                # revoked: no longer trusted), any registration it held may be written; after
                # "send Hello first" it evicted us and posts nothing more, so only a WRITE it
                # announced (Writing, still hinted) may. A producer whose connection closed died
                # (its kernel closed the sockets after sending what they held); a handshake never
                # had a registration forwarded.
                open_ = not self.ctx.wire.connection_closed(endpoint, peer.last_seen)
                if isinstance(event, pr.Silent | pr.Revoked) and old is PeerLinkState.READY:
                    told.extend(self._fail_waiting(endpoint, why, may_land=open_))
                else:
                    told.extend(self._fail_waiting(endpoint, why, announced_only=True,
                                                   may_land=open_ and isinstance(event, pr.HandshakeLost | pr.Rotated)))
            elif act is LinkAction.REDIAL:
                self.ctx.wire.close_producer(endpoint)
                if not self._open(peer):
                    self._forget(peer)
                    return HALT
            elif act is LinkAction.CLOSE:
                self._forget(peer)
            elif act is LinkAction.ROTATE:
                self.rotate_due = why
            return None

        drive(Single(pr.LINK_TABLE, None, peer, self.on_link_row), event, carry_out)
        return told

    def _open(self, peer: Producer) -> bool:
        """Open a connection to the producer and send our Hello; False if it cannot be dialled."""
        now = time.monotonic()
        try:
            peer.node = self.ctx.wire.open_producer(peer.endpoint)
        except ValueError as exc:
            peer.error = _reason(str(exc))
            log.warning("cannot connect to %s: %s", peer.endpoint, exc)
            return False
        peer.since = peer.last_seen = now
        self.ctx.wire.to_producer(peer.endpoint, make_hello(self.ctx, reply=False))
        self.exposure.sent(peer.node)
        return True

    def _fail_one(self, endpoint: str, msg: Any, why: str) -> list[Any]:
        """What fails one registration that was never forwarded (nothing of it can land): its
        producer at ``endpoint`` (the counter knows which of them that is)."""
        if not isinstance(msg, proto.PeerRegister):
            return []
        return [ctr.ProducerFailed(msg.transfer_id, msg.attempt, endpoint, _reason(why), time.monotonic(),
                                   ctr.Cause.PEER_LOST)]

    def _forget(self, peer: Producer) -> None:
        if self.producers.get(peer.endpoint) is peer:
            del self.producers[peer.endpoint]
            self.ctx.wire.close_producer(peer.endpoint)
        peer.queued.clear()

    def revoke(self, allowed: set[str]) -> None:
        """The allowlist changed: drop links to nodes no longer in it (their waiters fail). Each
        held our NIXL metadata (our Hello went out when we dialled): the link table says ROTATE,
        and one rotation replaces our agent for all of them. So does a revoked node we have no
        link to any more (it refused our Hello, or we dropped it) that got our current agent's
        metadata (``exposure``)."""
        for p in [p for p in self.producers.values() if p.node and p.node not in allowed]:
            self.apply(*self._link(p, pr.Revoked(), f"prefill node {p.node!r} was removed from the allowlist"))
        gone = self.exposure.revoked(allowed)
        if gone and not self.rotate_due:
            self.rotate_due = f"prefill node(s) {', '.join(map(repr, gone))} that got our metadata were revoked"
        if self.rotate_due:
            self.rotate(self.rotate_due)

    def rotate(self, why: str) -> None:
        """Replace our NIXL agent (new UCX worker, new keys): what a revoked producer loaded
        reaches nothing any more. Every remaining link gets ``Rotated`` (the table re-dials it
        with our new Hello). If the agent cannot be replaced, fence: a daemon that cannot
        close what a revoked node can reach must not go on serving."""
        self.rotate_due = ""
        t0 = time.monotonic()
        # Unguessable: a node that could name our next agent could load an agent of that name
        # at our producers first (NIXL refuses a second agent of a loaded name) and lock us out.
        name = f"{self._agent_base}-r{secrets.token_hex(8)}"
        try:
            self.ctx.transport.rotate(name)
        except Exception as exc:
            self.ctx.fence(f"NIXL agent rotation after a revocation failed: {exc}")
            return
        self.ctx.agent_name = name
        self.exposure.replaced()  # the links below re-dial with the new metadata (sent again)
        links = list(self.producers.values())
        for p in links:
            self.apply(*self._link(p, pr.Rotated(), f"prefill daemon {p.endpoint}: our NIXL agent was "
                                                    f"replaced ({why}); re-handshaking with the new one"))
        took = time.monotonic() - t0
        self.rotations += 1
        self.ctx.metrics.failure("nixl_rotation")
        log.warning("NIXL agent rotated in %.1f ms (%s): %d remaining link(s) re-handshake", took * 1e3, why,
                    len(links))

    def drop_all(self, why: str) -> None:
        """Forget every link (our memory changed, or we stop): the next Register re-handshakes."""
        if self.producers:
            log.info("dropping %d prefill link(s): %s", len(self.producers), why)
        for p in list(self.producers.values()):
            self._forget(p)

    def _fail_waiting(self, endpoint: str, why: str, *, may_land: bool = False,
                      announced_only: bool = False) -> list[Any]:
        """What fails every registration waiting on ``endpoint``; ``may_land`` marks a WRITE of
        it as possibly still on its way (with ``announced_only``: only one its producers
        announced, which the counter knows). A queued one failed just before (never forwarded:
        nothing of it can land) is resolved by then, and the counter ignores the repeat."""
        now = time.monotonic()
        return [ctr.ProducerFailed(tid, attempt, idx, why, now, ctr.Cause.PEER_LOST, may_land, announced_only)
                for tid, attempt, idx in self.counter.waiting_on(endpoint)]

    def _producer_result(self, tid: str, attempt: int, endpoint: str, reason: str, now: float, *,
                         failed: bool, may_land: bool = False) -> None:
        """A producer's answer, for the attempt's producer at ``endpoint`` (answers for
        superseded attempts resolve through the same endpoints; unknown ones change nothing)."""
        if failed:
            self.apply(ctr.ProducerFailed(tid, attempt, endpoint, reason, now, may_land=may_land))
        else:
            self.apply(ctr.ProducerCancelled(tid, attempt, endpoint, now))

    # ------------------------------------------------------------------ notifications

    def _on_writing(self, msg: proto.Writing, now: float) -> None:
        """A producer posted (done=False) or completed (done=True) a WRITE to us: the counter
        keeps what that means for polling NIXL (and has a completed final WRITE's notification
        looked for at once: PollNow)."""
        self.apply(ctr.Announced(msg.transfer_id, msg.attempt, msg.producer_rank, msg.group, msg.done, now))

    def take_notifications(self, now: float) -> bool:
        """Count every notification NIXL holds (drives its progress); True if there was one."""
        taken = self.ctx.transport.notifications()
        self.apply(*self._noticed(taken, now))
        return bool(taken)

    def _noticed(self, taken: list[tuple[str, bytes]], now: float) -> list[ctr.Noticed]:
        """The counter's events for notifications NIXL delivered, each with the endpoints of the
        links whose producer's agent sent it (a malformed one is reported)."""
        out = []
        for agent, payload in taken:
            n = Notification.decode(payload)
            if n is None:
                self.ctx.bad("notification", f"malformed notification from {agent}")
                continue
            senders = frozenset(ep for ep, p in self.producers.items() if p.agent_name == agent)
            out.append(ctr.Noticed(n.transfer_id, n.attempt, n.producer_rank, agent, senders, now, n.tag))
        return out

    def poll_cap(self, now: float) -> float:
        """How long the loop may sleep between NIXL polls while registrations are live."""
        if not self.receiving:
            return self.cfg.poll_max_s
        return min(self.cfg.poll_max_s, RECV_POLL_MAX_S if self.counter.tight(now) else RECV_FALLBACK_S)

    # ------------------------------------------------------------------ the core's actions

    def apply(self, *events: Any) -> None:
        """Feed the counter each event in turn and carry out its actions, in order; what
        carrying one out tells it (a registration that could not be forwarded) is applied
        after the batch (:func:`kvpush.common.machine.drive`)."""
        for event in events:
            drive(self.counter, event, self._carry_out)

    def _carry_out(self, act: Any) -> Any:
        tid = act.transfer_id
        if isinstance(act, ctr.Fail | ctr.Release) and act.unsafe:
            # Blocks a WRITE may still land in must not go back to the engine while our
            # NIXL agent can receive: fence (the engine then sees its daemon gone), and
            # carry out nothing more. The producers we know lost are left to our successor.
            self.leave_note()
            self.ctx.fence(f"transfer {tid} attempt {act.attempt}: "
                           f"{getattr(act, 'reason', 'aborted')}; a producer's WRITE may still arrive")
            return HALT
        if isinstance(act, ctr.Accepted):
            self.ctx.trace.stamp(tid, "d.daemon.register_forwarded")
            told: list[Any] = []
            for ep, fwd in zip(act.endpoints, act.forwards, strict=True):
                told.extend(self.forward(ep, fwd))
            return told
        if isinstance(act, ctr.Arrived):
            self.ctx.metrics.notification()
            self.ctx.trace.stamp(tid, "d.daemon.notif_seen")
        elif isinstance(act, ctr.Stranger):
            self.ctx.bad("notification", f"notification for {tid} from unexpected agent {act.agent}")
        elif isinstance(act, ctr.Tampered):
            self.ctx.bad(f"notification_{act.why}", f"{act.why} notification for {tid} attempt {act.attempt} "
                                                    f"(NIXL agent {act.agent!r}): not counted")
        elif isinstance(act, ctr.PollNow):
            return self._noticed(self.ctx.transport.notifications(), act.now)
        if isinstance(act, ctr.Complete):
            self.ctx.metrics.transfer_finished("decode", "ok")
            self.ctx.trace.stamp(tid, "d.daemon.received_sent")
            self.ctx.to_engine(proto.Received(tid, act.attempt))
            self._history(act, "ok", "")
        elif isinstance(act, ctr.Fail):
            self.ctx.metrics.transfer_finished("decode", "failed")
            if act.cause is ctr.Cause.TIMEOUT:
                self.ctx.metrics.timeout("deadline")
            self.ctx.trace.stamp(tid, "d.daemon.receive_failed")
            reason = _reason(act.reason)
            self.ctx.to_engine(proto.ReceiveFailed(tid, act.attempt, reason))
            self._history(act, "failed", reason)
        elif isinstance(act, ctr.Refuse):
            self.ctx.bad("register", act.reason)
            self.ctx.to_engine(proto.ReceiveFailed(tid, act.attempt, _reason(act.reason)))
        elif isinstance(act, ctr.Release):
            self.ctx.to_engine(proto.Released(tid, act.attempt))
        elif isinstance(act, ctr.SendCancel):
            for ep in act.endpoints:
                peer = self.producers.get(ep)
                if peer is not None and peer.state is PeerLinkState.READY:
                    self.ctx.wire.to_producer(ep, proto.Cancel(tid, act.attempt, _reason(act.reason)))
        return None

    def leave_note(self) -> None:
        """Before a fence: the producers we know lost, for the daemon started after us."""
        peer_note.leave(self._note, [ep for ep, p in self.producers.items()
                                     if p.state is PeerLinkState.RECOVERING])

    def _history(self, act: ctr.Complete | ctr.Fail, result: str, error: str) -> None:
        now = time.monotonic()
        self.ctx.history.add({
            "transfer_id": act.transfer_id, "attempt": act.attempt, "side": "decode", "result": result,
            "error": error, "latency_ms": round((now - act.since) * 1e3, 3) if act.since is not None else None,
            "at": now, "producers": act.producers,
        })

    # ------------------------------------------------------------------ time, ops, shutdown

    def resumed(self, gap: float) -> None:
        """The loop did not run for ``gap`` seconds (frozen, or the host stalled): our producers
        were not silent, we were. They get that time back and a ping now, so one that evicted
        us meanwhile says so at once ("send Hello first": HandshakeLost)."""
        log.warning("this daemon did not run for %.1f s; pinging its %d prefill link(s)", gap, len(self.producers))
        for p in self.producers.values():
            p.resumed(gap)

    def tick(self, now: float) -> None:
        self.apply(ctr.Tick(now))
        timeout = self.cfg.peer_timeout_s
        for p in list(self.producers.values()):
            event = p.due(now, timeout, max(self.cfg.register_timeout_s, 4 * timeout))
            if isinstance(event, pr.HandshakeTimeout):
                self.ctx.metrics.timeout("peer")
                self.apply(*self._link(p, event, f"prefill daemon {p.endpoint} did not answer the handshake in "
                                                 f"{timeout:.1f}s"))
            elif isinstance(event, pr.Silent):
                self.ctx.metrics.timeout("peer")
                self.apply(*self._link(p, event, f"prefill daemon {p.endpoint} silent for {timeout:.1f}s"))
            elif event is not None:
                self.apply(*self._link(p, event, ""))
        for s, n in self.counter.counts().items():
            if s not in ctr.TOMBSTONES:  # finished transfers are not pending
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
