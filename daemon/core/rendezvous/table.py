"""The rendezvous' transition table and the core that runs it.

``TABLE`` is the spec: every transition is one row, ``(state, event type, guard) -> (new
state, steps)`` (``None`` = no record for that transfer); see :mod:`kvpush.common.machine.core`
for how rows are picked. The guards and steps it names live beside it, by concern
(:mod:`.registration`, :mod:`.writes`, :mod:`.contest`, :mod:`.streaming`), and never import
this module. :class:`Rendezvous` adds what the table needs of a core: routing, a record per
transfer, each live state's deadline, the peers' holdings and the ops view.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvpush.common.machine.core import Core, Held, Table, _Deadline, row
from kvpush.daemon.core.quotas import Quota
from kvpush.daemon.core.rendezvous.contest import (
    cancels_with_heir,
    contends,
    contested,
    contested_complete,
    contested_mismatch,
    drains_to_heir,
    end_owner_cancelled,
    end_owner_lost,
    end_owner_timeout,
    expire_parked,
    heir_after_timeout,
    lost_with_heir,
    park,
    parked_expired,
    promote_heir,
    refuse_parked,
    reject_unbound,
    settle,
    unbound,
)
from kvpush.daemon.core.rendezvous.events import (
    Aborted,
    LayersReady,
    PeerLost,
    Prefilled,
    Registered,
    Tick,
    WriteDone,
    WriteFailed,
)
from kvpush.daemon.core.rendezvous.records import (
    DEADLINES,
    TOMBSTONES,
    PendingInfo,
    State,
    _peer_holdings,
    _Transfer,
)
from kvpush.daemon.core.rendezvous.registration import (
    add_reg,
    all_registered,
    answered,
    any_tokens_differ,
    attempt_over,
    cancels_attempt,
    cancels_busy,
    completes_set,
    confirm,
    confirm_streamed,
    confirm_unknown,
    decide_aborted,
    duplicate,
    end_cancelled,
    end_inconsistent,
    end_mismatch,
    end_mismatch_all,
    end_timeout,
    ended,
    fail_aborted,
    fail_lease,
    fail_peer_lost,
    fail_timeout,
    from_peer,
    inconsistent,
    inconsistent_busy,
    invalid,
    local,
    local_busy,
    local_idle,
    no_prefill,
    open_attempt,
    over_quota,
    overloaded,
    overloaded_newer,
    reject_closed,
    reject_ended,
    reject_inconsistent,
    reject_invalid,
    reject_overloaded,
    reject_quota,
    reject_stale,
    repeats_write,
    stale,
    tokens_differ,
    writes_to_peer,
    writes_to_peer_busy,
    writes_to_peer_idle,
)
from kvpush.daemon.core.rendezvous.streaming import (
    note_progress,
    pump,
)
from kvpush.daemon.core.rendezvous.writes import (
    busy,
    completes,
    completes_last,
    count_done,
    decide_ok,
    decide_overloaded,
    drains_ended,
    fail_late,
    fail_write,
    fails_attempt,
    fails_attempt_last,
    final_too_late,
    final_too_late_last,
    hold,
    idle,
    land,
    last_write,
    last_write_ok,
    release,
    release_overloaded,
    start_all,
    start_reg,
    unknown_write,
)

# ========================================================================= the table

_WP, _WR, _WG = State.WAIT_PREFILL, State.WAIT_REGISTER, State.WRITING
_DR, _OK, _FL, _EX = State.DRAINING, State.DONE, State.FAILED, State.EXPIRED
_ST = State.STREAMED
_WRITES_ANSWER = "WRITING and DRAINING set no deadline: the transport answers every write"
_IN_FLIGHT = "WRITING always has a write in flight (all started, not all done, none failed)"

TABLE = Table(State, (Registered, Prefilled, LayersReady, WriteDone, WriteFailed, Aborted, PeerLost, _Deadline), [
    # --- Registered ---------------------------------------------------------------------
    row(None, Registered, over_quota, None, reject_quota),
    row(None, Registered, invalid, None, reject_invalid),
    row(None, Registered, overloaded, None, reject_overloaded),
    row(None, Registered, None, _WP, open_attempt, add_reg),

    row(_WP, Registered, over_quota, _WP, reject_quota),
    row(_WP, Registered, repeats_write, _WP),  # a group WRITE into its blocks answers it
    row(_WP, Registered, contends, _WP, park),
    row(_WP, Registered, invalid, _WP, reject_invalid),
    row(_WP, Registered, stale, _WP, reject_stale),
    row(_WP, Registered, duplicate, _WP),
    row(_WP, Registered, ended, _WP, reject_ended),  # its groups drain (cancelled, inconsistent)
    row(_WP, Registered, inconsistent_busy, _WP, reject_inconsistent, end_inconsistent, refuse_parked),  # drains
    row(_WP, Registered, inconsistent, _EX, reject_inconsistent, end_inconsistent, refuse_parked),
    row(_WP, Registered, None, _WP, open_attempt, add_reg, pump),

    row(_WR, Registered, unbound, _WR, reject_unbound),
    row(_WR, Registered, over_quota, _WR, reject_quota),
    row(_WR, Registered, repeats_write, _WR),
    row(_WR, Registered, invalid, _WR, reject_invalid),
    row(_WR, Registered, stale, _WR, reject_stale),
    row(_WR, Registered, duplicate, _WR),
    row(_WR, Registered, ended, _WR, reject_ended),
    row(_WR, Registered, inconsistent, _WR, reject_inconsistent, end_inconsistent),
    row(_WR, Registered, tokens_differ, _WR, open_attempt, add_reg, end_mismatch),
    row(_WR, Registered, completes_set, _WG, open_attempt, add_reg, start_reg),
    row(_WR, Registered, None, _WR, open_attempt, add_reg, start_reg),

    row(_WG, Registered, unbound, _WG, reject_unbound),
    row(_WG, Registered, over_quota, _WG, reject_quota),
    row(_WG, Registered, repeats_write, _WG),
    row(_WG, Registered, invalid, _WG, reject_invalid),
    row(_WG, Registered, stale, _WG, reject_stale),
    row(_WG, Registered, duplicate, _WG),
    row(_WG, Registered, inconsistent, _WR, reject_inconsistent, end_inconsistent),
    # what is left is a newer attempt (every destination of this one is registered)
    row(_WG, Registered, tokens_differ, _WR, open_attempt, add_reg, end_mismatch),
    row(_WG, Registered, completes_set, _WG, open_attempt, add_reg, start_reg),
    row(_WG, Registered, None, _WR, open_attempt, add_reg, start_reg),

    *[row(s, Registered, over_quota, s, reject_quota) for s in (_DR, _OK, _FL)],
    *[row(s, Registered, answered, s) for s in (_DR, _OK, _FL)],
    *[row(s, Registered, None, s, reject_closed) for s in (_DR, _OK, _FL)],

    # EXPIRED: a newer attempt brings the transfer back (it counts as live again)
    row(_EX, Registered, over_quota, _EX, reject_quota),
    row(_EX, Registered, invalid, _EX, reject_invalid),
    row(_EX, Registered, overloaded_newer, _EX, reject_overloaded),
    row(_EX, Registered, stale, _EX, reject_stale),
    row(_EX, Registered, duplicate, _EX),
    row(_EX, Registered, ended, _EX, reject_ended),
    row(_EX, Registered, None, _WP, open_attempt, add_reg, pump),  # the progress kept goes out

    # STREAMED: progress only; the first registration takes its groups in one WRITE
    row(_ST, Registered, over_quota, _ST, reject_quota),
    row(_ST, Registered, invalid, _ST, reject_invalid),
    row(_ST, Registered, None, _WP, open_attempt, add_reg, pump),

    # --- Prefilled ------------------------------------------------------------------
    row(None, Prefilled, overloaded, None, release_overloaded),
    row(None, Prefilled, None, _WR, hold),
    row(_WP, Prefilled, attempt_over, _WR, hold, refuse_parked),  # the ended attempt's groups drain
    row(_WP, Prefilled, contested_mismatch, _WR, hold, settle, end_mismatch_all),
    row(_WP, Prefilled, contested_complete, _WG, hold, settle, start_all),
    row(_WP, Prefilled, contested, _WR, hold, settle, start_all),
    row(_WP, Prefilled, any_tokens_differ, _WR, hold, end_mismatch_all),
    row(_WP, Prefilled, all_registered, _WG, hold, start_all),
    row(_WP, Prefilled, None, _WR, hold, start_all),
    row(_DR, Prefilled, no_prefill, _DR, hold),  # a stream draining: released at its end
    *[row(s, Prefilled, None, s) for s in (_WR, _WG, _DR, _OK)],  # a duplicate
    # FAILED before any prefill (local abort): give the blocks straight back
    row(_FL, Prefilled, no_prefill, _FL, hold, release),
    row(_FL, Prefilled, None, _FL),
    # EXPIRED: hold the blocks until the lease, for a newer attempt (a decode that was
    # preempted re-registers under a new attempt)
    row(_EX, Prefilled, overloaded, _FL, hold, decide_overloaded, release),
    row(_EX, Prefilled, None, _WR, hold),
    row(_ST, Prefilled, None, _WR, hold),  # nothing written: the final write covers it all

    # --- LayersReady: kept before the seal, written while the live attempt is registered --
    row(None, LayersReady, overloaded, None),
    row(None, LayersReady, None, _ST, note_progress),
    row(_ST, LayersReady, None, _ST, note_progress),
    row(_WP, LayersReady, None, _WP, note_progress, pump),
    # after the seal the final write covers everything; ended transfers write nothing
    *[row(s, LayersReady, None, s) for s in (_WR, _WG, _DR, _OK, _FL)],
    # EXPIRED waits for a newer attempt: keep its progress current (a new epoch voids the old)
    row(_EX, LayersReady, None, _EX, note_progress),

    # --- WriteDone / WriteFailed: only states holding a prefill have writes in flight --
    *[row(s, e, unknown_write, s) for s in (_WP, _WR, _WG, _DR) for e in (WriteDone, WriteFailed)],
    # group WRITEs before the seal: a live attempt's failure fails the transfer
    row(_WP, WriteFailed, fails_attempt_last, _FL, land, fail_write, release, refuse_parked),
    row(_WP, WriteFailed, fails_attempt, _DR, land, fail_write, refuse_parked),
    *[row(_WP, e, drains_to_heir, _WP, land, promote_heir, pump) for e in (WriteDone, WriteFailed)],
    *[row(_WP, e, drains_ended, _EX, land, refuse_parked) for e in (WriteDone, WriteFailed)],
    *[row(_WP, e, None, _WP, land, pump) for e in (WriteDone, WriteFailed)],
    *[row(s, WriteDone, final_too_late_last, _FL, land, fail_late, release) for s in (_WR, _WG)],
    *[row(s, WriteDone, final_too_late, _DR, land, fail_late) for s in (_WR, _WG)],
    row(_WR, WriteDone, None, _WR, land, count_done),  # the live attempt is incomplete
    row(_WG, WriteDone, completes_last, _OK, land, count_done, decide_ok, release),
    row(_WG, WriteDone, completes, _DR, land, count_done, decide_ok),  # older writes read
    row(_WG, WriteDone, None, _WG, land, count_done),
    *[row(s, WriteFailed, fails_attempt_last, _FL, land, fail_write, release) for s in (_WR, _WG)],
    *[row(s, WriteFailed, fails_attempt, _DR, land, fail_write) for s in (_WR, _WG)],
    *[row(s, WriteFailed, None, s, land) for s in (_WR, _WG)],  # an older or dead attempt's
    *[row(_DR, e, last_write_ok, _OK, land, release) for e in (WriteDone, WriteFailed)],
    *[row(_DR, e, last_write, _FL, land, release) for e in (WriteDone, WriteFailed)],
    *[row(_DR, e, None, _DR, land) for e in (WriteDone, WriteFailed)],
    # no write in flight without a held prefill: a stray or repeated answer
    *[row(s, e, None, s) for s in (None, _ST, _OK, _FL, _EX) for e in (WriteDone, WriteFailed)],

    # --- Aborted ------------------------------------------------------------------------
    row(None, Aborted, from_peer, None, confirm_unknown),
    # A local abort of an unknown transfer: the engine gave its prefill up before we saw it (it
    # was unavailable to the engine): remembered, so its registration is refused at once.
    row(None, Aborted, None, _FL, decide_aborted),
    row(_WP, Aborted, local_busy, _DR, fail_aborted, refuse_parked),
    row(_WP, Aborted, local, _FL, fail_aborted, refuse_parked),
    row(_WP, Aborted, cancels_busy, _WP, end_cancelled, confirm, refuse_parked),  # its groups drain first
    row(_WP, Aborted, cancels_with_heir, _WP, end_owner_cancelled, confirm, promote_heir, pump),
    row(_WP, Aborted, cancels_attempt, _EX, end_cancelled, confirm, refuse_parked),
    row(_WP, Aborted, None, _WP, confirm),
    row(_WR, Aborted, local_idle, _FL, fail_aborted, release),
    row(_WR, Aborted, local, _DR, fail_aborted),
    row(_WR, Aborted, cancels_attempt, _WR, end_cancelled, confirm),
    row(_WR, Aborted, None, _WR, confirm),
    row(_WG, Aborted, local_idle, _FL, fail_aborted, release, unreachable=_IN_FLIGHT),
    row(_WG, Aborted, local, _DR, fail_aborted),
    row(_WG, Aborted, cancels_attempt, _WR, end_cancelled, confirm),
    row(_WG, Aborted, None, _WG, confirm),
    *[row(s, Aborted, from_peer, s, confirm) for s in (_DR, _OK, _FL, _EX)],
    *[row(s, Aborted, None, s) for s in (_DR, _OK, _FL)],
    row(_EX, Aborted, None, _FL, decide_aborted),  # remembered: a later Prefilled goes back
    row(_ST, Aborted, from_peer, _ST, confirm_streamed),
    row(_ST, Aborted, None, _FL, decide_aborted),

    # --- PeerLost (fanned out through the peer index) ---------------------------------
    row(_WP, PeerLost, writes_to_peer_busy, _DR, fail_peer_lost, refuse_parked),
    row(_WP, PeerLost, lost_with_heir, _WP, end_owner_lost, promote_heir, pump),
    row(_WP, PeerLost, writes_to_peer, _FL, fail_peer_lost, refuse_parked),
    row(_WR, PeerLost, writes_to_peer_idle, _FL, fail_peer_lost, release),
    row(_WR, PeerLost, writes_to_peer, _DR, fail_peer_lost),
    row(_WG, PeerLost, writes_to_peer_idle, _FL, fail_peer_lost, release, unreachable=_IN_FLIGHT),
    row(_WG, PeerLost, writes_to_peer, _DR, fail_peer_lost),
    *[row(s, PeerLost, None, s) for s in (_WP, _WR, _WG, _DR, _OK, _FL, _EX)],
    row(_ST, PeerLost, None, _ST, unreachable="STREAMED has no registration, so no peer index"),
    row(None, PeerLost, None, None, unreachable="the peer index forgets purged transfers"),

    # --- deadlines: registration, lease, tombstone --------------------------------------
    row(_WP, _Deadline, parked_expired, _WP, expire_parked),
    row(_WP, _Deadline, busy, _DR, fail_timeout, refuse_parked),  # the stream's writes drain first
    row(_WP, _Deadline, heir_after_timeout, _WP, end_owner_timeout, expire_parked, promote_heir, pump),
    row(_WP, _Deadline, None, _EX, end_timeout, expire_parked),
    row(_ST, _Deadline, None, None),  # progress nobody registered for or sealed: forget it
    row(_WR, _Deadline, idle, _FL, fail_lease, release),
    row(_WR, _Deadline, None, _DR, fail_lease),
    *[row(s, _Deadline, None, s, unreachable=_WRITES_ANSWER) for s in (_WG, _DR)],
    *[row(s, _Deadline, None, None) for s in (_OK, _FL, _EX)],  # tombstone time is over
    row(None, _Deadline, None, None, unreachable="a forgotten record has no deadline"),
])  # fmt: skip
del _WP, _WR, _WG, _DR, _OK, _FL, _EX, _ST


# ========================================================================== the core


class Rendezvous(Core[str, _Transfer]):
    """Matches decode registrations with prefill completions; see the package docstring.

    ``handle`` is O(1) amortised per event (O(destinations) for a transfer's own
    registrations); expiry costs O(expired · log n) and a heap peek when nothing is due.
    """

    def __init__(self, *, tombstone_s: float = 60.0, max_transfers: int = 100_000,
                 quota: Quota | None = None, max_parked: int = 8, max_groups: int = 256,
                 max_group_writes: int = 4, max_group_writes_total: int = 64) -> None:
        super().__init__(TABLE, TOMBSTONES, DEADLINES, tombstone_s=tombstone_s, max_live=max_transfers,
                         holdings=_peer_holdings)
        self.quota = quota  # each decode peer's share (None: no per-peer bound)
        self.max_parked = max_parked  # rival registrations one transfer keeps before its prefill
        self.max_groups = max_groups  # ready groups kept per transfer and epoch
        self.max_group_writes = max_group_writes  # group WRITEs in flight per transfer
        self.max_group_writes_total = max_group_writes_total  # ... and in all
        self.group_writes = 0  # group WRITEs in flight now, all transfers

    @property
    def max_transfers(self) -> int | None:
        return self.max_live

    # ------------------------------------------------------------------ public API

    def info(self, transfer_id: str, now: float | None = None) -> PendingInfo | None:
        """One transfer, tombstones included."""
        return self._view(transfer_id, now)  # type: ignore[no-any-return]

    def live(self, transfer_id: str) -> bool:
        """The transfer is known and not a tombstone (it may still write or release)."""
        return self._is_live(transfer_id)

    def peer_held(self, holder: str) -> Held:
        """The live transfers a decode peer's identity (:func:`quota_holder`) holds
        registrations in, and their block IDs in all (what its quota counts): kept up to date
        per transition, so O(1)."""
        return self.held(holder)

    def peer_stake(self, transfer_id: str, holder: str) -> int | None:
        """Block IDs ``holder`` holds in this transfer; None if it holds none there."""
        return self.held_in(transfer_id, holder)

    # ------------------------------------------------------------ Core hooks

    def _route(self, ev: object) -> Iterable[str]:
        if isinstance(ev, PeerLost):
            return sorted(self._index_pop(ev.peer))
        if isinstance(ev, Tick):
            return ()
        return (ev.transfer_id,)  # type: ignore[attr-defined]

    def _create(self, key: str, ev: object) -> _Transfer:
        return _Transfer(transfer_id=key)

    def _info(self, rec: _Transfer, now: float) -> PendingInfo:
        return PendingInfo(
            transfer_id=rec.transfer_id,
            attempt=rec.attempt,
            state=rec.state,
            blocks=len(rec.prefill.block_ids) if rec.prefill is not None else 0,
            registered=len(rec.regs) if rec.live else 0,
            expected=rec.expected,
            writes_in_flight=len(rec.writes.inflight),
            age=now - rec.created,
            deadline=self._deadlines.get(rec.transfer_id),
        )
