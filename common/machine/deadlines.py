"""A deadline per key, with expiry that never stops at the first unexpired entry.

The deadline store of :class:`kvpush.common.machine.core.Core`, which both pure cores
(rendezvous, completion counter) build on. A heap with lazy
invalidation: rescheduling a key pushes a new entry and leaves the old one to be
skipped when it surfaces; the heap is rebuilt when stale entries outnumber live
ones, so memory stays O(keys). No clock: callers pass ``now``. ``earliest`` (the heap's top,
a lower bound of every live deadline) lets a caller see that nothing is due without a call.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class Deadlines(Generic[K]):
    def __init__(self) -> None:
        self._live: dict[K, tuple[float, int]] = {}  # key -> (due, generation)
        self._heap: list[tuple[float, int, K]] = []
        self._seq = 0
        #: No key is due before this (the heap's top; a superseded entry only makes it early).
        self.earliest = float("inf")

    def get(self, key: K) -> float | None:
        entry = self._live.get(key)
        return None if entry is None else entry[0]

    def set(self, key: K, due: float | None) -> None:
        """Schedule ``key`` at ``due`` (None: no deadline), replacing any earlier one."""
        if due == self.get(key):
            return
        if due is None:
            del self._live[key]
        else:
            self._seq += 1
            self._live[key] = (due, self._seq)
            heapq.heappush(self._heap, (due, self._seq, key))
            self.earliest = self._heap[0][0]
        self._compact()

    def pop_due(self, now: float) -> Iterator[K]:
        """Yield (and unschedule) every key due at ``now``, earliest first.

        Safe against the caller rescheduling keys while iterating: each step looks at
        the heap afresh, and a superseded entry is skipped by its generation.
        """
        while self._heap and self._heap[0][0] <= now:
            _, gen, key = heapq.heappop(self._heap)
            self.earliest = self._heap[0][0] if self._heap else float("inf")
            entry = self._live.get(key)
            if entry is None or entry[1] != gen:
                continue
            del self._live[key]
            yield key
        self._compact()

    def _compact(self) -> None:
        """Rebuild once stale entries outnumber live ones (amortised O(1) per operation)."""
        if len(self._heap) > 2 * len(self._live) + 64:
            self._heap = [(d, g, k) for k, (d, g) in self._live.items()]
            heapq.heapify(self._heap)
            self.earliest = self._heap[0][0] if self._heap else float("inf")
