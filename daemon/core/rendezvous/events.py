"""The rendezvous' events: facts in the past tense, never a wire message's name (the shell,
:mod:`kvpush.daemon.prefill_side`, translates ``proto.PeerRegister``, ``proto.PrefillDone``,
``proto.Abort`` and ``proto.Cancel`` into them). Each carries ``now``: the core has no clock."""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from kvpush.daemon.core.causes import Cause


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
    key: bytes = b""  # what the final WRITE's notification is tagged with (PeerRegister.key)
    kv_groups: tuple[int, ...] = ()  # hybrid: each KV cache group's list length in block_ids (proto.groups)


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
    kv_groups: tuple[int, ...] = ()  # hybrid: as Registered.kv_groups

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
