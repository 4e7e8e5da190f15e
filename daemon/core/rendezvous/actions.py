"""The rendezvous' actions: what the shell carries out for it (post a WRITE, release the
engine's blocks, tell a decode peer), in the order the core returns them."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpush.daemon.core.causes import Cause


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
    key: bytes = field(default=b"", repr=False)  # the registration's notification key (Registered.key)
    src_kv_groups: tuple[int, ...] = ()  # hybrid: each KV cache group's list length (proto.groups)
    dst_kv_groups: tuple[int, ...] = ()


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
