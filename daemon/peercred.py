"""Who is on the other end of the engine socket: kernel credentials of local peers.

Why this exists: the engine socket is an ipc (unix) socket, and any local process that may
open it could otherwise send an Attach and take the rank over, or name memory that is not
its own. The kernel tells us who connected (``SO_PEERCRED``: pid, uid, gid at connect time):

* per message: libzmq puts ``<host>:<uid>:<gid>:<pid>`` of the connection a frame arrived on
  into the frame's ``Peer-Address`` property (ipc transport, SO_PEERCRED builds);
  :func:`parse_peer_address` reads it, so an Attach is bound to the process that sent it;
* per connection: the engine socket's monitor reports ``EVENT_ACCEPTED`` / ``EVENT_DISCONNECTED``
  with the connection's fd as value; :class:`PeerTable` keeps the live ones, so the daemon
  knows whether the attached engine still has a connection.

:func:`attach_refusal` is the pure rule that decides whether an Attach may take the rank.
"""

from __future__ import annotations

import os
import socket
import struct
from dataclasses import dataclass, field

__all__ = ["Holder", "PeerCred", "PeerTable", "attach_refusal", "parse_peer_address", "peercred_of_fd"]

_UCRED = struct.Struct("3i")  # struct ucred {pid_t pid; uid_t uid; gid_t gid;}


@dataclass(frozen=True, slots=True)
class PeerCred:
    """A local peer process as the kernel saw it when it connected."""

    pid: int
    uid: int
    gid: int


def parse_peer_address(value: str | None) -> PeerCred | None:
    """``"<host>:<uid>:<gid>:<pid>"`` (libzmq's ipc Peer-Address) -> PeerCred; None if the
    property is missing or not in that form (a tcp peer, a libzmq without SO_PEERCRED)."""
    if not value:
        return None
    parts = value.rsplit(":", 3)
    if len(parts) != 4:
        return None
    try:
        uid, gid, pid = (int(p) for p in parts[1:])
    except ValueError:
        return None
    if pid <= 0 or uid < 0 or gid < 0:
        return None
    return PeerCred(pid=pid, uid=uid, gid=gid)


def peercred_of_fd(fd: int) -> PeerCred | None:
    """SO_PEERCRED of a connected unix socket fd (libzmq's; we query a dup, never close it)."""
    try:
        dup = os.dup(fd)
    except OSError:
        return None
    try:
        with socket.socket(fileno=dup) as s:
            pid, uid, gid = _UCRED.unpack(s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    except OSError:
        return None
    return PeerCred(pid, uid, gid) if pid > 0 else None


@dataclass
class PeerTable:
    """Live connections of the engine socket, fed by its monitor (fd -> credentials).

    An fd is reused by the kernel once libzmq closes it; the monitor's events come in order
    (accepted, disconnected, accepted again), so applying them in order keeps the table right.
    """

    by_fd: dict[int, PeerCred] = field(default_factory=dict)

    def accepted(self, fd: int, cred: PeerCred | None) -> None:
        if cred is None:
            self.by_fd.pop(fd, None)
        else:
            self.by_fd[fd] = cred

    def disconnected(self, fd: int) -> None:
        self.by_fd.pop(fd, None)

    def connected(self, pid: int) -> bool:
        """Does process ``pid`` hold at least one live connection?"""
        return any(c.pid == pid for c in self.by_fd.values())


@dataclass(frozen=True, slots=True)
class Holder:
    """The process that holds this daemon's engine rank (it attached, or it is recorded as
    having attached before a daemon restart). ``grace_until``: until then it counts as
    connected even without a live connection (a restarted daemon waits for it to come back)."""

    pid: int
    start_time: int
    uid: int
    grace_until: float = 0.0


def attach_refusal(holder: Holder | None, peer: PeerCred, peer_start: int | None,
                   holder_start_now: int | None, holder_connected: bool, now: float) -> str | None:
    """Why an Attach from ``peer`` may not take the rank, or None if it may.

    ``peer_start`` / ``holder_start_now``: process start times read now (None: gone).
    The same process (pid and start time) may always attach again (a reconnect, new memory);
    another one only once the holder is gone: its process exited (or the pid was reused), or
    it lives but holds no connection any more and its grace is over.
    """
    if peer_start is None:
        return f"process {peer.pid} is gone"
    if holder is None:
        return None
    if peer.pid == holder.pid and peer_start == holder.start_time:
        return None
    if holder_start_now != holder.start_time:
        return None  # the holder exited (a reused pid has another start time)
    if holder_connected or now < holder.grace_until:
        return (f"rank held by engine process {holder.pid} (uid {holder.uid}), which is still "
                "connected; one engine per rank")
    return None
