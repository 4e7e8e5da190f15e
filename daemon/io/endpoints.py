"""Sockets of one accelerator's daemon: engine (unix stream), peer (ZeroMQ tcp), ops (ZeroMQ ipc).

Why here and not in the worker: socket options, file permissions and CURVE
authentication are security decisions; keeping them in one small module makes
them reviewable. The worker only sees ready-to-poll sockets.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import stat
from collections.abc import Callable, Iterable

import zmq

from kvpush.daemon.config import DEFAULT_MAX_MESSAGE, OPS_MAX_MESSAGE
from kvpush.daemon.io.enginelink import EngineListener
from kvpush.daemon.trust.peerauth import PeerAuth
from kvpush.proto.naming import ipc_path

log = logging.getLogger(__name__)

HEARTBEATS = 3  # a TCP peer that misses this many ZMTP heartbeats (PINGs) in a row is closed


class RuntimeDirError(RuntimeError):
    """The socket directory is not private to this daemon's user: refuse to start."""


def runtime_dir_mode(socket_modes: Iterable[int] = ()) -> int:
    """0700; 0750 when a socket is shared with a group (its mode has group bits), so the
    group's engines can reach it. Never group/world-writable: a writer of the directory
    could replace our sockets with its own."""
    return 0o750 if any(m & 0o070 for m in socket_modes) else 0o700


def check_private_dir(path: str, mode: int) -> None:
    """Raise RuntimeDirError unless ``path`` is a real directory (not a symlink) owned by
    our effective uid with no permission bits beyond ``mode``."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise RuntimeDirError(f"runtime directory {path} does not exist") from None
    if stat.S_ISLNK(st.st_mode):
        raise RuntimeDirError(f"runtime directory {path} is a symlink; refusing to use it")
    if not stat.S_ISDIR(st.st_mode):
        raise RuntimeDirError(f"runtime directory {path} is not a directory")
    euid = os.geteuid()
    if st.st_uid != euid:
        raise RuntimeDirError(
            f"runtime directory {path} is owned by uid {st.st_uid}, not by this daemon's uid "
            f"{euid} (another user may have created it first); remove it or set runtime_dir")
    extra = st.st_mode & 0o777 & ~mode
    if extra:
        what = "group/world-writable" if extra & 0o022 else "more open than socket_mode needs"
        raise RuntimeDirError(
            f"runtime directory {path} has mode {st.st_mode & 0o777:#o}, {what} (at most "
            f"{mode:#o}); chmod {mode:o} it or remove it")


def ensure_private_dir(path: str, mode: int = 0o700) -> None:
    """Create the runtime directory with exactly ``mode`` (whatever the umask), or check an
    existing one (:func:`check_private_dir`). Missing parents are created as usual (0777
    minus umask); only the last component holds sockets."""
    parent = os.path.dirname(path.rstrip("/"))
    if parent:
        os.makedirs(parent, exist_ok=True)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    else:
        os.chmod(path, mode)
    check_private_dir(path, mode)


def _bind_with_mode(path: str, mode: int, bind: Callable[[], None]) -> None:
    """Bind a socket file with ``mode`` from the start (no window): a stale file left by a
    killed daemon is replaced; the parent directory must be private to us (created so if
    missing, refused otherwise: :func:`ensure_private_dir`)."""
    ensure_private_dir(os.path.dirname(path), runtime_dir_mode([mode]))
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    old = os.umask(0o777 & ~mode)
    try:
        bind()
    finally:
        os.umask(old)
    os.chmod(path, mode)


def bind_private(sock: zmq.Socket, endpoint: str, mode: int) -> None:
    """Bind a ZeroMQ socket; an ipc one as :func:`_bind_with_mode` does."""
    path = ipc_path(endpoint)
    if path is None:
        sock.bind(endpoint)
        return
    _bind_with_mode(path, mode, lambda: sock.bind(endpoint))


def bind_private_unix(mode: int) -> Callable[[socket.socket, str], None]:
    """The engine listener's bind: a unix socket at ``path``, as :func:`_bind_with_mode`."""
    return lambda sock, path: _bind_with_mode(path, mode, lambda: sock.bind(path))


def remove_ipc(endpoint: str) -> None:
    path = ipc_path(endpoint)
    if path:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


class Endpoints:
    """Owns the three bound sockets and the outgoing per-peer DEALERs."""

    def __init__(
        self,
        ctx: zmq.Context,
        *,
        engine: str,
        peer: str,
        ops: str,
        socket_mode: int = 0o600,
        max_message: int = DEFAULT_MAX_MESSAGE,
        handshake_ms: int = 5000,
        auth: PeerAuth | None = None,
    ) -> None:
        """``auth`` None is the explicit insecure mode (``insecure_peers = true``)."""
        self.ctx = ctx
        # What one connection may cost us: a frame over max_message closes it (ZeroMQ checks
        # the length prefix, before buffering); one that has not greeted (ZMTP, CURVE) within
        # handshake_ms is closed; on TCP, one that stops answering heartbeats is closed too.
        self.max_message, self.handshake_ms = max_message, handshake_ms
        self.auth = auth
        self.ops_ep = ops
        # The engine link is no ZeroMQ socket (kvpush.proto.stream says why); it knows its
        # peers' kernel credentials itself (kvpush.daemon.io.peercred), and closes a connection
        # that sent no whole frame within handshake_ms as ZeroMQ closes one that never greeted.
        self.engine = EngineListener(engine, bind=bind_private_unix(socket_mode), max_message=max_message,
                                     first_frame_s=handshake_ms / 1000)
        self.ops = self._router(min(max_message, OPS_MAX_MESSAGE))
        bind_private(self.ops, ops, socket_mode)
        self.peer = self._router(heartbeat=True)
        if auth is not None:
            auth.serve(ctx, self.peer)
        if peer.endswith(":0"):
            port = self.peer.bind_to_random_port(peer.rsplit(":", 1)[0])
            peer = f"{peer.rsplit(':', 1)[0]}:{port}"
        else:
            self.peer.bind(peer)
        self.peer_ep = peer

    def _limit(self, s: zmq.Socket, max_message: int, heartbeat: bool) -> None:
        s.setsockopt(zmq.MAXMSGSIZE, max_message)
        s.setsockopt(zmq.HANDSHAKE_IVL, self.handshake_ms)
        if heartbeat:
            s.setsockopt(zmq.HEARTBEAT_IVL, self.handshake_ms)
            s.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEATS * self.handshake_ms)

    def _router(self, max_message: int | None = None, heartbeat: bool = False) -> zmq.Socket:
        s = self.ctx.socket(zmq.ROUTER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.ROUTER_MANDATORY, 0)
        s.setsockopt(zmq.SNDHWM, 100_000)
        s.setsockopt(zmq.RCVHWM, 100_000)
        self._limit(s, self.max_message if max_message is None else max_message, heartbeat)
        return s

    def dealer(self, endpoint: str) -> tuple[zmq.Socket, str]:
        """An outgoing connection to a peer daemon's peer endpoint, and the node it reaches.

        Authenticated: a CURVE client with this node's keys, expecting the server key of the
        allowlisted node whose certificate lists the endpoint's host (PeerAuthError if none);
        that node's name is returned. Insecure: a plain connection, name "".
        """
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 100_000)
        self._limit(s, self.max_message, heartbeat=True)
        node = ""
        if self.auth is not None:
            try:
                node = self.auth.dial(s, endpoint)
            except Exception:
                s.close(0)
                raise
        s.connect(endpoint)
        return s, node

    def close(self) -> None:
        self.engine.close()  # and its socket file
        for s in (self.ops, self.peer):
            s.close(0)
        if self.auth is not None:
            self.auth.close()
        remove_ipc(self.ops_ep)
