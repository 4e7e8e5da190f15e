"""ZeroMQ sockets of one accelerator's daemon: engine (ipc), peer (tcp), ops (ipc).

Why here and not in the worker: socket options, file permissions and CURVE
authentication are security decisions; keeping them in one small module makes
them reviewable. The worker only sees ready-to-poll sockets.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import zmq

from kvpush.daemon.config import DEFAULT_MAX_MESSAGE, OPS_MAX_MESSAGE

log = logging.getLogger(__name__)

HEARTBEATS = 3  # a TCP peer that misses this many ZMTP heartbeats (PINGs) in a row is closed


def ipc_path(endpoint: str) -> str | None:
    return endpoint[len("ipc://") :] if endpoint.startswith("ipc://") else None


def bind_private(sock: zmq.Socket, endpoint: str, mode: int) -> None:
    """Bind, creating an ipc socket file with ``mode`` from the start (no window).

    A stale file left by a killed daemon is replaced; the parent directory is
    created with the same restrictions (plus execute bits).
    """
    path = ipc_path(endpoint)
    if path is None:
        sock.bind(endpoint)
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
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


@dataclass
class CurveKeys:
    """This daemon's CURVE key pair and the directory of public keys it accepts."""

    public: bytes
    secret: bytes
    authorized_dir: str


def load_curve(secret_file: str, authorized_dir: str) -> CurveKeys:
    """Load the cluster certificate (zmq.auth format, public + secret key)."""
    import zmq.auth

    pub, sec = zmq.auth.load_certificate(secret_file)
    if sec is None:
        raise ValueError(f"{secret_file} holds no secret key")
    if not os.path.isdir(authorized_dir):
        raise ValueError(f"authorized keys directory {authorized_dir} does not exist")
    return CurveKeys(pub, sec, authorized_dir)


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
        curve: CurveKeys | None = None,
    ) -> None:
        self.ctx = ctx
        # What one connection may cost us: a frame over max_message closes it (ZeroMQ checks
        # the length prefix, before buffering); one that has not greeted (ZMTP, CURVE) within
        # handshake_ms is closed; on TCP, one that stops answering heartbeats is closed too.
        self.max_message, self.handshake_ms = max_message, handshake_ms
        self.curve = curve
        self._auth = None
        self.engine_ep, self.ops_ep = engine, ops
        self.engine = self._router()
        bind_private(self.engine, engine, socket_mode)
        self.ops = self._router(min(max_message, OPS_MAX_MESSAGE))
        bind_private(self.ops, ops, socket_mode)
        self.peer = self._router(heartbeat=True)
        if curve is not None:
            from zmq.auth.thread import ThreadAuthenticator

            self._auth = ThreadAuthenticator(ctx)
            self._auth.start()
            self._auth.configure_curve(domain="*", location=curve.authorized_dir)
            self.peer.curve_secretkey = curve.secret
            self.peer.curve_publickey = curve.public
            self.peer.curve_server = True
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

    def dealer(self, endpoint: str) -> zmq.Socket:
        """An outgoing connection to a peer daemon's peer endpoint.

        CURVE model: one cluster key pair (the same certificate on every node) is
        every peer endpoint's server key; a connecting daemon proves it holds a key
        listed in ``authorized_dir`` (ZAP allowlist), so a host without the
        certificate can neither connect nor make a daemon WRITE.
        """
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 100_000)
        self._limit(s, self.max_message, heartbeat=True)
        if self.curve is not None:
            s.curve_secretkey = self.curve.secret
            s.curve_publickey = self.curve.public
            s.curve_serverkey = self.curve.public
        s.connect(endpoint)
        return s

    def close(self) -> None:
        for s in (self.engine, self.ops, self.peer):
            s.close(0)
        if self._auth is not None:
            self._auth.stop()
        remove_ipc(self.engine_ep)
        remove_ipc(self.ops_ep)
