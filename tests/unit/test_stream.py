"""The engine link's framing (proto.stream) and the daemon's listener (daemon.enginelink)
over real unix sockets: frames survive any chunking, bounds hold, and every bound ends in a
closed connection the engine recovers from, never in a stuck or unbounded daemon."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpush.daemon.io.endpoints import bind_private_unix
from kvpush.daemon.io.enginelink import EngineListener, Incoming
from kvpush.proto.stream import HEADER, Deframer, FrameTooLarge, Outbox, Put, frame

payloads = st.lists(st.binary(max_size=300), max_size=20)


@given(payloads, st.lists(st.integers(1, 64), min_size=1, max_size=50))
def test_frames_survive_any_chunking(msgs: list[bytes], cuts: list[int]) -> None:
    stream = b"".join(frame(m) for m in msgs)
    d = Deframer(300)
    got: list[bytes] = []
    pos, i = 0, 0
    while pos < len(stream):
        n = cuts[i % len(cuts)]
        got += d.feed(stream[pos:pos + n])
        pos, i = pos + n, i + 1
    assert got == msgs
    assert d.buffered == 0


@given(st.integers(301, 2**32 - 1), st.binary(max_size=10))
def test_a_length_over_the_bound_raises_before_buffering(n: int, tail: bytes) -> None:
    d = Deframer(300)
    assert d.feed(frame(b"ok")) == [b"ok"]
    with pytest.raises(FrameTooLarge, match="exceeds the bound of 300"):
        d.feed(HEADER.pack(n) + tail)
    assert d.buffered == 0


@pytest.fixture
def path() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="kvs-", dir="/tmp")
    os.chmod(d, 0o700)
    yield f"{d}/engine.sock"
    shutil.rmtree(d, ignore_errors=True)


def listener(path: str, **kw: object) -> tuple[EngineListener, list[tuple[str, str]]]:
    bad: list[tuple[str, str]] = []
    lst = EngineListener(f"ipc://{path}", bind=bind_private_unix(0o600), max_message=1 << 16,
                         bad=lambda c, d: bad.append((c, d)), **kw)  # type: ignore[arg-type]
    return lst, bad


def connect(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    s.settimeout(5)
    return s


def receive_until(lst: EngineListener, n: int, timeout: float = 5.0) -> list[Incoming]:
    out: list[Incoming] = []
    end = time.monotonic() + timeout
    while len(out) < n:
        assert time.monotonic() < end, f"got {len(out)} of {n} frames"
        lst.wait(0.05)
        out += lst.receive()
    return out


def serve_until(lst: EngineListener, done: Callable[[], object], timeout: float = 5.0) -> None:
    """Let the listener accept and read until ``done()`` holds."""
    end = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < end, "the listener never got there"
        lst.wait(0.05)
        lst.receive()


def closed(s: socket.socket, timeout: float = 5.0) -> bool:
    s.settimeout(timeout)
    try:
        while s.recv(1 << 16):
            pass
    except ConnectionResetError:
        pass
    return True


def test_credentials_identity_and_order_per_connection(path: str) -> None:
    lst, bad = listener(path)
    try:
        assert os.stat(path).st_mode & 0o777 == 0o600
        a, b = connect(path), connect(path)
        a.sendall(frame(b"a1") + frame(b"a2"))
        b.sendall(frame(b"b1"))
        got = receive_until(lst, 3)
        by = {}
        for inc in got:
            by.setdefault(inc.ident, []).append(inc.payload)
            assert inc.cred is not None and inc.cred.pid == os.getpid() and inc.cred.uid == os.geteuid()
        assert sorted(by.values()) == [[b"a1", b"a2"], [b"b1"]]
        assert lst.peers.connected(os.getpid()) and lst.connections == 2
        ident_a = next(i for i, v in by.items() if v[0] == b"a1")
        assert lst.send(ident_a, b"reply")
        assert a.recv(64) == frame(b"reply")
        a.close()
        end = time.monotonic() + 5
        while lst.connections != 1:  # the end of a's stream drops it
            assert time.monotonic() < end
            lst.wait(0.05)
            lst.receive()
        assert not lst.send(ident_a, b"late")  # a gone connection's identity is never reused
        assert bad == []
        b.close()
    finally:
        lst.close()
    assert not os.path.exists(path)


def test_an_oversized_frame_closes_only_its_connection(path: str) -> None:
    lst, bad = listener(path)
    try:
        good, evil = connect(path), connect(path)
        evil.sendall(HEADER.pack((1 << 16) + 1) + b"x" * 100)
        good.sendall(frame(b"fine"))
        got = receive_until(lst, 1)
        assert [g.payload for g in got] == [b"fine"]
        assert closed(evil)
        assert bad and bad[0][0] == "frames" and "exceeds the bound" in bad[0][1]
        assert lst.connections == 1
    finally:
        lst.close()


def test_an_engine_that_does_not_read_is_dropped_at_the_backlog_bound(path: str) -> None:
    lst, bad = listener(path, backlog_bytes=1 << 20)
    try:
        s = connect(path)
        s.sendall(frame(b"hi"))
        (inc,) = receive_until(lst, 1)
        sent = 0
        while lst.send(inc.ident, b"r" * 4096):  # never read by s: kernel buffer, then backlog
            sent += 1
            assert sent < 10_000, "the backlog bound never hit"
        assert bad and bad[-1][0] == "backlog"
        assert lst.connections == 0 and not lst.peers.connected(os.getpid())
        assert closed(s)
    finally:
        lst.close()


def test_a_reply_larger_than_the_socket_buffer_arrives_whole(path: str) -> None:
    lst, _ = listener(path)
    try:
        s = connect(path)
        s.sendall(frame(b"hi"))
        (inc,) = receive_until(lst, 1)
        big = os.urandom(8 << 20)
        assert lst.send(inc.ident, big)
        d = Deframer(16 << 20)
        got: list[bytes] = []
        s.setblocking(False)
        end = time.monotonic() + 10
        while not got:
            assert time.monotonic() < end
            lst.wait(0.01)
            lst.receive()  # flushes the rest as the socket drains
            try:
                got += d.feed(s.recv(1 << 20))
            except BlockingIOError:
                pass
        assert got == [big]
    finally:
        lst.close()


def test_connections_over_the_bound_are_closed_at_accept(path: str) -> None:
    lst, bad = listener(path, max_conns=2)
    try:
        socks = [connect(path) for _ in range(3)]
        serve_until(lst, lambda: bad)
        assert lst.connections == 2 and bad[0][0] == "connections"
        assert closed(socks[2])
    finally:
        lst.close()


# ---- Outbox: what a non-blocking socket did not take, never half a frame ------------------

def small_pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    a.setblocking(False)
    b.settimeout(5)
    return a, b


def read_frames(b: socket.socket, d: Deframer) -> list[bytes]:
    b.setblocking(False)
    got: list[bytes] = []
    try:
        while True:
            data = b.recv(1 << 16)
            if not data:
                break
            got += d.feed(data)
    except BlockingIOError:
        pass
    return got


@given(st.lists(st.binary(min_size=1, max_size=20_000), min_size=1, max_size=12))
def test_outbox_frames_arrive_whole_and_in_order_through_a_small_socket_buffer(msgs: list[bytes]) -> None:
    a, b = small_pair()
    out, d = Outbox(1 << 20), Deframer(1 << 20)
    got: list[bytes] = []
    try:
        for m in msgs:
            assert out.put(a, frame(m)) is Put.TAKEN
            got += read_frames(b, d)  # the reader drains now and then, as an engine does
            assert out.flush(a)
        end = time.monotonic() + 5
        while len(got) < len(msgs):
            assert time.monotonic() < end
            assert out.flush(a)
            got += read_frames(b, d)
        assert got == msgs and len(out) == 0
    finally:
        a.close()
        b.close()


def test_outbox_full_refuses_a_frame_whole_and_a_dead_socket_says_so() -> None:
    a, b = small_pair()
    try:
        out = Outbox(64 << 10)
        big = frame(b"x" * (1 << 20))
        assert out.put(a, big) is Put.TAKEN  # the first tail is always kept whole
        assert len(out) > 64 << 10
        assert out.put(a, frame(b"late")) is Put.FULL  # refused: not a byte of it queued
        waiting = len(out)
        d, got = Deframer(2 << 20), []
        end = time.monotonic() + 5
        while not got:
            assert time.monotonic() < end
            assert out.flush(a)
            got += read_frames(b, d)
        assert got == [b"x" * (1 << 20)] and len(out) == 0 and waiting > 0
        assert out.put(a, frame(b"next")) is Put.TAKEN
        assert read_frames(b, d) == [b"next"]
        b.close()
        put = out.put(a, frame(b"to nobody"))
        if put is Put.TAKEN:  # a closed peer may take one send before the error shows
            put = out.put(a, frame(b"again"))
        assert put is Put.DEAD
    finally:
        a.close()


# ---- the listener's per-connection bounds over time and per user --------------------------

def test_a_connection_without_a_whole_first_frame_is_closed_after_the_handshake_bound(path: str) -> None:
    now = [100.0]
    lst, bad = listener(path, first_frame_s=5.0, clock=lambda: now[0])
    try:
        silent, half, good = connect(path), connect(path), connect(path)
        half.sendall(frame(b"hello")[:3])  # a header begun, never finished
        good.sendall(frame(b"hello"))
        (inc,) = receive_until(lst, 1)
        assert inc.payload == b"hello" and lst.connections == 3
        now[0] += 4.9
        assert lst.expire(now[0]) == 0 and lst.connections == 3
        now[0] += 0.2
        assert lst.expire(now[0]) == 2
        assert [c for c, _ in bad] == ["handshake", "handshake"] and "within 5 s" in bad[0][1]
        assert closed(silent) and closed(half)
        assert lst.connections == 1 and lst.peers.connected(os.getpid())
        assert lst.send(inc.ident, b"still here")  # the one that spoke keeps its link
        good.settimeout(5)
        assert Deframer(1 << 16).feed(good.recv(1 << 16)) == [b"still here"]
        now[0] += 1000
        assert lst.expire(now[0]) == 0
    finally:
        lst.close()


def test_one_user_cannot_hold_more_than_its_share_of_connections(path: str) -> None:
    lst, bad = listener(path, max_conns=8, max_conns_per_uid=2)
    try:
        socks = [connect(path) for _ in range(3)]
        serve_until(lst, lambda: bad)
        assert lst.connections == 2 and bad[0][0] == "connections" and f"uid {os.getuid()}" in bad[0][1]
        assert closed(socks[2])
        socks[0].close()  # a slot of that user frees when one of its connections ends
        serve_until(lst, lambda: lst.connections == 1)
        again = connect(path)
        again.sendall(frame(b"back"))
        assert [i.payload for i in receive_until(lst, 1)] == [b"back"] and lst.connections == 2
    finally:
        lst.close()
