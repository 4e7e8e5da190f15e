"""The rendezvous' per-transfer record: the facts its rules read and change, and the states
those facts imply.

A transfer (:class:`_Transfer`) keeps what every concern reads (the seal, the verdict on the
source blocks, the current attempt and its registrations) and holds one small record per
concern:

* ``writes`` (:class:`_Writes`): which destinations of the current attempt were started,
  are done or were told of a failure, and the WRITEs in flight for every attempt (what
  still reads the source blocks);
* ``contest`` (:class:`_Contest`): who owns the transfer and the rivals parked before the seal;
* ``stream`` (:class:`_Stream`): layer progress before the seal and how much of it each
  destination was sent.

:class:`Host` is what the rules see of the core that runs them, so that no rule imports it.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Protocol

from kvpush.common.machine.core import Held, Record
from kvpush.daemon.core.causes import Cause
from kvpush.daemon.core.quotas import Quota
from kvpush.daemon.core.rendezvous.actions import Part
from kvpush.daemon.core.rendezvous.events import Prefilled


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
    key: bytes = b""  # Registered.key
    kv_groups: tuple[int, ...] = ()  # Registered.kv_groups


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


@dataclass(slots=True)
class _Writes:
    """The WRITEs: per destination of the current attempt, and every flight still reading the
    source blocks (an older attempt's too)."""

    started: set[int] = field(default_factory=set)  # current attempt
    done: set[int] = field(default_factory=set)  # current attempt
    told: set[int] = field(default_factory=set)  # current attempt: dests told of its failure
    inflight: dict[tuple[int, int], _Flight] = field(default_factory=dict)  # (attempt, dest)


@dataclass(slots=True)
class _Contest:
    """Who may register: the owner, and the rivals parked until the seal's binding decides."""

    owner: str = ""  # identity of its first registration: only it may register (supersede) again
    parked: dict[tuple[str, int], _Parked] = field(default_factory=dict)  # (identity, dest): WAIT_PREFILL only


@dataclass(slots=True)
class _Stream:
    """Layer progress before the seal (``LayersReady``), bounded, and what of it went where."""

    epoch: int = -1  # the stream's current epoch
    binding: tuple[str, str] | None = None  # the stream's (LayersReady.binding); None: unknown
    groups: list[Part] = field(default_factory=list)  # ready parts of that epoch, in order
    posted: dict[int, int] = field(default_factory=dict)  # dest -> groups posted (attempt, epoch)
    off: bool = False  # too many groups, or a binding in doubt: the final write covers everything
    auto: bool = False  # the stream is "auto": only registrations worth it get groups
    seq: int = 0  # last group number handed out
    hold_until: float = 0.0  # STREAMED: forget the progress then


@dataclass(eq=False)
class _Transfer(Record):
    """One transfer: the facts every concern reads, and one record per concern."""

    transfer_id: str
    prefill: Prefilled | None = None
    verdict: _Verdict | None = None
    attempt: int = -1
    live: bool = False  # the current attempt may still write and complete
    expected: int = 0
    regs: dict[int, _Reg] = field(default_factory=dict)  # current attempt, by dest rank
    ended: tuple[str, Cause] = ("attempt ended", Cause.CLOSED)  # why the current attempt ended
    writes: _Writes = field(default_factory=_Writes)
    contest: _Contest = field(default_factory=_Contest)
    stream: _Stream = field(default_factory=_Stream)


def _earliest_registration(rec: _Transfer) -> float:
    return min(r.deadline for r in [*rec.regs.values(), *(p.reg for p in rec.contest.parked.values())])


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
    State.STREAMED: lambda rec: rec.stream.hold_until,
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
        if rec.live or (rec.attempt, dest) in rec.writes.inflight:
            out[reg.holder] = out.get(reg.holder, 0) + len(reg.block_ids)
    for (attempt, _), f in rec.writes.inflight.items():
        if attempt != rec.attempt:
            out.setdefault(f.holder, 0)
    for p in rec.contest.parked.values():
        out[p.reg.holder] = out.get(p.reg.holder, 0) + len(p.reg.block_ids)
    return out


class Host(Protocol):
    """What the rules read and change of the core that runs them
    (:class:`kvpush.daemon.core.rendezvous.table.Rendezvous`): the rules sit below the core
    and never import it."""

    quota: Quota | None
    max_parked: int
    max_groups: int
    max_group_writes: int
    max_group_writes_total: int
    group_writes: int

    @property
    def now(self) -> float: ...

    def overloaded(self) -> bool: ...

    def held(self, holder: Hashable) -> Held: ...

    def held_in(self, key: str, holder: Hashable) -> int | None: ...

    def _index_add(self, key: str, rec: _Transfer, name: Hashable) -> None: ...
