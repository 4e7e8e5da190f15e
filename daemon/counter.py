"""Decode-side completion counter: when is a registered transfer fully received?

Each destination rank's daemon expects exactly one notification from every producer
rank that writes into it. This pure state machine (no I/O, no clock, no threads)
counts them per (transfer, attempt) and decides what the local engine hears:
``Complete`` (Received), ``Fail`` (ReceiveFailed: recompute) or, after an engine
abort, ``Release`` (Released: the blocks may be reused).

The rule that shapes it: the engine reuses blocks as soon as it hears Fail or Release,
so neither is emitted while a producer might still write into them — every producer
must have notified, failed, or confirmed a cancel first — unless the hard deadline
passed (a hung producer must not pin blocks forever; the prefill side never starts a
write after the registration's deadline). A producer failure therefore cancels the
other producers and fails once they answer, usually within a round trip.

Every transition lives in one table, ``_TABLE`` at the end of this module, keyed by
``(state, event type)``; ``None`` = no record for that (transfer, attempt).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvpush.daemon.deadlines import Deadlines

# --------------------------------------------------------------------------- events


@dataclass(frozen=True)
class Expect:
    """The engine registered blocks; ``producers`` ranks will each notify exactly once."""

    transfer_id: str
    attempt: int
    producers: int
    now: float
    deadline: float


@dataclass(frozen=True)
class Notified:
    """A producer's write landed (its NIXL notification arrived)."""

    transfer_id: str
    attempt: int
    producer_rank: int
    now: float


@dataclass(frozen=True)
class ProducerFailed:
    """A producer will not write this attempt (its write failed or it gave up)."""

    transfer_id: str
    attempt: int
    producer_rank: int
    reason: str
    now: float


@dataclass(frozen=True)
class CancelConfirmed:
    """A producer answered our cancel: nothing of this attempt is or will be in flight."""

    transfer_id: str
    attempt: int
    producer_rank: int
    now: float


@dataclass(frozen=True)
class Abort:
    """The local engine no longer wants this attempt."""

    transfer_id: str
    attempt: int
    reason: str
    now: float


@dataclass(frozen=True)
class Tick:
    """Time passed: expire what is due."""

    now: float


@dataclass(frozen=True)
class _Deadline:
    """Internal: the record's scheduled deadline passed."""

    now: float


@dataclass(frozen=True)
class _Supersede:
    """Internal: a newer Expect for the same transfer arrived."""

    attempt: int


Event = Expect | Notified | ProducerFailed | CancelConfirmed | Abort | Tick

# -------------------------------------------------------------------------- actions


@dataclass(frozen=True)
class Accepted:
    """The registration is live: forward it to the producers now (sent once)."""

    transfer_id: str
    attempt: int


@dataclass(frozen=True)
class Complete:
    """Every producer notified: tell the engine Received."""

    transfer_id: str
    attempt: int


@dataclass(frozen=True)
class Fail:
    """Tell the engine ReceiveFailed (it recomputes into the blocks)."""

    transfer_id: str
    attempt: int
    reason: str


@dataclass(frozen=True)
class Release:
    """Tell the engine Released: the aborted registration's blocks may be reused."""

    transfer_id: str
    attempt: int


@dataclass(frozen=True)
class SendCancel:
    """Tell every producer of this attempt to cancel (they answer CancelConfirmed)."""

    transfer_id: str
    attempt: int
    reason: str


Action = Accepted | Complete | Fail | Release | SendCancel

# --------------------------------------------------------------------------- states


class State(enum.Enum):
    """Per-(transfer, attempt) states. COMPLETED, FAILED and RELEASED are tombstones,
    kept ``tombstone_s`` so late duplicates are recognised, then purged."""

    WAITING = "waiting"  # counting notifications
    FAILING = "failing"  # a producer failed; cancelled the rest, Fail once all answered
    ABORTING = "aborting"  # engine aborted; Release once all producers answered
    SUPERSEDED = "superseded"  # a newer attempt exists; forgotten once all answered
    COMPLETED = "completed"
    FAILED = "failed"
    RELEASED = "released"


_TOMBSTONES = frozenset({State.COMPLETED, State.FAILED, State.RELEASED})


@dataclass(frozen=True)
class PendingInfo:
    """One live (transfer, attempt) as ops sees it."""

    transfer_id: str
    attempt: int
    state: str
    notified: int
    resolved: int  # notified, failed or cancel-confirmed
    producers: int
    age: float
    deadline: float


@dataclass(eq=False)
class _Attempt:
    transfer_id: str
    attempt: int
    producers: int
    deadline: float  # hard deadline of this registration
    created: float
    state: State | None = None
    notified: set[int] = field(default_factory=set)
    resolved: set[int] = field(default_factory=set)
    reason: str = ""


Handler = Callable[..., None]
_Key = tuple[str, int]


class CompletionCounter:
    """Counts producer notifications per (transfer, attempt); see the module docstring.

    ``handle`` is O(1) amortised per event; expiry is O(expired · log n) and a heap
    peek when nothing is due.
    """

    def __init__(self, *, tombstone_s: float = 60.0) -> None:
        self.tombstone_s = tombstone_s
        self._recs: dict[_Key, _Attempt] = {}
        self._current: dict[str, int] = {}  # newest attempt per transfer
        self._deadlines: Deadlines[_Key] = Deadlines()
        self._now = float("-inf")
        self._counts: dict[State, int] = {s: 0 for s in State}

    # ------------------------------------------------------------------ public API

    def handle(self, ev: Event) -> list[Action]:
        """Apply one event; return the actions to carry out, in order.

        Expiry runs before and after the event, so nothing is counted after its
        deadline and nothing due at ``ev.now`` is left waiting.
        """
        self._now = max(self._now, ev.now)
        out: list[Action] = []
        self._expire(out)
        if isinstance(ev, Expect):
            self._expect(ev, out)
        elif not isinstance(ev, Tick):
            rec = self._recs.get((ev.transfer_id, ev.attempt))
            self._dispatch(rec, ev, out)
        self._expire(out)
        return out

    def pending(self, now: float | None = None) -> list[PendingInfo]:
        """Live (non-tombstone) attempts, oldest first. O(n): for ops only."""
        t = self._now if now is None else now
        rows = [self._info(r, t) for r in self._recs.values() if r.state not in _TOMBSTONES]
        return sorted(rows, key=lambda i: -i.age)

    def info(self, transfer_id: str, attempt: int, now: float | None = None) -> PendingInfo | None:
        """One (transfer, attempt), tombstones included."""
        rec = self._recs.get((transfer_id, attempt))
        return None if rec is None else self._info(rec, self._now if now is None else now)

    def counts(self) -> dict[str, int]:
        """Number of attempts per state (tombstones included)."""
        return {s.value: n for s, n in self._counts.items()}

    # ------------------------------------------------------------ bookkeeping

    def _info(self, rec: _Attempt, now: float) -> PendingInfo:
        assert rec.state is not None
        return PendingInfo(
            transfer_id=rec.transfer_id,
            attempt=rec.attempt,
            state=rec.state.value,
            notified=len(rec.notified),
            resolved=len(rec.resolved),
            producers=rec.producers,
            age=now - rec.created,
            deadline=rec.deadline,
        )

    def _dispatch(self, rec: _Attempt | None, ev: Any, out: list[Action]) -> None:
        _TABLE[(rec.state if rec is not None else None, type(ev))](self, rec, ev, out)

    def _expire(self, out: list[Action]) -> None:
        """Dispatch a deadline event to every record due at ``now``."""
        for key in self._deadlines.pop_due(self._now):
            self._dispatch(self._recs[key], _Deadline(self._now), out)

    def _schedule(self, rec: _Attempt, due: float) -> None:
        self._deadlines.set((rec.transfer_id, rec.attempt), due)

    def _set_state(self, rec: _Attempt, new: State) -> None:
        """Move to ``new``; tombstones are purged later, live states end by the deadline."""
        old = rec.state
        if old is new:
            return
        if old is not None:
            self._counts[old] -= 1
        self._counts[new] += 1
        rec.state = new
        due = self._now + self.tombstone_s if new in _TOMBSTONES else rec.deadline
        self._schedule(rec, due)

    def _drop(self, rec: _Attempt, ev: Any = None, out: list[Action] | None = None) -> None:
        """Forget the record (tombstone time over, or a superseded attempt settled)."""
        key = (rec.transfer_id, rec.attempt)
        del self._recs[key]
        assert rec.state is not None
        self._counts[rec.state] -= 1
        if self._current.get(rec.transfer_id) == rec.attempt:
            del self._current[rec.transfer_id]
        self._deadlines.set(key, None)

    def _unresolved(self, rec: _Attempt) -> bool:
        return len(rec.resolved) < rec.producers

    def _cancel_rest(self, rec: _Attempt, reason: str, out: list[Action]) -> None:
        """Stop producers that may still write (they may otherwise write late)."""
        if self._unresolved(rec):
            out.append(SendCancel(rec.transfer_id, rec.attempt, reason))

    def _settle(self, rec: _Attempt, out: list[Action]) -> None:
        """Finish a state whose wait is over."""
        if rec.state is State.WAITING:
            if len(rec.notified) == rec.producers:
                out.append(Complete(rec.transfer_id, rec.attempt))
                self._set_state(rec, State.COMPLETED)
        elif not self._unresolved(rec):
            if rec.state is State.FAILING:
                out.append(Fail(rec.transfer_id, rec.attempt, rec.reason))
                self._set_state(rec, State.FAILED)
            elif rec.state is State.ABORTING:
                out.append(Release(rec.transfer_id, rec.attempt))
                self._set_state(rec, State.RELEASED)
            elif rec.state is State.SUPERSEDED:
                self._drop(rec)

    # ------------------------------------------------------------------- Expect

    def _expect(self, ev: Expect, out: list[Action]) -> None:
        """Not per record: creates one, superseding the transfer's older attempt."""
        tid, attempt = ev.transfer_id, ev.attempt
        if (tid, attempt) in self._recs:
            return  # duplicate
        if attempt < 0 or ev.producers < 1:
            out.append(Fail(tid, attempt, "invalid registration"))
            return
        if ev.deadline <= self._now:
            out.append(Fail(tid, attempt, "registration deadline already passed"))
            return
        cur = self._current.get(tid)
        if cur is not None and attempt < cur:
            out.append(Fail(tid, attempt, f"stale attempt: attempt {cur} is newer"))
            return
        if cur is not None:
            old = self._recs.get((tid, cur))
            if old is not None:
                self._dispatch(old, _Supersede(attempt), out)
        rec = _Attempt(tid, attempt, ev.producers, ev.deadline, self._now)
        self._recs[(tid, attempt)] = rec
        self._current[tid] = attempt
        self._set_state(rec, State.WAITING)
        out.append(Accepted(tid, attempt))

    # ------------------------------------------------------------------ handlers

    def _resolve(self, rec: _Attempt, ev: Any, out: list[Action]) -> bool:
        """Count one producer's final word; False for out-of-range ranks and duplicates."""
        p = ev.producer_rank
        if not 0 <= p < rec.producers or p in rec.resolved:
            return False
        rec.resolved.add(p)
        if isinstance(ev, Notified):
            rec.notified.add(p)
        elif not rec.reason:
            why = ev.reason if isinstance(ev, ProducerFailed) else "cancelled"
            rec.reason = f"producer {p}: {why}"
        return True

    def _on_result(self, rec: _Attempt, ev: Any, out: list[Action]) -> None:
        """FAILING / ABORTING / SUPERSEDED: any final word counts the same."""
        if self._resolve(rec, ev, out):
            self._settle(rec, out)

    def _notified(self, rec: _Attempt, ev: Notified, out: list[Action]) -> None:
        if self._resolve(rec, ev, out):
            self._settle(rec, out)

    def _producer_gone(
        self, rec: _Attempt, ev: ProducerFailed | CancelConfirmed, out: list[Action]
    ) -> None:
        """WAITING: one producer will not write, so this attempt cannot complete."""
        if self._resolve(rec, ev, out):
            self._set_state(rec, State.FAILING)
            self._cancel_rest(rec, rec.reason, out)
            self._settle(rec, out)

    def _abort(self, rec: _Attempt, ev: Abort, out: list[Action]) -> None:
        if rec.state is State.WAITING:  # FAILING / SUPERSEDED already sent their cancel
            self._cancel_rest(rec, f"aborted: {ev.reason}", out)
        self._set_state(rec, State.ABORTING)
        self._settle(rec, out)

    def _abort_unknown(self, rec: None, ev: Abort, out: list[Action]) -> None:
        """Nothing registered (or long settled) for this attempt: blocks are free."""
        out.append(Release(ev.transfer_id, ev.attempt))

    def _release_now(self, rec: _Attempt, ev: Any, out: list[Action]) -> None:
        """Abort after Complete/Fail, or ABORTING's hard deadline: free the blocks."""
        out.append(Release(rec.transfer_id, rec.attempt))
        self._set_state(rec, State.RELEASED)

    def _supersede(self, rec: _Attempt, ev: _Supersede, out: list[Action]) -> None:
        if rec.state is State.WAITING:
            self._cancel_rest(rec, f"superseded by attempt {ev.attempt}", out)
        self._set_state(rec, State.SUPERSEDED)
        self._settle(rec, out)

    def _timeout(self, rec: _Attempt, ev: _Deadline, out: list[Action]) -> None:
        missing = rec.producers - len(rec.notified)
        why = f"timed out waiting for {missing} of {rec.producers} producers"
        out.append(Fail(rec.transfer_id, rec.attempt, why))
        self._cancel_rest(rec, why, out)
        self._set_state(rec, State.FAILED)

    def _fail_now(self, rec: _Attempt, ev: _Deadline, out: list[Action]) -> None:
        out.append(Fail(rec.transfer_id, rec.attempt, rec.reason))
        self._set_state(rec, State.FAILED)

    def _ignore(self, rec: _Attempt | None, ev: Any, out: list[Action]) -> None:
        return


# ------------------------------------------------------------------------ the table
# Every transition of a (transfer, attempt), in one place (Expect and Tick are handled
# by ``handle``: Expect creates records and sends _Supersede through this table).

_C = CompletionCounter
_WT, _FG, _AB, _SU = State.WAITING, State.FAILING, State.ABORTING, State.SUPERSEDED
_CO, _FD, _RL = State.COMPLETED, State.FAILED, State.RELEASED
_RESULTS = (Notified, ProducerFailed, CancelConfirmed)

_TABLE: dict[tuple[State | None, type], Handler] = {
    # no record: results are stale or unknown; an abort frees at once
    **{(None, e): _C._ignore for e in _RESULTS},
    (None, Abort): _C._abort_unknown,
    # WAITING
    (_WT, Notified): _C._notified,
    (_WT, ProducerFailed): _C._producer_gone,
    (_WT, CancelConfirmed): _C._producer_gone,
    (_WT, Abort): _C._abort,
    (_WT, _Supersede): _C._supersede,
    (_WT, _Deadline): _C._timeout,
    # FAILING
    **{(_FG, e): _C._on_result for e in _RESULTS},
    (_FG, Abort): _C._abort,  # the engine gets Release instead of Fail
    (_FG, _Supersede): _C._supersede,
    (_FG, _Deadline): _C._fail_now,
    # ABORTING: Release is owed whatever happens
    **{(_AB, e): _C._on_result for e in _RESULTS},
    (_AB, Abort): _C._ignore,
    (_AB, _Supersede): _C._ignore,
    (_AB, _Deadline): _C._release_now,
    # SUPERSEDED: no engine output unless the engine aborts this attempt
    **{(_SU, e): _C._on_result for e in _RESULTS},
    (_SU, Abort): _C._abort,
    (_SU, _Supersede): _C._ignore,
    (_SU, _Deadline): _C._drop,
    # tombstones
    **{(s, e): _C._ignore for s in (_CO, _FD, _RL) for e in _RESULTS},
    (_CO, Abort): _C._release_now,  # all producers notified: nothing in flight
    (_FD, Abort): _C._release_now,  # Fail came only once all answered or at the deadline
    (_RL, Abort): _C._ignore,
    **{(s, _Supersede): _C._ignore for s in (_CO, _FD, _RL)},
    **{(s, _Deadline): _C._drop for s in (_CO, _FD, _RL)},
}
del _C, _WT, _FG, _AB, _SU, _CO, _FD, _RL
