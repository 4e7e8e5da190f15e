"""Who is on the other end of the engine socket: kernel credentials of local peers.

Why this exists: the engine socket is a unix socket, and any local process that may open it
could otherwise send an Attach and take the rank over, or name memory that is not its own.
The kernel tells us who connected (``SO_PEERCRED``: pid, uid, gid at connect time):

* per connection: :func:`peercred_of` reads it once at accept
  (:mod:`kvpush.daemon.io.enginelink`), and every frame of that connection carries it, so an
  Attach is bound to the process that sent it;
* :class:`PeerTable` keeps the live connections, so the daemon knows whether the attached
  engine still has one.

:func:`attach_refusal` is the pure rule that decides whether an Attach may take the rank.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass, field

__all__ = ["Holder", "PeerCred", "PeerTable", "attach_refusal", "peercred_of"]

_UCRED = struct.Struct("3i")  # struct ucred {pid_t pid; uid_t uid; gid_t gid;}


@dataclass(frozen=True, slots=True)
class PeerCred:
    """A local peer process as the kernel saw it when it connected."""

    pid: int
    uid: int
    gid: int


def peercred_of(sock: socket.socket) -> PeerCred | None:
    """SO_PEERCRED of a connected unix socket; None if the kernel will not say."""
    try:
        pid, uid, gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    except OSError:
        return None
    return PeerCred(pid, uid, gid) if pid > 0 else None


@dataclass
class PeerTable:
    """Live connections of the engine socket (fd -> credentials), kept by the listener:
    a connection leaves the table before its fd is closed, so a reused fd is never confused
    with the connection that had it before."""

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
