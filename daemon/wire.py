"""The ZeroMQ shell of one daemon: frames in, decoded messages to handlers, messages out.

Implements the :class:`kvpush.daemon.context.Wire` port over :class:`Endpoints` (the bound
engine, peer and ops sockets) plus one DEALER per prefill daemon we dial. Every frame is
decoded and validated by :mod:`kvpush.proto` here, before any part of the daemon sees it;
a malformed one is answered with a clear Error and counted, and one message's handler
failing never takes the loop down.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import zmq

from kvpush import proto
from kvpush.daemon.endpoints import Endpoints
from kvpush.daemon.peercred import PeerCred, PeerTable, parse_peer_address, peercred_of_fd

log = logging.getLogger("kvpush.worker")

DRAIN_MAX = 1000  # frames per socket per loop turn: one busy socket cannot starve the others

Bad = Callable[[str, str], None]


def frame_node(frame: zmq.Frame) -> str:
    try:
        return str(frame.get("User-Id") or "")
    except zmq.ZMQError:  # no ZAP on this socket (insecure mode)
        return ""


def frame_cred(frame: zmq.Frame) -> PeerCred | None:
    """The kernel's credentials of the ipc connection this frame arrived on."""
    try:
        return parse_peer_address(frame.get("Peer-Address"))
    except zmq.ZMQError:
        return None


class ZmqWire:
    def __init__(self, ep: Endpoints, bad: Bad) -> None:
        self.ep = ep
        self.bad = bad
        self.engine_peers = PeerTable()  # live connections of the engine socket
        self._monitor: zmq.Socket | None = ep.engine_monitor
        self.dealers: dict[str, zmq.Socket] = {}  # prefill daemon endpoint -> our DEALER
        self._by_sock: dict[zmq.Socket, str] = {}
        self._monitors: dict[str, zmq.Socket] = {}  # endpoint -> its DEALER's disconnect monitor
        self._closed_at: dict[str, float] = {}  # endpoint -> when the producer's end closed
        self.poller = zmq.Poller()
        for s in (ep.engine, ep.peer, ep.ops):
            self.poller.register(s, zmq.POLLIN)
        if self._monitor is not None:
            self.poller.register(self._monitor, zmq.POLLIN)

    # ------------------------------------------------------------------ the Wire port

    def to_engine(self, identity: bytes, msg: Any) -> None:
        self._reply(self.ep.engine, identity, msg)

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
        ready = {s for s, _ in events}
        if self._monitor is not None and self._monitor in ready:
            ready.discard(self._monitor)
            self.drain_monitor()
        return ready

    def drain_monitor(self) -> None:
        """Apply the engine socket's connection events to :attr:`engine_peers` (in order:
        an fd the kernel reuses shows up as disconnected, then accepted again)."""
        from zmq.utils.monitor import recv_monitor_message

        assert self._monitor is not None
        for _ in range(DRAIN_MAX):
            try:
                ev = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            except (zmq.ZMQError, ValueError) as exc:
                log.warning("engine socket monitor: %s", exc)
                return
            fd = int(ev["value"])
            if ev["event"] == zmq.EVENT_ACCEPTED:
                self.engine_peers.accepted(fd, peercred_of_fd(fd))
            elif ev["event"] == zmq.EVENT_DISCONNECTED:
                self.engine_peers.disconnected(fd)

    def drain_router(self, sock: zmq.Socket, handler: Callable[..., None], *,
                     meta: Callable[[zmq.Frame], Any] | None = None) -> bool:
        """Hand every decoded frame waiting on a bound socket to ``handler(identity, msg)``, or
        with ``meta`` to ``handler(identity, msg, meta(frame))``: what ZeroMQ knows of the
        connection that carried it — :func:`frame_node` (the ZAP identity of an authenticated
        peer session) or :func:`frame_cred` (the kernel credentials of a local engine)."""
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
            try:
                msg = proto.decode(payload)
            except proto.ProtocolError as exc:
                self.bad("protocol", str(exc))
                self._reply(sock, ident, proto.Error("protocol", str(exc)))
                continue
            try:
                if meta is None:
                    handler(ident, msg)
                else:
                    handler(ident, msg, meta(raw[1]))
            except Exception as exc:  # never let one message kill the daemon
                log.exception("handling %s failed", type(msg).__name__)
                self.bad("internal", f"{type(exc).__name__}: {exc}")
                why = proto.codec.clip(f"{type(exc).__name__}: {exc}", proto.codec.REASON_MAX)
                self._reply(sock, ident, proto.Error("internal", why))
        return got

    def drain_dealer(self, sock: zmq.Socket, handler: Callable[[str, Any], None]) -> bool:
        """Hand every decoded frame from a prefill daemon to ``handler(endpoint, msg)``."""
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

    def _reply(self, sock: zmq.Socket, ident: bytes, msg: Any) -> None:
        try:
            sock.send_multipart([ident, proto.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("reply dropped: %s", exc)

    def close(self) -> None:
        for endpoint in list(self.dealers):
            self.close_producer(endpoint)
        self.ep.close()
