"""The daemon's end of the engine link: a listening AF_UNIX stream socket and its engines.

Why a plain socket and not ZeroMQ: see :mod:`kvpush.proto.stream` (one hop between idle
processes costs a quarter as much). What ZeroMQ did for this socket is done here, bounded by
configuration:

* framing (:mod:`kvpush.proto.stream`); a frame over ``max_message`` closes its connection
  before it is buffered, as libzmq's MAXMSGSIZE did;
* who is on the other end: ``SO_PEERCRED`` is read once at accept and travels with every
  frame of that connection (:class:`kvpush.daemon.io.peercred.PeerCred`); :attr:`peers` holds
  the live connections (the Attach rule asks whether the holder still has one);
* replies a slow engine has not read yet wait in a per-connection buffer of at most
  ``backlog_bytes``; an engine that lets it overflow is disconnected (it reconnects and
  re-attaches), so one stuck engine costs a bounded amount of memory;
* at most ``max_conns`` connections, and at most ``max_conns_per_uid`` of one user; more are
  closed at accept;
* a connection that has not delivered a whole first frame within ``first_frame_s`` is closed
  (:meth:`EngineListener.expire`), as ZeroMQ closed one that never finished its greeting: an
  engine dials only when it has something to say (its Attach), so a silent connection holds
  a slot for nothing.

The listener is one pollable object: its connections sit in an epoll set whose fd the worker's
poller watches, so the wire sees a single "engine" readiness however many engines connect.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import select
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvpush.daemon.io.peercred import PeerCred, PeerTable, peercred_of
from kvpush.proto.naming import ipc_path
from kvpush.proto.stream import Deframer, FrameTooLarge, Outbox, Put, frame

__all__ = ["BACKLOG_BYTES", "MAX_CONNS", "MAX_CONNS_PER_UID", "EngineListener", "Incoming"]

log = logging.getLogger(__name__)

BACKLOG_BYTES = 64 << 20  # unread replies per engine connection before it is dropped
MAX_CONNS = 256  # engine connections per daemon (one per rank is the norm)
MAX_CONNS_PER_UID = 64  # of them, one user's: another user allowed in cannot take them all
FIRST_FRAME_S = 5.0
READ_CHUNK = 256 << 10  # one recv; at most READ_TURN bytes per connection per receive() call
READ_TURN = 4 << 20
LISTEN_BACKLOG = 64

Bad = Callable[[str, str], None]


@dataclass(frozen=True, slots=True)
class Incoming:
    """One frame from an engine: who sent it (connection identity, kernel credentials)."""

    ident: bytes
    cred: PeerCred | None
    payload: bytes


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    ident: bytes
    cred: PeerCred | None
    reader: Deframer
    out: Outbox
    deadline: float  # for its first whole frame (kept while in the listener's _unframed)

    @property
    def uid(self) -> int | None:
        return None if self.cred is None else self.cred.uid

    @property
    def fd(self) -> int:
        return self.sock.fileno()


class EngineListener:
    """Accepts engine connections on ``endpoint`` (``ipc://path``) and moves their frames.

    Never blocks: every socket is non-blocking, a reply that does not fit the kernel buffer
    waits in the connection's own buffer and goes out when the socket is writable again.
    """

    def __init__(self, endpoint: str, *, bind: Callable[[socket.socket, str], None],
                 max_message: int, backlog_bytes: int = BACKLOG_BYTES, max_conns: int = MAX_CONNS,
                 max_conns_per_uid: int = MAX_CONNS_PER_UID, first_frame_s: float = FIRST_FRAME_S,
                 bad: Bad | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        """``bind(sock, path)`` binds the listening socket (file mode, private directory:
        :func:`kvpush.daemon.io.endpoints.bind_private_unix`)."""
        path = ipc_path(endpoint)
        if path is None:
            raise ValueError(f"engine socket must be an ipc:// endpoint, got {endpoint!r}")
        self.endpoint, self.path = endpoint, path
        self.max_message, self.backlog_bytes, self.max_conns = max_message, backlog_bytes, max_conns
        self.max_conns_per_uid, self.first_frame_s = max_conns_per_uid, first_frame_s
        self.bad: Bad = bad or (lambda cause, detail: None)
        self._clock = clock
        self._unframed: dict[int, _Conn] = {}  # fd -> connection still owing its first frame
        self.peers = PeerTable()
        self._serial = itertools.count(1)
        self._by_fd: dict[int, _Conn] = {}
        self._by_ident: dict[bytes, _Conn] = {}
        self._lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._lsock.setblocking(False)
            bind(self._lsock, path)
            self._lsock.listen(LISTEN_BACKLOG)
            self._ep = select.epoll()
        except BaseException:
            self._lsock.close()
            raise
        self._ep.register(self._lsock.fileno(), select.EPOLLIN)

    def fileno(self) -> int:
        """Readable while any connection has input (or room for a waiting reply)."""
        return self._ep.fileno()

    @property
    def connections(self) -> int:
        return len(self._by_fd)

    # ------------------------------------------------------------------ receiving

    def wait(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` for activity (test harnesses; the daemon polls fileno)."""
        return bool(self._ep.poll(max(0.0, timeout_s), 1))

    def receive(self) -> list[Incoming]:
        """Accept, flush and read whatever is ready now; the complete frames, in order per
        connection. Non-blocking; bounded (READ_TURN bytes per connection per call, the rest
        stays readable for the next call)."""
        out: list[Incoming] = []
        lfd = self._lsock.fileno()
        for fd, ev in self._ep.poll(0):
            if fd == lfd:
                self._accept()
                continue
            conn = self._by_fd.get(fd)
            if conn is None:
                continue
            if ev & select.EPOLLOUT and not self._flush(conn):
                continue
            if ev & (select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR):
                self._read(conn, out)
        return out

    def _accept(self) -> None:
        for _ in range(LISTEN_BACKLOG):
            try:
                sock, _ = self._lsock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE and friends: leave it in the backlog for later
                log.warning("engine socket accept failed: %s", exc)
                return
            if len(self._by_fd) >= self.max_conns:
                self.bad("connections", f"more than {self.max_conns} engine connections; closed one")
                sock.close()
                continue
            sock.setblocking(False)
            cred = peercred_of(sock)
            uid = None if cred is None else cred.uid
            if sum(c.uid == uid for c in self._by_fd.values()) >= self.max_conns_per_uid:
                self.bad("connections", f"more than {self.max_conns_per_uid} engine connections of "
                         f"uid {uid}; closed one")
                sock.close()
                continue
            conn = _Conn(sock, b"e%d" % next(self._serial), cred, Deframer(self.max_message),
                         Outbox(self.backlog_bytes), self._clock() + self.first_frame_s)
            self._by_fd[conn.fd] = conn
            self._by_ident[conn.ident] = conn
            self._unframed[conn.fd] = conn
            self.peers.accepted(conn.fd, cred)
            self._ep.register(conn.fd, select.EPOLLIN)

    def expire(self, now: float) -> int:
        """Close connections that owe their first whole frame past ``first_frame_s``; how many."""
        late = [c for c in self._unframed.values() if c.deadline <= now]
        for conn in late:
            self.bad("handshake", f"engine connection {conn.ident.decode()} (uid {conn.uid}) sent no "
                     f"whole frame within {self.first_frame_s:g} s; closed")
            self._drop(conn)
        return len(late)

    def _read(self, conn: _Conn, out: list[Incoming]) -> None:
        got = 0
        while got < READ_TURN:
            try:
                data = conn.sock.recv(READ_CHUNK)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self._drop(conn)
                return
            if not data:
                self._drop(conn)
                return
            got += len(data)
            try:
                frames = conn.reader.feed(data)
            except FrameTooLarge as exc:
                self.bad("frames", f"engine connection {conn.ident.decode()}: {exc}; closed")
                self._drop(conn)
                return
            if frames:
                self._unframed.pop(conn.fd, None)
            out.extend(Incoming(conn.ident, conn.cred, f) for f in frames)

    # ------------------------------------------------------------------ sending

    def send(self, ident: bytes, payload: bytes) -> bool:
        """Queue one frame to the connection ``ident``; False if it is gone (the frame is
        dropped: its engine went away) or was dropped now for an overflowing backlog."""
        conn = self._by_ident.get(ident)
        if conn is None:
            return False
        waited = len(conn.out)
        put = conn.out.put(conn.sock, frame(payload))
        if put is Put.DEAD:
            self._drop(conn)
            return False
        if put is Put.FULL:
            return self._overflow(conn)
        if conn.out and not waited:  # the kernel left a tail: send it when writable
            self._ep.modify(conn.fd, select.EPOLLIN | select.EPOLLOUT)
        return True

    def _flush(self, conn: _Conn) -> bool:
        """Send what waits; False if the connection died doing so."""
        if not conn.out.flush(conn.sock):
            self._drop(conn)
            return False
        if not conn.out:
            self._ep.modify(conn.fd, select.EPOLLIN)
        return True

    def _overflow(self, conn: _Conn) -> bool:
        self.bad("backlog", f"engine connection {conn.ident.decode()} left more than "
                 f"{self.backlog_bytes} bytes of replies unread; closed")
        self._drop(conn)
        return False

    # ------------------------------------------------------------------ teardown

    def _drop(self, conn: _Conn) -> None:
        fd = conn.fd
        self._by_fd.pop(fd, None)
        self._by_ident.pop(conn.ident, None)
        self._unframed.pop(fd, None)
        self.peers.disconnected(fd)
        with contextlib.suppress(OSError, ValueError):
            self._ep.unregister(fd)
        conn.sock.close()

    def close(self) -> None:
        for conn in list(self._by_fd.values()):
            self._drop(conn)
        self._ep.close()
        self._lsock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

