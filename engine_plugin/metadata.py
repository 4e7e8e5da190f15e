"""The one object the scheduler half hands the worker half each step.

vLLM's connector split: the scheduler half decides (which requests register
blocks, which finished prefill, which were aborted); the worker half, which owns
the daemon connection, publishes. Plain dataclasses: vLLM may pickle this to a
worker process.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass
class RegisterReq:
    """Decode side: these blocks wait for the transfer's KV."""

    req_id: str
    transfer_id: str
    attempt: int
    block_ids: list[int]
    num_tokens: int
    first_token: int
    prefill_endpoints: list[str]
    prefill_tp_size: int
    secret: str = ""  # the transfer's secret from the decode leg's params


@dataclass
class SendReq:
    """Prefill side: the request's KV is in memory in these blocks (held until Sent).

    ``early``: sent with the step that computes the request's last prompt token (its only
    output token is sampled there too): the worker publishes it right after that forward,
    and the same transfer's later, plain SendReq (from ``request_finished``) only confirms
    that vLLM finished the request, after which its blocks may be reported free.
    """

    req_id: str
    transfer_id: str
    block_ids: list[int]
    num_tokens: int
    early: bool = False
    bind_node: str = ""  # who may register: this decode node, or whoever presents bind_secret
    bind_secret: str = ""
    streamed: bool = False  # layer-wise: its chunks were streamed, the last one in ``epoch``
    epoch: int = 0


@dataclass
class AbortReq:
    """Decode side: the request went away while its registration was live."""

    req_id: str
    transfer_id: str
    attempt: int


@dataclass
class StreamChunk:
    """Prefill side, layer-wise: this step's forward computes tokens ``[first_token,
    num_tokens)`` of a streamed request, into ``block_ids`` (its blocks from index
    ``first_block``; ``first_token`` is that block's first token). ``epoch`` counts the
    request's restarts (preemption): the worker reports it with every layer group, and the
    daemon voids progress of an earlier epoch. The wire form is proto.LayerChunk."""

    transfer_id: str
    epoch: int
    first_block: int
    block_ids: list[int]
    first_token: int
    num_tokens: int
    bind_node: str = ""  # the seal's binding: the daemon streams only to a party it admits
    bind_secret: str = ""
    auto: bool = False  # layerwise "auto": the daemon streams it only where its link makes it worth it
    prompt_tokens: int = 0  # the request's prompt (auto: below the daemon's advice, no frames)


@dataclass
class KVPushMetadata(KVConnectorMetadata):
    registers: list[RegisterReq] = field(default_factory=list)
    sends: list[SendReq] = field(default_factory=list)
    aborts: list[AbortReq] = field(default_factory=list)
    # Prefill side: an early-published request vLLM then finished abnormally (aborted): the
    # daemon must stop using its blocks before they are reported free.
    send_aborts: list[AbortReq] = field(default_factory=list)
    # Prefill side, layer-wise: the chunks this step's forward computes, of streamed requests.
    streams: list[StreamChunk] = field(default_factory=list)
    # Prefill side: transfers that ended unsealed, streamed or not (aborted, abort_immediately):
    # the daemon drops them and fails a decode side's registration at once.
    stream_aborts: list[AbortReq] = field(default_factory=list)
    idle: bool = False  # the step runs no forward: the worker may wait briefly for the daemon
    # Timeline stamps taken by the scheduler half: (transfer_id, hop, monotonic ns).
    stamps: list[tuple[str, str, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.registers or self.sends or self.aborts or self.send_aborts or self.stream_aborts)
