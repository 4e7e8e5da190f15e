"""Prefill-side rendezvous: when may this daemon write a transfer's KV, and when free it.

A pure state machine (no I/O, no clock, no threads) so that every interleaving of
decode registrations, prefill completion, write results, aborts and deadlines can be
property-tested in isolation. The daemon feeds it events carrying ``now`` and carries
out the actions it returns.

Every transition lives in one table, ``_TABLE`` at the end of this module, keyed by
``(state, event type)`` (``None`` = no record for that transfer). Handlers mutate the
record's facts; :meth:`Rendezvous._settle` then derives the state from those facts, so
a state can never disagree with what is actually registered, started or in flight.

Safety rules the table upholds (each one is a bug seen in other systems):

* at most one ``StartWrite`` per (transfer, attempt, destination rank), only while the
  source blocks are held and the registration's deadline has not passed;
* ``ReleaseBlocks`` exactly once per accepted ``PrefillDone`` and never while a write
  that reads those blocks may still be in flight;
* ``NotifyFailure`` / ``ConfirmCancel`` to a decode peer never while a write into its
  blocks for that attempt is in flight (the decode side frees its blocks on them);
* every deadline is honoured no matter in which order entries were inserted (a heap
  with lazy invalidation; expiry never stops at the first unexpired entry).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvpush.daemon.deadlines import Deadlines

# --------------------------------------------------------------------------- events


@dataclass(frozen=True)
class Register:
    """A decode daemon registered its target blocks for one destination rank."""

    transfer_id: str
    attempt: int
    peer: str
    dest_rank: int
    expected_dests: int
    block_ids: tuple[int, ...]
    num_tokens: int
    now: float
    deadline: float
    first_token: int = 0  # block_ids cover tokens [first_token, num_tokens) (decode prefix hit)


@dataclass(frozen=True)
class PrefillDone:
    """The local engine's KV is in memory; its blocks are held until we release them."""

    transfer_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    now: float
    lease_deadline: float


@dataclass(frozen=True)
class WriteDone:
    """The transport finished one StartWrite (the decode side got its notification)."""

    transfer_id: str
    attempt: int
    dest_rank: int
    now: float


@dataclass(frozen=True)
class WriteFailed:
    """The transport gave up on one StartWrite; nothing of it is in flight any more."""

    transfer_id: str
    attempt: int
    dest_rank: int
    reason: str
    now: float


@dataclass(frozen=True)
class Abort:
    """``origin="peer"``: a decode daemon cancelled ``attempt`` (None: the current one).
    ``origin="local"``: the prefill engine or an operator cancelled the whole transfer."""

    transfer_id: str
    attempt: int | None
    reason: str
    origin: str
    now: float
    peer: str = ""

    def __post_init__(self) -> None:
        if self.origin not in ("local", "peer"):
            raise ValueError(f"Abort.origin must be 'local' or 'peer', not {self.origin!r}")


@dataclass(frozen=True)
class PeerLost:
    """A decode daemon is gone: its registrations can never be written."""

    peer: str
    now: float


@dataclass(frozen=True)
class Tick:
    """Time passed: expire what is due."""

    now: float


@dataclass(frozen=True)
class _Deadline:
    """Internal: the record's scheduled deadline passed (dispatched through the table)."""

    now: float


Event = Register | PrefillDone | WriteDone | WriteFailed | Abort | PeerLost | Tick

# -------------------------------------------------------------------------- actions


@dataclass(frozen=True)
class StartWrite:
    """Plan and post the WRITE of ``src_block_ids`` into the peer's ``dst_block_ids``."""

    transfer_id: str
    attempt: int
    peer: str
    dest_rank: int
    src_block_ids: tuple[int, ...]
    dst_block_ids: tuple[int, ...]
    num_tokens: int
    dst_first_token: int = 0


@dataclass(frozen=True)
class ReleaseBlocks:
    """Tell the engine Sent (ok) or SendFailed: it may free the source blocks now."""

    transfer_id: str
    block_ids: tuple[int, ...]
    ok: bool
    reason: str


@dataclass(frozen=True)
class NotifyFailure:
    """Tell that decode daemon now that this attempt will not be written to it."""

    transfer_id: str
    attempt: int
    peer: str
    dest_rank: int
    reason: str


@dataclass(frozen=True)
class ConfirmCancel:
    """Answer a peer's cancel: no write of this attempt to it is or will be in flight."""

    transfer_id: str
    attempt: int
    peer: str


Action = StartWrite | ReleaseBlocks | NotifyFailure | ConfirmCancel

# --------------------------------------------------------------------------- states


class State(enum.Enum):
    """Per-transfer states. DONE, FAILED and EXPIRED are tombstones: kept ``tombstone_s``
    so that late duplicates are recognised, then purged."""

    WAIT_PREFILL = "wait_prefill"  # live registrations, no prefill yet
    WAIT_REGISTER = "wait_register"  # prefill held, current attempt incomplete or dead
    WRITING = "writing"  # prefill held, every destination registered and started
    DRAINING = "draining"  # outcome decided, waiting for in-flight writes to finish
    DONE = "done"  # blocks released ok
    FAILED = "failed"  # blocks released not ok, or aborted before prefill
    EXPIRED = "expired"  # no prefill and no live registration left


_TOMBSTONES = frozenset({State.DONE, State.FAILED, State.EXPIRED})


@dataclass(frozen=True)
class PendingInfo:
    """One live transfer as ops sees it (``kvpushctl pending``)."""

    transfer_id: str
    attempt: int  # -1: no registration yet
    state: str
    blocks: int  # source blocks held (0 before prefill)
    registered: int  # registrations of the current attempt
    expected: int  # destinations the current attempt needs
    writes_in_flight: int
    age: float
    deadline: float | None


@dataclass
class _Reg:
    peer: str
    block_ids: tuple[int, ...]
    num_tokens: int
    deadline: float
    first_token: int = 0


@dataclass
class _Flight:
    peer: str
    confirm: bool = False  # the peer cancelled: answer ConfirmCancel when this ends


@dataclass(eq=False)
class _Transfer:
    transfer_id: str
    created: float
    state: State | None = None
    prefill: PrefillDone | None = None
    released: bool = False
    attempt: int = -1
    live: bool = False  # the current attempt may still write and complete
    expected: int = 0
    regs: dict[int, _Reg] = field(default_factory=dict)  # current attempt, by dest rank
    started: set[int] = field(default_factory=set)  # current attempt
    done: set[int] = field(default_factory=set)  # current attempt
    inflight: dict[tuple[int, int], _Flight] = field(default_factory=dict)  # (attempt, dest)
    outcome: tuple[bool, str] | None = None  # decided ReleaseBlocks(ok, reason)
    peers: set[str] = field(default_factory=set)  # every peer that registered (index cleanup)


Handler = Callable[..., None]


class Rendezvous:
    """Matches decode registrations with prefill completions; see the module docstring.

    ``handle`` is O(1) amortised per event (O(destinations) for a transfer's own
    registrations); expiry costs O(expired · log n) and a heap peek when nothing is due.
    """

    def __init__(self, *, tombstone_s: float = 60.0, max_transfers: int = 100_000) -> None:
        self.tombstone_s = tombstone_s
        self.max_transfers = max_transfers
        self._t: dict[str, _Transfer] = {}
        self._by_peer: dict[str, set[str]] = {}
        self._deadlines: Deadlines[str] = Deadlines()
        self._now = float("-inf")
        self._counts: dict[State, int] = {s: 0 for s in State}
        self._live = 0

    # ------------------------------------------------------------------ public API

    def handle(self, ev: Event) -> list[Action]:
        """Apply one event; return the actions to carry out, in order.

        Expiry runs before and after the event so that no event ever sees (or leaves)
        an entry whose deadline has already passed at ``ev.now``.
        """
        self._now = max(self._now, ev.now)
        out: list[Action] = []
        self._expire(out)
        if isinstance(ev, PeerLost):
            for tid in sorted(self._by_peer.pop(ev.peer, ())):
                rec = self._t.get(tid)
                if rec is not None:
                    self._dispatch(rec, ev, out)
        elif not isinstance(ev, Tick):
            self._dispatch(self._t.get(ev.transfer_id), ev, out)
        self._expire(out)
        return out

    def pending(self, now: float | None = None) -> list[PendingInfo]:
        """Live (non-tombstone) transfers, oldest first. O(n): for ops, not the hot path."""
        t = self._now if now is None else now
        rows = [self._info(r, t) for r in self._t.values() if r.state not in _TOMBSTONES]
        return sorted(rows, key=lambda i: -i.age)

    def info(self, transfer_id: str, now: float | None = None) -> PendingInfo | None:
        """One transfer, tombstones included."""
        rec = self._t.get(transfer_id)
        return None if rec is None else self._info(rec, self._now if now is None else now)

    def counts(self) -> dict[str, int]:
        """Number of transfers per state (tombstones included)."""
        return {s.value: n for s, n in self._counts.items()}

    # ------------------------------------------------------------ bookkeeping

    def _info(self, rec: _Transfer, now: float) -> PendingInfo:
        assert rec.state is not None
        return PendingInfo(
            transfer_id=rec.transfer_id,
            attempt=rec.attempt,
            state=rec.state.value,
            blocks=len(rec.prefill.block_ids) if rec.prefill is not None else 0,
            registered=len(rec.regs) if rec.live else 0,
            expected=rec.expected,
            writes_in_flight=len(rec.inflight),
            age=now - rec.created,
            deadline=self._deadlines.get(rec.transfer_id),
        )

    def _dispatch(self, rec: _Transfer | None, ev: Any, out: list[Action]) -> None:
        _TABLE[(rec.state if rec is not None else None, type(ev))](self, rec, ev, out)

    def _expire(self, out: list[Action]) -> None:
        """Dispatch a deadline event to every record due at ``now``."""
        for tid in self._deadlines.pop_due(self._now):
            self._dispatch(self._t[tid], _Deadline(self._now), out)

    def _schedule(self, rec: _Transfer, deadline: float | None) -> None:
        self._deadlines.set(rec.transfer_id, deadline)

    def _set_state(self, rec: _Transfer, new: State) -> None:
        old = rec.state
        if old is new:
            return
        if old is not None:
            self._counts[old] -= 1
            self._live -= old not in _TOMBSTONES
        self._counts[new] += 1
        self._live += new not in _TOMBSTONES
        rec.state = new

    def _new(self, tid: str) -> _Transfer:
        rec = _Transfer(transfer_id=tid, created=self._now)
        self._t[tid] = rec
        return rec

    def _purge(self, rec: _Transfer, ev: _Deadline, out: list[Action]) -> None:
        """Tombstone time is over: forget the transfer."""
        del self._t[rec.transfer_id]
        assert rec.state is not None
        self._counts[rec.state] -= 1
        for p in rec.peers:
            s = self._by_peer.get(p)
            if s is not None:
                s.discard(rec.transfer_id)
                if not s:
                    del self._by_peer[p]
        self._deadlines.set(rec.transfer_id, None)

    def _settle(self, rec: _Transfer, out: list[Action]) -> None:
        """Derive the state from the record's facts and do what entering it implies."""
        if (
            rec.outcome is None
            and rec.live
            and rec.prefill is not None
            and len(rec.done) == rec.expected
        ):
            rec.outcome = (True, "")
            rec.live = False
        new: State
        if rec.outcome is not None:
            if rec.inflight:
                new = State.DRAINING  # never free source blocks NIXL may still read
            else:
                if rec.prefill is not None and not rec.released:
                    rec.released = True
                    ok, reason = rec.outcome
                    out.append(ReleaseBlocks(rec.transfer_id, rec.prefill.block_ids, ok, reason))
                new = State.DONE if rec.outcome[0] else State.FAILED
        elif rec.prefill is None:
            new = State.WAIT_PREFILL if rec.live and rec.regs else State.EXPIRED
        elif rec.live and len(rec.regs) == rec.expected:
            new = State.WRITING
        else:
            new = State.WAIT_REGISTER
        old = rec.state
        self._set_state(rec, new)
        if new is State.WAIT_PREFILL:
            self._schedule(rec, min(r.deadline for r in rec.regs.values()))
        elif new is State.WAIT_REGISTER:
            assert rec.prefill is not None
            self._schedule(rec, rec.prefill.lease_deadline)
        elif new in _TOMBSTONES:
            if old is not new:
                self._schedule(rec, self._now + self.tombstone_s)
        else:
            self._schedule(rec, None)  # WRITING / DRAINING: the transport always answers

    # ------------------------------------------------------------ shared steps

    def _start(self, rec: _Transfer, dest: int, out: list[Action]) -> None:
        assert rec.prefill is not None and dest not in rec.started
        reg = rec.regs[dest]
        rec.started.add(dest)
        rec.inflight[(rec.attempt, dest)] = _Flight(reg.peer)
        out.append(
            StartWrite(
                rec.transfer_id,
                rec.attempt,
                reg.peer,
                dest,
                rec.prefill.block_ids,
                reg.block_ids,
                rec.prefill.num_tokens,
                reg.first_token,
            )
        )

    def _kill(
        self, rec: _Transfer, reason: str, out: list[Action], skip_peer: str | None = None
    ) -> None:
        """End the current attempt: it never writes again. Peers whose write has not
        started hear now; a started write's peer hears through that write's own end."""
        if not rec.live:
            return
        rec.live = False
        for dest, reg in sorted(rec.regs.items()):
            if dest not in rec.started and reg.peer != skip_peer:
                out.append(NotifyFailure(rec.transfer_id, rec.attempt, reg.peer, dest, reason))

    def _fail(self, rec: _Transfer, reason: str, out: list[Action]) -> None:
        """Fail the whole transfer: the source blocks go back as soon as nothing reads them."""
        self._kill(rec, reason, out)
        if rec.outcome is None:
            rec.outcome = (False, reason)

    def _confirm_when_idle(
        self, rec: _Transfer, attempt: int, peer: str, out: list[Action]
    ) -> None:
        flights = [f for (a, _), f in rec.inflight.items() if a == attempt and f.peer == peer]
        for f in flights:
            f.confirm = True
        if not flights:
            out.append(ConfirmCancel(rec.transfer_id, attempt, peer))

    def _invalid(self, ev: Register) -> str | None:
        if ev.attempt < 0:
            return "negative attempt"
        if ev.expected_dests < 1 or not 0 <= ev.dest_rank < ev.expected_dests:
            return f"dest_rank {ev.dest_rank} outside expected_dests {ev.expected_dests}"
        if ev.deadline <= self._now:
            return "registration deadline already passed"
        return None

    def _repeats_a_write(self, rec: _Transfer, ev: Register) -> bool:
        """A registration whose write is in flight is answered by that write's end; any
        earlier word (e.g. "superseded") would let the decode side free blocks NIXL is
        still writing into."""
        return (ev.attempt, ev.dest_rank) in rec.inflight

    def _reject(self, ev: Register, reason: str, out: list[Action]) -> None:
        out.append(NotifyFailure(ev.transfer_id, ev.attempt, ev.peer, ev.dest_rank, reason))

    def _accept_reg(self, rec: _Transfer, ev: Register, out: list[Action]) -> None:
        """Attempt numbers only grow: older ones are refused, a newer one supersedes."""
        if ev.attempt < rec.attempt:
            self._reject(ev, f"superseded by attempt {rec.attempt}", out)
            return
        if ev.attempt == rec.attempt:
            if ev.dest_rank in rec.regs:
                return  # duplicate
            if not rec.live:
                self._reject(ev, f"attempt {ev.attempt} already failed or ended", out)
                return
            if ev.expected_dests != rec.expected:
                self._reject(ev, "expected_dests differs between registrations", out)
                self._kill(rec, "inconsistent registrations", out)
                self._settle(rec, out)
                return
        else:
            self._kill(rec, f"superseded by attempt {ev.attempt}", out)
            rec.attempt, rec.live, rec.expected = ev.attempt, True, ev.expected_dests
            rec.regs, rec.started, rec.done = {}, set(), set()
        rec.regs[ev.dest_rank] = _Reg(ev.peer, tuple(ev.block_ids), ev.num_tokens, ev.deadline, ev.first_token)
        rec.peers.add(ev.peer)
        self._by_peer.setdefault(ev.peer, set()).add(rec.transfer_id)
        if rec.prefill is not None:
            if ev.num_tokens != rec.prefill.num_tokens:
                self._kill(
                    rec,
                    f"num_tokens mismatch: registered {ev.num_tokens}, "
                    f"prefilled {rec.prefill.num_tokens}",
                    out,
                )
            else:
                self._start(rec, ev.dest_rank, out)
        self._settle(rec, out)

    # ------------------------------------------------------------ handlers: Register

    def _reg_new(self, rec: None, ev: Register, out: list[Action]) -> None:
        bad = self._invalid(ev)
        if bad is not None:
            self._reject(ev, bad, out)
        elif self._live >= self.max_transfers:
            self._reject(ev, "overloaded", out)
        else:
            self._accept_reg(self._new(ev.transfer_id), ev, out)

    def _reg_live(self, rec: _Transfer, ev: Register, out: list[Action]) -> None:
        bad = self._invalid(ev)
        if self._repeats_a_write(rec, ev):
            return
        if bad is not None:
            self._reject(ev, bad, out)
        else:
            self._accept_reg(rec, ev, out)

    def _reg_revive(self, rec: _Transfer, ev: Register, out: list[Action]) -> None:
        """EXPIRED: a newer attempt may bring the transfer back (it counts as live again)."""
        bad = self._invalid(ev)
        if bad is not None:
            self._reject(ev, bad, out)
        elif ev.attempt > rec.attempt and self._live >= self.max_transfers:
            self._reject(ev, "overloaded", out)
        else:
            self._accept_reg(rec, ev, out)

    def _reg_closed(self, rec: _Transfer, ev: Register, out: list[Action]) -> None:
        """DRAINING / DONE / FAILED: the outcome is decided; no write may start again."""
        if self._repeats_a_write(rec, ev) or (
            ev.attempt == rec.attempt and ev.dest_rank in rec.regs
        ):
            return  # duplicate of a registration that already got its answer
        self._reject(ev, "source blocks released" if rec.prefill else "transfer aborted", out)

    # --------------------------------------------------------- handlers: PrefillDone

    def _prefill_new(self, rec: None, ev: PrefillDone, out: list[Action]) -> None:
        if self._live >= self.max_transfers:
            out.append(ReleaseBlocks(ev.transfer_id, ev.block_ids, False, "overloaded"))
            return
        rec = self._new(ev.transfer_id)
        rec.prefill = ev
        self._settle(rec, out)

    def _prefill_arrives(self, rec: _Transfer, ev: PrefillDone, out: list[Action]) -> None:
        """WAIT_PREFILL: check the registrations against the prefill, then start them all."""
        rec.prefill = ev
        bad = [r.num_tokens for r in rec.regs.values() if r.num_tokens != ev.num_tokens]
        if bad:
            msg = f"num_tokens mismatch: registered {bad[0]}, prefilled {ev.num_tokens}"
            self._kill(rec, msg, out)
        else:
            for dest in sorted(rec.regs):
                self._start(rec, dest, out)
        self._settle(rec, out)

    def _prefill_revive(self, rec: _Transfer, ev: PrefillDone, out: list[Action]) -> None:
        """EXPIRED: hold the blocks until the lease for a newer attempt (a decode that
        was preempted re-registers under a new attempt)."""
        rec.prefill = ev
        if self._live >= self.max_transfers:
            rec.outcome = (False, "overloaded")
        self._settle(rec, out)

    def _prefill_after_fail(self, rec: _Transfer, ev: PrefillDone, out: list[Action]) -> None:
        """FAILED before any prefill (local abort): give the blocks straight back."""
        if rec.prefill is None:
            rec.prefill = ev
            self._settle(rec, out)

    # ------------------------------------------------------ handlers: write results

    def _write_result(self, rec: _Transfer, ev: WriteDone | WriteFailed, out: list[Action]) -> None:
        flight = rec.inflight.pop((ev.attempt, ev.dest_rank), None)
        if flight is None:
            return  # not a write we started, or already answered
        failed = isinstance(ev, WriteFailed)
        reason = f"write failed: {ev.reason}" if isinstance(ev, WriteFailed) else ""
        if flight.confirm:
            if not any(
                a == ev.attempt and f.peer == flight.peer for (a, _), f in rec.inflight.items()
            ):
                out.append(ConfirmCancel(rec.transfer_id, ev.attempt, flight.peer))
        elif failed:
            out.append(
                NotifyFailure(rec.transfer_id, ev.attempt, flight.peer, ev.dest_rank, reason)
            )
        if rec.live and ev.attempt == rec.attempt:
            if failed:
                self._fail(rec, reason, out)
            else:
                rec.done.add(ev.dest_rank)
        self._settle(rec, out)

    # ------------------------------------------------------------ handlers: Abort

    def _abort_live(self, rec: _Transfer, ev: Abort, out: list[Action]) -> None:
        if ev.origin == "local":
            self._fail(rec, f"aborted: {ev.reason}", out)
        else:
            attempt = rec.attempt if ev.attempt is None else ev.attempt
            # Only a peer that registered for the live attempt can end it for everyone.
            if attempt == rec.attempt and any(r.peer == ev.peer for r in rec.regs.values()):
                self._kill(rec, f"cancelled by {ev.peer}: {ev.reason}", out, skip_peer=ev.peer)
            self._confirm_when_idle(rec, attempt, ev.peer, out)
        self._settle(rec, out)

    def _abort_other(self, rec: _Transfer | None, ev: Abort, out: list[Action]) -> None:
        """No record, DRAINING or a tombstone: answer cancels, remember a local abort."""
        if ev.origin == "peer":
            attempt = ev.attempt if ev.attempt is not None else (rec.attempt if rec else -1)
            if rec is not None:
                self._confirm_when_idle(rec, attempt, ev.peer, out)
            elif attempt >= 0:
                out.append(ConfirmCancel(ev.transfer_id, attempt, ev.peer))
        elif rec is not None and rec.state is State.EXPIRED:
            rec.outcome = (False, f"aborted: {ev.reason}")
            self._settle(rec, out)

    # ---------------------------------------------------- handlers: PeerLost, deadlines

    def _peer_lost(self, rec: _Transfer, ev: PeerLost, out: list[Action]) -> None:
        if rec.live and any(r.peer == ev.peer for r in rec.regs.values()):
            self._fail(rec, f"peer lost: {ev.peer}", out)
            self._settle(rec, out)

    def _prefill_timeout(self, rec: _Transfer, ev: _Deadline, out: list[Action]) -> None:
        self._kill(rec, "prefill did not complete in time", out)
        self._settle(rec, out)

    def _lease_expired(self, rec: _Transfer, ev: _Deadline, out: list[Action]) -> None:
        self._fail(rec, "lease expired", out)
        self._settle(rec, out)

    def _ignore(self, rec: _Transfer | None, ev: Any, out: list[Action]) -> None:
        return


# ------------------------------------------------------------------------ the table
# Every transition of a transfer, in one place. ``None``: no record for that transfer.
# Handlers change the record's facts; ``_settle`` derives the resulting state.

_R = Rendezvous
_WP, _WR, _WG = State.WAIT_PREFILL, State.WAIT_REGISTER, State.WRITING
_DR, _OK, _FL, _EX = State.DRAINING, State.DONE, State.FAILED, State.EXPIRED

_TABLE: dict[tuple[State | None, type], Handler] = {
    # Register
    (None, Register): _R._reg_new,
    (_WP, Register): _R._reg_live,
    (_WR, Register): _R._reg_live,
    (_WG, Register): _R._reg_live,
    (_DR, Register): _R._reg_closed,
    (_OK, Register): _R._reg_closed,
    (_FL, Register): _R._reg_closed,
    (_EX, Register): _R._reg_revive,
    # PrefillDone
    (None, PrefillDone): _R._prefill_new,
    (_WP, PrefillDone): _R._prefill_arrives,
    (_WR, PrefillDone): _R._ignore,  # duplicate
    (_WG, PrefillDone): _R._ignore,
    (_DR, PrefillDone): _R._ignore,
    (_OK, PrefillDone): _R._ignore,
    (_FL, PrefillDone): _R._prefill_after_fail,
    (_EX, PrefillDone): _R._prefill_revive,
    # WriteDone / WriteFailed: only states with prefill can have writes in flight
    **{(s, e): _R._write_result for s in (_WR, _WG, _DR) for e in (WriteDone, WriteFailed)},
    **{(s, e): _R._ignore for s in (None, _WP, _OK, _FL, _EX) for e in (WriteDone, WriteFailed)},
    # Abort
    (None, Abort): _R._abort_other,
    (_WP, Abort): _R._abort_live,
    (_WR, Abort): _R._abort_live,
    (_WG, Abort): _R._abort_live,
    (_DR, Abort): _R._abort_other,
    (_OK, Abort): _R._abort_other,
    (_FL, Abort): _R._abort_other,
    (_EX, Abort): _R._abort_other,
    # PeerLost (fanned out through the peer index, so never None)
    **{(s, PeerLost): _R._peer_lost for s in (_WP, _WR, _WG)},
    **{(s, PeerLost): _R._ignore for s in (None, _DR, _OK, _FL, _EX)},
    # deadlines: registration, lease, tombstone (WRITING / DRAINING never schedule one)
    (_WP, _Deadline): _R._prefill_timeout,
    (_WR, _Deadline): _R._lease_expired,
    (_WG, _Deadline): _R._ignore,
    (_DR, _Deadline): _R._ignore,
    (_OK, _Deadline): _R._purge,
    (_FL, _Deadline): _R._purge,
    (_EX, _Deadline): _R._purge,
}
del _R, _WP, _WR, _WG, _DR, _OK, _FL, _EX
