"""Which ``save_kv_layer`` call ends a layer group, and the frame it publishes.

vLLM calls ``save_kv_layer(layer_name, ...)`` after every attention layer of every forward
(CPU too: ``maybe_transfer_kv_layer`` wraps ``unified_attention_with_output``). While the
forward computes chunks of streamed requests (the step's ``KVPushMetadata.streams``), every
``layer_group`` layers, and after the last one, the worker publishes ONE proto.LayerProgress
for all of them. The plan is made once (layer names → the group each one ends) and the frame's
chunks once per forward, so a layer that ends no group costs one dict lookup.

Frames are encoded from parts: the chunks once per forward (the bulk of a frame: every block
ID of every streamed request), each group's layer range once at start-up, so a frame costs a
concatenation, not an encode of thousands of block IDs. :func:`frame_bytes` is the codec's
wire form of proto.LayerProgress (a unit test decodes it with the codec, field for field).

A refused publish (the link's queue is full, or the daemon is down) ends the forward's
stream: later frames would only queue behind it. Nothing is lost but speed: the seal
(PrefillDone) names every block, and the daemon writes whatever the stream did not.

Pure: no I/O; the shell sends and records events.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgpack

from kvpush import proto
from kvpush.engine_plugin.metadata import StreamChunk
from kvpush.proto.codec import DEFAULT_LIMITS, encode_struct

_PACK = msgpack.Packer(use_bin_type=True)
_HEAD = (_PACK.pack_map_header(6) + _PACK.pack("v") + _PACK.pack(proto.PROTOCOL_VERSION) + _PACK.pack("t")
         + _PACK.pack("LayerProgress") + _PACK.pack("chunks"))
_EVENT = _PACK.pack("event")


def chunks_bytes(chunks: Sequence[proto.LayerChunk]) -> bytes:
    """The start of a LayerProgress frame up to its chunks: made once per forward."""
    return _HEAD + _PACK.pack_array_header(len(chunks)) + b"".join(encode_struct(c) for c in chunks)


def span_bytes(lo: int, hi: int) -> bytes:
    """A group's layer range and the event key: made once per group at start-up."""
    return _PACK.pack("layer_lo") + _PACK.pack(lo) + _PACK.pack("layer_hi") + _PACK.pack(hi) + _EVENT


def frame_bytes(head: bytes, span: bytes, event: int) -> bytes:
    """One encoded LayerProgress: ``chunks_bytes`` + ``span_bytes`` + the event."""
    return head + span + (_PACK.pack(event) if event > 127 else bytes((event,)))


def group_ends(layer_names: Sequence[str], group: int) -> dict[str, tuple[int, int]]:
    """Layer name → ``(layer_lo, layer_hi)`` of the group it ends (names in model order)."""
    if group < 1:
        raise ValueError("layer_group must be >= 1")
    n = len(layer_names)
    ends = {}
    for lo in range(0, n, group):
        hi = min(lo + group, n)
        ends[layer_names[hi - 1]] = (lo, hi)
    return ends


class LayerStream:
    """One rank's plan and the current forward's frame."""

    __slots__ = ("ends", "chunks", "head", "refused", "frames", "too_big")

    def __init__(self, layer_names: Sequence[str], group: int) -> None:
        # layer name -> the encoded range of the group it ends
        self.ends = {name: span_bytes(lo, hi) for name, (lo, hi) in group_ends(layer_names, group).items()}
        self.chunks: tuple[proto.LayerChunk, ...] = ()  # this forward's; () streams nothing
        self.head = b""
        self.too_big = 0  # forwards not streamed: their frame would exceed the wire's max_message
        self.refused = 0  # forwards whose stream a refused frame ended (cumulative)
        self.frames = 0  # frames handed to the link (cumulative)

    def begin(self, streams: Sequence[StreamChunk], auto_min_tokens: int = 0) -> int:
        """bind_connector_metadata: the chunks this forward computes (the wire form, once).
        An ``auto`` request whose prompt is shorter than ``auto_min_tokens`` (the daemon's
        advice: it would stream it to no peer) is left out, its seal covers it; returns how
        many were."""
        kept = [c for c in streams if not (c.auto and c.prompt_tokens < auto_min_tokens)]
        self.chunks = tuple(proto.LayerChunk(c.transfer_id, c.epoch, c.first_block, tuple(c.block_ids),
                                             c.first_token, c.num_tokens, c.bind_node, c.bind_secret, c.auto)
                            for c in kept)
        if self.chunks:
            self.head = chunks_bytes(self.chunks)
            if len(self.head) > DEFAULT_LIMITS.max_message - 64:  # the daemon would refuse it: the seal covers
                self.too_big += 1
                self.chunks, self.head = (), b""
        return len(streams) - len(kept)

    def sent(self, ok: bool) -> None:
        """The link took the frame, or refused it: then the forward streams nothing more."""
        if ok:
            self.frames += 1
        else:
            self.refused += 1
            self.chunks = ()

    def end(self) -> None:
        """wait_for_save: the forward is over; its seal (if any) goes out now."""
        self.chunks, self.head = (), b""
