"""The engine-daemon link machine, alone: its table, and random event sequences against it.

No sockets, no clock: the simulated shell below does what DaemonClient does with each action
(a send may fail, as a NOBLOCK send can) and records every frame that "went out" per link, so
the properties are about what a daemon would see.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush.common.machine import Row
from kvpush.engine_plugin.link.state import (
    EVENTS,
    FLOWS,
    LINK_UP,
    TABLE,
    Act,
    AttachAcked,
    AttachRequested,
    AttachSent,
    Close,
    Connected,
    DaemonLink,
    Disconnected,
    Drained,
    Heard,
    HeartbeatAcked,
    HeartbeatSent,
    LinkError,
    Route,
    State,
    Tick,
    shell_bug,
)

HB, DEAD, MAXQ = 1.0, 3.0, 5


def test_the_table_is_total_and_says_which_pairs_are_shell_bugs() -> None:
    """Every (state, event) has rows (machine.Table checks it); the pairs that cannot happen
    are rows documented unreachable, exactly these, and a closed link stays closed."""
    for s in State:
        for e in EVENTS:
            assert TABLE.rows_for(s, e)
    errors = {(r.state, r.event) for r in TABLE.rows if r.unreachable}
    assert errors == (
        {(s, AttachSent) for s in State if s is not State.ATTACH_DUE}
        | {(s, HeartbeatSent) for s in (State.PLAIN_DOWN, State.DOWN)}
        | {(State.CLOSED, e) for e in EVENTS}
    )
    assert all(r.to is State.CLOSED for r in TABLE.rows if r.state is State.CLOSED)
    harmless = [r for r in TABLE.rows if r.unreachable and shell_bug not in r.steps]
    assert {(r.state, r.event) for r in harmless} == {(State.CLOSED, Close), (State.CLOSED, Drained)}
    assert all(r.steps == () for r in harmless)


@pytest.mark.parametrize("r", [r for r in TABLE.rows if shell_bug in r.steps], ids=str)
def test_an_impossible_event_raises(r: Row) -> None:
    link = DaemonLink(0.0, max_queue=1, heartbeat_s=HB, dead_after_s=DEAD)
    link.state = r.state  # type: ignore[assignment]
    ev = {AttachRequested: AttachRequested(), AttachSent: AttachSent(), Close: Close(),
          AttachAcked: AttachAcked("d", "a", 0.0), HeartbeatAcked: HeartbeatAcked(1, "d", 0.0)}
    with pytest.raises(LinkError, match=f"{r.event.__name__} cannot happen in state {r.state.name}"):
        link.handle(ev.get(r.event) or r.event(0.0))
    assert link.state is r.state


def test_an_unknown_event_raises() -> None:
    link = DaemonLink(0.0, max_queue=1, heartbeat_s=HB, dead_after_s=DEAD)
    with pytest.raises(LinkError, match="unknown event"):
        link.handle(object())  # type: ignore[arg-type]


def test_no_row_sends_anything_without_a_link() -> None:
    sends = {"send_attach", "send_heartbeat", "flush"}
    for r in TABLE.rows:
        names = {f.__name__ for f in r.steps}
        if sends & names:
            assert r.to in LINK_UP, r
        if "flush" in names:
            assert r.to in FLOWS, r


# ---- a simulated shell ---------------------------------------------------------------------


@dataclass
class Shell:
    """DaemonClient's action handling, with the unix stream socket replaced by a list of frames per link."""

    link: DaemonLink = field(default_factory=lambda: DaemonLink(
        0.0, max_queue=MAXQ, heartbeat_s=HB, dead_after_s=DEAD))
    sock_takes: bool = True  # a non-blocking send succeeds (else EAGAIN)
    links: list[list[str]] = field(default_factory=list)  # frames out, per link
    acked: bool = False  # an AttachAck came after the last Attach that went out on this link
    n: int = 0  # messages offered
    fail_next: bool = False  # the next send alone finds no room

    def out(self, what: str) -> bool:
        assert self.link.state in LINK_UP, f"{what} sent without a link ({self.link.state})"
        if what.startswith("Msg"):
            assert self.link.state in FLOWS, f"{what} sent in {self.link.state}"
        if not self.sock_takes or self.fail_next:
            self.fail_next = False
            return False
        self.links[-1].append(what)
        if what == "Attach":
            self.acked = False
        elif what.startswith("Msg") and "Attach" in self.links[-1]:
            assert self.acked, f"{what} went out before the Attach was acknowledged"
        return True

    def run(self, acts: tuple[Act, ...], now: float) -> None:
        for a in acts:
            if a is Act.SEND_ATTACH:
                if self.out("Attach"):
                    self.run(self.link.handle(AttachSent()), now)
            elif a is Act.SEND_HEARTBEAT:
                if self.out("Heartbeat"):
                    self.run(self.link.handle(HeartbeatSent(now)), now)
            elif a is Act.FLUSH:
                self.flush()
            elif a is Act.DROP_QUEUE:
                self.link.queue.clear()

    def flush(self) -> None:
        q = self.link.queue
        while self.link.flows and q and self.out(q[0].decode()):
            q.popleft()

    def feed(self, ev: object, now: float) -> None:
        if isinstance(ev, Connected):
            self.links.append([])
            self.acked = False
        if isinstance(ev, AttachAcked):
            self.acked = True
        self.run(self.link.handle(ev), now)  # type: ignore[arg-type]

    def send(self) -> None:
        if self.link.state is not State.CLOSED and self.link.queue:
            self.flush()
        self.n += 1
        route = self.link.route()
        frame = f"Msg{self.n}"
        if route is Route.REFUSE:
            return
        if route is Route.DIRECT and self.out(frame):
            return
        self.link.enqueue(frame.encode())


# Events a real shell can produce. Monitor events alternate in practice, but a duplicated one
# must still be handled; acks may come from the same daemon or another one, at any time.
_step = st.one_of(
    st.just("connected"), st.just("disconnected"), st.just("attach"), st.just("send"),
    st.tuples(st.just("attach_ack"), st.sampled_from(["d1", "d2"])),
    st.tuples(st.just("hb_ack"), st.sampled_from(["d1", "d2"])),
    st.just("heard"), st.tuples(st.just("poll"), st.floats(0.0, 5.0)),
    st.tuples(st.just("eagain"), st.booleans()), st.just("close"),
)


def _play(sh: Shell, steps: list[object]) -> None:
    now = 0.0
    had_attach = sh.link.state not in (State.PLAIN_DOWN, State.PLAIN_UP)
    holder = None  # the daemon whose AttachAck came last
    for step in steps:
        link = sh.link
        if link.state is State.CLOSED and step != "send":
            continue  # the shell feeds nothing to a closed link (send() is refused)
        if step == "connected":
            sh.feed(Connected(now), now)
        elif step == "disconnected":
            sh.feed(Disconnected(now), now)
        elif step == "attach":
            sh.feed(AttachRequested(), now)
            had_attach = True
        elif step == "send":
            sh.send()
        elif step == "heard":
            sh.feed(Heard(now), now)
        elif step == "close":
            sh.feed(Close(), now)
        elif isinstance(step, tuple) and step[0] == "attach_ack":
            sh.feed(AttachAcked(step[1], "agent", now), now)
            # The worker half fails what it published exactly when another daemon acknowledged.
            assert link.take_replaced() == (holder is not None and holder != step[1]) and not link.take_replaced()
            holder = step[1]
        elif isinstance(step, tuple) and step[0] == "hb_ack":
            sh.feed(HeartbeatAcked(link.hb_seq, step[1], now), now)
        elif isinstance(step, tuple) and step[0] == "poll":
            now += step[1]
            sh.feed(Tick(now), now)
            sh.feed(Drained(now), now)
        elif isinstance(step, tuple) and step[0] == "eagain":
            sh.sock_takes = step[1]
        elif step == "eagain_once":
            sh.fail_next = True
        # Invariants after every step.
        assert len(link.queue) <= MAXQ
        if isinstance(step, tuple) and step[0] == "poll":  # liveness is judged per poll
            assert not link.available or link.state in LINK_UP
        assert link.attached == (link.state is State.ATTACHED)
        # Known down: unavailable after an acknowledged Attach, or never answered within DEAD.
        assert link.holder == holder
        assert link.down(now) == (not link.available and (holder is not None or now > DEAD))
        if link.state is not State.CLOSED:
            assert had_attach == (link.state not in (State.PLAIN_DOWN, State.PLAIN_UP))
    msgs = [int(f[3:]) for frames in sh.links for f in frames if f.startswith("Msg")]
    assert msgs == sorted(msgs) and len(set(msgs)) == len(msgs), "nothing overtakes, no repeats"


@settings(max_examples=500, deadline=None)
@given(st.lists(_step, max_size=80))
def test_random_sequences_plain_client_then_maybe_attach(steps: list[object]) -> None:
    """Nothing without a link, messages only while the link lets them flow (and, once an
    Attach went out on a link, only after it was acknowledged), in order, queue bounded."""
    _play(Shell(), steps)


@settings(max_examples=500, deadline=None)
@given(st.lists(_step, max_size=80))
def test_random_sequences_with_an_attach_every_link_starts_with_it(steps: list[object]) -> None:
    """A client that has its Attach before any link (the plugin's case): every link, the
    first and every reconnect, starts with the Attach, and no message precedes its ack."""
    sh = Shell()
    sh.feed(AttachRequested(), 0.0)
    _play(sh, steps)
    for frames in sh.links:
        if frames:
            assert frames[0] == "Attach", frames


def test_silence_then_answer_reattaches_and_restart_reattaches() -> None:
    sh = Shell()
    sh.feed(AttachRequested(), 0.0)
    sh.feed(Connected(0.0), 0.0)
    assert sh.links[-1] == ["Attach", "Heartbeat"] and sh.link.state is State.ATTACHING
    sh.feed(AttachAcked("d1", "a", 0.0), 0.0)
    sh.feed(HeartbeatAcked(1, "d1", 0.1), 0.1)
    sh.feed(Drained(0.1), 0.1)
    assert sh.link.available and sh.link.attached
    # Heartbeats go unanswered: silent once the oldest is older than dead_after_s.
    t = 0.1
    for _ in range(5):
        t += 1.0
        sh.feed(Tick(t), t)
        sh.feed(Drained(t), t)
    assert sh.link.state is State.SILENT and not sh.link.available
    assert sh.link.unavailable_since is not None and sh.link.counters.unavailable == 1
    sh.feed(HeartbeatAcked(sh.link.hb_seq, "d1", t), t)
    assert sh.links[-1].count("Attach") == 2 and sh.link.state is State.ATTACHING
    assert sh.link.counters.reattaches == 1
    sh.feed(AttachAcked("d1", "a", t), t)
    sh.feed(HeartbeatAcked(sh.link.hb_seq, "d2", t), t)  # same link, another daemon
    assert sh.links[-1].count("Attach") == 3 and sh.link.counters.restarts_seen == 1
    assert sh.link.daemon_id == "d2"


def test_down_is_known_unreachable_not_merely_unanswered_yet() -> None:
    """The one judgement of the daemon's liveness the worker half acts on (it fails loads at
    once while down): not during start-up's first dead_after_s while the Attach is in flight;
    at once when the link of an attached daemon drops; never while it is available."""
    sh = Shell()
    sh.feed(AttachRequested(), 0.0)
    sh.feed(Connected(0.0), 0.0)
    sh.feed(Drained(DEAD - 0.1), DEAD - 0.1)
    assert not sh.link.available and not sh.link.down(DEAD - 0.1)  # still starting
    assert sh.link.down(DEAD + 0.1)  # never answered
    sh.feed(AttachAcked("d1", "a", 0.5), 0.5)
    sh.feed(Drained(0.5), 0.5)
    assert sh.link.available and not sh.link.down(0.5) and sh.link.holder == "d1"
    sh.feed(Disconnected(1.0), 1.0)
    sh.feed(Drained(1.0), 1.0)
    assert sh.link.down(1.0)  # it answered once and is lost: down before DEAD
    assert not sh.link.take_replaced()


def test_a_restart_is_reported_once_by_the_attach_ack_of_the_new_daemon() -> None:
    """A HeartbeatAck naming another daemon re-attaches; only that Attach's ack says the
    daemon holding the engine's work was replaced, and it says so once."""
    sh = Shell()
    sh.feed(AttachRequested(), 0.0)
    sh.feed(Connected(0.0), 0.0)
    sh.feed(AttachAcked("d1", "a", 0.0), 0.0)
    sh.feed(AttachAcked("d1", "a", 0.1), 0.1)  # the same daemon again (a re-attach after silence)
    assert not sh.link.take_replaced()
    sh.feed(HeartbeatAcked(sh.link.hb_seq, "d2", 0.2), 0.2)
    assert sh.link.state is State.ATTACHING and not sh.link.take_replaced() and sh.link.holder == "d1"
    sh.feed(AttachAcked("d2", "a", 0.3), 0.3)
    assert sh.link.holder == "d2" and sh.link.take_replaced() and not sh.link.take_replaced()


def test_failed_attach_send_is_retried_each_poll_and_gates_messages() -> None:
    sh = Shell()
    sh.feed(AttachRequested(), 0.0)
    sh.sock_takes = False
    sh.feed(Connected(0.0), 0.0)
    assert sh.link.state is State.ATTACH_DUE and sh.links[-1] == []
    sh.send()
    assert sh.link.queue and sh.links[-1] == []
    sh.sock_takes = True
    sh.feed(Tick(0.1), 0.1)
    assert sh.links[-1] == ["Attach"] and sh.link.state is State.ATTACHING
    sh.feed(AttachAcked("d1", "a", 0.1), 0.1)
    assert sh.links[-1] == ["Attach", "Msg1"] and not sh.link.queue


def test_idle_gap_is_not_silence() -> None:
    link = DaemonLink(0.0, max_queue=1, heartbeat_s=HB, dead_after_s=DEAD)
    link.handle(Connected(0.0))
    link.handle(HeartbeatSent(0.0))
    link.handle(HeartbeatAcked(link.hb_seq, "d1", 0.0))
    assert link.handle(Drained(0.0)) == (Act.LOG_AVAILABLE,)
    # 30 s without a poll: the first poll after it sends a heartbeat and is still alive.
    assert Act.SEND_HEARTBEAT in link.handle(Tick(30.0))
    link.handle(HeartbeatSent(30.0))
    assert link.handle(Drained(30.0)) == () and link.available


def test_a_heartbeat_never_answered_does_not_make_a_later_idle_gap_silence() -> None:
    """Silence is proven only by a heartbeat sent after the daemon was last heard: one whose
    ack was lost while later ones were answered says nothing about the daemon. (Seen on TP=2
    engines: both rank daemons declared silent at the first poll after an idle spell.)"""
    link = DaemonLink(0.0, max_queue=1, heartbeat_s=HB, dead_after_s=DEAD)
    link.handle(Connected(0.0))
    link.handle(HeartbeatSent(0.0))  # its ack never comes
    assert Act.SEND_HEARTBEAT in link.handle(Tick(HB))
    link.handle(HeartbeatSent(HB))
    link.handle(HeartbeatAcked(link.hb_seq, "d1", HB))
    assert link.handle(Drained(HB)) == (Act.LOG_AVAILABLE,)
    t = HB + 30.0  # an idle spell, then the next batch's first poll
    assert Act.SEND_HEARTBEAT in link.handle(Tick(t))
    link.handle(HeartbeatSent(t))
    assert link.handle(Drained(t)) == () and link.available
    # A heartbeat sent after the last answer and left unanswered past DEAD still is silence.
    assert Act.LOG_SILENT in link.handle(Drained(t + DEAD + 0.1)) and not link.available
    assert link.silence_detail(t + DEAD + 0.1).endswith(f"heartbeat {link.hb_seq} unanswered for 3.1 s")


def test_queue_is_bounded_and_closing_drops_it() -> None:
    link = DaemonLink(0.0, max_queue=2, heartbeat_s=HB, dead_after_s=DEAD)
    routes = [link.route() for _ in range(2)]
    assert routes == [Route.QUEUE, Route.QUEUE]
    assert link.enqueue(b"a") and link.enqueue(b"b")
    assert link.route() is Route.REFUSE and not link.enqueue(b"c")
    assert link.counters.dropped == 2 and link.counters.enqueued == 2
    assert link.handle(Close()) == (Act.DROP_QUEUE,)
    assert link.route() is Route.REFUSE and link.handle(Close()) == ()


def _random_steps(rng: random.Random, n: int) -> list[object]:
    kinds = ["connected", "disconnected", "attach", "send", "heard", "close"]
    out: list[object] = []
    for _ in range(n):
        k = rng.random()
        if k < 0.3:
            out.append(rng.choice(kinds[:-1]) if rng.random() > 0.01 else "close")
        elif k < 0.45:
            out.append(("attach_ack", rng.choice(["d1", "d2"])))
        elif k < 0.65:
            out.append(("hb_ack", rng.choice(["d1", "d1", "d2"])))
        elif k < 0.9:
            out.append(("poll", rng.choice([0.0, 0.3, 1.0, 2.5, 4.0])))
        elif k < 0.95:
            out.append(("eagain", rng.random() < 0.7))
        else:
            out.append("eagain_once")
    if rng.random() < 0.5:
        out.append("close")
    return out


def test_every_row_is_taken_or_documented_unreachable_and_never_taken() -> None:
    """Row by row, as tests/unit/test_cores.py does for the daemon's cores: random shells
    (plain and attaching ones) take every reachable row, and no unreachable one."""
    taken: set[Row] = set()
    rng = random.Random(7)
    for i in range(400):
        sh = Shell()
        sh.link.on_row = taken.add
        if i % 2:
            sh.feed(AttachRequested(), 0.0)
        _play(sh, _random_steps(rng, 120))
    sh = Shell()  # closing a silent link: rare at random
    sh.link.on_row = taken.add
    _play(sh, ["attach", "connected", ("attach_ack", "d1"), ("hb_ack", "d1"), ("poll", 0.5),
               *[("poll", 1.0)] * 5, "close"])
    assert sh.link.state is State.CLOSED
    unreachable = {r for r in TABLE.rows if r.unreachable}
    assert not taken & unreachable
    missing = [str(r) for r in TABLE.rows if r not in taken and r not in unreachable]
    assert not missing, "\n".join(missing)
