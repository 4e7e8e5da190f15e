"""Prefill-side rendezvous: when may this daemon write a transfer's KV, and when free it.

A pure state machine (no I/O, no clock, no threads) so that every interleaving of
decode registrations, prefill completion, write results, aborts and deadlines can be
property-tested in isolation. The daemon feeds it events carrying ``now`` and carries
out the actions it returns.

Events are facts in the past tense (``Registered``, ``Prefilled``, ``WriteDone``,
``Aborted``, ``PeerLost`` ...), never a wire message's name: the shell
(:mod:`kvpush.daemon.prefill_side`) translates ``proto.PeerRegister``, ``proto.PrefillDone``,
``proto.Abort`` and ``proto.Cancel`` into them.

Every transition is one row of ``TABLE`` at the end of this module,
``(state, event type, guard) -> (new state, steps)`` (``None`` = no record for that
transfer); see :mod:`kvpush.common.machine.core` for how rows are picked. Guards are named pure
predicates over the record's facts and the event; steps only change those facts and emit
actions, so the legal transitions, and the actions each one carries, read off the table.

Safety rules the table upholds (each one is a bug seen in other systems):

* at most one ``StartWrite`` per (transfer, attempt, destination rank), only while the
  source blocks are held and the registration's deadline has not passed;
* ``ReleaseBlocks`` exactly once per accepted ``Prefilled`` and never while a write
  that reads those blocks may still be in flight;
* ``NotifyFailure`` / ``ConfirmCancel`` to a decode peer never while a write into its
  blocks for that attempt is in flight (the decode side frees its blocks on them);
* every deadline is honoured no matter in which order entries were inserted (a heap
  with lazy invalidation; expiry never stops at the first unexpired entry);
* a transfer the engine bound (``Prefilled.bind_identity`` / ``bind_secret``) is written only
  to a registration of that identity or presenting that secret. A registration by another
  identity that arrives before the prefill is *parked*, not refused: the prefill's binding
  then picks the bound party, so a hijacker that registered first neither gets the KV nor
  locks the bound decode side out.

Layer-wise streaming (``LayersReady``, DESIGN §9) adds group WRITEs (``StartGroupWrite``, no
notification) before the seal (``Prefilled``), tracked in the same per-(attempt, destination)
flight as the final write, so every fence above covers them too:

* progress may come before any registration (state STREAMED: kept until ``hold_deadline``,
  then forgotten) and is only written while a registration of the live attempt is known and
  the seal has not come (after the seal the final write covers everything);
* groups ready before a registration go out together in one WRITE, later ones as they come,
  at most ``max_group_writes`` per transfer and ``max_group_writes_total`` in all (the rest
  wait in the record; whatever is still unposted at the seal goes with the final write);
* the final write (the one carrying the notification) is posted only once no group WRITE of
  that attempt and destination is in flight (NIXL orders a notification after its own data
  only); it may skip the parts already written (``StartWrite.written``) only when they were
  read from the very blocks the seal names in the seal's epoch;
* a new epoch (preemption on P) voids the progress seen so far: nothing of the new epoch is
  posted to a destination while a WRITE of an older epoch to it is in flight (drain first),
  and the final write rewrites whatever the new epoch did not stream;
* more than ``max_groups`` groups in one epoch turns streaming off for that transfer (the
  final write covers all): the record stays bounded;
* a stream in ``auto`` (``LayersReady.auto``) goes only to registrations the shell judged
  worth it (``Registered.stream``: its whole WRITE would take long enough over that link);
  the others get everything in the final write, as if nothing had streamed.
"""

from __future__ import annotations

import enum
import hmac
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvpush.common.machine.core import Core, Held, Record, Table, _Deadline, row
from kvpush.daemon.core.causes import Cause
from kvpush.daemon.core.quotas import Quota, refusal

__all__ = [
    "Aborted", "Action", "Cause", "ConfirmCancel", "Event", "LayersReady", "NotifyFailure", "Part",
    "PeerLost", "PendingInfo", "Prefilled", "Registered", "ReleaseBlocks", "Rendezvous",
    "StartGroupWrite", "StartWrite",
    "State", "TABLE", "TOMBSTONES", "Tick", "WriteDone", "WriteFailed",
]

# --------------------------------------------------------------------------- events


@dataclass(frozen=True)
class Registered:
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
    identity: str = ""  # the registering peer's authenticated node ("" when unauthenticated)
    secret: str = ""  # the transfer's secret as the decode side presents it ("" none)
    # Is streaming to it worth it (the shell's estimate of this registration's whole WRITE over
    # its link)? Consulted only for a stream in "auto" (LayersReady.auto): "on" streams anyway.
    stream: bool = True


@dataclass(frozen=True)
class Prefilled:
    """The local engine's KV is in memory; its blocks are held until we release them."""

    transfer_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    now: float
    lease_deadline: float
    bind_identity: str = ""  # only this decode identity may register ("" unbound by identity)
    bind_secret: str = ""  # or only a registration presenting this secret ("" none)
    epoch: int = -1  # the request's epoch at the seal; -1: unknown (no streamed part is trusted)

    @property
    def bound(self) -> bool:
        return bool(self.bind_identity or self.bind_secret)

    def admits(self, identity: str, secret: str) -> bool:
        """May a registration by ``identity`` presenting ``secret`` be written? (Constant-time
        compare of the secret: its length is the only thing a timing can tell.)"""
        if not self.bound:
            return True
        if self.bind_identity and identity == self.bind_identity:
            return True
        return bool(self.bind_secret) and hmac.compare_digest(secret.encode(), self.bind_secret.encode())


@dataclass(frozen=True)
class LayersReady:
    """Layers ``[layer_lo, layer_hi)`` of the request's blocks ``first_block ...`` (these
    IDs) are computed (prefill engine, mid-forward). ``epoch`` counts the request's restarts:
    progress of an older epoch is void. Kept until ``hold_deadline`` if nobody registers."""

    transfer_id: str
    epoch: int
    layer_lo: int
    layer_hi: int
    first_block: int
    block_ids: tuple[int, ...]
    now: float
    hold_deadline: float
    # The binding the seal will carry (Prefilled.bind_identity, bind_secret), known before it:
    # a group is written only to registrations it admits. None: not known (a frame that does
    # not say): nothing is streamed, the final write after the seal's check covers it all.
    binding: tuple[str, str] | None = None
    end_token: int = 0  # the chunk's end (LayerChunk.num_tokens); 0: unknown
    auto: bool = False  # layerwise "auto": stream only to registrations worth it (Registered.stream)


@dataclass(frozen=True)
class WriteDone:
    """The transport finished one StartWrite (the decode side got its notification)."""

    transfer_id: str
    attempt: int
    dest_rank: int
    now: float
    group: int = 0  # 0: the final write; n > 0: StartGroupWrite.group n


@dataclass(frozen=True)
class WriteFailed:
    """The transport gave up on one StartWrite; nothing of it is in flight any more."""

    transfer_id: str
    attempt: int
    dest_rank: int
    reason: str
    now: float
    cause: Cause = Cause.WRITE_FAILED  # e.g. TIMEOUT when the WRITE ran past its limit
    group: int = 0  # as WriteDone.group


@dataclass(frozen=True)
class Aborted:
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
            raise ValueError(f"Aborted.origin must be 'local' or 'peer', not {self.origin!r}")


@dataclass(frozen=True)
class PeerLost:
    """A decode daemon is gone: its registrations can never be written."""

    peer: str
    now: float


@dataclass(frozen=True)
class Tick:
    """Time passed: expire what is due."""

    now: float


Event = Registered | Prefilled | LayersReady | WriteDone | WriteFailed | Aborted | PeerLost | Tick

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
    written: tuple[Part, ...] = ()  # already in the peer's blocks (group WRITEs): may be skipped


@dataclass(frozen=True)
class Part:
    """Layers ``[layer_lo, layer_hi)`` of the source blocks at request indices
    ``first_block ...`` (``src_block_ids``)."""

    layer_lo: int
    layer_hi: int
    first_block: int
    src_block_ids: tuple[int, ...]
    epoch: int = 0
    end_token: int = 0  # the chunk's end: is its last block complete? (0: unknown, assume not)


@dataclass(frozen=True)
class StartGroupWrite:
    """Post one WRITE of these parts into the peer's blocks, without a notification;
    answered by WriteDone/WriteFailed with ``group``."""

    transfer_id: str
    attempt: int
    peer: str
    dest_rank: int
    group: int
    parts: tuple[Part, ...]
    dst_block_ids: tuple[int, ...]
    dst_first_token: int = 0


@dataclass(frozen=True)
class ReleaseBlocks:
    """Tell the engine Sent (ok) or SendFailed: it may free the source blocks now."""

    transfer_id: str
    block_ids: tuple[int, ...]
    ok: bool
    reason: str
    cause: Cause = Cause.OK


@dataclass(frozen=True)
class NotifyFailure:
    """Tell that decode daemon now that this attempt will not be written to it."""

    transfer_id: str
    attempt: int
    peer: str
    dest_rank: int
    reason: str
    cause: Cause = Cause.INVALID


@dataclass(frozen=True)
class ConfirmCancel:
    """Answer a peer's cancel: no write of this attempt to it is or will be in flight."""

    transfer_id: str
    attempt: int
    peer: str


Action = StartWrite | StartGroupWrite | ReleaseBlocks | NotifyFailure | ConfirmCancel

# --------------------------------------------------------------------------- states


class State(enum.StrEnum):
    """Per-transfer states and the facts each one implies (the table keeps them true).
    DONE, FAILED and EXPIRED are tombstones: kept ``tombstone_s`` so that late duplicates
    are recognised, then purged."""

    WAIT_PREFILL = "wait_prefill"  # no prefill; the current attempt is live with registrations,
    # or ended by its peer's cancel while group writes of it drain
    WAIT_REGISTER = "wait_register"  # prefill held; current attempt incomplete or dead
    WRITING = "writing"  # prefill held; every destination registered, started, >= 1 in flight
    DRAINING = "draining"  # verdict decided, waiting for in-flight writes to finish
    DONE = "done"  # blocks released ok
    FAILED = "failed"  # blocks released not ok, or aborted before prefill
    EXPIRED = "expired"  # no prefill and no live registration left
    STREAMED = "streamed"  # layer progress only: no registration, no prefill, nothing written


TOMBSTONES = frozenset({State.DONE, State.FAILED, State.EXPIRED})


@dataclass(frozen=True)
class PendingInfo:
    """One transfer as ops sees it (``kvpushctl pending``)."""

    transfer_id: str
    attempt: int  # -1: no registration yet
    state: State
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
    holder: str = ""  # whose quota it counts in: the peer's identity (its session if anonymous)
    identity: str = ""  # the registering node ("" unauthenticated)
    secret: str = ""  # what it presented
    stream: bool = True  # Registered.stream


@dataclass
class _Parked:
    """A registration by another identity than the owner's, before the prefill said who is
    bound: kept (not refused, not written) until the prefill or the owner's expiry decides."""

    attempt: int
    dest_rank: int
    expected: int
    reg: _Reg


@dataclass
class _Flight:
    peer: str
    holder: str = ""  # as _Reg.holder
    confirm: bool = False  # the peer cancelled: answer ConfirmCancel when this ends
    final: bool = True  # the final write (with the notification) is in flight
    groups: dict[int, int] = field(default_factory=dict)  # group WRITEs in flight -> epoch
    final_due: bool = False  # post the final write once the groups have landed


@dataclass(frozen=True)
class _Verdict:
    """How the blocks go back once nothing reads them: ReleaseBlocks(ok, reason, cause)."""

    ok: bool
    reason: str
    cause: Cause


@dataclass(eq=False)
class _Transfer(Record):
    transfer_id: str
    prefill: Prefilled | None = None
    attempt: int = -1
    live: bool = False  # the current attempt may still write and complete
    expected: int = 0
    regs: dict[int, _Reg] = field(default_factory=dict)  # current attempt, by dest rank
    started: set[int] = field(default_factory=set)  # current attempt
    done: set[int] = field(default_factory=set)  # current attempt
    inflight: dict[tuple[int, int], _Flight] = field(default_factory=dict)  # (attempt, dest)
    verdict: _Verdict | None = None
    owner: str = ""  # identity of its first registration: only it may register (supersede) again
    parked: dict[tuple[str, int], _Parked] = field(default_factory=dict)  # (identity, dest): WAIT_PREFILL only
    epoch: int = -1  # the stream's current epoch
    binding: tuple[str, str] | None = None  # the stream's (LayersReady.binding); None: unknown
    groups: list[Part] = field(default_factory=list)  # ready parts of that epoch, in order
    posted: dict[int, int] = field(default_factory=dict)  # dest -> groups posted (attempt, epoch)
    told: set[int] = field(default_factory=set)  # current attempt: dests told of its failure
    stream_off: bool = False  # too many groups: the final write covers everything
    auto: bool = False  # the stream is "auto": only registrations worth it get groups
    seq: int = 0  # last group number handed out
    hold_until: float = 0.0  # STREAMED: forget the progress then
    ended: tuple[str, Cause] = ("attempt ended", Cause.CLOSED)  # why the current attempt ended


def _earliest_registration(rec: _Transfer) -> float:
    return min(r.deadline for r in [*rec.regs.values(), *(p.reg for p in rec.parked.values())])


def _lease(rec: _Transfer) -> float:
    assert rec.prefill is not None
    return rec.prefill.lease_deadline


def _none(rec: _Transfer) -> None:
    return None  # the transport always answers a write


#: What each live state waits for before giving up (tombstones: ``tombstone_s``).
DEADLINES = {
    State.WAIT_PREFILL: _earliest_registration,
    State.WAIT_REGISTER: _lease,
    State.WRITING: _none,
    State.DRAINING: _none,
    State.STREAMED: lambda rec: rec.hold_until,
}


def _peer_holdings(rec: _Transfer) -> dict[str, int]:
    """Block IDs each decode peer has registered here that may still be written: the live
    attempt's registrations and any whose write is in flight (an older attempt's flight
    counts as a transfer of 0 blocks). What a peer's quota counts, by identity (one node's
    sessions share one quota: opening more sessions buys nothing); tombstones hold nothing."""
    out: dict[str, int] = {}
    if rec.state in TOMBSTONES:
        return out
    for dest, reg in rec.regs.items():
        if rec.live or (rec.attempt, dest) in rec.inflight:
            out[reg.holder] = out.get(reg.holder, 0) + len(reg.block_ids)
    for (attempt, _), f in rec.inflight.items():
        if attempt != rec.attempt:
            out.setdefault(f.holder, 0)
    for p in rec.parked.values():
        out[p.reg.holder] = out.get(p.reg.holder, 0) + len(p.reg.block_ids)
    return out


class Rendezvous(Core[str, _Transfer]):
    """Matches decode registrations with prefill completions; see the module docstring.

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
            writes_in_flight=len(rec.inflight),
            age=now - rec.created,
            deadline=self._deadlines.get(rec.transfer_id),
        )


# ============================================================================ guards
# Pure predicates over (core, record, event), evaluated before any step of the row.


def _why_invalid(rv: Rendezvous, ev: Registered, rec: _Transfer | None = None) -> str | None:
    if rec is not None and rec.owner and ev.identity != rec.owner:
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


def invalid(rv: Rendezvous, rec: _Transfer | None, ev: Registered) -> bool:
    return _why_invalid(rv, ev, rec) is not None


def _why_over_quota(rv: Rendezvous, rec: _Transfer | None, ev: Registered) -> str:
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


def over_quota(rv: Rendezvous, rec: _Transfer | None, ev: Registered) -> bool:
    return bool(_why_over_quota(rv, rec, ev))


def overloaded(rv: Rendezvous, rec: _Transfer | None, ev: object) -> bool:
    return rv.overloaded()


def overloaded_newer(rv: Rendezvous, rec: _Transfer, ev: Registered) -> bool:
    """A newer attempt would make this tombstone live again, but there is no room."""
    return ev.attempt > rec.attempt and rv.overloaded()


def stale(rv: Rendezvous, rec: _Transfer, ev: Registered) -> bool:
    """Attempt numbers only grow: an older one is refused."""
    return ev.attempt < rec.attempt


def duplicate(rv: Rendezvous, rec: _Transfer, ev: Registered) -> bool:
    return ev.attempt == rec.attempt and ev.dest_rank in rec.regs


def ended(rv: Rendezvous, rec: _Transfer, ev: Registered) -> bool:
    """The current attempt already failed or ended: it takes no new registrations."""
    return ev.attempt == rec.attempt and not rec.live


def inconsistent(rv: Rendezvous, rec: _Transfer, ev: Registered) -> bool:
    return ev.attempt == rec.attempt and ev.expected_dests != rec.expected


def attempt_over(rv: Rendezvous, rec: _Transfer, ev: object) -> bool:
    return not rec.live


def inconsistent_busy(rv: Rendezvous, rec: _Transfer, ev: Registered) -> bool:
    return inconsistent(rv, rec, ev) and bool(rec.inflight)


def repeats_write(rv: Rendezvous, rec: _Transfer, ev: Registered) -> bool:
    """A registration whose write is in flight is answered by that write's end; any
    earlier word (e.g. "superseded") would let the decode side free blocks NIXL is
    still writing into."""
    return (ev.attempt, ev.dest_rank) in rec.inflight


def answered(rv: Rendezvous, rec: _Transfer, ev: Registered) -> bool:
    """A repeat of a registration that already got (or will get) its answer."""
    return repeats_write(rv, rec, ev) or duplicate(rv, rec, ev)


def tokens_differ(rv: Rendezvous, rec: _Transfer, ev: Registered) -> bool:
    assert rec.prefill is not None
    return ev.num_tokens != rec.prefill.num_tokens


def completes_set(rv: Rendezvous, rec: _Transfer, ev: Registered) -> bool:
    """With this registration every destination of its attempt is registered."""
    if ev.attempt == rec.attempt:
        return len(rec.regs) + 1 == rec.expected
    return ev.expected_dests == 1


def any_tokens_differ(rv: Rendezvous, rec: _Transfer, ev: Prefilled) -> bool:
    return any(r.num_tokens != ev.num_tokens for r in rec.regs.values())


def all_registered(rv: Rendezvous, rec: _Transfer, ev: object) -> bool:
    return len(rec.regs) == rec.expected


def no_prefill(rv: Rendezvous, rec: _Transfer, ev: object) -> bool:
    return rec.prefill is None


def unknown_write(rv: Rendezvous, rec: _Transfer, ev: WriteDone | WriteFailed) -> bool:
    """Not a write we started, or one already answered."""
    f = rec.inflight.get((ev.attempt, ev.dest_rank))
    if f is None:
        return True
    return not f.final if ev.group == 0 else ev.group not in f.groups


def _frees_final(rec: _Transfer, ev: WriteDone | WriteFailed) -> bool:
    """This group is the last one before the deferred final write of a live attempt."""
    f = rec.inflight[(ev.attempt, ev.dest_rank)]
    return (ev.group > 0 and isinstance(ev, WriteDone) and f.final_due and not f.confirm
            and set(f.groups) == {ev.group} and not f.final and _of_live_attempt(rec, ev))


def _in_time(rv: Rendezvous, rec: _Transfer, dest: int) -> bool:
    return rv.now < rec.regs[dest].deadline


def _posts_final(rv: Rendezvous, rec: _Transfer, ev: WriteDone | WriteFailed) -> bool:
    """This group's landing lets the deferred final write go out (within the registration's
    deadline, as every write)."""
    return _frees_final(rec, ev) and _in_time(rv, rec, ev.dest_rank)


def final_too_late(rv: Rendezvous, rec: _Transfer, ev: WriteDone) -> bool:
    """The groups landed after the registration's deadline: the final write may not go."""
    return _frees_final(rec, ev) and not _in_time(rv, rec, ev.dest_rank)


def final_too_late_last(rv: Rendezvous, rec: _Transfer, ev: WriteDone) -> bool:
    return final_too_late(rv, rec, ev) and len(rec.inflight) == 1


def _ends_flight(rv: Rendezvous, rec: _Transfer, ev: WriteDone | WriteFailed) -> bool:
    f = rec.inflight.get((ev.attempt, ev.dest_rank))
    if f is None:
        return False
    if ev.group == 0:
        return f.final and not f.groups
    return set(f.groups) == {ev.group} and not f.final and not _posts_final(rv, rec, ev)


def last_write(rv: Rendezvous, rec: _Transfer, ev: WriteDone | WriteFailed) -> bool:
    """This write is the only one still in flight (and posts nothing after it)."""
    return len(rec.inflight) == 1 and _ends_flight(rv, rec, ev)


def drains_ended(rv: Rendezvous, rec: _Transfer, ev: WriteDone | WriteFailed) -> bool:
    """The last group WRITE of an attempt that ended before the seal (cancelled, inconsistent)
    lands: nothing is live or in flight any more, as if it had ended idle."""
    return not rec.live and last_write(rv, rec, ev)


def drains_to_heir(rv: Rendezvous, rec: _Transfer, ev: WriteDone | WriteFailed) -> bool:
    """As ``drains_ended``, with a rival parked meanwhile: it takes the transfer over, as it
    would have had the attempt ended idle (``cancels_with_heir``)."""
    return drains_ended(rv, rec, ev) and bool(_heir(rv, rec, None))


def busy(rv: Rendezvous, rec: _Transfer, ev: object) -> bool:
    """A (group) write is in flight."""
    return bool(rec.inflight)


def _of_live_attempt(rec: _Transfer, ev: WriteDone | WriteFailed) -> bool:
    return rec.live and ev.attempt == rec.attempt


def fails_attempt(rv: Rendezvous, rec: _Transfer, ev: WriteFailed) -> bool:
    """A write of the live attempt failed: the transfer fails."""
    return _of_live_attempt(rec, ev)


def fails_attempt_last(rv: Rendezvous, rec: _Transfer, ev: WriteFailed) -> bool:
    return _of_live_attempt(rec, ev) and last_write(rv, rec, ev)


def completes(rv: Rendezvous, rec: _Transfer, ev: WriteDone) -> bool:
    """The last outstanding write of the live attempt landed: the transfer succeeded."""
    return ev.group == 0 and _of_live_attempt(rec, ev) and len(rec.done | {ev.dest_rank}) == rec.expected


def completes_last(rv: Rendezvous, rec: _Transfer, ev: WriteDone) -> bool:
    return completes(rv, rec, ev) and last_write(rv, rec, ev)


def last_write_ok(rv: Rendezvous, rec: _Transfer, ev: WriteDone | WriteFailed) -> bool:
    assert rec.verdict is not None
    return last_write(rv, rec, ev) and rec.verdict.ok


def idle(rv: Rendezvous, rec: _Transfer, ev: object) -> bool:
    """No write is in flight: the source blocks can go back now."""
    return not rec.inflight


def local(rv: Rendezvous, rec: _Transfer | None, ev: Aborted) -> bool:
    return ev.origin == "local"


def local_idle(rv: Rendezvous, rec: _Transfer, ev: Aborted) -> bool:
    return ev.origin == "local" and not rec.inflight


def local_busy(rv: Rendezvous, rec: _Transfer, ev: Aborted) -> bool:
    return ev.origin == "local" and bool(rec.inflight)


def from_peer(rv: Rendezvous, rec: _Transfer | None, ev: Aborted) -> bool:
    return ev.origin == "peer"


def cancels_attempt(rv: Rendezvous, rec: _Transfer, ev: Aborted) -> bool:
    """Only a peer that registered for the live attempt can end it for everyone."""
    attempt = rec.attempt if ev.attempt is None else ev.attempt
    return (
        ev.origin == "peer"
        and rec.live
        and attempt == rec.attempt
        and any(r.peer == ev.peer for r in rec.regs.values())
    )


def cancels_busy(rv: Rendezvous, rec: _Transfer, ev: Aborted) -> bool:
    return cancels_attempt(rv, rec, ev) and bool(rec.inflight)


def writes_to_peer(rv: Rendezvous, rec: _Transfer, ev: PeerLost) -> bool:
    """The lost peer registered for the live attempt."""
    return rec.live and any(r.peer == ev.peer for r in rec.regs.values())


def writes_to_peer_idle(rv: Rendezvous, rec: _Transfer, ev: PeerLost) -> bool:
    return writes_to_peer(rv, rec, ev) and not rec.inflight


def writes_to_peer_busy(rv: Rendezvous, rec: _Transfer, ev: PeerLost) -> bool:
    return writes_to_peer(rv, rec, ev) and bool(rec.inflight)


# ---- binding: parked rivals and the prefill's choice of party (see the module docstring)


def contends(rv: Rendezvous, rec: _Transfer, ev: Registered) -> bool:
    """Before the prefill, another identity than the owner's registers: it may be the bound
    party (the owner a hijacker that came first), so it is parked, not refused."""
    return rec.prefill is None and bool(rec.owner) and bool(ev.identity) and ev.identity != rec.owner


def unbound(rv: Rendezvous, rec: _Transfer, ev: Registered) -> bool:
    """The prefill bound the transfer to another identity or secret."""
    return rec.prefill is not None and not rec.prefill.admits(ev.identity, ev.secret)


def _heir(rv: Rendezvous, rec: _Transfer, prefill: Prefilled | None, skip: frozenset = frozenset()) -> list[_Parked]:
    """The parked registrations that would take the transfer over: the first parked identity
    (admitted by ``prefill``'s binding, if given) with a live registration, its newest attempt
    (``skip``: keys of parked registrations about to go)."""
    live = [p for k, p in rec.parked.items() if p.reg.deadline > rv.now and k not in skip
            and (prefill is None or prefill.admits(p.reg.identity, p.reg.secret))]
    if not live:
        return []
    who = live[0].reg.identity
    top = max(p.attempt for p in live if p.reg.identity == who)
    mine = [p for p in live if p.reg.identity == who and p.attempt == top]
    return [p for p in mine if p.expected == mine[0].expected]


def _keeps_owner(rec: _Transfer, ev: Prefilled) -> bool:
    return all(ev.admits(r.identity, r.secret) for r in rec.regs.values())


def _settled(rv: Rendezvous, rec: _Transfer, ev: Prefilled) -> list[tuple[int, _Reg]]:
    """The registrations (dest, reg) the transfer has once ``ev``'s binding is applied."""
    if _keeps_owner(rec, ev):
        return sorted(rec.regs.items())
    return [(p.dest_rank, p.reg) for p in _heir(rv, rec, ev)]


def contested(rv: Rendezvous, rec: _Transfer, ev: Prefilled) -> bool:
    """Rivals are parked, or the binding ousts the owner's registrations."""
    return bool(rec.parked) or not _keeps_owner(rec, ev)


def contested_mismatch(rv: Rendezvous, rec: _Transfer, ev: Prefilled) -> bool:
    return contested(rv, rec, ev) and any(r.num_tokens != ev.num_tokens for _, r in _settled(rv, rec, ev))


def contested_complete(rv: Rendezvous, rec: _Transfer, ev: Prefilled) -> bool:
    if not contested(rv, rec, ev):
        return False
    if _keeps_owner(rec, ev):
        return len(rec.regs) == rec.expected
    heir = _heir(rv, rec, ev)
    return bool(heir) and len({p.dest_rank for p in heir}) == heir[0].expected


def _owner_expired(rv: Rendezvous, rec: _Transfer) -> bool:
    return any(r.deadline <= rv.now for r in rec.regs.values())


def parked_expired(rv: Rendezvous, rec: _Transfer, ev: object) -> bool:
    """Only parked registrations are due: the owner's attempt goes on."""
    return not _owner_expired(rv, rec)


def heir_after_timeout(rv: Rendezvous, rec: _Transfer, ev: object) -> bool:
    return bool(_heir(rv, rec, None))


def cancels_with_heir(rv: Rendezvous, rec: _Transfer, ev: Aborted) -> bool:
    return cancels_attempt(rv, rec, ev) and bool(_heir(rv, rec, None, _cancelled_parked(rec, ev)))


def _cancelled_parked(rec: _Transfer, ev: Aborted) -> frozenset:
    """Keys of the parked registrations a peer's cancel takes back (see ``confirm``)."""
    attempt = rec.attempt if ev.attempt is None else ev.attempt
    return frozenset(k for k, p in rec.parked.items()
                     if p.reg.peer == ev.peer and (ev.attempt is None or p.attempt == attempt))


def lost_with_heir(rv: Rendezvous, rec: _Transfer, ev: PeerLost) -> bool:
    return writes_to_peer(rv, rec, ev) and bool(_heir(rv, rec, None))


# ============================================================================= steps
# (core, record, event, out): change the record's facts, append actions. No states.


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
        if (rec.attempt, dest) in rec.inflight or dest in rec.done or dest in rec.told:
            continue
        rec.told.add(dest)
        if reg.peer != skip_peer:
            _notify(rec, dest, reg, reason, cause, out)


def _begin_attempt(rec: _Transfer, attempt: int, expected: int, regs: dict[int, _Reg]) -> None:
    """The live attempt from now on (a newer registration, or a parked party taking over).
    Nothing of the older attempt's bookkeeping carries over: what it was written, started or
    told went to other blocks."""
    rec.attempt, rec.live, rec.expected = attempt, True, expected
    rec.regs, rec.started, rec.done = regs, set(), set()
    rec.posted, rec.told = {}, set()


def _fail(rec: _Transfer, reason: str, cause: Cause, out: list) -> None:
    """Fail the whole transfer: the source blocks go back as soon as nothing reads them."""
    _end_attempt(rec, reason, cause, out)
    if rec.verdict is None:
        rec.verdict = _Verdict(False, reason, cause)


def _start(rec: _Transfer, dest: int, out: list) -> None:
    """The final write, or its promise once the group WRITEs to ``dest`` have landed."""
    assert rec.prefill is not None and dest not in rec.started
    rec.started.add(dest)
    flight = rec.inflight.get((rec.attempt, dest))
    if flight is not None:
        flight.final_due = True
        return
    _post_final(rec, dest, out)


def _written(rec: _Transfer, dest: int) -> tuple[Part, ...]:
    """Parts of the seal's epoch already written to ``dest`` from the blocks the seal names."""
    assert rec.prefill is not None
    if rec.prefill.epoch < 0 or rec.prefill.epoch != rec.epoch:
        return ()
    src = rec.prefill.block_ids
    return tuple(p for p in rec.groups[: rec.posted.get(dest, 0)]
                 if src[p.first_block: p.first_block + len(p.src_block_ids)] == p.src_block_ids)


def _post_final(rec: _Transfer, dest: int, out: list) -> None:
    assert rec.prefill is not None
    reg = rec.regs[dest]
    rec.inflight[(rec.attempt, dest)] = _Flight(reg.peer, reg.holder)
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
            _written(rec, dest),
        )
    )


def _refuse(ev: Registered, reason: str, cause: Cause, out: list) -> None:
    out.append(NotifyFailure(ev.transfer_id, ev.attempt, ev.peer, ev.dest_rank, reason, cause))


def _promote(rv: Rendezvous, rec: _Transfer, heir: list[_Parked]) -> None:
    """The heir's registrations become the transfer's (the owner's attempt is over)."""
    first = heir[0]
    _begin_attempt(rec, first.attempt, first.expected, {p.dest_rank: p.reg for p in heir})
    rec.owner = first.reg.identity
    for p in heir:
        del rec.parked[(p.reg.identity, p.dest_rank)]
        rv._index_add(rec.transfer_id, rec, p.reg.peer)


def _refuse_parked(rec: _Transfer, reason: str, cause: Cause, out: list, now: float | None = None) -> None:
    """Answer parked registrations (all, or those due at ``now``) and forget them."""
    for key, p in sorted(rec.parked.items()):
        if now is None or p.reg.deadline <= now:
            del rec.parked[key]
            out.append(NotifyFailure(rec.transfer_id, p.attempt, p.reg.peer, p.dest_rank, reason, cause))


def park(rv: Rendezvous, rec: _Transfer, ev: Registered, out: list) -> None:
    """Keep a rival's registration until the prefill's binding (or the owner's end) decides."""
    why = _why_invalid(rv, ev)  # its own fields; the owner rule is what parking defers
    key = (ev.identity, ev.dest_rank)
    if why is None and key not in rec.parked and len(rec.parked) >= rv.max_parked:
        why = f"overloaded: more than {rv.max_parked} rival registrations for one transfer"
        cause = Cause.OVERLOADED
    else:
        cause = Cause.INVALID
    old = rec.parked.get(key)
    if why is None and old is not None and ev.attempt < old.attempt:
        why, cause = f"superseded by attempt {old.attempt}", Cause.SUPERSEDED
    if why is not None:
        _refuse(ev, why, cause, out)
        return
    rec.parked[key] = _Parked(ev.attempt, ev.dest_rank, ev.expected_dests, _Reg(
        ev.peer, tuple(ev.block_ids), ev.num_tokens, ev.deadline, ev.first_token, quota_holder(ev),
        ev.identity, ev.secret, ev.stream))


def reject_unbound(rv: Rendezvous, rec: _Transfer, ev: Registered, out: list) -> None:
    _refuse(ev, "transfer is bound to another party", Cause.UNBOUND, out)


def settle(rv: Rendezvous, rec: _Transfer, ev: Prefilled, out: list) -> None:
    """Apply the prefill's binding: the owner keeps the transfer if admitted, else the first
    admitted parked identity takes it (or nobody yet); every other rival is refused."""
    if not _keeps_owner(rec, ev):
        heir = _heir(rv, rec, ev)
        _end_attempt(rec, "transfer is bound to another party", Cause.UNBOUND, out)
        if heir:
            _promote(rv, rec, heir)
        else:
            rec.attempt, rec.expected, rec.regs, rec.owner = -1, 0, {}, ""
    if ev.bound:
        _refuse_parked(rec, "transfer is bound to another party", Cause.UNBOUND, out)
    else:
        _refuse_parked(rec, "transfer was registered by another peer", Cause.INVALID, out)


def expire_parked(rv: Rendezvous, rec: _Transfer, ev: object, out: list) -> None:
    _refuse_parked(rec, "prefill did not complete in time", Cause.TIMEOUT, out, now=rv.now)


def promote_heir(rv: Rendezvous, rec: _Transfer, ev: object, out: list) -> None:
    """The owner's attempt ended before the prefill: the first parked identity takes over."""
    heir = _heir(rv, rec, None)
    assert heir
    _promote(rv, rec, heir)


def end_owner_timeout(rv: Rendezvous, rec: _Transfer, ev: _Deadline, out: list) -> None:
    _end_attempt(rec, "prefill did not complete in time", Cause.TIMEOUT, out)


def end_owner_cancelled(rv: Rendezvous, rec: _Transfer, ev: Aborted, out: list) -> None:
    _end_attempt(rec, f"cancelled by {ev.peer}: {ev.reason}", Cause.CANCELLED, out, skip_peer=ev.peer)


def end_owner_lost(rv: Rendezvous, rec: _Transfer, ev: PeerLost, out: list) -> None:
    _end_attempt(rec, f"peer lost: {ev.peer}", Cause.PEER_LOST, out)


def refuse_parked(rv: Rendezvous, rec: _Transfer, ev: object, out: list) -> None:
    """The transfer ends before the prefill: parked rivals hear it too."""
    _refuse_parked(rec, "transfer ended before its prefill", Cause.CLOSED, out)


def reject_invalid(rv: Rendezvous, rec: _Transfer | None, ev: Registered, out: list) -> None:
    why = _why_invalid(rv, ev, rec)
    assert why is not None
    _refuse(ev, why, Cause.INVALID, out)


def reject_quota(rv: Rendezvous, rec: _Transfer | None, ev: Registered, out: list) -> None:
    _refuse(ev, _why_over_quota(rv, rec, ev), Cause.QUOTA, out)


def reject_overloaded(rv: Rendezvous, rec: _Transfer | None, ev: Registered, out: list) -> None:
    _refuse(ev, "overloaded", Cause.OVERLOADED, out)


def reject_stale(rv: Rendezvous, rec: _Transfer, ev: Registered, out: list) -> None:
    _refuse(ev, f"superseded by attempt {rec.attempt}", Cause.SUPERSEDED, out)


def reject_ended(rv: Rendezvous, rec: _Transfer, ev: Registered, out: list) -> None:
    _refuse(ev, f"attempt {ev.attempt} already failed or ended", Cause.CLOSED, out)


def reject_inconsistent(rv: Rendezvous, rec: _Transfer, ev: Registered, out: list) -> None:
    _refuse(ev, "expected_dests differs between registrations", Cause.INVALID, out)


def reject_closed(rv: Rendezvous, rec: _Transfer, ev: Registered, out: list) -> None:
    why = "source blocks released" if rec.prefill else "transfer aborted"
    _refuse(ev, why, Cause.CLOSED, out)


def end_inconsistent(rv: Rendezvous, rec: _Transfer, ev: Registered, out: list) -> None:
    _end_attempt(rec, "inconsistent registrations", Cause.INVALID, out)


def open_attempt(rv: Rendezvous, rec: _Transfer, ev: Registered, out: list) -> None:
    """A newer attempt supersedes the current one (same attempt: nothing to do)."""
    if ev.attempt > rec.attempt:
        _end_attempt(rec, f"superseded by attempt {ev.attempt}", Cause.SUPERSEDED, out)
        _begin_attempt(rec, ev.attempt, ev.expected_dests, {})


def add_reg(rv: Rendezvous, rec: _Transfer, ev: Registered, out: list) -> None:
    rec.owner = rec.owner or ev.identity
    rec.regs[ev.dest_rank] = _Reg(ev.peer, tuple(ev.block_ids), ev.num_tokens, ev.deadline, ev.first_token,
                                  quota_holder(ev), ev.identity, ev.secret, ev.stream)
    rv._index_add(rec.transfer_id, rec, ev.peer)


def start_reg(rv: Rendezvous, rec: _Transfer, ev: Registered, out: list) -> None:
    _start(rec, ev.dest_rank, out)


def end_mismatch(rv: Rendezvous, rec: _Transfer, ev: Registered, out: list) -> None:
    assert rec.prefill is not None
    msg = f"num_tokens mismatch: registered {ev.num_tokens}, prefilled {rec.prefill.num_tokens}"
    _end_attempt(rec, msg, Cause.MISMATCH, out)


def hold(rv: Rendezvous, rec: _Transfer, ev: Prefilled, out: list) -> None:
    """Keep the engine's blocks until ReleaseBlocks. A binding the owner does not meet frees
    the transfer for the bound party (the owner's registrations, if any, are over)."""
    rec.prefill = ev
    if ev.bound and not any(ev.admits(r.identity, r.secret) for r in rec.regs.values()):
        rec.owner = ""


def start_all(rv: Rendezvous, rec: _Transfer, ev: Prefilled, out: list) -> None:
    for dest in sorted(rec.regs):
        _start(rec, dest, out)


def end_mismatch_all(rv: Rendezvous, rec: _Transfer, ev: Prefilled, out: list) -> None:
    bad = [r.num_tokens for r in rec.regs.values() if r.num_tokens != ev.num_tokens]
    msg = f"num_tokens mismatch: registered {bad[0]}, prefilled {ev.num_tokens}"
    _end_attempt(rec, msg, Cause.MISMATCH, out)


def release_overloaded(rv: Rendezvous, rec: None, ev: Prefilled, out: list) -> None:
    out.append(ReleaseBlocks(ev.transfer_id, ev.block_ids, False, "overloaded", Cause.OVERLOADED))


def decide_overloaded(rv: Rendezvous, rec: _Transfer, ev: Prefilled, out: list) -> None:
    rec.verdict = _Verdict(False, "overloaded", Cause.OVERLOADED)


def release(rv: Rendezvous, rec: _Transfer, ev: object, out: list) -> None:
    """Give the source blocks back with the verdict (the row guarantees nothing reads them).
    No seal yet (a stream drained): nothing is held; a later Prefilled goes straight back."""
    assert rec.verdict is not None and not rec.inflight
    if rec.prefill is None:
        return
    v = rec.verdict
    out.append(ReleaseBlocks(rec.transfer_id, rec.prefill.block_ids, v.ok, v.reason, v.cause))


def land(rv: Rendezvous, rec: _Transfer, ev: WriteDone | WriteFailed, out: list) -> None:
    """The write is over: answer its peer (a pending cancel, or the failure) once its
    flight is empty; a group's landing may let the deferred final write go out."""
    key = (ev.attempt, ev.dest_rank)
    flight = rec.inflight[key]
    final_landed = ev.group == 0
    if final_landed:
        flight.final = False
    else:
        del flight.groups[ev.group]
        rv.group_writes -= 1
    if flight.groups or flight.final:
        return
    if (not final_landed and flight.final_due and isinstance(ev, WriteDone)
            and _of_live_attempt(rec, ev) and not flight.confirm and _in_time(rv, rec, ev.dest_rank)):
        del rec.inflight[key]
        _post_final(rec, ev.dest_rank, out)
        return
    del rec.inflight[key]
    if flight.confirm:
        if not any(a == ev.attempt and f.peer == flight.peer for (a, _), f in rec.inflight.items()):
            out.append(ConfirmCancel(rec.transfer_id, ev.attempt, flight.peer))
        return
    if isinstance(ev, WriteFailed):
        reason, cause = _write_reason(ev), ev.cause
    elif final_landed or _of_live_attempt(rec, ev):
        return  # the peer has its notification, or more of a live attempt is to come
    else:  # group WRITEs of an ended attempt: the peer never gets a notification
        reason, cause = rec.ended if ev.attempt == rec.attempt else (
            f"superseded by attempt {rec.attempt}", Cause.SUPERSEDED)
    if ev.attempt == rec.attempt:
        rec.told.add(ev.dest_rank)
    out.append(NotifyFailure(rec.transfer_id, ev.attempt, flight.peer, ev.dest_rank, reason, cause))


def _write_reason(ev: WriteFailed) -> str:
    return f"write failed: {ev.reason}"


def count_done(rv: Rendezvous, rec: _Transfer, ev: WriteDone, out: list) -> None:
    if ev.group == 0 and _of_live_attempt(rec, ev):
        rec.done.add(ev.dest_rank)


def decide_ok(rv: Rendezvous, rec: _Transfer, ev: WriteDone, out: list) -> None:
    rec.live = False
    rec.verdict = _Verdict(True, "", Cause.OK)


def fail_write(rv: Rendezvous, rec: _Transfer, ev: WriteFailed, out: list) -> None:
    _fail(rec, _write_reason(ev), ev.cause, out)


def fail_aborted(rv: Rendezvous, rec: _Transfer, ev: Aborted, out: list) -> None:
    _fail(rec, f"aborted: {ev.reason}", Cause.ABORTED, out)


def decide_aborted(rv: Rendezvous, rec: _Transfer, ev: Aborted, out: list) -> None:
    rec.verdict = _Verdict(False, f"aborted: {ev.reason}", Cause.ABORTED)


def end_cancelled(rv: Rendezvous, rec: _Transfer, ev: Aborted, out: list) -> None:
    _end_attempt(rec, f"cancelled by {ev.peer}: {ev.reason}", Cause.CANCELLED, out, skip_peer=ev.peer)


def confirm(rv: Rendezvous, rec: _Transfer, ev: Aborted, out: list) -> None:
    """Answer the peer's cancel now, or when its last write of that attempt ends. A parked
    registration of that peer's is forgotten: once confirmed, its blocks may hold another
    request's KV, so it must never be promoted and written."""
    attempt = rec.attempt if ev.attempt is None else ev.attempt
    for key in _cancelled_parked(rec, ev):
        del rec.parked[key]
    flights = [f for (a, _), f in rec.inflight.items() if a == attempt and f.peer == ev.peer]
    for f in flights:
        f.confirm = True
    if not flights:
        out.append(ConfirmCancel(rec.transfer_id, attempt, ev.peer))


def confirm_unknown(rv: Rendezvous, rec: None, ev: Aborted, out: list) -> None:
    """Nothing known of that transfer, so nothing is in flight."""
    if ev.attempt is not None and ev.attempt >= 0:
        out.append(ConfirmCancel(ev.transfer_id, ev.attempt, ev.peer))


def fail_peer_lost(rv: Rendezvous, rec: _Transfer, ev: PeerLost, out: list) -> None:
    _fail(rec, f"peer lost: {ev.peer}", Cause.PEER_LOST, out)


def end_timeout(rv: Rendezvous, rec: _Transfer, ev: _Deadline, out: list) -> None:
    _end_attempt(rec, "prefill did not complete in time", Cause.TIMEOUT, out)


def fail_lease(rv: Rendezvous, rec: _Transfer, ev: _Deadline, out: list) -> None:
    if rec.attempt < 0:  # nobody came: worth telling apart (a router or decode engine not using kvpush)
        _fail(rec, "lease expired: no decode side registered", Cause.UNCLAIMED, out)
    else:
        _fail(rec, "lease expired", Cause.LEASE_EXPIRED, out)


def note_progress(rv: Rendezvous, rec: _Transfer, ev: LayersReady, out: list) -> None:
    """Keep a ready group (bounded); a newer epoch voids the groups seen so far."""
    if ev.epoch < rec.epoch:
        return
    if rec.state is State.STREAMED or rec.state is None:
        rec.hold_until = max(rec.hold_until, ev.hold_deadline)
    if ev.epoch > rec.epoch:
        rec.epoch, rec.groups, rec.posted = ev.epoch, [], {}
    rec.auto = ev.auto
    if rec.binding is None or ev.binding != rec.binding:
        # first word of the binding, or a frame that says otherwise: trust only agreement
        rec.binding = ev.binding if rec.binding is None else None
        if rec.binding is None:
            rec.stream_off = True
    if rec.stream_off:
        return
    if len(rec.groups) >= rv.max_groups:
        rec.stream_off, rec.groups = True, []
        return
    rec.groups.append(Part(ev.layer_lo, ev.layer_hi, ev.first_block, tuple(ev.block_ids), ev.epoch, ev.end_token))


def _stream_admits(rec: _Transfer) -> bool:
    """Before the seal, KV goes only where the binding the stream announced admits every
    registration, and while no rival is parked (the seal may yet pick another party)."""
    if rec.binding is None or rec.parked:
        return False
    who = Prefilled(rec.transfer_id, (), 0, 0.0, 0.0, *rec.binding)
    return all(who.admits(r.identity, r.secret) for r in rec.regs.values())


def pump(rv: Rendezvous, rec: _Transfer, ev: object, out: list) -> None:
    """Post the ready groups each registered destination of the live attempt has not had,
    as one WRITE, within the bounds; never over a WRITE of an older epoch to it."""
    if not rec.live or rec.stream_off or rec.prefill is not None or not _stream_admits(rec):
        return
    for dest, reg in sorted(rec.regs.items()):
        n = rec.posted.get(dest, 0)
        if dest in rec.started or n >= len(rec.groups) or (rec.auto and not reg.stream):
            continue
        flight = rec.inflight.get((rec.attempt, dest))
        if flight is not None and (any(e != rec.epoch for e in flight.groups.values())
                                   or len(flight.groups) >= rv.max_group_writes):
            continue
        if rv.group_writes >= rv.max_group_writes_total:
            return
        if flight is None:
            flight = rec.inflight[(rec.attempt, dest)] = _Flight(reg.peer, reg.holder, final=False)
        rec.seq += 1
        flight.groups[rec.seq] = rec.epoch
        rv.group_writes += 1
        rec.posted[dest] = len(rec.groups)
        out.append(StartGroupWrite(rec.transfer_id, rec.attempt, reg.peer, dest, rec.seq,
                                   tuple(rec.groups[n:]), reg.block_ids, reg.first_token))


def fail_late(rv: Rendezvous, rec: _Transfer, ev: WriteDone, out: list) -> None:
    _fail(rec, "prefill did not complete in time (the stream's writes landed after the registration's "
          "deadline)", Cause.TIMEOUT, out)


def fail_timeout(rv: Rendezvous, rec: _Transfer, ev: _Deadline, out: list) -> None:
    _fail(rec, "prefill did not complete in time", Cause.TIMEOUT, out)


def confirm_streamed(rv: Rendezvous, rec: _Transfer, ev: Aborted, out: list) -> None:
    confirm_unknown(rv, None, ev, out)


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
    row(None, Aborted, None, None),  # a local abort of an unknown transfer
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
