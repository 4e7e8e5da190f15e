"""DaemonClient against the daemon's real engine listener, which the test binds and plays
the daemon with (kvpush_dev.engine_peer).

Time is a fake clock wherever liveness is judged, so nothing waits for heartbeat periods; the
only real waits are for the client to dial again or notice a closed peer. Those
waits poll for a condition with a generous real-time bound (the CI machine is small and
loaded): the bound only limits how long success may take, it never decides a result.
"""

from __future__ import annotations

import logging
import shutil
import signal
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import msgpack
import pytest

from kvpush.engine_plugin.link.client import DaemonClient
from kvpush.proto import (
    Abort,
    Attach,
    AttachAck,
    Error,
    HeartbeatAck,
    MemoryHandle,
    Message,
    PrefillDone,
    Received,
    ReceiveFailed,
    Register,
    Released,
    SendFailed,
    Sent,
    encode,
)
from kvpush.proto.layout import flash_layout
from kvpush_dev.engine_peer import FakeDaemon

LOGGER = "kvpush.engine_plugin.link.client"


class FakeClock:
    """Manually advanced monotonic clock."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


@pytest.fixture
def endpoint() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="kvc-", dir="/tmp")  # ipc paths must stay < 107 chars
    yield f"ipc://{d}/engine.sock"
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Turn a call that blocks (a send waiting for a peer) into a failure, not a hang."""

    def expired(*_: object) -> None:
        raise TimeoutError(f"blocked for more than {seconds} s")

    old = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def pump(
    client: DaemonClient,
    daemons: list[FakeDaemon],
    until: Callable[[], bool],
    timeout: float = 15.0,
) -> list[Message]:
    """Poll client and daemons (real time) until ``until()``; returns what poll() returned."""
    out: list[Message] = []
    end = time.monotonic() + timeout
    while True:
        out += client.poll()
        for d in daemons:
            d.serve()
        if until():
            return out
        if time.monotonic() > end:
            raise AssertionError("condition not reached in time")
        time.sleep(0.002)


def make_client(endpoint: str, clock: FakeClock, **kw: object) -> DaemonClient:
    return DaemonClient(endpoint, clock=clock, **kw)  # type: ignore[arg-type]


def make_attach() -> Attach:
    layout = flash_layout(
        num_layers=2, num_blocks=8, block_size=16, num_heads=2, head_size=64, dtype="float16"
    )
    mem = MemoryHandle("cpu_shm", b"/kvpush-test", layout.region_size)
    return Attach("engine-0", 0, 1, "decode", (mem,), layout)


def register(i: int, nblocks: int = 4) -> Register:
    return Register(f"t{i}", 0, tuple(range(i, i + nblocks)), 16 * nblocks, ("tcp://p:1",), 1, 5000)


# ---- tests --------------------------------------------------------------------------------


def test_messages_arrive_decoded_and_in_order(endpoint, clock) -> None:
    d = FakeDaemon(endpoint, "d1")
    c = make_client(endpoint, clock)
    assert not c.available
    pump(c, [d], lambda: c.available)
    assert c.daemon_id == "d1" and c.unavailable_since is None and c.rtt_s is not None

    sent: list[Message] = []
    for i in range(300):
        m = (register(i), PrefillDone(f"t{i}", (1, 2, 3), 40, 1000), Abort(f"t{i}", 1, "x"))[i % 3]
        assert c.send(m)
        sent.append(m)
    assert c.send(Register("r", 2, (7, 8), 20, ("tcp://a:1",), 2, 100))
    assert c.publish_prefill_done("p", [9], 5, 50)
    assert c.publish_abort("a", 3, "why")
    sent += [
        Register("r", 2, (7, 8), 20, ("tcp://a:1",), 2, 100),
        PrefillDone("p", (9,), 5, 50),
        Abort("a", 3, "why"),
    ]
    pump(c, [d], lambda: len(d.got) >= len(sent))
    assert d.got == sent
    assert c.sent == len(sent) and c.dropped == 0

    replies: list[Message] = [
        Sent("t0", 0),
        Received("t1", 0),
        SendFailed("t2", 0, "nixl"),
        ReceiveFailed("t3", 1, "timeout"),
        Released("t3", 1),
        Error("bad_register", "no such block", "t4"),
        AttachAck("agent", "d1"),
    ]
    base = c.received
    for i, m in enumerate(replies):
        d.send(m)
        if i == 2:
            d.send(HeartbeatAck(99, "d1"))  # consumed by the client, not returned
    got = pump(c, [d], lambda: c.received >= base + len(replies) + 1)
    assert got == replies
    c.close()
    d.close()


def test_send_without_daemon_never_blocks_and_is_bounded(endpoint, clock) -> None:
    c = make_client(endpoint, clock)  # nothing bound at endpoint
    msg = Abort("t" * 32, 0, "r")
    results: list[bool] = []
    with deadline(5.0):  # a blocking send never returns: the alarm fails the test
        t0 = time.thread_time()  # CPU time: what the sends cost, whatever else runs
        for _ in range(10_000):
            results.append(c.send(msg))
        elapsed = time.thread_time() - t0
        for _ in range(100):
            assert c.poll() == []
    # 4096 encodes (~2-4 us each, the codec's cost) dominate.
    assert elapsed < 0.5, f"10k sends took {elapsed * 1e3:.1f} ms of CPU"
    assert results == [True] * 4096 + [False] * (10_000 - 4096)
    assert c.queued == 4096 and c.dropped == 10_000 - 4096 and c.sent == 0
    assert not c.available and c.unavailable_since == clock.t
    c.close()
    assert not c.send(msg) and c.poll() == []
    c.close()  # idempotent


def test_queued_messages_flush_when_daemon_comes_up(endpoint, clock) -> None:
    c = make_client(endpoint, clock, max_queue=50)
    msgs = [register(i) for i in range(60)]
    accepted = [c.send(m) for m in msgs]
    assert accepted == [True] * 50 + [False] * 10 and c.queued == 50
    c.poll()
    d = FakeDaemon(endpoint, "d1")
    pump(c, [d], lambda: len(d.got) >= 50 and c.available)
    assert d.got == msgs[:50]
    assert c.queued == 0 and c.sent == 50
    c.close()
    d.close()


def test_attach_gates_queued_messages_until_ack(endpoint, clock) -> None:
    c = make_client(endpoint, clock)
    att = make_attach()
    c.attach(att)  # no daemon yet: remembered, sent when it appears
    regs = [register(i) for i in range(20)]
    assert all(c.send(m) for m in regs)
    d = FakeDaemon(endpoint, "d1")
    d.answer_attach = False
    pump(c, [d], lambda: len(d.got) >= 1 and c.available)
    time.sleep(0.05)
    pump(c, [d], lambda: True)
    assert d.got == [att], "nothing may overtake Attach or go before AttachAck"
    assert not c.attached and c.queued == 20
    d.send(AttachAck("agent-d1", "d1"))
    got = pump(c, [d], lambda: len(d.got) >= 21)
    assert got == [AttachAck("agent-d1", "d1")]
    assert c.attached and c.agent_name == "agent-d1"
    assert d.got == [att, *regs]
    c.close()
    d.close()


def test_silent_daemon_goes_unavailable_after_dead_after_s(endpoint, clock, caplog) -> None:
    d = FakeDaemon(endpoint, "d1")
    c = make_client(endpoint, clock, heartbeat_s=1.0, dead_after_s=3.0)
    att = make_attach()
    c.attach(att)
    # Wait for the link's heartbeat ack as well: arriving late, it would move "last heard".
    pump(c, [d], lambda: c.available and c.attached and c.rtt_s is not None)
    d.answer_heartbeats = False  # hung daemon: connection stays up, nothing answers
    caplog.set_level(logging.INFO, logger=LOGGER)
    caplog.clear()
    for _ in range(3):
        clock.advance(1.0)
        pump(c, [d], lambda: True)
        assert c.available  # the oldest unanswered heartbeat (t=1) is not yet 3 s old
    clock.advance(1.0)
    pump(c, [d], lambda: True)
    assert c.available  # t=4.0: exactly dead_after_s after that heartbeat
    clock.advance(0.5)
    t_dead = clock.t
    for _ in range(5):
        pump(c, [d], lambda: True)
        clock.advance(0.1)
    assert not c.available and not c.attached and c.unavailable_since == t_dead
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "unavailable" in warnings[0].getMessage()

    # It answers again: the first ack after unavailability re-sends Attach (the daemon may
    # have lost state), attached stays False until AttachAck.
    d.answer_heartbeats = True
    d.answer_attach = False
    clock.advance(1.0)
    pump(c, [d], lambda: c.available and len(d.got) >= 2)
    assert d.got == [att, att] and not c.attached and c.unavailable_since is None
    d.send(AttachAck("agent-d1", "d1"))
    pump(c, [d], lambda: c.attached)
    c.close()
    d.close()


def _fresh_client_round(ep: str, order: str, label: str) -> None:
    clock = FakeClock()
    att = make_attach()
    d = FakeDaemon(ep, "d1") if order != "client_first" else None
    c = make_client(ep, clock, heartbeat_s=0.01, dead_after_s=60.0)

    def step() -> None:
        clock.advance(0.01)
        c.poll()
        if d is not None:
            d.serve()

    if d is not None and order == "link_up_then_attach":
        pump(c, [d], lambda: c.available)  # link up, heartbeats answered, no Attach yet
    c.attach(att)
    if d is None:
        for _ in range(5):
            step()  # heartbeats fall due while no daemon is there
        d = FakeDaemon(ep, "d1")
    end = time.monotonic() + 15.0
    while not (c.attached and c.available and d.heartbeats >= 5):
        assert time.monotonic() < end, f"{label}: not attached ({d.kinds[:5]})"
        step()
        time.sleep(0.001)
    for _ in range(20):  # later heartbeats and their acks must not re-attach
        step()
    assert d.kinds.count("Attach") == 1, f"{label}: {d.kinds[:8]}"
    if order != "link_up_then_attach":
        assert d.kinds[0] == "Attach", f"{label}: {d.kinds[:8]}"
    assert c.reattaches == 0 and c.attached and c.available
    c.close()
    d.close()


@pytest.mark.parametrize("order", ["daemon_first", "client_first", "link_up_then_attach"])
def test_fresh_client_sends_exactly_one_attach_and_it_goes_first(endpoint, order) -> None:
    """One Attach per link, before any other frame, with heartbeats flowing all along.

    The fake clock moves one heartbeat period per step, so a heartbeat is due on every poll:
    a link that came up before the Attach was known, or an Attach lost to a failed send, would
    let a Heartbeat go out first or no Attach at all. Many fresh clients per order, as the
    races live in a link's first milliseconds.
    """
    for i in range(15):
        _fresh_client_round(f"{endpoint}.{i}", order, f"round {i}")


def test_closed_router_makes_daemon_unavailable(endpoint, clock, caplog) -> None:
    d = FakeDaemon(endpoint, "d1")
    c = make_client(endpoint, clock, dead_after_s=3.0)
    c.attach(make_attach())
    pump(c, [d], lambda: c.available and c.attached)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    caplog.clear()
    d.close()
    # The disconnect is seen without waiting dead_after_s (fake time stands still) ...
    pump(c, [], lambda: not c.available)
    assert not c.attached and c.unavailable_since == clock.t
    # ... and even without it, the clock alone would end availability after dead_after_s.
    clock.advance(3.5)
    for _ in range(5):
        assert c.poll() == []
    assert not c.available
    assert len([r for r in caplog.records if "unavailable" in r.getMessage()]) == 1
    assert c.send(register(1)) and c.queued == 1  # kept for the next daemon, not raised
    c.close()


def test_restarted_daemon_gets_attach_first(endpoint, clock) -> None:
    att = make_attach()
    d1 = FakeDaemon(endpoint, "d1")
    c = make_client(endpoint, clock)
    c.attach(att)
    pump(c, [d1], lambda: c.attached)
    assert c.daemon_id == "d1" and d1.got == [att]
    d1.close()
    pump(c, [], lambda: not c.available)
    r = register(5)
    assert c.send(r) and c.queued == 1
    d2 = FakeDaemon(endpoint, "d2")  # same path: a supervisor respawn
    got = pump(c, [d2], lambda: c.attached and c.available and len(d2.got) >= 2)
    assert d2.got == [att, r]
    assert d2.kinds[:2] == ["Attach", "Heartbeat"]  # the new link starts with Attach
    assert c.daemon_id == "d2" and AttachAck("agent-d2", "d2") in got
    c.close()
    d2.close()


def test_new_daemon_id_in_heartbeat_ack_resends_attach(endpoint, clock) -> None:
    """A restart the socket monitor cannot see (same connection): only daemon_id tells."""
    att = make_attach()
    d = FakeDaemon(endpoint, "d1")
    c = make_client(endpoint, clock, heartbeat_s=1.0)
    c.attach(att)
    pump(c, [d], lambda: c.attached and c.rtt_s is not None)  # the link's ack came from d1
    d.daemon_id = "d9"
    d.answer_attach = False
    clock.advance(1.0)
    pump(c, [d], lambda: len(d.got) >= 2)
    assert d.got == [att, att] and not c.attached and c.daemon_id == "d9"
    r = register(3)
    assert c.send(r)
    pump(c, [d], lambda: True)
    assert c.queued == 1 and d.got == [att, att]  # gated until the new daemon acks
    d.send(AttachAck("agent-d9", "d9"))
    pump(c, [d], lambda: len(d.got) >= 3)
    assert c.attached and d.got[-1] == r and c.reattaches >= 1
    c.close()
    d.close()


def test_garbage_frames_are_skipped_and_counted(endpoint, clock) -> None:
    d = FakeDaemon(endpoint, "d1")
    c = make_client(endpoint, clock)
    pump(c, [d], lambda: c.available)
    d.send_raw(b"\xc1")  # never-used msgpack byte
    d.send(Sent("a", 0))
    d.send_raw(b"")
    d.send_raw(msgpack.packb({"v": 1, "t": "NoSuchMessage"}))
    d.send_raw(msgpack.packb({"v": 1, "t": "Sent", "transfer_id": "x", "attempt": 0}))
    d.send_raw(encode(Received("b", 1))[:-1])  # truncated
    d.send(Received("b", 1))
    got = pump(c, [d], lambda: c.decode_errors >= 5 and c.received >= 3)
    assert got == [Sent("a", 0), Received("b", 1)]
    assert c.decode_errors == 5 and c.available
    c.close()
    d.close()


def test_poll_and_send_cost(endpoint, clock) -> None:
    """The engine-loop budget: poll() with nothing pending stays in single-digit µs."""
    d = FakeDaemon(endpoint, "d1")
    c = make_client(endpoint, clock)
    pump(c, [d], lambda: c.available)
    polls = []
    for _ in range(3000):
        t0 = time.perf_counter_ns()
        c.poll()
        polls.append(time.perf_counter_ns() - t0)
    reg = Register("x" * 36, 0, tuple(range(1000, 1064)), 1024, ("tcp://10.0.0.1:5555",), 2, 30000)
    sends = []
    for _ in range(5):
        for _ in range(500):
            t0 = time.perf_counter_ns()
            c.send(reg)
            sends.append(time.perf_counter_ns() - t0)
        pump(c, [d], lambda: c.queued == 0)
    pump(c, [d], lambda: len(d.got) == 2500)
    assert c.dropped == 0
    poll_med = statistics.median(polls) / 1e3
    send_med = statistics.median(sends) / 1e3
    print(f"poll idle median {poll_med:.2f} us p99 {sorted(polls)[int(0.99 * len(polls))] / 1e3:.2f} us;"
          f" send Register(64) median {send_med:.2f} us p99 {sorted(sends)[int(0.99 * len(sends))] / 1e3:.2f} us")
    assert poll_med < 10.0
    assert send_med < 100.0
    c.close()
    d.close()


def test_idle_engine_gap_is_not_silence(endpoint, clock) -> None:
    """An idle engine does not step, so it does not poll: a long gap without polls must not
    make the daemon unavailable (that would fail the next request's load for nothing)."""
    d = FakeDaemon(endpoint, "d1")
    c = make_client(endpoint, clock, heartbeat_s=1.0, dead_after_s=3.0)
    c.attach(make_attach())
    pump(c, [d], lambda: c.available and c.attached and c.rtt_s is not None)
    d.send(AttachAck("agent-d1", "d1"))
    pump(c, [d], lambda: c.attached)
    clock.advance(30.0)  # no poll at all for 30 s
    c.poll()
    assert c.available and c.attached
    assert c.reattaches == 0
    c.close()
    d.close()


def test_wait_then_poll_returns_the_frame_that_ended_the_wait(endpoint, clock) -> None:
    """The frame that ended a wait() comes out of the very next poll(), not one heartbeat
    later (over ZeroMQ's edge-triggered FD it once did: D's first token waited up to
    heartbeat_s), and a wait() with nothing pending does not return at once."""
    d = FakeDaemon(endpoint, "d1")
    c = make_client(endpoint, clock, heartbeat_s=3600.0)  # no heartbeat can rescue it
    c.attach(make_attach())
    pump(c, [d], lambda: c.available and c.attached)
    for i in range(20):
        assert c.poll() == []  # quiet: the socket is read and its edge consumed
        d.send(Received(f"t{i}", 0))
        assert c.wait(5.0)
        assert c.poll() == [Received(f"t{i}", 0)]
        assert not c.wait(0.0)  # nothing else pending: wait() must not return at once again
    c.close()
    d.close()


def test_the_attach_goes_out_at_attach_without_waiting_for_a_poll(endpoint, clock) -> None:
    """An engine attaches at start-up and may not poll again until its first request, many
    seconds later; by then its daemon must know it (else the plugin counts the daemon as
    never answered and fails that request's transfer): the link is dialled in attach() and
    the Attach leaves there, as the link's first frame. Before that the client holds no
    connection (vLLM builds the worker long before its KV cache exists, and the daemon
    closes a connection that stays silent past its handshake bound)."""
    d = FakeDaemon(endpoint, "d1")
    c = make_client(endpoint, clock)
    time.sleep(0.05)
    d.serve()
    assert d.listener.connections == 0, "the client dialled before it had anything to say"
    c.attach(make_attach())
    end = time.monotonic() + 15
    while not d.kinds:
        assert time.monotonic() < end, "the Attach waited for a poll()"
        d.serve()
        time.sleep(0.002)
    assert d.kinds[0] == "Attach"
    pump(c, [d], lambda: c.attached and c.available)  # the first poll finds it all answered
    c.close()
    d.close()
