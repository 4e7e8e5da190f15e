"""Who may register, supersede and cancel: the life of one attempt (rendezvous rules).

A transfer's current attempt takes registrations until every destination registered; a
newer attempt supersedes it, its own peers may cancel it, and it ends (``_end_attempt``)
telling every peer with no write in flight; a failure of the whole transfer also decides
how the source blocks go back (``_fail``).

Guards are pure predicates over (core, record, event), evaluated before any step of the
row; steps (core, record, event, out) change the record's facts and append actions, never a
state. The rows of :mod:`kvpush.daemon.core.rendezvous.table` name them. The core is seen
through :class:`~kvpush.daemon.core.rendezvous.records.Host` only: no rule imports it.
"""

from __future__ import annotations

from kvpush.common.machine.core import _Deadline
from kvpush.daemon.core.causes import Cause
from kvpush.daemon.core.quotas import refusal
from kvpush.daemon.core.rendezvous.actions import ConfirmCancel, NotifyFailure
from kvpush.daemon.core.rendezvous.events import Aborted, PeerLost, Prefilled, Registered
from kvpush.daemon.core.rendezvous.records import Host, _Reg, _Transfer, _Verdict

# ============================================================================ guards


def _why_invalid(rv: Host, ev: Registered, rec: _Transfer | None = None) -> str | None:
    if rec is not None and rec.contest.owner and ev.identity != rec.contest.owner:
        return "transfer was registered by another peer"
    if ev.attempt < 0:
        return "negative attempt"
    if ev.expected_dests < 1 or ev.dest_rank < 0:
        return f"dest_rank {ev.dest_rank} / expected_dests {ev.expected_dests}"
    # Destination ranks are the consumers' TP ranks (TP 2 -> 4: producer 1 writes ranks 2 and
    # 3, MLA: rank r of 4 hears from r % 2), so they are not below expected_dests; what must
    # hold is that no more than expected_dests distinct destinations join one attempt.
    # (A registration that disagrees on expected_dests is the `inconsistent` row's to end.)
    if (rec is not None and ev.attempt == rec.attempt and ev.expected_dests == rec.expected
            and ev.dest_rank not in rec.regs and len(rec.regs) >= rec.expected):
        return f"dest_rank {ev.dest_rank} would exceed expected_dests {rec.expected}"
    if ev.deadline <= rv.now:
        return "registration deadline already passed"
    return None


def invalid(rv: Host, rec: _Transfer | None, ev: Registered) -> bool:
    return _why_invalid(rv, ev, rec) is not None


def _why_over_quota(rv: Host, rec: _Transfer | None, ev: Registered) -> str:
    """Why this registration would take its peer over its share (:mod:`quotas`), or "".
    A repeat or an older attempt of a transfer the peer holds is the other rows' to answer:
    a WRITE into those blocks may be in flight, so it must not hear a failure."""
    if rv.quota is None:
        return ""
    holder = quota_holder(ev)
    stake = rv.held_in(ev.transfer_id, holder)
    if stake is not None and rec is not None and ev.attempt <= rec.attempt:
        return ""
    return refusal(rv.quota, rv.held(holder), stake, len(ev.block_ids))


def quota_holder(ev: Registered) -> str:
    """Whose share a registration counts in: its authenticated identity, across all of that
    node's sessions; an unauthenticated peer's (insecure_peers) own session."""
    return ev.identity or ev.peer


def over_quota(rv: Host, rec: _Transfer | None, ev: Registered) -> bool:
    return bool(_why_over_quota(rv, rec, ev))


def overloaded(rv: Host, rec: _Transfer | None, ev: object) -> bool:
    return rv.overloaded()


def overloaded_newer(rv: Host, rec: _Transfer, ev: Registered) -> bool:
    """A newer attempt would make this tombstone live again, but there is no room."""
    return ev.attempt > rec.attempt and rv.overloaded()


def stale(rv: Host, rec: _Transfer, ev: Registered) -> bool:
    """Attempt numbers only grow: an older one is refused."""
    return ev.attempt < rec.attempt


def duplicate(rv: Host, rec: _Transfer, ev: Registered) -> bool:
    return ev.attempt == rec.attempt and ev.dest_rank in rec.regs


def ended(rv: Host, rec: _Transfer, ev: Registered) -> bool:
    """The current attempt already failed or ended: it takes no new registrations."""
    return ev.attempt == rec.attempt and not rec.live


def inconsistent(rv: Host, rec: _Transfer, ev: Registered) -> bool:
    return ev.attempt == rec.attempt and ev.expected_dests != rec.expected


def attempt_over(rv: Host, rec: _Transfer, ev: object) -> bool:
    return not rec.live


def inconsistent_busy(rv: Host, rec: _Transfer, ev: Registered) -> bool:
    return inconsistent(rv, rec, ev) and bool(rec.writes.inflight)


def repeats_write(rv: Host, rec: _Transfer, ev: Registered) -> bool:
    """A registration whose write is in flight is answered by that write's end; any
    earlier word (e.g. "superseded") would let the decode side free blocks NIXL is
    still writing into."""
    return (ev.attempt, ev.dest_rank) in rec.writes.inflight


def answered(rv: Host, rec: _Transfer, ev: Registered) -> bool:
    """A repeat of a registration that already got (or will get) its answer."""
    return repeats_write(rv, rec, ev) or duplicate(rv, rec, ev)


def tokens_differ(rv: Host, rec: _Transfer, ev: Registered) -> bool:
    assert rec.prefill is not None
    return ev.num_tokens != rec.prefill.num_tokens


def completes_set(rv: Host, rec: _Transfer, ev: Registered) -> bool:
    """With this registration every destination of its attempt is registered."""
    if ev.attempt == rec.attempt:
        return len(rec.regs) + 1 == rec.expected
    return ev.expected_dests == 1


def any_tokens_differ(rv: Host, rec: _Transfer, ev: Prefilled) -> bool:
    return any(r.num_tokens != ev.num_tokens for r in rec.regs.values())


def all_registered(rv: Host, rec: _Transfer, ev: object) -> bool:
    return len(rec.regs) == rec.expected


def no_prefill(rv: Host, rec: _Transfer, ev: object) -> bool:
    return rec.prefill is None


def local(rv: Host, rec: _Transfer | None, ev: Aborted) -> bool:
    return ev.origin == "local"


def local_idle(rv: Host, rec: _Transfer, ev: Aborted) -> bool:
    return ev.origin == "local" and not rec.writes.inflight


def local_busy(rv: Host, rec: _Transfer, ev: Aborted) -> bool:
    return ev.origin == "local" and bool(rec.writes.inflight)


def from_peer(rv: Host, rec: _Transfer | None, ev: Aborted) -> bool:
    return ev.origin == "peer"


def cancels_attempt(rv: Host, rec: _Transfer, ev: Aborted) -> bool:
    """Only a peer that registered for the live attempt can end it for everyone."""
    attempt = rec.attempt if ev.attempt is None else ev.attempt
    return (
        ev.origin == "peer"
        and rec.live
        and attempt == rec.attempt
        and any(r.peer == ev.peer for r in rec.regs.values())
    )


def cancels_busy(rv: Host, rec: _Transfer, ev: Aborted) -> bool:
    return cancels_attempt(rv, rec, ev) and bool(rec.writes.inflight)


def _cancelled_parked(rec: _Transfer, ev: Aborted) -> frozenset:
    """Keys of the parked registrations a peer's cancel takes back (see ``confirm``)."""
    attempt = rec.attempt if ev.attempt is None else ev.attempt
    return frozenset(k for k, p in rec.contest.parked.items()
                     if p.reg.peer == ev.peer and (ev.attempt is None or p.attempt == attempt))


def writes_to_peer(rv: Host, rec: _Transfer, ev: PeerLost) -> bool:
    """The lost peer registered for the live attempt."""
    return rec.live and any(r.peer == ev.peer for r in rec.regs.values())


def writes_to_peer_idle(rv: Host, rec: _Transfer, ev: PeerLost) -> bool:
    return writes_to_peer(rv, rec, ev) and not rec.writes.inflight


def writes_to_peer_busy(rv: Host, rec: _Transfer, ev: PeerLost) -> bool:
    return writes_to_peer(rv, rec, ev) and bool(rec.writes.inflight)


# ============================================================================= steps


def _notify(rec: _Transfer, dest: int, reg: _Reg, reason: str, cause: Cause, out: list) -> None:
    out.append(NotifyFailure(rec.transfer_id, rec.attempt, reg.peer, dest, reason, cause))


def _end_attempt(
    rec: _Transfer, reason: str, cause: Cause, out: list, skip_peer: str | None = None
) -> None:
    """End the current attempt: it never writes again. Peers with no write in flight hear
    now; the others hear through their flight's own end."""
    if not rec.live:
        return
    rec.live = False
    rec.ended = (reason, cause)
    for dest, reg in sorted(rec.regs.items()):
        if (rec.attempt, dest) in rec.writes.inflight or dest in rec.writes.done or dest in rec.writes.told:
            continue
        rec.writes.told.add(dest)
        if reg.peer != skip_peer:
            _notify(rec, dest, reg, reason, cause, out)


def _begin_attempt(rec: _Transfer, attempt: int, expected: int, regs: dict[int, _Reg]) -> None:
    """The live attempt from now on (a newer registration, or a parked party taking over).
    Nothing of the older attempt's bookkeeping carries over: what it was written, started or
    told went to other blocks."""
    rec.attempt, rec.live, rec.expected = attempt, True, expected
    rec.regs, rec.writes.started, rec.writes.done = regs, set(), set()
    rec.stream.posted, rec.writes.told = {}, set()


def _fail(rec: _Transfer, reason: str, cause: Cause, out: list) -> None:
    """Fail the whole transfer: the source blocks go back as soon as nothing reads them."""
    _end_attempt(rec, reason, cause, out)
    if rec.verdict is None:
        rec.verdict = _Verdict(False, reason, cause)


def _refuse(ev: Registered, reason: str, cause: Cause, out: list) -> None:
    out.append(NotifyFailure(ev.transfer_id, ev.attempt, ev.peer, ev.dest_rank, reason, cause))


def reject_invalid(rv: Host, rec: _Transfer | None, ev: Registered, out: list) -> None:
    why = _why_invalid(rv, ev, rec)
    assert why is not None
    _refuse(ev, why, Cause.INVALID, out)


def reject_quota(rv: Host, rec: _Transfer | None, ev: Registered, out: list) -> None:
    _refuse(ev, _why_over_quota(rv, rec, ev), Cause.QUOTA, out)


def reject_overloaded(rv: Host, rec: _Transfer | None, ev: Registered, out: list) -> None:
    _refuse(ev, "overloaded", Cause.OVERLOADED, out)


def reject_stale(rv: Host, rec: _Transfer, ev: Registered, out: list) -> None:
    _refuse(ev, f"superseded by attempt {rec.attempt}", Cause.SUPERSEDED, out)


def reject_ended(rv: Host, rec: _Transfer, ev: Registered, out: list) -> None:
    _refuse(ev, f"attempt {ev.attempt} already failed or ended", Cause.CLOSED, out)


def reject_inconsistent(rv: Host, rec: _Transfer, ev: Registered, out: list) -> None:
    _refuse(ev, "expected_dests differs between registrations", Cause.INVALID, out)


def reject_closed(rv: Host, rec: _Transfer, ev: Registered, out: list) -> None:
    why = "source blocks released" if rec.prefill else "transfer aborted"
    _refuse(ev, why, Cause.CLOSED, out)


def end_inconsistent(rv: Host, rec: _Transfer, ev: Registered, out: list) -> None:
    _end_attempt(rec, "inconsistent registrations", Cause.INVALID, out)


def open_attempt(rv: Host, rec: _Transfer, ev: Registered, out: list) -> None:
    """A newer attempt supersedes the current one (same attempt: nothing to do)."""
    if ev.attempt > rec.attempt:
        _end_attempt(rec, f"superseded by attempt {ev.attempt}", Cause.SUPERSEDED, out)
        _begin_attempt(rec, ev.attempt, ev.expected_dests, {})


def add_reg(rv: Host, rec: _Transfer, ev: Registered, out: list) -> None:
    rec.contest.owner = rec.contest.owner or ev.identity
    rec.regs[ev.dest_rank] = _Reg(ev.peer, tuple(ev.block_ids), ev.num_tokens, ev.deadline, ev.first_token,
                                  quota_holder(ev), ev.identity, ev.secret, ev.stream, ev.key,
                                  tuple(ev.kv_groups))
    rv._index_add(rec.transfer_id, rec, ev.peer)


def end_mismatch(rv: Host, rec: _Transfer, ev: Registered, out: list) -> None:
    assert rec.prefill is not None
    msg = f"num_tokens mismatch: registered {ev.num_tokens}, prefilled {rec.prefill.num_tokens}"
    _end_attempt(rec, msg, Cause.MISMATCH, out)


def end_mismatch_all(rv: Host, rec: _Transfer, ev: Prefilled, out: list) -> None:
    bad = [r.num_tokens for r in rec.regs.values() if r.num_tokens != ev.num_tokens]
    msg = f"num_tokens mismatch: registered {bad[0]}, prefilled {ev.num_tokens}"
    _end_attempt(rec, msg, Cause.MISMATCH, out)


def fail_aborted(rv: Host, rec: _Transfer, ev: Aborted, out: list) -> None:
    _fail(rec, f"aborted: {ev.reason}", Cause.ABORTED, out)


def decide_aborted(rv: Host, rec: _Transfer, ev: Aborted, out: list) -> None:
    rec.verdict = _Verdict(False, f"aborted: {ev.reason}", Cause.ABORTED)


def end_cancelled(rv: Host, rec: _Transfer, ev: Aborted, out: list) -> None:
    _end_attempt(rec, f"cancelled by {ev.peer}: {ev.reason}", Cause.CANCELLED, out, skip_peer=ev.peer)


def confirm(rv: Host, rec: _Transfer, ev: Aborted, out: list) -> None:
    """Answer the peer's cancel now, or when its last write of that attempt ends. A parked
    registration of that peer's is forgotten: once confirmed, its blocks may hold another
    request's KV, so it must never be promoted and written."""
    attempt = rec.attempt if ev.attempt is None else ev.attempt
    for key in _cancelled_parked(rec, ev):
        del rec.contest.parked[key]
    flights = [f for (a, _), f in rec.writes.inflight.items() if a == attempt and f.peer == ev.peer]
    for f in flights:
        f.confirm = True
    if not flights:
        out.append(ConfirmCancel(rec.transfer_id, attempt, ev.peer))


def confirm_unknown(rv: Host, rec: None, ev: Aborted, out: list) -> None:
    """Nothing known of that transfer, so nothing is in flight."""
    if ev.attempt is not None and ev.attempt >= 0:
        out.append(ConfirmCancel(ev.transfer_id, ev.attempt, ev.peer))


def confirm_streamed(rv: Host, rec: _Transfer, ev: Aborted, out: list) -> None:
    confirm_unknown(rv, None, ev, out)


def fail_peer_lost(rv: Host, rec: _Transfer, ev: PeerLost, out: list) -> None:
    _fail(rec, f"peer lost: {ev.peer}", Cause.PEER_LOST, out)


def end_timeout(rv: Host, rec: _Transfer, ev: _Deadline, out: list) -> None:
    _end_attempt(rec, "prefill did not complete in time", Cause.TIMEOUT, out)


def fail_lease(rv: Host, rec: _Transfer, ev: _Deadline, out: list) -> None:
    if rec.attempt < 0:  # nobody came: worth telling apart (a router or decode engine not using kvpush)
        _fail(rec, "lease expired: no decode side registered", Cause.UNCLAIMED, out)
    else:
        _fail(rec, "lease expired", Cause.LEASE_EXPIRED, out)


def fail_timeout(rv: Host, rec: _Transfer, ev: _Deadline, out: list) -> None:
    _fail(rec, "prefill did not complete in time", Cause.TIMEOUT, out)
