"""The one client of the daemons' ops sockets (kvpushctl, the supervisor's /metrics scrape).

Wire: one ``OpsRequest`` frame on a fresh DEALER (LINGER 0) per daemon, one ``OpsReply``
frame back. The ops endpoint is a ROUTER, so REQ's empty delimiter frame must not be sent;
a fresh socket per request means a late reply to a timed-out one is never read as the
next one's answer. Every daemon is asked at once and the whole call waits at most
``timeout_s``; each answer is typed (:mod:`kvpush.proto.ops`) or says why not.
"""

from __future__ import annotations

import os
import socket
import stat
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import zmq

from kvpush import proto
from kvpush.proto.naming import ipc_path
from kvpush.proto.ops import OpsData, OpsDataError, parse_reply

OUTCOMES = ("ok", "down", "denied", "refused")


@dataclass
class Answer:
    """What came of asking one daemon.

    ``outcome``: ok (accepted, ``reply`` holds the typed data) | down (no socket, stale
    socket, no reply in time, unreadable or malformed reply) | denied (file permissions)
    | refused (the daemon answered ``ok=False``; ``error`` is its reason).
    """

    endpoint: str
    outcome: str = "ok"
    error: str | None = None
    reply: OpsData | None = None

    @property
    def ok(self) -> bool:
        return self.outcome == "ok"

    @property
    def data(self) -> dict[str, Any] | None:
        """The reply data as it travelled (a refusal carries ``{}``; no answer: None)."""
        if self.reply is not None:
            return self.reply.to_data()
        return {} if self.outcome == "refused" else None


def probe(endpoint: str) -> Answer | None:
    """Cheap local checks before ZeroMQ (which would only time out): missing or stale
    socket file -> down, no access -> denied. None if the daemon is worth asking."""
    path = ipc_path(endpoint)
    if path is None:
        return None
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return Answer(endpoint, "down", f"daemon not running (no socket {path})")
    except PermissionError:
        return Answer(endpoint, "denied", f"permission denied: cannot reach {path}")
    if not stat.S_ISSOCK(st.st_mode):
        return Answer(endpoint, "down", f"{path} is not a socket")
    if not os.access(path, os.R_OK | os.W_OK):
        return Answer(endpoint, "denied", f"permission denied on {path} (run as its owner or group)")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(path)
        except PermissionError:
            return Answer(endpoint, "denied", f"permission denied connecting to {path}")
        except ConnectionRefusedError:
            return Answer(endpoint, "down", f"daemon not running (stale socket {path})")
        except OSError:
            pass  # let ZeroMQ have its go (and time out) rather than guess
    return None


def read_reply(endpoint: str, cmd: str, frame: bytes) -> Answer:
    """One reply frame to a ``cmd`` request, decoded and checked against its schema."""
    try:
        reply = proto.decode(frame)
    except proto.ProtocolError as e:
        return Answer(endpoint, "down", f"unreadable reply from {endpoint}: {e}")
    if not isinstance(reply, proto.OpsReply):
        return Answer(endpoint, "down", f"unexpected {type(reply).__name__} from {endpoint}")
    if not reply.ok:
        return Answer(endpoint, "refused", reply.error or "refused")
    try:
        return Answer(endpoint, reply=parse_reply(cmd, reply.data))
    except OpsDataError as e:
        return Answer(endpoint, "down", f"malformed {cmd} reply from {endpoint}: {e}")


def ask(endpoints: Sequence[str], req: proto.OpsRequest, timeout_s: float,
        ctx: zmq.Context | None = None, *, check: bool = True) -> list[Answer]:
    """Send ``req`` to every endpoint at once; one Answer per endpoint, in order, within
    ``timeout_s`` in total. ``check``: run :func:`probe` first (skip it where the caller
    knows the socket is live, e.g. the supervisor scraping an up child)."""
    ctx = ctx or zmq.Context.instance()
    answers: list[Answer | None] = [probe(ep) if check else None for ep in endpoints]
    socks: dict[zmq.Socket, int] = {}
    payload = proto.encode(req)
    try:
        for i, ep in enumerate(endpoints):
            if answers[i] is not None:
                continue
            s = ctx.socket(zmq.DEALER)
            # Owned by the finally from here on: a Ctrl-C (kvpushctl --watch) between here and
            # the poll must not leave a socket open, or the context's term() at exit waits on it.
            socks[s] = i
            s.setsockopt(zmq.LINGER, 0)
            try:
                s.connect(ep)
                s.send(payload, zmq.NOBLOCK)
            except zmq.ZMQError as e:
                del socks[s]
                s.close(0)
                answers[i] = Answer(ep, "down", f"cannot send to {ep}: {e}")
                continue
        poller = zmq.Poller()
        for s in socks:
            poller.register(s, zmq.POLLIN)
        waiting = set(socks)
        deadline = time.monotonic() + timeout_s
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for s, _ in poller.poll(int(left * 1000) + 1):
                if s in waiting:
                    waiting.discard(s)
                    poller.unregister(s)
                    i = socks[s]
                    answers[i] = read_reply(endpoints[i], req.cmd, s.recv())
        for s in waiting:
            ep = endpoints[socks[s]]
            answers[socks[s]] = Answer(ep, "down", f"no reply within {timeout_s:g}s from {ep}")
    finally:
        for s in socks:
            s.close(0)
    return [a for a in answers if a is not None]


def request(endpoint: str, req: proto.OpsRequest, timeout_s: float = 5.0) -> Answer:
    """One daemon, one command."""
    return ask([endpoint], req, timeout_s)[0]
