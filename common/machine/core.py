"""What every state machine of kvpush shares: a transition table and the record keeping
around it. Neutral ground: the daemon's cores and the engine plugin's lifecycle both build
on it, and it imports nothing of either.

A core keeps one record of facts per key and a state per record. Every transition is one
:class:`Row` of plain data in the core's :class:`Table`::

    (state, event type, guard) -> (new state, steps)

``state`` ``None`` means "no record for this key"; ``new state`` ``None`` means "forget the
record" (or create none). A guard is a named pure predicate over (core, record, event),
evaluated *before* any step runs; the rows of one (state, event type) are tried in order and
the first whose guard holds is taken, so the last row of each pair is unguarded and the
table is total (checked when it is built). Steps only compute the event's effect on the
record's facts and append actions; they never choose a state. The core then enters the
row's new state, so the state is always the one the table names.

Around that table, :class:`Core` owns what both cores need and must get right once:

* records by key, their states and the number per state (``counts``);
* one deadline per record in a :class:`Deadlines` heap: a live state's deadline is a function
  of the record (recomputed after every transition, so it never goes stale), a tombstone's is
  ``tombstone_s`` after entering it, and then the record is purged;
* expiry before and after every event, so no event sees (or leaves) a passed deadline;
* a capacity bound on live records (``max_live``) that rows may test with ``overloaded``;
* a secondary index (e.g. by peer) that is cleaned when a record is forgotten;
* holdings: what each holder (e.g. a peer) holds across the records, kept up to date
  incrementally after every transition (quotas ask it in O(1), never scan);
* ``pending`` / ``info`` views for ops.

A core is pure: no I/O, no clock (events carry ``now``), no threads.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from kvpush.common.machine.deadlines import Deadlines

K = TypeVar("K", bound=Hashable)
R = TypeVar("R", bound="Record")


# ------------------------------------------------------------------------- the table

Guard = Callable[[Any, Any, Any], bool]  # (core, record | None, event) -> bool, pure
Step = Callable[[Any, Any, Any, list[Any]], None]  # (core, record | None, event, out)


@dataclass(frozen=True)
class Row:
    """One transition. ``unreachable`` documents why a row can never be taken (it still says
    what would happen, safely); tests check such rows are never taken."""

    state: enum.Enum | None
    event: type
    guard: Guard | None
    to: enum.Enum | None
    steps: tuple[Step, ...] = ()
    unreachable: str = ""

    def __str__(self) -> str:
        def name(s: enum.Enum | None) -> str:
            return "-" if s is None else s.name

        g = f"[{self.guard.__name__}]" if self.guard else ""
        steps = ", ".join(s.__name__ for s in self.steps)
        return f"{name(self.state)} --{self.event.__name__}{g}--> {name(self.to)}: {steps}"


def row(
    state: enum.Enum | None,
    event: type,
    guard: Guard | None,
    to: enum.Enum | None,
    *steps: Step,
    unreachable: str = "",
) -> Row:
    return Row(state, event, guard, to, steps, unreachable)


class Table:
    """The rows of a core, indexed by (state, event type); total by construction.

    A keyed core's table also covers state ``None`` ("no record for this key"). A machine
    that always exists (one link, one child process) passes ``keyed=False``: it has no rows
    for ``None`` and never forgets itself, and it is driven by :meth:`take`.
    """

    def __init__(self, states: type[enum.Enum], events: tuple[type, ...], rows: Iterable[Row],
                 *, keyed: bool = True):
        self.states = states
        self.events = events
        self.keyed = keyed
        self.rows = tuple(rows)
        index: dict[tuple[enum.Enum | None, type], list[Row]] = {}
        for r in self.rows:
            if r.event not in events:
                raise ValueError(f"{r}: {r.event.__name__} is not an event of this table")
            if not keyed and (r.state is None or r.to is None):
                raise ValueError(f"{r}: a machine that always exists has no state None")
            index.setdefault((r.state, r.event), []).append(r)
        for s in ((None, *states) if keyed else tuple(states)):
            for e in events:
                rows_ = index.get((s, e))
                if not rows_:
                    raise ValueError(f"no row for ({s}, {e.__name__})")
                if any(r.guard is None for r in rows_[:-1]) or rows_[-1].guard is not None:
                    raise ValueError(f"({s}, {e.__name__}): exactly the last row must be unguarded")
        self._index = {k: tuple(v) for k, v in index.items()}

    def rows_for(self, state: enum.Enum | None, event: type) -> tuple[Row, ...]:
        return self._index[(state, event)]

    def pick(self, core: Any, rec: Any, ev: Any) -> Row:
        """The first row of (record's state, event type) whose guard holds."""
        state = None if rec is None else rec.state
        for r in self._index[(state, type(ev))]:
            if r.guard is None or r.guard(core, rec, ev):
                return r
        raise AssertionError("unreachable: the last row is unguarded")  # pragma: no cover

    def take(self, owner: Any, rec: Any, ev: Any, out: list[Any]) -> Row:
        """Drive one record its caller keeps (see :class:`Single`): pick the row for
        (``rec.state``, event), run its steps with (owner, rec, ev, out), enter its state.
        In a keyed table a record in state None is a new one, and a row to None tells the
        caller to forget it (its actions say so)."""
        r = self.pick(owner, rec, ev)
        for step in r.steps:
            step(owner, rec, ev, out)
        rec.state = r.to
        return r

    def describe(self) -> str:
        """The table as text, one row a line (for docs and assertion messages)."""
        return "\n".join(map(str, self.rows))


class Single:
    """One record driven by a table, as a machine (``handle``: an event in, actions out), for
    :func:`kvpush.common.machine.drive`. What a keyed :class:`Core` is for the records it keeps,
    this is for a record its shell keeps: a machine that always exists (``keyed=False``: a
    link, a child process), or one record of a keyed table whose shell holds the collection
    (state None until its first row). ``owner`` is what guards and steps get as the core."""

    __slots__ = ("table", "owner", "rec", "on_row")

    def __init__(self, table: Table, owner: Any, rec: Any,
                 on_row: Callable[[Row], None] | None = None) -> None:
        self.table, self.owner, self.rec, self.on_row = table, owner, rec, on_row

    def handle(self, ev: Any) -> list[Any]:
        out: list[Any] = []
        r = self.table.take(self.owner, self.rec, ev, out)
        if self.on_row is not None:
            self.on_row(r)
        return out


# ----------------------------------------------------------------------- the records


@dataclass(eq=False, kw_only=True)
class Record:
    """Base of a core's per-key record: the core sets ``state``, ``created`` and ``names``."""

    state: Any = None
    created: float = 0.0
    names: set[Hashable] = field(default_factory=set)  # index entries that point here


Deadline = Callable[[Any], float | None]  # record -> when its live state gives up
Holdings = Callable[[Any], Mapping[Hashable, int]]  # record -> {holder: units it holds there}


@dataclass(frozen=True)
class Held:
    """What one holder holds across a core's records: in how many, and units in all."""

    records: int = 0
    units: int = 0


_NOTHING = Held()


@dataclass(frozen=True)
class _Deadline:
    """The event a core dispatches when a record's deadline passes."""

    now: float


class Core(ABC, Generic[K, R]):
    """Records, states, deadlines, tombstones and views, driven by a :class:`Table`.

    Subclasses say how an event maps to keys (``_route``), how a record is created
    (``_create``) and how it looks to ops (``_info``). ``handle`` is O(1) amortised per
    event plus the steps' own work; expiry is O(expired · log n) and a heap peek when
    nothing is due.
    """

    def __init__(
        self,
        table: Table,
        tombstones: frozenset[Any],
        deadlines: Mapping[Any, Deadline],
        *,
        tombstone_s: float,
        max_live: int | None,
        holdings: Holdings | None = None,
    ) -> None:
        live = [s for s in table.states if s not in tombstones]
        missing = [s for s in live if s not in deadlines]
        if missing:
            raise ValueError(f"no deadline rule for live states {missing}")
        self.tombstone_s = tombstone_s
        self.max_live = max_live
        self._table = table
        self._tombstones = tombstones
        self._due = dict(deadlines)
        self._recs: dict[K, R] = {}
        self._deadlines: Deadlines[K] = Deadlines()
        self._counts: dict[Any, int] = {s: 0 for s in table.states}
        self._live = 0
        self._index: dict[Hashable, set[K]] = {}
        self._holdings = holdings
        self._charges: dict[K, dict[Hashable, int]] = {}  # key -> its record's holdings
        self._held: dict[Hashable, Held] = {}  # holder -> totals over every record
        self._now = float("-inf")
        #: Called after every transition as (key, old state, event, row): for tests and tracing.
        self.on_transition: Callable[[K, Any, Any, Row], None] | None = None

    # ------------------------------------------------------------------ public API

    def handle(self, ev: Any) -> list[Any]:
        """Apply one event; return the actions to carry out, in order.

        Expiry runs before and after the event, so no event ever sees (or leaves) a
        record whose deadline has already passed at ``ev.now``.
        """
        self._now = max(self._now, ev.now)
        out: list[Any] = []
        self._expire(out)
        for key in self._route(ev):
            self._dispatch(key, ev, out)
        self._expire(out)
        return out

    def counts(self) -> dict[Any, int]:
        """Number of records per state (tombstones included)."""
        return dict(self._counts)

    def live_count(self) -> int:
        """Records in a live (non-tombstone) state."""
        return self._live

    def pending(self, now: float | None = None) -> list[Any]:
        """Live records as ops sees them, oldest first. O(n): for ops, not the hot path."""
        t = self._now if now is None else now
        rows = [self._info(r, t) for r in self._recs.values() if r.state not in self._tombstones]
        return sorted(rows, key=lambda i: -i.age)

    def held(self, holder: Hashable) -> Held:
        """What ``holder`` holds across all records (per the core's ``holdings``). O(1)."""
        return self._held.get(holder, _NOTHING)

    def held_in(self, key: K, holder: Hashable) -> int | None:
        """Units ``holder`` holds in the record of ``key``; None if it holds nothing there."""
        return self._charges.get(key, {}).get(holder)

    @property
    def table(self) -> Table:
        return self._table

    # ------------------------------------------------------------ for the rows

    @property
    def now(self) -> float:
        return self._now

    def overloaded(self) -> bool:
        return self.max_live is not None and self._live >= self.max_live

    def _get(self, key: K) -> R | None:
        return self._recs.get(key)

    def _is_live(self, key: K) -> bool:
        rec = self._recs.get(key)
        return rec is not None and rec.state not in self._tombstones

    def _view(self, key: K, now: float | None) -> Any:
        rec = self._recs.get(key)
        return None if rec is None else self._info(rec, self._now if now is None else now)

    def _index_add(self, key: K, rec: R, name: Hashable) -> None:
        rec.names.add(name)
        self._index.setdefault(name, set()).add(key)

    def _index_pop(self, name: Hashable) -> set[K]:
        """Take every key under ``name`` out of the index (their records keep existing)."""
        return self._index.pop(name, set())

    def _index_get(self, name: Hashable) -> set[K]:
        return self._index.get(name, set())

    def _dispatch(self, key: K, ev: Any, out: list[Any]) -> None:
        """Take the table's row for (record's state, event): run its steps, enter its state."""
        rec = self._recs.get(key)
        old = None if rec is None else rec.state
        r = self._table.pick(self, rec, ev)
        if rec is None and r.to is not None:
            rec = self._create(key, ev)
            rec.created = self._now
            self._recs[key] = rec
        for step in r.steps:
            step(self, rec, ev, out)
        if rec is not None:
            if r.to is None:
                self._forget(key, rec)
            else:
                self._enter(key, rec, old, r.to)
            if self._holdings is not None:
                self._recharge(key, None if r.to is None else rec)
        if self.on_transition is not None:
            self.on_transition(key, old, ev, r)

    # ------------------------------------------------------------ bookkeeping

    def _enter(self, key: K, rec: R, old: Any, new: Any) -> None:
        if old is not new:
            if old is not None:
                self._counts[old] -= 1
                self._live -= old not in self._tombstones
            self._counts[new] += 1
            self._live += new not in self._tombstones
            rec.state = new
        if new in self._tombstones:
            if old is not new:  # kept tombstone_s after entering it, then purged
                self._deadlines.set(key, self._now + self.tombstone_s)
        else:  # a function of the facts: recomputed, so never stale
            self._deadlines.set(key, self._due[new](rec))

    def _forget(self, key: K, rec: R) -> None:
        del self._recs[key]
        if rec.state is not None:
            self._counts[rec.state] -= 1
            self._live -= rec.state not in self._tombstones
        self._deadlines.set(key, None)
        for name in rec.names:
            keys = self._index.get(name)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._index[name]
        self._forgotten(key, rec)

    def _recharge(self, key: K, rec: R | None) -> None:
        """Replace what ``key``'s record held by what it holds now: O(its holders)."""
        assert self._holdings is not None
        new = {} if rec is None else dict(self._holdings(rec))
        for holder, units in self._charges.pop(key, {}).items():
            h = self._held[holder]
            if h.records == 1:
                del self._held[holder]
            else:
                self._held[holder] = Held(h.records - 1, h.units - units)
        for holder, units in new.items():
            h = self._held.get(holder, _NOTHING)
            self._held[holder] = Held(h.records + 1, h.units + units)
        if new:
            self._charges[key] = new

    def _expire(self, out: list[Any]) -> None:
        """Dispatch a deadline event to every record due at ``now`` (most events find none:
        the heap's top says so without a call)."""
        if self._deadlines.earliest > self._now:
            return
        for key in self._deadlines.pop_due(self._now):
            self._dispatch(key, _Deadline(self._now), out)

    # ------------------------------------------------------------ for subclasses

    @abstractmethod
    def _route(self, ev: Any) -> Iterable[K]:
        """The keys an external event is dispatched to (none for a Tick)."""

    @abstractmethod
    def _create(self, key: K, ev: Any) -> R:
        """A fresh record for ``key`` (a row from state None to a state creates it)."""

    @abstractmethod
    def _info(self, rec: R, now: float) -> Any:
        """The ops view (PendingInfo) of one record."""

    def _forgotten(self, key: K, rec: R) -> None:
        """Hook: ``rec`` was just forgotten."""
