"""The socket shell of one daemon: frames in, decoded messages to handlers, messages out.

Implements the :class:`kvpush.daemon.context.Wire` port over :class:`Endpoints` (the engine
listener, a unix stream socket; the bound ZeroMQ peer and ops sockets) plus one ZeroMQ DEALER
per prefill daemon we dial. Every frame is
decoded and validated by :mod:`kvpush.proto` here, before any part of the daemon sees it;
a malformed one is answered with a clear Error and counted, and one message's handler
failing never takes the loop down.
"""

from __future__ import annotations

import logging
import os
import resource
import socket
import time
from collections.abc import Callable
from typing import Any

import zmq

from kvpush import proto
from kvpush.daemon.core.session_gate import SessionTable
from kvpush.daemon.io.endpoints import Endpoints
from kvpush.daemon.io.enginelink import EngineListener

log = logging.getLogger(__name__)

DRAIN_MAX = 1000  # frames per socket per loop turn: one busy socket cannot starve the others

Bad = Callable[[str, str], None]


def frame_node(frame: zmq.Frame) -> str:
    try:
        return str(frame.get("User-Id") or "")
    except zmq.ZMQError:  # no ZAP on this socket (insecure mode)
        return ""


def shut(fd: int) -> None:
    """End the TCP connection on ZeroMQ's descriptor ``fd`` without closing the descriptor
    (ZeroMQ owns it; and no dup: at the descriptor limit there is none to spare): ZeroMQ
    sees the end, closes it and reports it disconnected."""
    try:
        s = socket.socket(fileno=fd)
    except OSError:
        return  # gone meanwhile
    try:
        if s.type == socket.SOCK_STREAM and s.family in (socket.AF_INET, socket.AF_INET6):
            s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        s.detach()


def fds_short(reserved: int) -> int:
    """How many descriptors short of ``reserved`` free ones this process is (0: none short):
    the peer port leaves them to the daemon's own files (allowlist, shm, engine and producer
    sockets)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return 0
    try:
        used = len(os.listdir("/proc/self/fd")) - 1  # less the listing's own
    except OSError:
        return reserved  # none left even to look
    return max(0, reserved - (soft - used))


class DaemonWire:
    def __init__(self, ep: Endpoints, bad: Bad, *, hello_deadline_s: float = 10.0,
                 reserved_fds: int = 256) -> None:
        self.ep = ep
        self.bad = bad
        ep.engine.bad = bad
        self.engine_peers = ep.engine.peers  # live connections of the engine socket
        self._engine_fd = ep.engine.fileno()
        self.dealers: dict[str, zmq.Socket] = {}  # prefill daemon endpoint -> our DEALER
        self._by_sock: dict[zmq.Socket, str] = {}
        self._monitors: dict[str, zmq.Socket] = {}  # endpoint -> its DEALER's disconnect monitor
        self._closed_at: dict[str, float] = {}  # endpoint -> when the producer's end closed
        self.poller = zmq.Poller()
        for s in (ep.peer, ep.ops):
            self.poller.register(s, zmq.POLLIN)
        self.poller.register(self._engine_fd, zmq.POLLIN)
        # Peer connections by descriptor: each must carry a live session (Hello said) within
        # hello_deadline_s, and at most session_limit(reserved_fds) exist (session_gate).
        self.sessions = SessionTable(hello_deadline_s)
        self.reserved_fds = reserved_fds
        self.session_live: Callable[[bytes], bool] = lambda ident: False
        self._peer_mon = ep.peer.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self.poller.register(self._peer_mon, zmq.POLLIN)

    # ------------------------------------------------------------------ the Wire port

    def to_engine(self, identity: bytes, msg: Any) -> None:
        self.ep.engine.send(identity, proto.encode(msg))  # False: that engine is gone

    def to_consumer(self, routing_id: bytes, msg: Any) -> None:
        self._reply(self.ep.peer, routing_id, msg)

    def to_ops(self, identity: bytes, msg: Any) -> None:
        self._reply(self.ep.ops, identity, msg)

    def open_producer(self, endpoint: str) -> str:
        try:
            sock, node = self.ep.dealer(endpoint)
        except (zmq.ZMQError, ValueError) as exc:  # PeerAuthError is a ValueError
            raise ValueError(str(exc)) from exc
        self.poller.register(sock, zmq.POLLIN)
        self.dealers[endpoint] = sock
        self._by_sock[sock] = endpoint
        # Disconnect events tell a dead producer (its kernel closed the TCP connection) from a
        # partition (nothing closes): only the latter can deliver a WRITE late.
        self._monitors[endpoint] = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        return node

    def connection_closed(self, endpoint: str, since: float) -> bool:
        mon = self._monitors.get(endpoint)
        if mon is not None:
            while mon.poll(0):
                mon.recv_multipart()  # one event: (event id + value, address)
                self._closed_at[endpoint] = time.monotonic()
        return self._closed_at.get(endpoint, -1.0) >= since

    def to_producer(self, endpoint: str, msg: Any) -> None:
        sock = self.dealers.get(endpoint)
        if sock is None:
            return
        try:
            sock.send(proto.encode(msg), zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("send to %s dropped: %s", endpoint, exc)

    def close_producer(self, endpoint: str) -> None:
        sock = self.dealers.pop(endpoint, None)
        mon = self._monitors.pop(endpoint, None)
        self._closed_at.pop(endpoint, None)
        if mon is not None:
            if sock is not None:
                sock.disable_monitor()
            mon.close(0)
        if sock is None:
            return
        self._by_sock.pop(sock, None)
        try:
            self.poller.unregister(sock)
        except KeyError:
            pass
        sock.close(0)

    # ------------------------------------------------------------------ receiving

    def poll(self, timeout_s: float) -> set[Any]:
        """The sockets with input, waiting up to ``timeout_s``. ZeroMQ waits in whole
        milliseconds; a shorter wait (a WRITE in flight, whose bytes move only while NIXL is
        polled) checks, sleeps, and checks again, so that the loop neither spins (on a small
        host a spinning daemon starves the kernel's network work and the other daemon) nor
        sleeps a whole millisecond."""
        if timeout_s >= 0.001:
            events = self.poller.poll(int(timeout_s * 1000))
        else:
            events = self.poller.poll(0)
            if not events and timeout_s > 0:
                time.sleep(timeout_s)
                events = self.poller.poll(0)
        ready: set[Any] = {s for s, _ in events}
        if self._engine_fd in ready:
            ready.discard(self._engine_fd)
            ready.add(self.ep.engine)
        return ready

    def expire(self, now: float) -> None:
        """Timers of the wire itself: engine connections that never sent a whole frame, peer
        connections without a live session for hello_deadline_s."""
        self.ep.engine.expire(now)
        self._peer_events(now)
        overdue = self.sessions.overdue(now, self.session_live)
        if overdue:
            self.bad("handshake", f"{len(overdue)} peer connection(s) said no Hello within "
                     f"{self.sessions.hello_deadline_s:g} s: closed")
        for fd in overdue:
            shut(fd)

    def _peer_events(self, now: float) -> None:
        """Connections accepted and closed on the peer port; when fewer than reserved_fds
        descriptors are free, the newest connections close."""
        accepted = False
        while self._peer_mon.poll(0):
            ev = self._peer_mon.recv_multipart()
            kind, fd = int.from_bytes(ev[0][:2], "little"), int.from_bytes(ev[0][2:6], "little")
            if kind == zmq.EVENT_ACCEPTED:
                self.sessions.accepted(fd, now)
                accepted = True
            else:
                self.sessions.closed(fd)
        short = fds_short(self.reserved_fds) if accepted else 0
        over = self.sessions.over(len(self.sessions.conns) - short, self.session_live) if short else []
        if over:
            self.bad("overloaded", f"{len(over)} peer connection(s) over the descriptor limit "
                     f"(soft RLIMIT_NOFILE less reserved_fds {self.reserved_fds}): closed")
        for fd in over:
            shut(fd)

    def drain_engine(self, handler: Callable[[bytes, Any, Any], None]) -> bool:
        """Hand every decoded frame from the local engines to ``handler(identity, msg, cred)``:
        ``cred`` is the kernel's credentials of the connection that carried it."""
        engine: EngineListener = self.ep.engine
        got = False
        for inc in engine.receive():
            got = True
            self._dispatch(lambda m, v=proto.PROTOCOL_VERSION, ident=inc.ident:
                           self.ep.engine.send(ident, proto.encode(m, v)),
                           inc.ident, inc.payload, handler, (inc.cred,))
        return got

    def drain_router(self, sock: zmq.Socket, handler: Callable[..., None], *,
                     meta: Callable[[zmq.Frame], Any] | None = None) -> bool:
        """Hand every decoded frame waiting on a bound socket to ``handler(identity, msg)``, or
        with ``meta`` to ``handler(identity, msg, meta(frame))``: what ZeroMQ knows of the
        connection that carried it: :func:`frame_node`, the ZAP identity of an authenticated
        peer session."""
        got = False
        for _ in range(DRAIN_MAX):
            try:
                raw = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            got = True
            if len(raw) != 2:
                self.bad("frames", f"{len(raw)} frames")
                continue
            ident, payload = raw[0].bytes, raw[1].bytes
            if sock is self.ep.peer:
                self.sessions.carried(raw[1].get(zmq.SRCFD), ident)
            extra = () if meta is None else (meta(raw[1]),)
            self._dispatch(lambda m, v=proto.PROTOCOL_VERSION, ident=ident: self._reply(sock, ident, m, v),
                           ident, payload, handler, extra)
        return got

    def _dispatch(self, reply: Callable[..., None], ident: bytes, payload: bytes,
                  handler: Callable[..., None], extra: tuple[Any, ...]) -> None:
        """Decode one frame and hand it to ``handler(ident, msg, *extra)``; a bad frame or a
        failing handler is answered with an Error (``reply(msg[, version])``) and counted,
        never raised. A sender on another protocol version is answered in its own envelope
        where that version reads our Error (proto.ERROR_COMPATIBLE_VERSIONS): it learns why."""
        try:
            msg = proto.decode(payload)
        except proto.ProtocolError as exc:
            self.bad("protocol", str(exc))
            v = getattr(exc, "version", proto.PROTOCOL_VERSION)
            reply(proto.Error("protocol", str(exc)),
                  v if v in proto.ERROR_COMPATIBLE_VERSIONS else proto.PROTOCOL_VERSION)
            return
        try:
            handler(ident, msg, *extra)
        except Exception as exc:  # never let one message kill the daemon
            log.exception("handling %s failed", type(msg).__name__)
            self.bad("internal", f"{type(exc).__name__}: {exc}")
            why = proto.codec.clip(f"{type(exc).__name__}: {exc}", proto.codec.REASON_MAX)
            reply(proto.Error("internal", why))

    def drain_dealer(self, sock: zmq.Socket, handler: Callable[[str, Any], None]) -> bool:
        """Hand every decoded frame from a prefill daemon to ``handler(endpoint, msg)``."""
        if sock is self._peer_mon:
            self._peer_events(time.monotonic())
            return False
        endpoint = self._by_sock.get(sock)
        got = False
        for _ in range(DRAIN_MAX):
            if endpoint is not None and self.dealers.get(endpoint) is not sock:
                break  # the handler dropped this link (and closed the socket)
            try:
                payload = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            got = True
            if endpoint is None:
                continue
            try:
                msg = proto.decode(payload)
            except proto.ProtocolError as exc:
                self.bad("protocol", f"from producer {endpoint}: {exc}")
                continue
            handler(endpoint, msg)
        return got

    def bound(self) -> tuple[Any, Any, Any]:
        return self.ep.engine, self.ep.peer, self.ep.ops

    def _reply(self, sock: zmq.Socket, ident: bytes, msg: Any, version: int = proto.PROTOCOL_VERSION) -> None:
        try:
            sock.send_multipart([ident, proto.encode(msg, version)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("reply dropped: %s", exc)

    def close(self) -> None:
        for endpoint in list(self.dealers):
            self.close_producer(endpoint)
        self.ep.peer.disable_monitor()
        self._peer_mon.close(0)
        self.ep.close()
