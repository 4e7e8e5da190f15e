"""The completion counter's vocabulary: the events it is fed and the actions it returns.

Plain frozen data, no logic: :mod:`kvpush.daemon.core.counter` (the rules and the table) and
its shell (:mod:`kvpush.daemon.decode_side`) share these; the counter module re-exports them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvpush.daemon.core.causes import Cause

# --------------------------------------------------------------------------- events


@dataclass(frozen=True)
class Registered:
    """The engine registered blocks; ``producers`` producers will each notify exactly once.

    ``endpoints[i]``, ``ranks[i]``, ``forwards[i]`` and ``keys[i]`` describe producer ``i``
    (its daemon's endpoint, its TP rank, what to send it, the key its notification is tagged
    with); empty, or one entry per producer. Without keys no notification counts."""

    transfer_id: str
    attempt: int
    producers: int
    now: float
    deadline: float
    endpoints: tuple[str, ...] = ()
    ranks: tuple[int, ...] = ()
    forwards: tuple[Any, ...] = ()
    keys: tuple[bytes, ...] = field(default=(), repr=False)


@dataclass(frozen=True)
class Notified:
    """A producer's write landed (its NIXL notification arrived)."""

    transfer_id: str
    attempt: int
    producer: int  # index into the registration's producers
    now: float


@dataclass(frozen=True)
class ProducerFailed:
    """A producer will not write this attempt (its write failed or it gave up)."""

    transfer_id: str
    attempt: int
    producer: int | str  # its index, or its daemon's endpoint (what the shell knows of a frame)
    reason: str
    now: float
    cause: Cause = Cause.PRODUCER_FAILED  # e.g. PEER_LOST when its daemon died
    may_land: bool = False  # a WRITE of it may still arrive (silent link, its WRITE timed out)
    # with may_land: only if a WRITE of this attempt was announced and may still land (Announced)
    announced_only: bool = False


@dataclass(frozen=True)
class ProducerCancelled:
    """A producer answered our cancel: nothing of this attempt is or will be in flight."""

    transfer_id: str
    attempt: int
    producer: int | str  # its index, or its daemon's endpoint
    now: float


@dataclass(frozen=True)
class Aborted:
    """The local engine no longer wants this attempt."""

    transfer_id: str
    attempt: int
    reason: str
    now: float


@dataclass(frozen=True)
class Announced:
    """A producer said it posted (``done`` False) or completed (``done`` True) a WRITE of this
    attempt (``proto.Writing``): a wake-up, not a proof. It decides how tightly the daemon
    polls NIXL for the attempt (``tight``) and whether a WRITE of it may still land; a final
    WRITE that completed is looked for at once (``PollNow``)."""

    transfer_id: str
    attempt: int
    producer_rank: int
    group: int  # 0: the final WRITE (with the notification); n: that producer's group WRITE n
    done: bool
    now: float


@dataclass(frozen=True)
class Noticed:
    """NIXL delivered a notification naming this attempt and producer rank, sent by NIXL agent
    ``agent``; ``senders``: the endpoints of the producers whose agent that is (the shell's
    links); ``tag``: what it carries (:class:`kvpush.proto.notif.Notification`). It counts as
    that producer's Notified only for the newest live attempt, only if its tag verifies under
    that producer's key and it is the first one that does, and only if the producer's endpoint
    is among ``senders``."""

    transfer_id: str
    attempt: int
    producer_rank: int
    agent: str
    senders: frozenset[str]
    now: float
    tag: str = ""


@dataclass(frozen=True)
class Tick:
    """Time passed: expire what is due."""

    now: float


Event = Registered | Notified | ProducerFailed | ProducerCancelled | Aborted | Announced | Noticed | Tick

# -------------------------------------------------------------------------- actions


@dataclass(frozen=True)
class Accepted:
    """The registration is live: forward ``forwards[i]`` to ``endpoints[i]`` now (once)."""

    transfer_id: str
    attempt: int
    forwards: tuple[Any, ...] = ()
    endpoints: tuple[str, ...] = ()


@dataclass(frozen=True)
class Complete:
    """Every producer notified: tell the engine Received."""

    transfer_id: str
    attempt: int
    # the registration, for the history (not part of the decision)
    since: float | None = field(default=None, compare=False, repr=False)
    producers: int | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Fail:
    """Tell the engine ReceiveFailed (it recomputes into the blocks)."""

    transfer_id: str
    attempt: int
    reason: str
    cause: Cause = Cause.INVALID
    unsafe: bool = False  # a producer's WRITE may still land: fence, do not hand the blocks back
    # the registration (None: none was taken), for the history
    since: float | None = field(default=None, compare=False, repr=False)
    producers: int | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Refuse:
    """Tell the engine ReceiveFailed for a registration not taken: nothing was forwarded or
    counted (a bad registration, not a failed transfer)."""

    transfer_id: str
    attempt: int
    reason: str
    cause: Cause


@dataclass(frozen=True)
class Release:
    """Tell the engine Released: the aborted registration's blocks may be reused."""

    transfer_id: str
    attempt: int
    unsafe: bool = False  # as Fail.unsafe


@dataclass(frozen=True)
class SendCancel:
    """Tell the producers at ``endpoints`` to cancel this attempt (their answers come back as
    ProducerCancelled). None for an attempt a newer one superseded: its producers hear the
    newer registration instead, which ends this attempt there."""

    transfer_id: str
    attempt: int
    reason: str
    cause: Cause = Cause.ABORTED
    endpoints: tuple[str, ...] = field(default=(), compare=False, repr=False)


@dataclass(frozen=True)
class PollNow:
    """Take NIXL's notifications now: a final WRITE of this attempt completed (its
    notification follows it closely)."""

    transfer_id: str
    attempt: int
    now: float


@dataclass(frozen=True)
class Arrived:
    """A notification of this attempt came from its producer's agent (counted, or a repeat):
    what the daemon's metrics and the transfer's timeline see."""

    transfer_id: str
    attempt: int


@dataclass(frozen=True)
class Stranger:
    """A notification for this attempt came from NIXL agent ``agent``, not its producer's:
    reported, never counted."""

    transfer_id: str
    attempt: int
    agent: str


@dataclass(frozen=True)
class Tampered:
    """A notification for this attempt that its producer did not send: its tag does not verify
    (``why`` "forged": another agent, another attempt's or transfer's tag, or none), or it
    repeats one already counted (``why`` "replayed"). Never counted; a live attempt fails."""

    transfer_id: str
    attempt: int
    agent: str
    why: str


Action = Accepted | Complete | Fail | Refuse | Release | SendCancel | PollNow | Arrived | Stranger | Tampered
