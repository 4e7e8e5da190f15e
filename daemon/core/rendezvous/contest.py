"""Binding and contest (rendezvous rules): a transfer the engine bound is written only to
the party it names. Before the seal another identity than the owner's is *parked*, not
refused; the seal's binding then settles who gets the KV (``settle``), and when the owner's
attempt ends before the seal the first parked party still live takes over (its heir).

Guards are pure predicates over (core, record, event), evaluated before any step of the
row; steps (core, record, event, out) change the record's facts and append actions, never a
state. The rows of :mod:`kvpush.daemon.core.rendezvous.table` name them. The core is seen
through :class:`~kvpush.daemon.core.rendezvous.records.Host` only: no rule imports it.
"""

from __future__ import annotations

from kvpush.common.machine.core import _Deadline
from kvpush.daemon.core.causes import Cause
from kvpush.daemon.core.rendezvous.actions import NotifyFailure
from kvpush.daemon.core.rendezvous.events import (
    Aborted,
    PeerLost,
    Prefilled,
    Registered,
    WriteDone,
    WriteFailed,
)
from kvpush.daemon.core.rendezvous.records import Host, _Parked, _Reg, _Transfer
from kvpush.daemon.core.rendezvous.registration import (
    _begin_attempt,
    _cancelled_parked,
    _end_attempt,
    _refuse,
    _why_invalid,
    cancels_attempt,
    quota_holder,
    writes_to_peer,
)
from kvpush.daemon.core.rendezvous.writes import drains_ended

# ============================================================================ guards


def contends(rv: Host, rec: _Transfer, ev: Registered) -> bool:
    """Before the prefill, another identity than the owner's registers: it may be the bound
    party (the owner a hijacker that came first), so it is parked, not refused."""
    return rec.prefill is None and bool(rec.contest.owner) and bool(ev.identity) and ev.identity != rec.contest.owner


def unbound(rv: Host, rec: _Transfer, ev: Registered) -> bool:
    """The prefill bound the transfer to another identity or secret."""
    return rec.prefill is not None and not rec.prefill.admits(ev.identity, ev.secret)


def _heir(rv: Host, rec: _Transfer, prefill: Prefilled | None, skip: frozenset = frozenset()) -> list[_Parked]:
    """The parked registrations that would take the transfer over: the first parked identity
    (admitted by ``prefill``'s binding, if given) with a live registration, its newest attempt
    (``skip``: keys of parked registrations about to go)."""
    live = [p for k, p in rec.contest.parked.items() if p.reg.deadline > rv.now and k not in skip
            and (prefill is None or prefill.admits(p.reg.identity, p.reg.secret))]
    if not live:
        return []
    who = live[0].reg.identity
    top = max(p.attempt for p in live if p.reg.identity == who)
    mine = [p for p in live if p.reg.identity == who and p.attempt == top]
    return [p for p in mine if p.expected == mine[0].expected]


def _keeps_owner(rec: _Transfer, ev: Prefilled) -> bool:
    return all(ev.admits(r.identity, r.secret) for r in rec.regs.values())


def _settled(rv: Host, rec: _Transfer, ev: Prefilled) -> list[tuple[int, _Reg]]:
    """The registrations (dest, reg) the transfer has once ``ev``'s binding is applied."""
    if _keeps_owner(rec, ev):
        return sorted(rec.regs.items())
    return [(p.dest_rank, p.reg) for p in _heir(rv, rec, ev)]


def contested(rv: Host, rec: _Transfer, ev: Prefilled) -> bool:
    """Rivals are parked, or the binding ousts the owner's registrations."""
    return bool(rec.contest.parked) or not _keeps_owner(rec, ev)


def contested_mismatch(rv: Host, rec: _Transfer, ev: Prefilled) -> bool:
    return contested(rv, rec, ev) and any(r.num_tokens != ev.num_tokens for _, r in _settled(rv, rec, ev))


def contested_complete(rv: Host, rec: _Transfer, ev: Prefilled) -> bool:
    if not contested(rv, rec, ev):
        return False
    if _keeps_owner(rec, ev):
        return len(rec.regs) == rec.expected
    heir = _heir(rv, rec, ev)
    return bool(heir) and len({p.dest_rank for p in heir}) == heir[0].expected


def _owner_expired(rv: Host, rec: _Transfer) -> bool:
    return any(r.deadline <= rv.now for r in rec.regs.values())


def parked_expired(rv: Host, rec: _Transfer, ev: object) -> bool:
    """Only parked registrations are due: the owner's attempt goes on."""
    return not _owner_expired(rv, rec)


def heir_after_timeout(rv: Host, rec: _Transfer, ev: object) -> bool:
    return bool(_heir(rv, rec, None))


def cancels_with_heir(rv: Host, rec: _Transfer, ev: Aborted) -> bool:
    return cancels_attempt(rv, rec, ev) and bool(_heir(rv, rec, None, _cancelled_parked(rec, ev)))


def lost_with_heir(rv: Host, rec: _Transfer, ev: PeerLost) -> bool:
    return writes_to_peer(rv, rec, ev) and bool(_heir(rv, rec, None))


def drains_to_heir(rv: Host, rec: _Transfer, ev: WriteDone | WriteFailed) -> bool:
    """As ``drains_ended``, with a rival parked meanwhile: it takes the transfer over, as it
    would have had the attempt ended idle (``cancels_with_heir``)."""
    return drains_ended(rv, rec, ev) and bool(_heir(rv, rec, None))


# ============================================================================= steps


def _promote(rv: Host, rec: _Transfer, heir: list[_Parked]) -> None:
    """The heir's registrations become the transfer's (the owner's attempt is over)."""
    first = heir[0]
    _begin_attempt(rec, first.attempt, first.expected, {p.dest_rank: p.reg for p in heir})
    rec.contest.owner = first.reg.identity
    for p in heir:
        del rec.contest.parked[(p.reg.identity, p.dest_rank)]
        rv._index_add(rec.transfer_id, rec, p.reg.peer)


def _refuse_parked(rec: _Transfer, reason: str, cause: Cause, out: list, now: float | None = None) -> None:
    """Answer parked registrations (all, or those due at ``now``) and forget them."""
    for key, p in sorted(rec.contest.parked.items()):
        if now is None or p.reg.deadline <= now:
            del rec.contest.parked[key]
            out.append(NotifyFailure(rec.transfer_id, p.attempt, p.reg.peer, p.dest_rank, reason, cause))


def park(rv: Host, rec: _Transfer, ev: Registered, out: list) -> None:
    """Keep a rival's registration until the prefill's binding (or the owner's end) decides."""
    why = _why_invalid(rv, ev)  # its own fields; the owner rule is what parking defers
    key = (ev.identity, ev.dest_rank)
    if why is None and key not in rec.contest.parked and len(rec.contest.parked) >= rv.max_parked:
        why = f"overloaded: more than {rv.max_parked} rival registrations for one transfer"
        cause = Cause.OVERLOADED
    else:
        cause = Cause.INVALID
    old = rec.contest.parked.get(key)
    if why is None and old is not None and ev.attempt < old.attempt:
        why, cause = f"superseded by attempt {old.attempt}", Cause.SUPERSEDED
    if why is not None:
        _refuse(ev, why, cause, out)
        return
    rec.contest.parked[key] = _Parked(ev.attempt, ev.dest_rank, ev.expected_dests, _Reg(
        ev.peer, tuple(ev.block_ids), ev.num_tokens, ev.deadline, ev.first_token, quota_holder(ev),
        ev.identity, ev.secret, ev.stream, ev.key, tuple(ev.kv_groups)))


def reject_unbound(rv: Host, rec: _Transfer, ev: Registered, out: list) -> None:
    _refuse(ev, "transfer is bound to another party", Cause.UNBOUND, out)


def settle(rv: Host, rec: _Transfer, ev: Prefilled, out: list) -> None:
    """Apply the prefill's binding: the owner keeps the transfer if admitted, else the first
    admitted parked identity takes it (or nobody yet); every other rival is refused."""
    if not _keeps_owner(rec, ev):
        heir = _heir(rv, rec, ev)
        _end_attempt(rec, "transfer is bound to another party", Cause.UNBOUND, out)
        if heir:
            _promote(rv, rec, heir)
        else:
            rec.attempt, rec.expected, rec.regs, rec.contest.owner = -1, 0, {}, ""
    if ev.bound:
        _refuse_parked(rec, "transfer is bound to another party", Cause.UNBOUND, out)
    else:
        _refuse_parked(rec, "transfer was registered by another peer", Cause.INVALID, out)


def expire_parked(rv: Host, rec: _Transfer, ev: object, out: list) -> None:
    _refuse_parked(rec, "prefill did not complete in time", Cause.TIMEOUT, out, now=rv.now)


def promote_heir(rv: Host, rec: _Transfer, ev: object, out: list) -> None:
    """The owner's attempt ended before the prefill: the first parked identity takes over."""
    heir = _heir(rv, rec, None)
    assert heir
    _promote(rv, rec, heir)


def end_owner_timeout(rv: Host, rec: _Transfer, ev: _Deadline, out: list) -> None:
    _end_attempt(rec, "prefill did not complete in time", Cause.TIMEOUT, out)


def end_owner_cancelled(rv: Host, rec: _Transfer, ev: Aborted, out: list) -> None:
    _end_attempt(rec, f"cancelled by {ev.peer}: {ev.reason}", Cause.CANCELLED, out, skip_peer=ev.peer)


def end_owner_lost(rv: Host, rec: _Transfer, ev: PeerLost, out: list) -> None:
    _end_attempt(rec, f"peer lost: {ev.peer}", Cause.PEER_LOST, out)


def refuse_parked(rv: Host, rec: _Transfer, ev: object, out: list) -> None:
    """The transfer ends before the prefill: parked rivals hear it too."""
    _refuse_parked(rec, "transfer ended before its prefill", Cause.CLOSED, out)
