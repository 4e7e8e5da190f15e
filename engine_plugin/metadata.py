"""The one object the scheduler half hands the worker half each step.

vLLM's connector split: the scheduler half decides (which requests register
blocks, which finished prefill, which were aborted); the worker half, which owns
the daemon connection, publishes. What it decides travels as the worker lifecycle's
own events (:data:`kvpush.engine_plugin.worker.lifecycle.FromScheduler`): built once by
the scheduler half, applied as they are by the worker half, with no copy in between.
Plain dataclasses: vLLM may pickle this to a worker process.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvpush.engine_plugin.worker.lifecycle import (
    AbortLoad,
    FromScheduler,
    Register,
    Send,
    SendAbort,
    StreamAbort,
)

__all__ = ["AbortLoad", "FromScheduler", "KVPushMetadata", "Register", "Send", "SendAbort", "StreamAbort",
           "StreamChunk"]


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
    # The worker lifecycle's events the scheduler half decided this step, in the order it did.
    events: list[FromScheduler] = field(default_factory=list)
    # Prefill side, layer-wise: the chunks this step's forward computes, of streamed requests.
    streams: list[StreamChunk] = field(default_factory=list)
    idle: bool = False  # the step runs no forward: the worker may wait briefly for the daemon
    # Timeline stamps taken by the scheduler half: (transfer_id, hop, monotonic ns).
    stamps: list[tuple[str, str, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.events)
