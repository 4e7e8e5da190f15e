"""What both plugin halves' lifecycle cores share: a :class:`kvpush.common.machine.Core` that also
knows which keys are in a few chosen states.

The halves act once per engine step on every request in a given state (the decode
requests whose load just ended, the prefill requests that may publish early, the early
PrefillDones waiting for the step's forward). Scanning every record each step would cost
O(requests in flight) on vLLM's engine loop; these per-state key sets are kept up to
date on every transition instead, so a step looks only at the keys concerned. They are
part of the core's bookkeeping, not a collection kept by hand: a key is in the set of
its record's state and nowhere else, and leaves it when the record does.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from typing import Any

from kvpush.common.machine import Core, Table
from kvpush.common.machine.core import Deadline


class TrackedCore(Core[Any, Any]):
    """A core that keeps, for each state in ``tracked``, the keys whose record is in it
    (in the order they entered it)."""

    def __init__(self, table: Table, tombstones: frozenset[Any], deadlines: Mapping[Any, Deadline], *,
                 tracked: Iterable[Any], tombstone_s: float, max_live: int | None = None) -> None:
        super().__init__(table, tombstones, deadlines, tombstone_s=tombstone_s, max_live=max_live)
        self._in: dict[Any, dict[Hashable, None]] = {s: {} for s in tracked}

    def keys_in(self, state: Any) -> list[Hashable]:
        """The keys in a tracked ``state``, oldest entry first (a copy: safe to dispatch on)."""
        return list(self._in[state])

    def state(self, key: Hashable) -> Any:
        """The state of ``key``'s record (None: no record)."""
        rec = self._recs.get(key)
        return None if rec is None else rec.state

    def count(self, state: Any) -> int:
        """Records in ``state``: O(1)."""
        return self._counts[state]

    def sizes(self) -> dict[str, int]:
        """Every collection this core keeps and its size: what the soak benchmark watches."""
        return {
            "records": len(self._recs),
            "deadlines": len(self._deadlines._live),
            "deadline_heap": len(self._deadlines._heap),
            "index": len(self._index),
            **{f"in_{s.name.lower()}": len(keys) for s, keys in self._in.items()},
        }

    def _enter(self, key: Any, rec: Any, old: Any, new: Any) -> None:
        super()._enter(key, rec, old, new)
        if old is not new:
            if old in self._in:
                self._in[old].pop(key, None)
            if new in self._in:
                self._in[new][key] = None

    def _forget(self, key: Any, rec: Any) -> None:
        if rec.state in self._in:
            self._in[rec.state].pop(key, None)
        super()._forget(key, rec)
