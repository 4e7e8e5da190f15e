"""ZeroMQ sockets of one accelerator's daemon: engine (ipc), peer (tcp), ops (ipc).

Why here and not in the worker: socket options, file permissions and CURVE
authentication are security decisions; keeping them in one small module makes
them reviewable. The worker only sees ready-to-poll sockets.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from collections.abc import Iterable

import zmq

from kvpush.daemon.config import DEFAULT_MAX_MESSAGE, OPS_MAX_MESSAGE
from kvpush.daemon.peerauth import PeerAuth

log = logging.getLogger(__name__)

HEARTBEATS = 3  # a TCP peer that misses this many ZMTP heartbeats (PINGs) in a row is closed


def ipc_path(endpoint: str) -> str | None:
    return endpoint[len("ipc://") :] if endpoint.startswith("ipc://") else None


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


def bind_private(sock: zmq.Socket, endpoint: str, mode: int) -> None:
    """Bind, creating an ipc socket file with ``mode`` from the start (no window).

    A stale file left by a killed daemon is replaced; the parent directory must be
    private to us (created so if missing, refused otherwise: :func:`ensure_private_dir`).
    """
    path = ipc_path(endpoint)
    if path is None:
        sock.bind(endpoint)
        return
    ensure_private_dir(os.path.dirname(path), runtime_dir_mode([mode]))
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    old = os.umask(0o777 & ~mode)
    try:
        sock.bind(endpoint)
    finally:
        os.umask(old)
    os.chmod(path, mode)


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
        self.engine_ep, self.ops_ep = engine, ops
        self.engine = self._router()
        # Before bind: every accepted engine connection (its fd) and its end are reported
        # here; the wire keeps the live local peers from them (kvpush.daemon.peercred).
        self.engine_monitor = self.engine.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        bind_private(self.engine, engine, socket_mode)
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
        with contextlib.suppress(zmq.ZMQError):
            self.engine.disable_monitor()
        self.engine_monitor.close(0)
        for s in (self.engine, self.ops, self.peer):
            s.close(0)
        if self.auth is not None:
            self.auth.close()
        remove_ipc(self.engine_ep)
        remove_ipc(self.ops_ep)
