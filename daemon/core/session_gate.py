"""What a peer session may cost before it says Hello (issue 44, item 5).

ZeroMQ hides a ROUTER's connections, so an allowlisted node could open CURVE sessions that
never send a Hello: nothing counted them and nothing timed them out, and they took the file
descriptors the daemon needs for its own files (the allowlist reload then failed closed).
Two rules, both pure here (events in, decisions out); :mod:`kvpush.daemon.io.wire` feeds
them from the peer socket's monitor (accepted/disconnected, by file descriptor) and from each
frame's source descriptor, and shuts down what they name:

* :class:`SessionTable`: every accepted connection must carry a live handshaken session
  within ``hello_deadline_s`` of its acceptance (or of the moment its session stopped being
  live: refused, evicted), else it is closed; and the peer port never holds more than
  ``limit`` connections (the newest beyond it are closed at once), so the descriptors the
  daemon's own files need stay free.
* :class:`PendingCap`: the per-identity session cap, applied at the CURVE handshake (ZAP),
  before any Hello: an identity's admitted-but-not-yet-Hello sessions of the last
  ``window_s`` plus its handshaken ones may not exceed the cap. Thread-safe: ZAP runs on its
  own thread.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class _Conn:
    accepted: float
    since: float  # accepted, or last seen carrying a live session
    ident: bytes | None = None  # the routing identity its frames carried


@dataclass
class SessionTable:
    """Peer connections by file descriptor. Pure: the caller says what happened and when."""

    hello_deadline_s: float
    conns: dict[int, _Conn] = field(default_factory=dict)

    def accepted(self, fd: int, now: float) -> None:
        self.conns[fd] = _Conn(now, now)

    def closed(self, fd: int) -> None:
        self.conns.pop(fd, None)

    def carried(self, fd: int, ident: bytes) -> None:
        """A frame arrived on ``fd`` from the session ``ident``."""
        c = self.conns.get(fd)
        if c is not None:
            c.ident = ident

    def overdue(self, now: float, live: Callable[[bytes], bool]) -> list[int]:
        """Connections with no live session for ``hello_deadline_s``: to close (and forget)."""
        out = []
        for fd, c in self.conns.items():
            if c.ident is not None and live(c.ident):
                c.since = now
            elif now - c.since >= self.hello_deadline_s:
                out.append(fd)
        for fd in out:
            del self.conns[fd]
        return out

    def over(self, limit: int, live: Callable[[bytes], bool]) -> list[int]:
        """Connections beyond ``limit`` to close (and forget): those without a live session
        first, the newest first; a handshaken peer's connection goes last."""
        if len(self.conns) <= limit:
            return []

        def keep_first(fd: int) -> tuple[bool, float]:
            c = self.conns[fd]
            return (not (c.ident is not None and live(c.ident)), c.accepted)

        doomed = sorted(self.conns, key=keep_first)[max(0, limit):]
        for fd in doomed:
            del self.conns[fd]
        return doomed


class PendingCap:
    """Per identity: sessions admitted by ZAP and not yet handshaken, within ``window_s``
    (after it a silent session is closed by :class:`SessionTable`), plus handshaken ones."""

    def __init__(self, cap: int, window_s: float) -> None:
        self.cap, self.window_s = cap, window_s
        self._lock = threading.Lock()
        self._pending: dict[str, deque[float]] = {}
        self._live: dict[str, int] = {}

    def admit(self, name: str, now: float) -> bool:
        """May ``name`` open one more session (ZAP thread)?"""
        with self._lock:
            q = self._pending.setdefault(name, deque())
            while q and now - q[0] >= self.window_s:
                q.popleft()
            if len(q) + self._live.get(name, 0) >= self.cap:
                if not q:
                    del self._pending[name]
                return False
            q.append(now)
            return True

    def handshaken(self, name: str, live: dict[str, int]) -> None:
        """A session of ``name`` said Hello; ``live``: handshaken sessions per identity now."""
        with self._lock:
            q = self._pending.get(name)
            if q:
                q.popleft()
            self._live = dict(live)

    def set_live(self, live: dict[str, int]) -> None:
        with self._lock:
            self._live = dict(live)
            for name in [n for n, q in self._pending.items() if not q]:
                del self._pending[name]
