"""Every message kvpush sends, as frozen dataclasses.

The dataclasses are the schema: :mod:`kvpush.proto.codec` reads their fields and type hints
to encode and validate, so adding a message is adding a class here (decorated with
``@message``) and nothing else. Enumerated string fields carry their allowed values in the
field metadata (``choices``) so the codec can reject anything else at the boundary.

All ints are >= 0 on the wire; ``block_ids`` and other sequences are tuples at runtime.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field
from typing import Any, TypeVar

from kvpush.proto.layout import KVLayout

# 2: Attach carries one MemoryHandle per region, Hello one base per region.
# 3: PeerRegister.timeout_ms (was deadline_ms: it always was a duration, not a deadline).
# 4: layer-wise streaming (LayerProgress, LayerEvents), least-reach handshakes and bound transfers.
# 5: PeerRegister.key; the NIXL notification carries an HMAC under it (kvpush.proto.notif, "kvp2");
#    hybrid KV cache groups: Register / PeerRegister / PrefillDone.kv_groups, KVLayout.kv_groups.
# 6: state groups (Mamba2, gated delta net): a group's description carries its state; a state
#    pair moves only the state's bytes of its page, and a prefill leg of such a model computes
#    all but the prompt's last token. A version-5 daemon would copy whole pages by position.
PROTOCOL_VERSION = 6
#: Older versions whose ``Error`` message is this version's, field for field: a sender on one
#: of them is refused with an Error in its own envelope (it can read why), and its refusals
#: of us are read too. Every other message of another version is refused as a whole.
ERROR_COMPATIBLE_VERSIONS = frozenset({2, 3, 4, 5})

MEMORY_KINDS = frozenset({"cpu_shm", "cuda_ipc"})
MEM_TYPES = frozenset({"DRAM", "VRAM"})  # NIXL memory types of registered regions
ROLES = frozenset({"prefill", "decode", "both"})
OPS_COMMANDS = frozenset({"status", "pending", "peers", "transfers", "cancel", "drain", "metrics", "trace"})

MESSAGE_TYPES: dict[str, type] = {}
"""Wire type name ("t") -> message class."""

_T = TypeVar("_T", bound=type)


def message(cls: _T) -> _T:
    """Register a message class under its class name, which is its wire type name."""
    if cls.__name__ in MESSAGE_TYPES:
        raise TypeError(f"message type {cls.__name__} registered twice")
    MESSAGE_TYPES[cls.__name__] = cls
    return cls


def choice(values: frozenset[str], default: Any = MISSING) -> Any:
    """A str field restricted to ``values`` (the codec enforces it on decode).

    Without ``default`` the field stays required (``MISSING`` is dataclasses' "no default").
    """
    return field(default=default, metadata={"choices": values})


@dataclass(frozen=True, slots=True)
class MemoryHandle:
    """Engine memory another process can map (a shm file or a CUDA IPC handle)."""

    kind: str = choice(MEMORY_KINDS)
    handle: bytes  # a payload per kind (ShmInfo, CudaIpcInfo): see kvpush.proto.handles
    size: int
    offset: int = 0
    device: int = 0


# ---- engine -> daemon -------------------------------------------------------------------


@message
@dataclass(frozen=True, slots=True)
class Attach:
    """An engine rank hands its daemon the KV memory and how it is laid out.

    ``regions``: every distinct allocation of the rank's KV, in the layout's region order
    (vLLM-cpu: one storage; vLLM on GPU: one per layer or per shared KV tensor)."""

    engine_id: str
    rank: int
    tp_size: int
    role: str = choice(ROLES)
    regions: tuple[MemoryHandle, ...]
    layout: KVLayout


@message
@dataclass(frozen=True, slots=True)
class Register:
    """Decode side: these blocks wait for a transfer's KV, from these prefill endpoints."""

    transfer_id: str
    attempt: int
    block_ids: tuple[int, ...]
    num_tokens: int
    prefill_endpoints: tuple[str, ...]
    prefill_tp_size: int
    timeout_ms: int
    first_token: int = 0  # block_ids cover tokens [first_token, num_tokens): a local prefix hit
    secret: str = ""  # the transfer's secret from the decode leg's params, for the PeerRegisters
    kv_groups: tuple[int, ...] = ()  # hybrid: each KV cache group's list length in block_ids (proto.groups)


@message
@dataclass(frozen=True, slots=True)
class PrefillDone:
    """Prefill side: the transfer's KV is in these blocks, held for ``lease_ms``."""

    transfer_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    lease_ms: int
    # Who may register (either suffices; both "": anyone allowlisted, the first one owns it):
    bind_node: str = ""  # the decode node's certificate name
    bind_secret: str = ""  # the transfer's secret, presented in PeerRegister.secret
    # Layer-wise: the request streamed (LayerProgress), and its epoch (LayerChunk.epoch) when its
    # last chunk was computed: the final WRITE skips only what groups of this epoch wrote.
    streamed: bool = False
    epoch: int = 0
    kv_groups: tuple[int, ...] = ()  # hybrid: each KV cache group's list length in block_ids (proto.groups)


@dataclass(frozen=True, slots=True)
class LayerChunk:
    """One request's part of a forward, as far as a :class:`LayerProgress` reports it.

    ``block_ids`` are the request's blocks holding tokens ``[first_token, num_tokens)`` (this
    chunk; ``first_token`` is a multiple of the block size less any partial block the chunk
    completes), ``first_block`` the index of ``block_ids[0]`` among the request's blocks.
    ``epoch`` counts the request's restarts in this engine (preemption): progress of an
    earlier epoch is void, and the blocks it named may already belong to another request."""

    transfer_id: str
    epoch: int
    first_block: int
    block_ids: tuple[int, ...]
    first_token: int
    num_tokens: int
    # The binding the seal (PrefillDone) will carry: layers are written before the seal only to
    # a registration it admits, so a hijacker that registered first gets nothing early either.
    bind_node: str = ""
    bind_secret: str = ""
    # layerwise "auto" on the engine: the daemon streams it only to a decode side its link
    # makes worth it (the whole WRITE estimated at >= layerwise_min_transfer_ms); False: "on".
    auto: bool = False


@message
@dataclass(frozen=True, slots=True)
class LayerProgress:
    """Prefill side, during a forward: layers ``[layer_lo, layer_hi)`` of these chunks are in
    their blocks (one frame per layer group for all streamed requests of the forward).

    Progress only: the seal is still the request's PrefillDone, which names every block and
    covers whatever the stream did not (prefix hits, unreported layers). ``event`` (GPU):
    1 + the index in the engine's :class:`LayerEvents` pool of the event recorded after these
    layers; the daemon posts nothing of them before it has fired. 0: none (CPU: the hook
    runs after the layer's kernels finished). Wire ints are never negative."""

    layer_lo: int
    layer_hi: int
    chunks: tuple[LayerChunk, ...]
    event: int = 0


@message
@dataclass(frozen=True, slots=True)
class LayerEvents:
    """Prefill side, GPU, once after Attach: the interprocess CUDA events a LayerProgress
    names by index (``torch.cuda.Event(interprocess=True).ipc_handle()``), on ``device``."""

    handles: tuple[bytes, ...]
    device: int


@message
@dataclass(frozen=True, slots=True)
class Abort:
    """Engine gives up on one attempt of a transfer (either side)."""

    transfer_id: str
    attempt: int
    reason: str


@message
@dataclass(frozen=True, slots=True)
class Heartbeat:
    """Engine liveness probe; the daemon echoes ``seq``."""

    seq: int


# The contract behind a Heartbeat: an engine gives its daemon up (fails its loads, frees the
# blocks of its sends) only after a heartbeat stayed unanswered this long at least (the plugin's
# ``dead_after_ms`` may be larger, never smaller). A daemon that did not run for less cannot have
# been given up; one that did not run for longer must assume the blocks it held were freed.
ENGINE_DEAD_AFTER_MIN_S = 1.5


@message
@dataclass(frozen=True, slots=True)
class TraceReport:
    """Engine plugin's stamps of one transfer (see :mod:`kvpush.proto.trace`), sent once the
    request is past its transfer so `kvpushctl trace` can show the whole node's timeline."""

    transfer_id: str
    hops: tuple[str, ...]
    times_ns: tuple[int, ...]


# ---- daemon -> engine -------------------------------------------------------------------


@message
@dataclass(frozen=True, slots=True)
class AttachAck:
    """Daemon accepted an Attach; ``daemon_id`` changes on every daemon restart."""

    agent_name: str
    daemon_id: str


@message
@dataclass(frozen=True, slots=True)
class Sent:
    """Prefill side: all WRITEs of the attempt completed; source blocks are free."""

    transfer_id: str
    attempt: int


@message
@dataclass(frozen=True, slots=True)
class SendFailed:
    """Prefill side: the attempt's WRITEs will not happen (or did not complete)."""

    transfer_id: str
    attempt: int
    reason: str


@message
@dataclass(frozen=True, slots=True)
class Received:
    """Decode side: every expected producer's KV landed in the registered blocks."""

    transfer_id: str
    attempt: int


@message
@dataclass(frozen=True, slots=True)
class ReceiveFailed:
    """Decode side: the attempt failed; blocks are *not* yet safe to reuse (wait Released)."""

    transfer_id: str
    attempt: int
    reason: str


@message
@dataclass(frozen=True, slots=True)
class Released:
    """Decode side: no WRITE of this aborted registration can land any more; reuse blocks."""

    transfer_id: str
    attempt: int


@message
@dataclass(frozen=True, slots=True)
class HeartbeatAck:
    """Answer to Heartbeat; a new ``daemon_id`` tells the engine to re-attach.

    ``stream_min_tokens`` (prefill side, layerwise "auto"): the shortest prompt this daemon
    would stream to any decode peer it knows, by the rate its WRITEs to each recently moved
    (0: any, e.g. a peer not measured yet). A shorter prompt's progress frames would only wake
    the daemon for nothing: the plugin does not send them (its own layerwise_min_tokens still
    applies). Advice only: the daemon decides per registration anyway."""

    seq: int
    daemon_id: str
    stream_min_tokens: int = 0


@message
@dataclass(frozen=True, slots=True)
class Error:
    """A request was rejected; ``ref`` names what it refers to (e.g. a transfer ID)."""

    code: str
    message: str
    ref: str = ""


# ---- daemon <-> daemon ------------------------------------------------------------------


@message
@dataclass(frozen=True, slots=True)
class Hello:
    """Peer handshake: NIXL agent metadata, layout and compatibility hash of one rank.

    Only the dialling decode daemon's Hello (``reply=False``: the WRITE target) carries its
    NIXL metadata and region addresses. The prefill daemon's reply carries ``b""`` and ``()``:
    a producer's memory is never exposed to anyone (least reach, issue 28)."""

    agent_name: str
    agent_metadata: bytes  # b"" in a reply
    layout: KVLayout
    region_bases: tuple[int, ...]  # address of each registered region, in the layout's order; () in a reply
    version: int
    compat: str
    engine_id: str
    rank: int
    tp_size: int
    endpoint: str
    reply: bool = False
    mem_type: str = choice(MEM_TYPES, "DRAM")  # of every region (VRAM: CUDA IPC on GPU)
    device: int = 0  # the regions' device (the GPU index in NIXL's descriptors)


@message
@dataclass(frozen=True, slots=True)
class PeerRegister:
    """Decode daemon tells a prefill daemon where (and how many producers) to WRITE."""

    transfer_id: str
    attempt: int
    block_ids: tuple[int, ...]
    num_tokens: int
    dest_rank: int
    dest_tp_size: int
    expected_dests: int
    timeout_ms: int  # how long from now the decode side waits for the WRITE (capped by config)
    first_token: int = 0  # as in Register: destination blocks start at this token
    secret: str = ""  # the transfer's secret (as in Register), for a transfer bound to one
    # This registration's notification key (proto.notif.KEY_BYTES random bytes, new per
    # registration and producer): the producer tags its NIXL notification with it, and the
    # decode side counts only a notification whose tag verifies. It travels only here, over
    # the CURVE-encrypted link to the producer the registration names.
    key: bytes = b""
    kv_groups: tuple[int, ...] = ()  # as in Register: each KV cache group's list length in block_ids


@message
@dataclass(frozen=True, slots=True)
class Cancel:
    """Decode daemon withdraws a registration; the producer must confirm."""

    transfer_id: str
    attempt: int
    reason: str


@message
@dataclass(frozen=True, slots=True)
class CancelConfirmed:
    """Producer guarantees no WRITE of this attempt is or will be in flight."""

    transfer_id: str
    attempt: int
    producer_rank: int


@message
@dataclass(frozen=True, slots=True)
class WriteFailedNotice:
    """Producer could not post or complete its WRITEs; the consumer stops waiting for it.
    ``may_land``: a WRITE was posted and did not finish (it timed out): NIXL cannot recall
    it, so it may still arrive; the consumer must fence before reusing its blocks."""

    transfer_id: str
    attempt: int
    producer_rank: int
    reason: str
    may_land: bool = False


@message
@dataclass(frozen=True, slots=True)
class Writing:
    """Producer posted (``done`` false) or completed (``done`` true) its WRITE of this attempt.

    Wake-ups, not proofs: only the NIXL notification, which NIXL delivers after the data,
    completes a transfer. A posted WRITE makes the consumer poll NIXL tightly until the
    notification shows (some UCX modes need the receiver's progress to complete at all); a
    completed one makes it look at once instead of at its next poll. A group WRITE's hints
    (``group``) bracket only that WRITE: between groups the consumer need not spin.
    """

    transfer_id: str
    attempt: int
    producer_rank: int
    done: bool
    # 0: the final WRITE (the one with the notification); n: the producer's group WRITE n
    # (layer-wise): no notification follows its completion, so the tight poll it asked for
    # ends when it is done.
    group: int = 0


# ---- ops --------------------------------------------------------------------------------


@message
@dataclass(frozen=True, slots=True)
class OpsRequest:
    """A kvpushctl command."""

    cmd: str = choice(OPS_COMMANDS)
    arg: str = ""


@message
@dataclass(frozen=True, slots=True)
class OpsReply:
    """Answer to OpsRequest; ``data`` is JSON-like (str keys, depth <= 8): when ``ok``, the
    command's :mod:`kvpush.proto.ops` dataclass as ``to_data()``, else ``{}`` and ``error``."""

    ok: bool
    data: dict[str, Any]
    error: str = ""


Message = (
    Attach
    | Register
    | PrefillDone
    | LayerProgress
    | LayerEvents
    | Abort
    | Heartbeat
    | TraceReport
    | AttachAck
    | Sent
    | SendFailed
    | Received
    | ReceiveFailed
    | Released
    | HeartbeatAck
    | Error
    | Hello
    | PeerRegister
    | Cancel
    | CancelConfirmed
    | WriteFailedNotice
    | Writing
    | OpsRequest
    | OpsReply
)
"""Any wire message (what decode returns)."""
