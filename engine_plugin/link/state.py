"""The engine's link to its daemon as a sans-IO state machine: one table of transitions.

No sockets and no clock here (events carry ``now``), so every rule of the link can be tested
exhaustively and at random (tests/unit/test_link.py). The socket shell
(:class:`kvpush.engine_plugin.link.client.DaemonClient`) turns connects, ends of stream, decoded
frames and polls into events, feeds them to :meth:`DaemonLink.handle`, and carries out the
actions it returns, in order; the outcome of a send it was told to make comes back as an event
(``AttachSent``, ``HeartbeatSent``), since a non-blocking send may find no room.

Every transition is one row of :data:`TABLE`, a :class:`kvpush.common.machine.Table` (the one
machine idiom of kvpush): (state, event type, guard) -> (new state, steps). The table is
total: an event the shell can never feed in a state (a shell bug) is a row documented
unreachable whose step raises :class:`LinkError`.

The rules the table encodes:

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
  once. Each transition is logged once. This machine is the one judge of the daemon's
  liveness in the plugin: the worker half asks it (``down``: known unreachable, not merely
  unanswered yet; ``take_replaced``: the daemon that acknowledged our Attach is not the one
  that did before, so nothing the engine published before is held any more).

Data path: the machine owns the bounded queue of encoded frames; :meth:`DaemonLink.route` says what
``send()`` does with the next message (refuse, queue, or hand it to the socket directly).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Final

from kvpush.common.machine import Row, Table, row

__all__ = [
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
    "DaemonLink",
    "Drained",
    "Heard",
    "HeartbeatAcked",
    "HeartbeatSent",
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


S, A = State, Act
LINK_UP: Final = frozenset({S.PLAIN_UP, S.ATTACH_DUE, S.ATTACHING, S.ATTACHED, S.SILENT})
FLOWS: Final = frozenset({S.PLAIN_UP, S.ATTACHED})  # ordinary messages may go out


# ---- events (what the shell feeds) --------------------------------------------------------


@dataclass(slots=True)
class Connected:
    """The shell's connect succeeded: a new link."""

    now: float


@dataclass(slots=True)
class Disconnected:
    """End of stream or a socket error."""

    now: float


@dataclass(slots=True)
class AttachRequested:
    """attach(): a (new) Attach to remember."""


@dataclass(slots=True)
class AttachSent:
    """The shell handed the Attach to the socket."""


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
    """Any other frame from the daemon."""

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
EVENTS: Final = (Connected, Disconnected, AttachRequested, AttachSent, AttachAcked, HeartbeatAcked,
                 HeartbeatSent, Heard, Tick, Drained, Close)


# ---- guards: pure predicates over (link, link, event), evaluated before any step -----------


def restarted(lk: DaemonLink, _: Any, ev: HeartbeatAcked) -> bool:
    """The ack names another daemon than this link heard so far (a restart the shell could
    not see). This link's id only: a new link to a restarted daemon was attached by its
    handshake already, and its first ack must not re-attach a second time."""
    return lk._link_daemon_id is not None and ev.daemon_id != lk._link_daemon_id


def heartbeat_due(lk: DaemonLink, _: Any, ev: Tick) -> bool:
    return ev.now >= lk._next_hb


def comes_alive(lk: DaemonLink, _: Any, ev: Drained) -> bool:
    return not lk.available and lk._heard_recently(ev.now)


def goes_silent(lk: DaemonLink, _: Any, ev: Drained) -> bool:
    return lk.available and not lk._heard_recently(ev.now)


def was_available(lk: DaemonLink, _: Any, ev: Drained) -> bool:
    return lk.available


def never_answered(lk: DaemonLink, _: Any, ev: Drained) -> bool:
    """Unavailable since start for more than dead_after_s, not yet said (said once)."""
    return (not lk.available and not lk._ever_available and not lk._warned_never
            and ev.now - lk._started > lk.dead_after_s)


# ---- steps: the event's effect on the link's facts, and the actions (never the state) ------


def new_link(lk: DaemonLink, _: Any, ev: Connected, out: list[Act]) -> None:
    lk._link_daemon_id = None
    lk.counters.links += 1
    lk._next_hb = ev.now + lk.heartbeat_s


def link_dropped(lk: DaemonLink, _: Any, ev: Disconnected, out: list[Act]) -> None:
    if lk.state in LINK_UP:
        lk.counters.disconnects += 1
    lk._link_daemon_id = None
    lk._last_heard = None  # the daemon's state died with the link
    lk._hb_sent_at.clear()


def new_attach(lk: DaemonLink, _: Any, ev: AttachRequested, out: list[Act]) -> None:
    lk._attach_sends = 0  # a new Attach, not a re-attach


def attach_went_out(lk: DaemonLink, _: Any, ev: AttachSent, out: list[Act]) -> None:
    lk._attach_sends += 1
    if lk._attach_sends > 1:
        lk.counters.reattaches += 1


def attach_acked(lk: DaemonLink, _: Any, ev: AttachAcked, out: list[Act]) -> None:
    lk._heard(ev.now)
    lk._learn_daemon(ev.daemon_id)
    lk.agent_name = ev.agent_name
    if lk.holder is not None and ev.daemon_id != lk.holder:
        lk._replaced = True  # what the engine published to the old holder is gone with it
    lk.holder = ev.daemon_id


def heartbeat_acked(lk: DaemonLink, _: Any, ev: HeartbeatAcked, out: list[Act]) -> None:
    lk._heard(ev.now)
    sent_at = lk._hb_sent_at.pop(ev.seq, None)
    if sent_at is not None:
        lk.rtt_s = ev.now - sent_at
    lk._learn_daemon(ev.daemon_id)


def heartbeat_went_out(lk: DaemonLink, _: Any, ev: HeartbeatSent, out: list[Act]) -> None:
    lk.counters.heartbeats += 1
    if len(lk._hb_sent_at) > HB_TRACKED:
        lk._hb_sent_at.clear()
    lk._hb_sent_at[lk.hb_seq] = ev.now


def heard(lk: DaemonLink, _: Any, ev: Heard, out: list[Act]) -> None:
    lk._heard(ev.now)


def next_beat(lk: DaemonLink, _: Any, ev: Tick, out: list[Act]) -> None:
    lk._next_hb = ev.now + lk.heartbeat_s


def send_attach(lk: DaemonLink, _: Any, ev: Any, out: list[Act]) -> None:
    out.append(A.SEND_ATTACH)


def send_heartbeat(lk: DaemonLink, _: Any, ev: Any, out: list[Act]) -> None:
    lk.hb_seq += 1
    out.append(A.SEND_HEARTBEAT)


def flush(lk: DaemonLink, _: Any, ev: Any, out: list[Act]) -> None:
    out.append(A.FLUSH)


def recheck_link(lk: DaemonLink, _: Any, ev: Any, out: list[Act]) -> None:
    out.append(A.RECHECK_LINK)


def log_restart(lk: DaemonLink, _: Any, ev: Any, out: list[Act]) -> None:
    out.append(A.LOG_RESTART)


def now_available(lk: DaemonLink, _: Any, ev: Drained, out: list[Act]) -> None:
    lk.available = lk._ever_available = True
    lk.unavailable_since = None
    out.append(A.LOG_AVAILABLE)


def _unavailable(lk: DaemonLink, now: float) -> None:
    lk.available = False
    lk.unavailable_since = now
    lk.counters.unavailable += 1


def now_lost(lk: DaemonLink, _: Any, ev: Drained, out: list[Act]) -> None:
    """Unavailable because the link dropped (its drop already reset the state)."""
    _unavailable(lk, ev.now)
    out.append(A.LOG_LOST)


def now_silent(lk: DaemonLink, _: Any, ev: Drained, out: list[Act]) -> None:
    _unavailable(lk, ev.now)
    out.append(A.LOG_SILENT)


def warn_never_answered(lk: DaemonLink, _: Any, ev: Drained, out: list[Act]) -> None:
    lk._warned_never = True
    out.append(A.LOG_NEVER_ANSWERED)


def closing(lk: DaemonLink, _: Any, ev: Close, out: list[Act]) -> None:
    lk.available = False


def drop_queue(lk: DaemonLink, _: Any, ev: Close, out: list[Act]) -> None:
    out.append(A.DROP_QUEUE)


def shell_bug(lk: DaemonLink, _: Any, ev: Any, out: list[Act]) -> None:
    raise LinkError(f"{type(ev).__name__} cannot happen in state {lk.state.name}")


# ---- the table ---------------------------------------------------------------------------

_PLAIN = (S.PLAIN_DOWN, S.PLAIN_UP)
_NO_LINK = (S.PLAIN_DOWN, S.DOWN)
_WITH_ATTACH_UP = (S.ATTACH_DUE, S.ATTACHING, S.ATTACHED, S.SILENT)
_OPEN = tuple(s for s in S if s is not S.CLOSED)
_SENT_ONLY_WHEN_ASKED = "the shell reports a send only right after the action that asked for it"
_NOTHING_AFTER_CLOSE = "the shell feeds a closed link nothing but Close"


def _rows() -> list[Row]:
    r: list[Row] = []
    # A new link: the Attach (if any) first, then a heartbeat to learn the daemon_id.
    r += [row(s, Connected, None, S.PLAIN_UP, new_link, send_heartbeat) for s in _PLAIN]
    r += [row(s, Connected, None, S.ATTACH_DUE, new_link, send_attach, send_heartbeat)
          for s in (S.DOWN, *_WITH_ATTACH_UP)]
    # A dropped link: whatever the daemon knew of us died with it.
    r += [row(s, Disconnected, None, S.PLAIN_DOWN, link_dropped) for s in _PLAIN]
    r += [row(s, Disconnected, None, S.DOWN, link_dropped) for s in (S.DOWN, *_WITH_ATTACH_UP)]
    # attach(): a new Attach goes out at once on a live link, else as a new link's first frame.
    r += [row(s, AttachRequested, None, S.DOWN, new_attach) for s in _NO_LINK]
    r += [row(s, AttachRequested, None, S.ATTACH_DUE, new_attach, send_attach)
          for s in (S.PLAIN_UP, *_WITH_ATTACH_UP)]
    r += [row(S.ATTACH_DUE, AttachSent, None, S.ATTACHING, attach_went_out)]
    r += [row(s, AttachSent, None, s, shell_bug, unreachable=_SENT_ONLY_WHEN_ASKED)
          for s in _OPEN if s is not S.ATTACH_DUE]
    # AttachAck opens the gate; a stale one (our Attach not out on this link yet) does not.
    r += [row(S.ATTACHING, AttachAcked, None, S.ATTACHED, attach_acked, flush),
          row(S.SILENT, AttachAcked, None, S.ATTACHED, attach_acked, flush)]  # a slow Attach
    r += [row(s, AttachAcked, None, s, attach_acked)
          for s in (S.ATTACHED, S.ATTACH_DUE, S.DOWN, S.PLAIN_DOWN, S.PLAIN_UP)]
    # Heartbeat acks: a silent daemon that answers again, or a restarted one, is re-attached.
    r += [row(s, HeartbeatAcked, None, s, heartbeat_acked) for s in (*_PLAIN, S.DOWN)]
    for s in _WITH_ATTACH_UP:
        r.append(row(s, HeartbeatAcked, restarted, S.ATTACH_DUE, heartbeat_acked, log_restart,
                     send_attach))
        if s is S.SILENT:
            r.append(row(s, HeartbeatAcked, None, S.ATTACH_DUE, heartbeat_acked, send_attach))
        else:
            r.append(row(s, HeartbeatAcked, None, s, heartbeat_acked))
    r += [row(s, HeartbeatSent, None, s, heartbeat_went_out) for s in LINK_UP]
    r += [row(s, HeartbeatSent, None, s, shell_bug, unreachable=_SENT_ONLY_WHEN_ASKED)
          for s in _NO_LINK]
    r += [row(s, Heard, None, s, heard) for s in _OPEN]
    # Polls: retries and flushes, then heartbeats when one is due, only on a link
    # (recheck_link: a shell without a connection dials now).
    for s, every in ((S.PLAIN_DOWN, ()), (S.DOWN, ()), (S.ATTACHING, ()), (S.SILENT, ()),
                     (S.ATTACH_DUE, (send_attach,)),  # its send failed: retry
                     (S.PLAIN_UP, (flush,)), (S.ATTACHED, (flush,))):
        beat = (next_beat, recheck_link) + ((send_heartbeat,) if s in LINK_UP else ())
        r += [row(s, Tick, heartbeat_due, s, *every, *beat), row(s, Tick, None, s, *every)]
    # Liveness, judged after a poll read the daemon's frames. Silence on a live link: the
    # daemon may have lost us (re-attach at its next answer); without an Attach, nothing to redo.
    for s in _OPEN:
        if s in _NO_LINK:
            r.append(row(s, Drained, was_available, s, now_lost))
        else:
            r.append(row(s, Drained, comes_alive, s, now_available))
            r.append(row(s, Drained, goes_silent, S.PLAIN_UP if s is S.PLAIN_UP else S.SILENT,
                         now_silent))
        if s not in (S.ATTACHED, S.SILENT):  # both were heard: their next poll proves them alive
            r.append(row(s, Drained, never_answered, s, warn_never_answered))
        r.append(row(s, Drained, None, s))
    r += [row(s, Close, None, S.CLOSED, closing, drop_queue) for s in _OPEN]
    # A closed link: the shell's close() and poll() return before feeding anything; were
    # they fed, Close and Drained would change nothing, the rest are shell bugs.
    r += [row(S.CLOSED, Close, None, S.CLOSED, unreachable=_NOTHING_AFTER_CLOSE),
          row(S.CLOSED, Drained, None, S.CLOSED, unreachable=_NOTHING_AFTER_CLOSE)]
    r += [row(S.CLOSED, e, None, S.CLOSED, shell_bug, unreachable=_NOTHING_AFTER_CLOSE)
          for e in EVENTS if e not in (Close, Drained)]
    return r


TABLE: Final = Table(State, EVENTS, _rows(), keyed=False)


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


class DaemonLink:
    """The machine of one engine-daemon link: its state, liveness and queue (the module
    docstring has the rules; :data:`TABLE` every transition)."""

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
        #: the daemon that acknowledged our Attach last: it holds what the engine published
        self.holder: str | None = None
        self._replaced = False  # an AttachAck named another holder, not yet taken (take_replaced)
        #: Called with every row taken (tests count them).
        self.on_row: Callable[[Row], None] | None = None

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
        """Apply one event (one row of :data:`TABLE`); the actions the shell must carry out,
        in order."""
        if type(ev) not in EVENTS:
            raise LinkError(f"unknown event {ev!r}")
        out: list[Act] = []
        taken = TABLE.take(self, self, ev, out)
        if self.on_row is not None:
            self.on_row(taken)
        return tuple(out)

    def tick(self, now: float) -> tuple[Act, ...]:
        """``handle(Tick(now))``: every poll starts with it."""
        return self.handle(Tick(now))

    def drained(self, now: float) -> tuple[Act, ...]:
        """``handle(Drained(now))``: liveness, judged after the poll read the daemon's frames."""
        return self.handle(Drained(now))

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

    def down(self, now: float) -> bool:
        """Is the daemon known to be unreachable? Not merely "no answer yet": right after
        start-up the Attach is in flight and messages queue behind it. Down = unavailable
        after a daemon acknowledged our Attach once, or never answered within dead_after_s."""
        if self.available:
            return False
        return self.holder is not None or now - self._started > self.dead_after_s

    def take_replaced(self) -> bool:
        """Did an AttachAck name another daemon than the one that acknowledged the Attach
        before (a restart)? Said once per replacement: the caller fails what it published."""
        replaced, self._replaced = self._replaced, False
        return replaced
