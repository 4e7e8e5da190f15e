"""Decode-side completion counter: when is a registered transfer fully received?

Each destination rank's daemon expects exactly one notification from every producer
rank that writes into it. This pure state machine (no I/O, no clock, no threads)
counts them per (transfer, attempt) and decides what the local engine hears:
``Complete`` (Received), ``Fail`` (ReceiveFailed: recompute) or, after an engine
abort, ``Release`` (Released: the blocks may be reused). A registration it will not take
(an older attempt than the transfer's newest, or one whose outcome was already told) is
answered ``Refuse`` at once: silence would leave the engine waiting out its timeout.

The rule that shapes it: the engine reuses blocks as soon as it hears Fail or Release,
so neither is emitted while a producer might still write into them — every producer
must have notified, failed, or confirmed a cancel first. A producer failure therefore
cancels the other producers and fails once they answer, usually within a round trip.
Where that cannot be known — the hard deadline passed with producers unresolved (a hung
producer must not pin blocks forever), or a producer was given up with a WRITE possibly
still on its way (``ProducerFailed.may_land``: its link went silent, or its own WRITE
timed out; NIXL cannot recall a posted WRITE, and UCX delivers it after a partition
heals) — the Fail or Release is marked ``unsafe``: the daemon must not hand those blocks
back while its NIXL agent can still receive; it fences instead (kvpush.daemon.decode_side).

The counter owns every fact of a registration: which producers (index ``i``: endpoint,
TP rank and an opaque per-producer payload the caller forwards on ``Accepted``), since
when, until when, and what its producers announced (``Announced``: how tightly to poll NIXL
for it, whether a WRITE of it may still land). Its actions carry what the shell needs to
carry them out (``SendCancel`` the producers to tell, ``Complete``/``Fail`` the
registration's age and size), and a producer's answer may name it by endpoint: the shell
keeps no record of its own and does not ask back. A NIXL notification (``Noticed``) names its
producer by TP rank and comes with the endpoints of the producers whose NIXL agent sent it
(agents are the shell's knowledge) and the tag it carries: it counts only for the transfer's
newest live attempt, only if its tag verifies under the key this registration gave that
producer (``Registered.keys``, :func:`kvpush.proto.notif.authentic`) and only from that
producer's agent (``Arrived``). NIXL lets any agent that holds our metadata take any name
and write into our blocks, so a tag that does not verify, or a second notification of a
producer already counted (a replay), is ``Tampered``: never counted, and the attempt fails
(its producers are cancelled first, as for a producer failure): blocks an impostor may have
written are recomputed, never decoded from. Anything else is ignored or reported (``Stranger``).

Events are facts in the past tense (``Registered``, ``Notified``, ``ProducerCancelled``,
``Aborted`` ...), never a wire message's name: the shell (:mod:`kvpush.daemon.decode_side`)
translates ``proto.Register``, ``proto.CancelConfirmed``, ``proto.Abort`` into them.

Every transition is one row of ``TABLE`` at the end of this module,
``(state, event type, guard) -> (new state, steps)``; ``None`` = no record for that
(transfer, attempt). See :mod:`kvpush.common.machine.core` for how rows are picked.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from kvpush.common.machine.core import Core, Record, Table, _Deadline, row
from kvpush.daemon.core.causes import Cause
from kvpush.daemon.core.counter_events import (  # noqa: F401 - re-exported, the counter's vocabulary
    Aborted,
    Accepted,
    Action,
    Announced,
    Arrived,
    Complete,
    Event,
    Fail,
    Noticed,
    Notified,
    PollNow,
    ProducerCancelled,
    ProducerFailed,
    Refuse,
    Registered,
    Release,
    SendCancel,
    Stranger,
    Tampered,
    Tick,
)
from kvpush.proto.notif import Notification, authentic

__all__ = [
    "Aborted", "Accepted", "Action", "Announced", "Arrived", "ProducerCancelled", "Cause", "Complete",
    "CompletionCounter", "Event", "Registered", "Fail", "Noticed", "Notified", "PendingInfo", "PollNow",
    "ProducerFailed", "Refuse", "Registration", "Release", "SendCancel", "State", "Stranger", "TABLE",
    "TOMBSTONES", "Tampered", "Tick",
]

HINT_S = 0.02  # how long a completed WRITE keeps the tight poll if its notification never shows
MAX_GROUP_HINTS = 64  # group WRITEs tracked in flight per attempt (producers keep a few each)


# --------------------------------------------------------------------------- states


class State(enum.StrEnum):
    """Per-(transfer, attempt) states. COMPLETED, FAILED and RELEASED are tombstones,
    kept ``tombstone_s`` so late duplicates are recognised, then purged. Every live state
    has at least one producer unresolved (otherwise its row would have left it)."""

    WAITING = "waiting"  # counting notifications; every resolved producer notified
    FAILING = "failing"  # a producer failed; cancelled the rest, Fail once all answered
    ABORTING = "aborting"  # engine aborted; Release once all producers answered
    SUPERSEDED = "superseded"  # a newer attempt exists; forgotten once all answered
    COMPLETED = "completed"
    FAILED = "failed"
    RELEASED = "released"


TOMBSTONES = frozenset({State.COMPLETED, State.FAILED, State.RELEASED})


@dataclass(frozen=True)
class PendingInfo:
    """One (transfer, attempt) as ops sees it."""

    transfer_id: str
    attempt: int
    state: State
    notified: int
    resolved: int  # notified, failed or cancel-confirmed
    producers: int
    age: float
    deadline: float


@dataclass(frozen=True)
class Registration:
    """One registered (transfer, attempt), everything the daemon loop needs about it."""

    transfer_id: str
    attempt: int
    state: State
    live: bool  # not a tombstone: the engine has not heard the outcome yet
    producers: int
    endpoints: tuple[str, ...]  # producer i's daemon endpoint (empty if not given)
    ranks: tuple[int, ...]  # producer i's TP rank (empty if not given)
    forwards: tuple[Any, ...]
    since: float
    deadline: float
    notified: int
    announced_until: float  # a WRITE a producer announced may still land until (-inf: none)


@dataclass(eq=False)
class _Attempt(Record):
    transfer_id: str
    attempt: int
    producers: int
    deadline: float  # hard deadline of this registration
    endpoints: tuple[str, ...] = ()
    ranks: tuple[int, ...] = ()
    forwards: tuple[Any, ...] = ()
    keys: tuple[bytes, ...] = ()
    notified: set[int] = field(default_factory=set)
    resolved: set[int] = field(default_factory=set)
    reason: str = ""  # the first producer failure
    cause: Cause = Cause.PRODUCER_FAILED
    may_land: bool = False  # a producer given up on may still write (ProducerFailed.may_land)
    superseded: bool = False  # a newer attempt was accepted: this one is not the newest
    tainted: bool = False  # a notification its producers did not send came (Tampered): it fails
    # What its producers announced (Announced): wake-ups for the poll, never proofs.
    announced_until: float = float("-inf")  # a WRITE announced may still land until
    poll_until: float = float("-inf")  # poll tightly until: its final WRITE is on its way
    groups: set[tuple[int, int]] = field(default_factory=set)  # (producer rank, group) WRITEs in flight

    def unsafe(self) -> bool:
        """May a WRITE still land in these blocks? (unresolved producers, or one given up on)"""
        return self.may_land or len(self.resolved) < self.producers


_Key = tuple[str, int]


def _by_transfer(transfer_id: str) -> tuple[str, str]:
    """The index name of a transfer's records (endpoints, the other names, are strings)."""
    return ("transfer", transfer_id)


def _hard_deadline(rec: _Attempt) -> float:
    return rec.deadline


#: Every live state waits at most until the registration's hard deadline.
DEADLINES = {s: _hard_deadline for s in State if s not in TOMBSTONES}


class CompletionCounter(Core[_Key, _Attempt]):
    """Counts producer notifications per (transfer, attempt); see the module docstring.

    ``handle`` is O(1) amortised per event; expiry is O(expired · log n) and a heap
    peek when nothing is due. ``max_attempts`` bounds the live records (None: unbounded).
    """

    def __init__(self, *, tombstone_s: float = 60.0, max_attempts: int | None = None,
                 cancel_grace_s: float = 0.0, write_timeout_s: float = 5.0, hint_s: float = HINT_S,
                 max_group_hints: int = MAX_GROUP_HINTS) -> None:
        super().__init__(TABLE, TOMBSTONES, DEADLINES, tombstone_s=tombstone_s, max_live=max_attempts)
        self.cancel_grace_s = cancel_grace_s  # after the hard deadline, for cancels to be answered
        self.write_timeout_s = write_timeout_s  # a posted WRITE may land until then (the producers' bound)
        self.hint_s = hint_s
        self.max_group_hints = max_group_hints
        self._tight: dict[_Key, None] = {}  # records that asked for a tight poll (some may no longer)

    # ------------------------------------------------------------------ public API

    def info(self, transfer_id: str, attempt: int, now: float | None = None) -> PendingInfo | None:
        """One (transfer, attempt), tombstones included."""
        return self._view((transfer_id, attempt), now)  # type: ignore[no-any-return]

    def current(self, transfer_id: str) -> int | None:
        """The newest accepted attempt of the transfer still on record: the one of its
        records not superseded (accepting an attempt supersedes the newest before it, so
        there is at most one). O(attempts on record of this transfer)."""
        for key in self._index_get(_by_transfer(transfer_id)):
            if not self._recs[key].superseded:
                return key[1]
        return None

    def live(self, transfer_id: str) -> bool:
        """The transfer's newest attempt is registered and its outcome not yet told."""
        cur = self.current(transfer_id)
        return cur is not None and self._is_live((transfer_id, cur))

    def registration(self, transfer_id: str, attempt: int | None = None) -> Registration | None:
        """That attempt (None: the newest) while on record, tombstones included."""
        rec = self._rec(transfer_id, attempt)
        if rec is None:
            return None
        return Registration(
            transfer_id=rec.transfer_id,
            attempt=rec.attempt,
            state=rec.state,
            live=rec.state not in TOMBSTONES,
            producers=rec.producers,
            endpoints=rec.endpoints,
            ranks=rec.ranks,
            forwards=rec.forwards,
            since=rec.created,
            deadline=rec.deadline,
            notified=len(rec.notified),
            announced_until=rec.announced_until,
        )

    def producer_index(self, transfer_id: str, endpoint: str, attempt: int | None = None) -> int | None:
        """Which producer of that attempt (None: the newest) ``endpoint`` is."""
        rec = self._rec(transfer_id, attempt)
        if rec is None or endpoint not in rec.endpoints:
            return None
        return rec.endpoints.index(endpoint)

    def rank_index(self, transfer_id: str, rank: int, attempt: int | None = None) -> int | None:
        """Which producer of that attempt (None: the newest) TP rank ``rank`` is."""
        rec = self._rec(transfer_id, attempt)
        if rec is None or rank not in rec.ranks:
            return None
        return rec.ranks.index(rank)

    def tight(self, now: float) -> bool:
        """Must NIXL be polled tightly now: a live attempt's final WRITE was announced and its
        notification may still come (within the announcement's window), or a group WRITE of
        one is in flight (between group WRITEs the next layers are still being computed).
        Forgets, on the way, the records that no longer ask."""
        for key in list(self._tight):
            rec = self._recs.get(key)
            if rec is not None and rec.state not in TOMBSTONES and (rec.groups or now <= rec.poll_until):
                return True
            del self._tight[key]
        return False

    def waiting_on(self, endpoint: str) -> list[tuple[str, int, int]]:
        """(transfer, attempt, producer index) of every live attempt, current or older,
        that has not heard from the producer at ``endpoint`` yet: what to fail when that
        prefill daemon is gone."""
        out = []
        for key in self._index_get(endpoint):
            rec = self._recs[key]
            if rec.state in TOMBSTONES:
                continue
            for i, ep in enumerate(rec.endpoints):
                if ep == endpoint and i not in rec.resolved:
                    out.append((rec.transfer_id, rec.attempt, i))
        return sorted(out)

    # ------------------------------------------------------------ Core hooks

    def _rec(self, transfer_id: str, attempt: int | None) -> _Attempt | None:
        if attempt is None:
            attempt = self.current(transfer_id)
            if attempt is None:
                return None
        return self._recs.get((transfer_id, attempt))

    def _route(self, ev: object) -> Iterable[_Key]:
        if isinstance(ev, Tick):
            return ()
        key = (ev.transfer_id, ev.attempt)  # type: ignore[attr-defined]
        if isinstance(ev, Registered) and key not in self._recs:
            # The newest attempt hears a newer one first (its row supersedes it), but only
            # when the table will accept the newer one: its row from "no record" creates one.
            cur = self.current(ev.transfer_id)
            if cur is not None and cur < ev.attempt and self.table.pick(self, None, ev).to is not None:
                return ((ev.transfer_id, cur), key)
        return (key,)

    def _create(self, key: _Key, ev: Registered) -> _Attempt:
        rec = _Attempt(
            transfer_id=ev.transfer_id,
            attempt=ev.attempt,
            producers=ev.producers,
            deadline=ev.deadline,
            endpoints=tuple(ev.endpoints),
            ranks=tuple(ev.ranks),
            forwards=tuple(ev.forwards),
            keys=tuple(ev.keys),
        )
        for ep in set(rec.endpoints):
            self._index_add(key, rec, ep)
        self._index_add(key, rec, _by_transfer(ev.transfer_id))
        return rec

    def _forgotten(self, key: _Key, rec: _Attempt) -> None:
        self._tight.pop(key, None)

    def _info(self, rec: _Attempt, now: float) -> PendingInfo:
        return PendingInfo(
            transfer_id=rec.transfer_id,
            attempt=rec.attempt,
            state=rec.state,
            notified=len(rec.notified),
            resolved=len(rec.resolved),
            producers=rec.producers,
            age=now - rec.created,
            deadline=rec.deadline,
        )


# ============================================================================ guards
# Pure predicates over (core, record, event), evaluated before any step of the row.


def invalid(cc: CompletionCounter, rec: None, ev: Registered) -> bool:
    sized = (ev.endpoints, ev.ranks, ev.forwards, ev.keys)
    return ev.attempt < 0 or ev.producers < 1 or any(t and len(t) != ev.producers for t in sized)


def late(cc: CompletionCounter, rec: None, ev: Registered) -> bool:
    return ev.deadline <= cc.now


def stale(cc: CompletionCounter, rec: None, ev: Registered) -> bool:
    """An older attempt than the transfer's newest: refused."""
    cur = cc.current(ev.transfer_id)
    return cur is not None and ev.attempt < cur


def overloaded(cc: CompletionCounter, rec: None, ev: Registered) -> bool:
    return cc.overloaded()


def newer(cc: CompletionCounter, rec: _Attempt, ev: Registered) -> bool:
    """A newer attempt of this record's transfer that the table accepts (``_route`` routes
    it here only then): this record is superseded."""
    return ev.attempt > rec.attempt


def stale_here(cc: CompletionCounter, rec: _Attempt, ev: Registered) -> bool:
    """This record's own attempt registered again while a newer attempt is the newest."""
    return rec.superseded


def _producer(rec: _Attempt, ev: Any) -> int | None:
    """The index of the producer an event names (by index, endpoint or TP rank); None: not one of them."""
    if isinstance(ev, Noticed):
        return rec.ranks.index(ev.producer_rank) if ev.producer_rank in rec.ranks else None
    p = ev.producer
    if isinstance(p, str):
        return rec.endpoints.index(p) if p in rec.endpoints else None
    return p if 0 <= p < rec.producers else None


def unresolvable(cc: CompletionCounter, rec: _Attempt, ev: Any) -> bool:
    """An out-of-range or unknown producer, or one whose final word was already counted."""
    p = _producer(rec, ev)
    return p is None or p in rec.resolved


def completes(cc: CompletionCounter, rec: _Attempt, ev: Notified) -> bool:
    """This notification is the last one missing."""
    return len(rec.notified) + 1 == rec.producers


def last_unresolved(cc: CompletionCounter, rec: _Attempt, ev: Any) -> bool:
    """This producer is the last one whose final word was missing."""
    return len(rec.resolved) + 1 == rec.producers


def not_counted_here(cc: CompletionCounter, rec: _Attempt, ev: Noticed) -> bool:
    """A notification for an attempt that is not the transfer's newest, or from a producer
    rank this attempt has none of: ignored by design (stale, or not ours)."""
    return rec.superseded or ev.producer_rank not in rec.ranks


def _tamper(rec: _Attempt, ev: Noticed) -> str:
    """Why the producer this notification names did not send it ("forged": its tag does not
    verify under that producer's key; "replayed": that producer's was counted already), or ""."""
    p = rec.ranks.index(ev.producer_rank)
    key = rec.keys[p] if rec.keys else b""
    if not authentic(key, Notification(ev.transfer_id, ev.attempt, ev.producer_rank, ev.tag)):
        return "forged"
    return "replayed" if p in rec.notified else ""


def tampered(cc: CompletionCounter, rec: _Attempt, ev: Noticed) -> bool:
    """For one of this attempt's producer ranks, and not sent by that producer (see ``_tamper``)."""
    return ev.producer_rank in rec.ranks and bool(_tamper(rec, ev))


def stranger(cc: CompletionCounter, rec: _Attempt, ev: Noticed) -> bool:
    """Not sent by the agent of the producer it names."""
    i = rec.ranks.index(ev.producer_rank)
    return not rec.endpoints or rec.endpoints[i] not in ev.senders


# ============================================================================= steps
# (core, record, event, out): change the record's facts, append actions. No states.


def _since(rec: _Attempt) -> dict[str, Any]:
    """What an outcome carries of its registration (for the shell's history)."""
    return {"since": rec.created, "producers": len(rec.endpoints)}


def fail_invalid(cc: CompletionCounter, rec: None, ev: Registered, out: list) -> None:
    out.append(Fail(ev.transfer_id, ev.attempt, "invalid registration", Cause.INVALID))


def fail_late(cc: CompletionCounter, rec: None, ev: Registered, out: list) -> None:
    out.append(Fail(ev.transfer_id, ev.attempt, "registration deadline already passed", Cause.INVALID))


def refuse_stale(cc: CompletionCounter, rec: _Attempt | None, ev: Registered, out: list) -> None:
    cur = cc.current(ev.transfer_id)
    why = f"stale attempt: attempt {cur} is newer" if cur is not None else "stale attempt: superseded"
    out.append(Refuse(ev.transfer_id, ev.attempt, why, Cause.SUPERSEDED))


def refuse_ended(cc: CompletionCounter, rec: _Attempt, ev: Registered, out: list) -> None:
    """Its outcome was told: repeating it could vouch for blocks nobody wrote."""
    why = (f"attempt {ev.attempt} of this transfer already ended ({rec.state.name.lower()}); "
           "register a new attempt")
    out.append(Refuse(ev.transfer_id, ev.attempt, why, Cause.CLOSED))


def fail_overloaded(cc: CompletionCounter, rec: None, ev: Registered, out: list) -> None:
    out.append(Fail(ev.transfer_id, ev.attempt, "overloaded", Cause.OVERLOADED))


def supersede(cc: CompletionCounter, rec: _Attempt, ev: Registered, out: list) -> None:
    """A newer attempt is accepted: this one is no longer the transfer's newest."""
    rec.superseded = True


def accept(cc: CompletionCounter, rec: _Attempt, ev: Registered, out: list) -> None:
    out.append(Accepted(rec.transfer_id, rec.attempt, rec.forwards, rec.endpoints))


def resolve(cc: CompletionCounter, rec: _Attempt, ev: Any, out: list) -> None:
    """Count one producer's final word (the row's guard ruled out repeats)."""
    p = _producer(rec, ev)
    assert p is not None  # the row's guard
    rec.resolved.add(p)
    if isinstance(ev, Notified | Noticed):
        rec.notified.add(p)
    elif isinstance(ev, ProducerFailed) and ev.may_land and (not ev.announced_only
                                                             or ev.now <= rec.announced_until):
        rec.may_land = True
    if not isinstance(ev, Notified | Noticed) and not rec.reason:
        why = ev.reason if isinstance(ev, ProducerFailed) else "cancelled"
        rec.reason = f"producer {p}: {why}"
        rec.cause = ev.cause if isinstance(ev, ProducerFailed) else Cause.CANCELLED


def _cancel_rest(rec: _Attempt, reason: str, cause: Cause, out: list) -> None:
    """Stop producers that may still write (they may otherwise write late)."""
    if len(rec.resolved) < rec.producers:
        out.append(SendCancel(rec.transfer_id, rec.attempt, reason, cause,
                              () if rec.superseded else rec.endpoints))


def cancel_failed(cc: CompletionCounter, rec: _Attempt, ev: Any, out: list) -> None:
    _cancel_rest(rec, rec.reason, rec.cause, out)


def cancel_aborted(cc: CompletionCounter, rec: _Attempt, ev: Aborted, out: list) -> None:
    _cancel_rest(rec, f"aborted: {ev.reason}", Cause.ABORTED, out)


def cancel_superseded(cc: CompletionCounter, rec: _Attempt, ev: Registered, out: list) -> None:
    _cancel_rest(rec, f"superseded by attempt {ev.attempt}", Cause.SUPERSEDED, out)


def complete(cc: CompletionCounter, rec: _Attempt, ev: Any, out: list) -> None:
    out.append(Complete(rec.transfer_id, rec.attempt, **_since(rec)))


def fail(cc: CompletionCounter, rec: _Attempt, ev: Any, out: list) -> None:
    out.append(Fail(rec.transfer_id, rec.attempt, rec.reason, rec.cause, rec.unsafe(), **_since(rec)))


def time_out(cc: CompletionCounter, rec: _Attempt, ev: _Deadline, out: list) -> None:
    """The hard deadline passed: cancel the producers still out and give them ``cancel_grace_s``
    to answer (a live one answers within a round trip, once nothing of it is in flight), so
    that a timeout is a safe Fail; one that stays silent makes it unsafe (FAILING's deadline)."""
    missing = rec.producers - len(rec.notified)
    rec.reason = f"timed out waiting for {missing} of {rec.producers} producers"
    rec.cause = Cause.TIMEOUT
    rec.deadline = cc.now + cc.cancel_grace_s
    _cancel_rest(rec, rec.reason, Cause.TIMEOUT, out)


def fail_timeout(cc: CompletionCounter, rec: _Attempt, ev: _Deadline, out: list) -> None:
    missing = rec.producers - len(rec.notified)
    why = f"timed out waiting for {missing} of {rec.producers} producers"
    out.append(Fail(rec.transfer_id, rec.attempt, why, Cause.TIMEOUT, rec.unsafe(), **_since(rec)))
    _cancel_rest(rec, why, Cause.TIMEOUT, out)


def graceless(cc: CompletionCounter, rec: _Attempt, ev: _Deadline) -> bool:
    return cc.cancel_grace_s <= 0


def release(cc: CompletionCounter, rec: _Attempt, ev: Any, out: list) -> None:
    out.append(Release(rec.transfer_id, rec.attempt, rec.unsafe()))


def release_settled(cc: CompletionCounter, rec: _Attempt, ev: Aborted, out: list) -> None:
    """The engine heard the outcome already (Received, or a Fail it was safe to hear)."""
    out.append(Release(rec.transfer_id, rec.attempt))


def release_unknown(cc: CompletionCounter, rec: None, ev: Aborted, out: list) -> None:
    """Nothing registered (or long settled) for this attempt: the blocks are free."""
    out.append(Release(ev.transfer_id, ev.attempt))


def note_write(cc: CompletionCounter, rec: _Attempt, ev: Announced, out: list) -> None:
    """What a producer's announcement means for the poll: a posted WRITE may land until the
    write timeout, a completed one's notification trails it by ``hint_s``. The final WRITE
    keeps the poll tight until then, and once done is looked for at once; a group WRITE keeps
    it tight only while in flight (up to ``max_group_hints``: past that, as a final WRITE)."""
    until = ev.now + (cc.hint_s if ev.done else cc.write_timeout_s)
    if not (ev.group and ev.done):  # a done group keeps its posted hint's window
        rec.announced_until = max(rec.announced_until, until)
    if not ev.group:
        rec.poll_until = max(rec.poll_until, until)
        if ev.done:
            out.append(PollNow(rec.transfer_id, rec.attempt, ev.now))
    elif ev.done:
        rec.groups.discard((ev.producer_rank, ev.group))
    elif len(rec.groups) < cc.max_group_hints:
        rec.groups.add((ev.producer_rank, ev.group))
    else:
        rec.poll_until = max(rec.poll_until, until)
    cc._tight[(rec.transfer_id, rec.attempt)] = None


def arrived(cc: CompletionCounter, rec: _Attempt, ev: Noticed, out: list) -> None:
    out.append(Arrived(rec.transfer_id, rec.attempt))


def report_stranger(cc: CompletionCounter, rec: _Attempt, ev: Noticed, out: list) -> None:
    out.append(Stranger(rec.transfer_id, rec.attempt, ev.agent))


def report_tampered(cc: CompletionCounter, rec: _Attempt, ev: Noticed, out: list) -> None:
    out.append(Tampered(rec.transfer_id, rec.attempt, ev.agent, _tamper(rec, ev)))


def taint(cc: CompletionCounter, rec: _Attempt, ev: Noticed, out: list) -> None:
    """Someone else may have written into these blocks: the attempt fails (the engine
    recomputes), once its producers answered the cancel (``cancel_failed``) as for a failure."""
    rec.tainted = True
    if not rec.reason:
        rec.reason = (f"{_tamper(rec, ev)} notification for producer rank {ev.producer_rank} from NIXL agent "
                      f"{ev.agent!r} refused: the blocks are not trusted")
        rec.cause = Cause.FORGED


# ========================================================================= the table

_WT, _FG, _AB, _SU = State.WAITING, State.FAILING, State.ABORTING, State.SUPERSEDED
_CO, _FD, _RL = State.COMPLETED, State.FAILED, State.RELEASED
_GONE = (ProducerFailed, ProducerCancelled)  # a producer that will not write
_RESULTS = (Notified, *_GONE)
_CURRENT_ONLY = "only the newest attempt is superseded, and a SUPERSEDED one is not the newest"

TABLE = Table(State, (Registered, *_RESULTS, Aborted, _Deadline, Announced, Noticed), [
    # --- no record --------------------------------------------------------------------
    row(None, Registered, invalid, None, fail_invalid),
    row(None, Registered, late, None, fail_late),
    row(None, Registered, stale, None, refuse_stale),
    row(None, Registered, overloaded, None, fail_overloaded),
    row(None, Registered, None, _WT, accept),
    *[row(None, e, None, None) for e in _RESULTS],  # stale or unknown
    row(None, Aborted, None, None, release_unknown),
    row(None, _Deadline, None, None, unreachable="a forgotten record has no deadline"),

    # --- Registered on record: a newer attempt supersedes the newest (``_route`` brings it
    # here only when the table accepts it); the same attempt again is older than the
    # newest, already told, or a duplicate of one still counting (its Accepted went out).
    row(_WT, Registered, newer, _SU, supersede, cancel_superseded),
    row(_WT, Registered, None, _WT),
    row(_FG, Registered, newer, _SU, supersede),
    row(_FG, Registered, None, _FG),
    row(_AB, Registered, newer, _AB, supersede),
    row(_AB, Registered, stale_here, _AB, refuse_stale),
    row(_AB, Registered, None, _AB),
    row(_SU, Registered, newer, _SU, unreachable=_CURRENT_ONLY),
    row(_SU, Registered, stale_here, _SU, refuse_stale),
    row(_SU, Registered, None, _SU, unreachable="a SUPERSEDED attempt is never the newest"),
    *[r for s in (_CO, _FD, _RL) for r in (
        row(s, Registered, newer, s, supersede),
        row(s, Registered, stale_here, s, refuse_stale),
        row(s, Registered, None, s, refuse_ended),
    )],

    # --- WAITING: counting ------------------------------------------------------------
    *[row(_WT, e, unresolvable, _WT) for e in _RESULTS],
    row(_WT, Notified, completes, _CO, resolve, complete),
    row(_WT, Notified, None, _WT, resolve),
    *[row(_WT, e, last_unresolved, _FD, resolve, fail) for e in _GONE],
    *[row(_WT, e, None, _FG, resolve, cancel_failed) for e in _GONE],
    row(_WT, Aborted, None, _AB, cancel_aborted),
    row(_WT, _Deadline, graceless, _FD, fail_timeout),
    row(_WT, _Deadline, None, _FG, time_out),

    # --- FAILING: Fail once every producer answered --------------------------------------
    *[row(_FG, e, unresolvable, _FG) for e in _RESULTS],
    *[row(_FG, e, last_unresolved, _FD, resolve, fail) for e in _RESULTS],
    *[row(_FG, e, None, _FG, resolve) for e in _RESULTS],
    row(_FG, Aborted, None, _AB),  # the engine gets Release instead of Fail
    row(_FG, _Deadline, None, _FD, fail),

    # --- ABORTING: Release is owed whatever happens ---------------------------------------
    *[row(_AB, e, unresolvable, _AB) for e in _RESULTS],
    *[row(_AB, e, last_unresolved, _RL, resolve, release) for e in _RESULTS],
    *[row(_AB, e, None, _AB, resolve) for e in _RESULTS],
    row(_AB, Aborted, None, _AB),
    row(_AB, _Deadline, None, _RL, release),

    # --- SUPERSEDED: no engine output unless the engine aborts this attempt ---------------
    *[row(_SU, e, unresolvable, _SU) for e in _RESULTS],
    *[row(_SU, e, last_unresolved, None, resolve) for e in _RESULTS],
    *[row(_SU, e, None, _SU, resolve) for e in _RESULTS],
    row(_SU, Aborted, None, _AB),
    row(_SU, _Deadline, None, None),

    # --- tombstones -------------------------------------------------------------------
    *[row(s, e, None, s) for s in (_CO, _FD, _RL) for e in _RESULTS],
    row(_CO, Aborted, None, _RL, release_settled),  # all producers notified: nothing in flight
    row(_FD, Aborted, None, _RL, release_settled),  # its Fail was safe, or the daemon fenced
    row(_RL, Aborted, None, _RL),
    *[row(s, _Deadline, None, None) for s in (_CO, _FD, _RL)],  # tombstone time is over

    # --- a producer announced a WRITE: facts for the poll while the attempt is live ---------
    row(None, Announced, None, None),  # unknown, or long settled
    *[row(s, Announced, None, s, note_write) for s in (_WT, _FG, _AB, _SU)],
    *[row(s, Announced, None, s) for s in (_CO, _FD, _RL)],

    # --- a NIXL notification: Notified, for the newest live attempt, from its producer (its
    # tag), its producer's agent; one its producer did not send fails a live attempt.
    row(None, Noticed, None, None),  # stale or unknown: ignored by design
    row(_WT, Noticed, not_counted_here, _WT),
    row(_WT, Noticed, tampered, _FG, report_tampered, taint, cancel_failed),
    *[r for s in (_FG, _AB) for r in (
        row(s, Noticed, not_counted_here, s),
        row(s, Noticed, tampered, s, report_tampered, taint),  # failing or released already
    )],
    *[row(s, Noticed, stranger, s, report_stranger) for s in (_WT, _FG, _AB)],
    row(_WT, Noticed, unresolvable, _WT, unreachable="in WAITING each resolved producer notified: a repeat "
                                                     "is Tampered (replayed)"),
    *[row(s, Noticed, unresolvable, s, arrived) for s in (_FG, _AB)],  # it failed (may_land) or cancelled: late
    row(_WT, Noticed, completes, _CO, arrived, resolve, complete),
    row(_WT, Noticed, None, _WT, arrived, resolve),
    row(_FG, Noticed, last_unresolved, _FD, arrived, resolve, fail),
    row(_FG, Noticed, None, _FG, arrived, resolve),
    row(_AB, Noticed, last_unresolved, _RL, arrived, resolve, release),
    row(_AB, Noticed, None, _AB, arrived, resolve),
    row(_SU, Noticed, tampered, _SU, report_tampered),  # reported, not counted anyway
    row(_SU, Noticed, None, _SU),  # not the newest attempt
    *[r for s in (_CO, _FD, _RL) for r in (
        row(s, Noticed, tampered, s, report_tampered),
        row(s, Noticed, None, s),  # its outcome was told
    )],
])  # fmt: skip
del _WT, _FG, _AB, _SU, _CO, _FD, _RL
