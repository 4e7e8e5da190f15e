"""Whom the engine trusts on its own node: the daemon's socket directory, socket, card and
listening process must belong to a trusted user.

Why: the daemon checks who its engines are (``SO_PEERCRED``); the engine must check who its
daemon is, or a local user who created the well-known socket directory first (0777, then owned
by it) gets the engine's Attach and may answer it with any Received, and may plant a card
naming its own peer endpoint for serial proxies to hand on.

Trusted uids: root, the engine's own effective uid (both can already do anything to the
engine: root everything, the same uid ptrace and its files), and the daemon's user: the
connector config's ``daemon_user`` if set, else the system user ``kvpush`` if this host has
one (scripts/install_systemd.sh runs kvpushd as ``kvpush``; only root makes users).
The rules, checked on every dial (two ``lstat`` calls and one ``getsockopt``, microseconds):

* the socket directory is a real directory (no symlink) owned by a trusted uid and not group-
  or world-writable (else its writer could replace the socket);
* the socket is a socket (no symlink) owned by a trusted uid; its own mode is not checked
  (write on a socket is the right to connect, which the daemon's ``SO_PEERCRED`` check guards);
* the process listening on it (``SO_PEERCRED`` of the connection) runs as a trusted uid;
* a card is opened ``O_NONBLOCK | O_NOFOLLOW`` and must be a regular file owned by a trusted
  uid and not group- or world-writable, in a directory that passes the first rule.

A refusal never blocks and never raises: the link stays down, so the daemon is "unavailable"
(the engine keeps serving and loads recompute), with one warning per reason.
"""

from __future__ import annotations

import os
import pwd
import stat
from collections.abc import Iterable

__all__ = ["dir_refusal", "file_refusal", "path_refusal", "peer_refusal", "socket_refusal", "trusted_uids"]


DEFAULT_DAEMON_USER = "kvpush"


def trusted_uids(daemon_uid: int | None = None, euid: int | None = None) -> frozenset[int]:
    """Root, our own uid, and the daemon user's uid (configured, else ``kvpush`` if it exists)."""
    own = os.geteuid() if euid is None else euid
    if daemon_uid is None:
        try:
            daemon_uid = pwd.getpwnam(DEFAULT_DAEMON_USER).pw_uid
        except KeyError:
            pass
    return frozenset({0, own} | ({daemon_uid} if daemon_uid is not None else set()))


def _owner(st: os.stat_result, what: str, uids: Iterable[int]) -> str:
    if st.st_uid not in uids:
        return f"{what} is owned by uid {st.st_uid}, not by a trusted uid {sorted(uids)} (set daemon_user?)"
    return ""


def dir_refusal(st: os.stat_result, uids: frozenset[int]) -> str:
    """Why a socket directory (its lstat) cannot be trusted, or ``""``. Pure."""
    if stat.S_ISLNK(st.st_mode):
        return "socket directory is a symlink"
    if not stat.S_ISDIR(st.st_mode):
        return "socket directory is not a directory"
    if st.st_mode & 0o022:
        return f"socket directory is group/world-writable (mode {st.st_mode & 0o7777:#o})"
    return _owner(st, "socket directory", uids)


def socket_refusal(st: os.stat_result, uids: frozenset[int]) -> str:
    """Why a daemon socket file (its lstat) cannot be trusted, or ``""``. Pure."""
    if not stat.S_ISSOCK(st.st_mode):
        return "daemon socket is not a socket" + (" (a symlink)" if stat.S_ISLNK(st.st_mode) else "")
    return _owner(st, "daemon socket", uids)


def file_refusal(st: os.stat_result, uids: frozenset[int]) -> str:
    """Why a card (fstat of the opened file) cannot be trusted, or ``""``. Pure."""
    if not stat.S_ISREG(st.st_mode):
        return "card is not a regular file"
    if st.st_mode & 0o022:
        return f"card is group/world-writable (mode {st.st_mode & 0o7777:#o})"
    return _owner(st, "card", uids)


def peer_refusal(uid: int | None, uids: frozenset[int]) -> str:
    """Why the process listening on the daemon socket is not our daemon, or ``""``. Pure."""
    if uid is None:
        return "the kernel did not say who listens on the daemon socket (SO_PEERCRED)"
    if uid not in uids:
        return f"the daemon socket's listener runs as uid {uid}, not as a trusted uid {sorted(uids)}"
    return ""


def path_refusal(path: str, uids: frozenset[int]) -> str:
    """The socket rules for ``path`` (its directory, then itself), read now; ``""`` if it may be
    dialled. A missing path is no refusal (the connect then fails as usual)."""
    try:
        why = dir_refusal(os.lstat(os.path.dirname(path) or "."), uids)
        if why:
            return why
        return socket_refusal(os.lstat(path), uids)
    except FileNotFoundError:
        return ""
    except OSError as exc:
        return f"cannot check the daemon socket: {exc.strerror}"
