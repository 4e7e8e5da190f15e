"""sd_notify(3) without libsystemd: one datagram to $NOTIFY_SOCKET.

systemd's ``Type=notify`` waits for ``READY=1`` before it considers kvpushd started, so
units ordered after it (engines) start only once every accelerator daemon listens. Outside
systemd ``NOTIFY_SOCKET`` is unset and every call is a cheap no-op returning False.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping


def notify_address(env: Mapping[str, str] | None = None) -> str | None:
    """The socket address to send to ('@name' -> abstract namespace), or None."""
    env = os.environ if env is None else env
    addr = env.get("NOTIFY_SOCKET", "")
    if addr.startswith("@"):
        return "\0" + addr[1:]
    if addr.startswith("/"):
        return addr
    return None  # unset, or a vsock: address we do not speak


def notify(msg: str, env: Mapping[str, str] | None = None) -> bool:
    """Send ``msg`` (e.g. "READY=1\\nSTATUS=2/2 devices up"); True if it was delivered."""
    addr = notify_address(env)
    if addr is None:
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(addr)
            sock.sendall(msg.encode())
        return True
    except OSError:
        return False


def watchdog_interval_s(env: Mapping[str, str] | None = None) -> float | None:
    """Half of WATCHDOG_USEC (as systemd recommends) when the watchdog is meant for us."""
    env = os.environ if env is None else env
    usec = env.get("WATCHDOG_USEC")
    pid = env.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return max(int(usec) / 2e6, 0.01)
    except ValueError:
        return None
