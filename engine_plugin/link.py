"""The engine's link to its daemon as a sans-IO state machine: one table of transitions.

No sockets and no clock here (events carry ``now``), so every rule of the link can be tested
exhaustively and at random (tests/unit/test_link.py). The socket shell
(:class:`kvpush.engine_plugin.client.DaemonClient`) turns connects, ends of stream, decoded
frames and polls into events, feeds them to :meth:`Link.handle`, and carries out the actions
it returns, in order; the outcome of a send it was told to make comes back as an event
(``AttachSent``, ``HeartbeatSent``), since a non-blocking send may find no room.

The rules the table encodes (see TABLE):

* Nothing goes out before a link exists (the shell's connect: ``Connected``); a link of a
  client that has an Attach starts with it, and ordinary messages wait in the local queue
  until its ``AttachAck`` (only OPEN and ATTACHED let messages flow).
* The Attach goes out once per link, and again on the same link only when a HeartbeatAck
  names another daemon_id than this link's (a restart the shell could not see) or when the
  daemon answers again after it was declared silent (it may have lost what it knew of us).
* An unsent Attach (EAGAIN) is retried on every poll (``Tick``).
* Liveness: available = link up and heard recently, where silence is only proven by a
  heartbeat sent after the daemon was last heard and left unanswered for ``dead_after_s`` (an
  idle engine does not poll, so a long gap says nothing). A dropped link is unavailable at
  once. Each transition is logged once.

Data path: the machine owns the bounded queue of encoded frames; :meth:`Link.route` says what
``send()`` does with the next message (refuse, queue, or hand it to the socket directly).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from enum import StrEnum
from typing import Final

__all__ = [
    "ERRORS",
    "FLOWS",
    "LINK_UP",
    "TABLE",
    "Act",
    "AttachAcked",
    "AttachRequested",
    "AttachSent",
    "Close",
    "Connected",
    "Disconnected",
    "Drained",
    "Ev",
    "Heard",
    "HeartbeatAcked",
    "HeartbeatSent",
    "Link",
    "LinkCounters",
    "LinkError",
    "Route",
    "State",
    "Tick",
]

HB_TRACKED = 64  # heartbeats awaiting an ack that are remembered (acks lost with a dead daemon)


class State(StrEnum):
    PLAIN_DOWN = "plain_down"  # no Attach remembered, no link
    PLAIN_UP = "plain_up"  # no Attach remembered, link up: a plain client, messages flow
    DOWN = "down"  # Attach remembered, no link (the shell dials again)
    ATTACH_DUE = "attach_due"  # link up, the Attach must go out first and has not yet
    ATTACHING = "attaching"  # Attach out on this link, AttachAck awaited
    ATTACHED = "attached"  # acknowledged: messages flow
    SILENT = "silent"  # link up, daemon silent too long: re-attach at its next HeartbeatAck
    CLOSED = "closed"


class Ev(StrEnum):
    """Table keys; :meth:`Link.handle` derives them from the event objects below."""

    CONNECTED = "connected"  # the shell's connect succeeded
    DISCONNECTED = "disconnected"  # end of stream or a socket error
    ATTACH_SET = "attach_set"  # attach(): a (new) Attach to remember
    ATTACH_SENT = "attach_sent"  # the shell handed the Attach to the socket
    ATTACH_ACKED = "attach_acked"
    HEARTBEAT_ACKED = "heartbeat_acked"  # from the daemon this link has heard so far
    RESTART_SEEN = "restart_seen"  # a HeartbeatAck naming another daemon_id than this link's
    HEARTBEAT_DUE = "heartbeat_due"  # a Tick a heartbeat period after the last one
    HEARTBEAT_SENT = "heartbeat_sent"
    HEARD = "heard"  # any other frame from the daemon
    SILENCE = "silence"  # liveness lost on a live link (from Drained)
    TICK = "tick"  # every poll
    CLOSE = "close"


class Act(StrEnum):
    SEND_ATTACH = "send_attach"  # report AttachSent() if the socket took it
    SEND_HEARTBEAT = "send_heartbeat"  # Heartbeat(link.hb_seq); report HeartbeatSent(now)
    FLUSH = "flush"  # hand queued frames to the socket while it takes them (call link.sent_one())
    DROP_QUEUE = "drop_queue"  # discard the queued frames (closing: they fail)
    RECHECK_LINK = "recheck_link"  # without a connection: dial now (beside the shell's own pacing)
    LOG_RESTART = "log_restart"
    LOG_AVAILABLE = "log_available"
    LOG_LOST = "log_lost"  # unavailable: connection lost
    LOG_SILENT = "log_silent"  # unavailable: silent for more than dead_after_s
    LOG_NEVER_ANSWERED = "log_never_answered"  # no answer at all since start, once


class Route(StrEnum):
    """What send() does with the next message."""

    REFUSE = "refuse"  # closed or queue full (counted in dropped)
    QUEUE = "queue"  # encode and queue: the gate is closed or others wait before it
    DIRECT = "direct"  # encode and hand to the socket; queue it if it has no room


class LinkError(RuntimeError):
    """The shell fed an event that cannot happen in the current state (a shell bug)."""


S, E, A = State, Ev, Act
LINK_UP: Final = frozenset({S.PLAIN_UP, S.ATTACH_DUE, S.ATTACHING, S.ATTACHED, S.SILENT})
FLOWS: Final = frozenset({S.PLAIN_UP, S.ATTACHED})  # ordinary messages may go out
_WITH_ATTACH_UP = (S.ATTACH_DUE, S.ATTACHING, S.ATTACHED, S.SILENT)
_OPEN = tuple(s for s in S if s is not S.CLOSED)
_NEW_LINK = (S.ATTACH_DUE, (A.SEND_ATTACH, A.SEND_HEARTBEAT))
_REATTACH = (S.ATTACH_DUE, (A.SEND_ATTACH,))
_RESTART = (S.ATTACH_DUE, (A.LOG_RESTART, A.SEND_ATTACH))

# (state, event) -> (new state, actions). A pair missing here is in ERRORS.
TABLE: Final[dict[tuple[State, Ev], tuple[State, tuple[Act, ...]]]] = {
    # A new link: the Attach (if any) first, then a heartbeat to learn the daemon_id.
    (S.PLAIN_DOWN, E.CONNECTED): (S.PLAIN_UP, (A.SEND_HEARTBEAT,)),
    (S.PLAIN_UP, E.CONNECTED): (S.PLAIN_UP, (A.SEND_HEARTBEAT,)),
    (S.DOWN, E.CONNECTED): _NEW_LINK,
    **{(s, E.CONNECTED): _NEW_LINK for s in _WITH_ATTACH_UP},
    # A dropped link: whatever the daemon knew of us died with it.
    (S.PLAIN_DOWN, E.DISCONNECTED): (S.PLAIN_DOWN, ()),
    (S.PLAIN_UP, E.DISCONNECTED): (S.PLAIN_DOWN, ()),
    **{(s, E.DISCONNECTED): (S.DOWN, ()) for s in (S.DOWN, *_WITH_ATTACH_UP)},
    # attach(): a new Attach goes out at once on a live link, else as a new link's first frame.
    (S.PLAIN_DOWN, E.ATTACH_SET): (S.DOWN, ()),
    (S.DOWN, E.ATTACH_SET): (S.DOWN, ()),
    (S.PLAIN_UP, E.ATTACH_SET): _REATTACH,
    **{(s, E.ATTACH_SET): _REATTACH for s in _WITH_ATTACH_UP},
    (S.ATTACH_DUE, E.ATTACH_SENT): (S.ATTACHING, ()),
    # AttachAck opens the gate; a stale one (our Attach not out on this link yet) does not.
    (S.ATTACHING, E.ATTACH_ACKED): (S.ATTACHED, (A.FLUSH,)),
    (S.SILENT, E.ATTACH_ACKED): (S.ATTACHED, (A.FLUSH,)),  # it knows us: a slow Attach
    (S.ATTACHED, E.ATTACH_ACKED): (S.ATTACHED, ()),
    (S.ATTACH_DUE, E.ATTACH_ACKED): (S.ATTACH_DUE, ()),
    (S.DOWN, E.ATTACH_ACKED): (S.DOWN, ()),
    (S.PLAIN_DOWN, E.ATTACH_ACKED): (S.PLAIN_DOWN, ()),
    (S.PLAIN_UP, E.ATTACH_ACKED): (S.PLAIN_UP, ()),
    # Heartbeat acks: a silent daemon that answers again, or a restarted one, is re-attached.
    **{(s, E.HEARTBEAT_ACKED): (s, ()) for s in _OPEN if s is not S.SILENT},
    (S.SILENT, E.HEARTBEAT_ACKED): _REATTACH,
    **{(s, E.RESTART_SEEN): (s, ()) for s in (S.PLAIN_DOWN, S.PLAIN_UP, S.DOWN)},
    **{(s, E.RESTART_SEEN): _RESTART for s in _WITH_ATTACH_UP},
    # Time: heartbeats only on a link (RECHECK_LINK: a shell without a connection dials now).
    **{(s, E.HEARTBEAT_DUE): (s, (A.RECHECK_LINK,)) for s in (S.PLAIN_DOWN, S.DOWN)},
    **{(s, E.HEARTBEAT_DUE): (s, (A.RECHECK_LINK, A.SEND_HEARTBEAT)) for s in LINK_UP},
    **{(s, E.HEARTBEAT_SENT): (s, ()) for s in LINK_UP},
    **{(s, E.HEARD): (s, ()) for s in _OPEN},
    **{(s, E.TICK): (s, ()) for s in (S.PLAIN_DOWN, S.DOWN, S.ATTACHING, S.SILENT)},
    (S.ATTACH_DUE, E.TICK): (S.ATTACH_DUE, (A.SEND_ATTACH,)),  # its send failed: retry
    (S.PLAIN_UP, E.TICK): (S.PLAIN_UP, (A.FLUSH,)),
    (S.ATTACHED, E.TICK): (S.ATTACHED, (A.FLUSH,)),
    # Silence on a live link: the daemon may have lost us; without an Attach, nothing to redo.
    (S.PLAIN_UP, E.SILENCE): (S.PLAIN_UP, ()),
    **{(s, E.SILENCE): (S.SILENT, ()) for s in _WITH_ATTACH_UP},
    **{(s, E.CLOSE): (S.CLOSED, (A.DROP_QUEUE,)) for s in _OPEN},
    (S.CLOSED, E.CLOSE): (S.CLOSED, ()),
}

# Pairs that cannot happen: the shell reports a send only right after the action asked for
# it, SILENCE only comes on a live link, and a closed link takes no events but CLOSE.
ERRORS: Final[frozenset[tuple[State, Ev]]] = frozenset(
    {(s, e) for s in State for e in Ev} - TABLE.keys()
)


# ---- events (what the shell feeds) --------------------------------------------------------


@dataclass(slots=True)
class Connected:
    now: float


@dataclass(slots=True)
class Disconnected:
    now: float


@dataclass(slots=True)
class AttachRequested:
    pass


@dataclass(slots=True)
class AttachSent:
    pass


@dataclass(slots=True)
class AttachAcked:
    daemon_id: str
    agent_name: str
    now: float


@dataclass(slots=True)
class HeartbeatAcked:
    seq: int
    daemon_id: str
    now: float


@dataclass(slots=True)
class HeartbeatSent:
    now: float


@dataclass(slots=True)
class Heard:
    now: float


@dataclass(slots=True)
class Tick:
    """Start of a poll: retries, flushes and heartbeats that fell due."""

    now: float


@dataclass(slots=True)
class Drained:
    """End of a poll, after the daemon's frames were read: liveness is judged here."""

    now: float


@dataclass(slots=True)
class Close:
    pass


Event = (Connected | Disconnected | AttachRequested | AttachSent | AttachAcked | HeartbeatAcked
         | HeartbeatSent | Heard | Tick | Drained | Close)


@dataclass
class LinkCounters:
    """Cumulative; exported through vLLM's KV-connector stats (engine_plugin/stats.py)."""

    sent: int = 0  # frames handed to the socket (engine messages; heartbeats excluded)
    enqueued: int = 0  # messages that waited in the local queue
    dropped: int = 0  # send() refusals: local queue full or client closed
    received: int = 0
    decode_errors: int = 0
    heartbeats: int = 0
    links: int = 0  # links established (handshakes); beyond the first are reconnects
    disconnects: int = 0
    reattaches: int = 0  # Attach sends beyond the first of the same Attach
    restarts_seen: int = 0  # the daemon_id changed
    unavailable: int = 0  # transitions to unavailable

    def as_dict(self) -> dict[str, int]:
        return dict(vars(self))  # not dataclasses.asdict: this runs every step


class Link:
    """State, liveness and queue of one engine-daemon link; see the module docstring."""

    def __init__(self, now: float, *, max_queue: int, heartbeat_s: float, dead_after_s: float) -> None:
        self.max_queue = max_queue
        self.heartbeat_s = heartbeat_s
        self.dead_after_s = dead_after_s
        self.state = S.PLAIN_DOWN
        self.queue: deque[bytes] = deque()
        self.counters = LinkCounters()
        self.available = False
        self.unavailable_since: float | None = now
        self.daemon_id: str | None = None
        self.agent_name: str | None = None
        self.rtt_s: float | None = None  # last heartbeat round trip
        self.hb_seq = 0  # seq of the heartbeat SEND_HEARTBEAT asks for
        self._hb_sent_at: dict[int, float] = {}
        self._next_hb = now
        self._link_daemon_id: str | None = None  # daemon_id heard on the current link
        self._last_heard: float | None = None
        self._started = now
        self._ever_available = False
        self._warned_never = False
        self._attach_sends = 0  # of the current Attach; beyond the first are re-attaches

    # ---- queries -----------------------------------------------------------------------

    @property
    def flows(self) -> bool:
        return self.state in FLOWS

    @property
    def attached(self) -> bool:
        return self.state is S.ATTACHED

    @property
    def link_up(self) -> bool:
        return self.state in LINK_UP

    def route(self) -> Route:
        """What send() does with the next message; nothing overtakes what is queued."""
        if self.state is S.CLOSED:
            self.counters.dropped += 1
            return Route.REFUSE
        if self.queue or self.state not in FLOWS:
            if len(self.queue) >= self.max_queue:
                self.counters.dropped += 1  # refused before encoding: the full path stays cheap
                return Route.REFUSE
            return Route.QUEUE
        return Route.DIRECT

    def enqueue(self, frame: bytes) -> bool:
        """Queue an encoded frame if there is room (counted in dropped if not)."""
        if len(self.queue) >= self.max_queue or self.state is S.CLOSED:
            self.counters.dropped += 1
            return False
        self.queue.append(frame)
        self.counters.enqueued += 1
        return True

    # ---- events ------------------------------------------------------------------------

    def handle(self, ev: Event) -> tuple[Act, ...]:
        """Apply one event; returns the actions the shell must carry out, in order."""
        t = type(ev)
        if t is Tick:
            assert isinstance(ev, Tick)
            return self.tick(ev.now)
        if t is Drained:
            assert isinstance(ev, Drained)
            return self.drained(ev.now)
        if t is Heard:
            assert isinstance(ev, Heard)
            self._heard(ev.now)
            return self._step(E.HEARD)
        if t is HeartbeatAcked:
            assert isinstance(ev, HeartbeatAcked)
            self._heard(ev.now)
            sent_at = self._hb_sent_at.pop(ev.seq, None)
            if sent_at is not None:
                self.rtt_s = ev.now - sent_at
            # This link's id only: a new link to a restarted daemon was attached by its
            # handshake already, and its first ack must not re-attach a second time.
            restarted = self._link_daemon_id is not None and ev.daemon_id != self._link_daemon_id
            self._learn_daemon(ev.daemon_id)
            return self._step(E.RESTART_SEEN if restarted else E.HEARTBEAT_ACKED)
        if t is AttachAcked:
            assert isinstance(ev, AttachAcked)
            self._heard(ev.now)
            self._learn_daemon(ev.daemon_id)
            self.agent_name = ev.agent_name
            return self._step(E.ATTACH_ACKED)
        if t is HeartbeatSent:
            assert isinstance(ev, HeartbeatSent)
            self.counters.heartbeats += 1
            if len(self._hb_sent_at) > HB_TRACKED:
                self._hb_sent_at.clear()
            self._hb_sent_at[self.hb_seq] = ev.now
            return self._step(E.HEARTBEAT_SENT)
        if t is AttachSent:
            self._attach_sends += 1
            if self._attach_sends > 1:
                self.counters.reattaches += 1
            return self._step(E.ATTACH_SENT)
        if t is Connected:
            assert isinstance(ev, Connected)
            self._link_daemon_id = None
            self.counters.links += 1
            acts = self._step(E.CONNECTED)
            self._next_hb = ev.now + self.heartbeat_s
            return acts
        if t is Disconnected:
            if self.state in LINK_UP:
                self.counters.disconnects += 1
            self._link_daemon_id = None
            self._last_heard = None  # the daemon's state died with the link
            self._hb_sent_at.clear()
            return self._step(E.DISCONNECTED)
        if t is AttachRequested:
            self._attach_sends = 0  # a new Attach, not a re-attach
            return self._step(E.ATTACH_SET)
        if t is Close:
            self.available = False
            return self._step(E.CLOSE)
        raise LinkError(f"unknown event {ev!r}")

    def tick(self, now: float) -> tuple[Act, ...]:
        """``handle(Tick(now))`` without the event object: it runs on every poll."""
        acts = self._step(E.TICK)
        if now >= self._next_hb:
            self._next_hb = now + self.heartbeat_s
            acts = acts + self._step(E.HEARTBEAT_DUE)
        return acts

    def drained(self, now: float) -> tuple[Act, ...]:
        """``handle(Drained(now))``: liveness, judged after the poll read the daemon's frames."""
        return self._liveness(now)

    def _step(self, ev: Ev) -> tuple[Act, ...]:
        try:
            self.state, acts = TABLE[(self.state, ev)]
        except KeyError:
            raise LinkError(f"event {ev.name} cannot happen in state {self.state.name}") from None
        if A.SEND_HEARTBEAT in acts:
            self.hb_seq += 1
        return acts

    def _heard(self, now: float) -> None:
        self.counters.received += 1
        self._last_heard = now

    def _learn_daemon(self, daemon_id: str) -> None:
        if self.daemon_id is not None and daemon_id != self.daemon_id:
            self.counters.restarts_seen += 1
        self.daemon_id = self._link_daemon_id = daemon_id

    # ---- liveness ----------------------------------------------------------------------

    def _heard_recently(self, now: float) -> bool:
        """Silence is only proven by a heartbeat, sent after the daemon was last heard, left
        unanswered for ``dead_after_s``.

        An idle engine does not step, so it neither polls nor sends heartbeats; a long
        gap since the last message then says nothing about the daemon.
        """
        last = self._last_heard
        if last is None:
            return False
        if now - last <= self.dead_after_s:
            return True
        # Only a heartbeat sent after the daemon was last heard can prove it silent.
        oldest = min((t for t in self._hb_sent_at.values() if t > last), default=None)
        return oldest is None or now - oldest <= self.dead_after_s

    def _liveness(self, now: float) -> tuple[Act, ...]:
        if self.state is S.CLOSED:
            return ()
        alive = self.state in LINK_UP and self._heard_recently(now)
        if alive == self.available:
            if (not alive and not self._ever_available and not self._warned_never
                    and now - self._started > self.dead_after_s):
                self._warned_never = True
                return (A.LOG_NEVER_ANSWERED,)
            return ()
        self.available = alive
        if alive:
            self._ever_available = True
            self.unavailable_since = None
            return (A.LOG_AVAILABLE,)
        self.unavailable_since = now
        self.counters.unavailable += 1
        if self.state not in LINK_UP:
            return (A.LOG_LOST,)  # the link's drop already reset it (DOWN)
        return (A.LOG_SILENT, *self._step(E.SILENCE))

    def silence_detail(self, now: float) -> str:
        """What proved the silence, for the log line: when the daemon was last heard and the
        oldest heartbeat sent since then."""
        last = self._last_heard
        if last is None:
            return "never heard on this link"
        since = [(t, q) for q, t in self._hb_sent_at.items() if t > last]
        hb = f"; heartbeat {min(since)[1]} unanswered for {now - min(since)[0]:.1f} s" if since else ""
        return f"last heard {now - last:.1f} s ago{hb}"

    def never_answered_s(self, now: float) -> float:
        return now - self._started
