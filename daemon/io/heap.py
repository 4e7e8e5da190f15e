"""Hands the allocator's free pages back to the kernel after a burst.

A flood of partial frames on the peer port makes ZeroMQ buffer up to sessions x
``max_message_bytes``. When those connections close, glibc keeps the freed memory in its arenas:
a prefill daemon measured +38 MiB that stayed after the flood (docs/results/peer-flood-rss.md).
``malloc_trim(0)`` returns every arena's free pages.

:class:`TrimPolicy` decides when (pure): only while the process's anonymous memory stands
``grow_bytes`` above the lowest level seen after a trim, at most once per ``every_s``, and a
trim that gave back less than ``useful_bytes`` doubles the wait (up to ``max_every_s``), so a
daemon whose heap is legitimately larger does not pay for a trim every interval.
:class:`HeapTrimmer` is the shell: reads ``RssAnon`` and calls glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

__all__ = ["HeapTrimmer", "TrimPolicy", "anon_bytes"]

MiB = 1 << 20


@dataclass
class TrimPolicy:
    """When to trim: events in (a reading of anonymous memory, a trim's result), a decision out."""

    grow_bytes: int = 16 * MiB
    every_s: float = 10.0
    max_every_s: float = 320.0
    useful_bytes: int = 4 * MiB
    floor: int | None = None  # the lowest anonymous memory seen after a trim (or at start)
    wait_s: float = field(init=False)
    next_at: float = field(init=False, default=0.0)

    def __post_init__(self) -> None:
        self.wait_s = self.every_s

    def due(self, now: float, anon: int) -> bool:
        """Whether to trim now, given ``anon`` bytes of anonymous memory."""
        if now < self.next_at:
            return False
        if self.floor is None or anon < self.floor:
            self.floor = anon
        if anon - self.floor >= self.grow_bytes:
            return True
        self.next_at = now + self.every_s  # read again one interval later, not every tick
        return False

    def trimmed(self, now: float, before: int, after: int) -> None:
        """A trim's result: a useful one keeps the interval, a useless one doubles it."""
        if before - after >= self.useful_bytes:
            self.wait_s = self.every_s
        else:
            self.wait_s = min(self.wait_s * 2, self.max_every_s)
        self.floor = min(self.floor if self.floor is not None else after, after)
        self.next_at = now + self.wait_s


def anon_bytes() -> int | None:
    """This process's anonymous resident memory (``RssAnon``), or None where /proc has none."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"RssAnon:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _glibc_trim() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        fn = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


class HeapTrimmer:
    """The daemon's tick calls :meth:`tick`; it trims when the policy says so."""

    def __init__(self, policy: TrimPolicy | None = None) -> None:
        self.policy = policy or TrimPolicy()
        self._trim = _glibc_trim()
        self.released = 0  # bytes given back, in all
        self.trims = 0

    def tick(self, now: float) -> int:
        """Trim if due; the bytes given back (0 if not due or not possible)."""
        if self._trim is None or now < self.policy.next_at:
            return 0
        before = anon_bytes()
        if before is None or not self.policy.due(now, before):
            return 0
        self._trim(0)
        after = anon_bytes() or before
        self.policy.trimmed(now, before, after)
        self.trims += 1
        freed = max(0, before - after)
        self.released += freed
        if freed >= self.policy.useful_bytes:
            log.info("gave %.1f MiB of freed heap back to the kernel (anonymous memory %.1f -> %.1f MiB)",
                     freed / MiB, before / MiB, after / MiB)
        return freed
