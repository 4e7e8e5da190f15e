"""Which ``save_kv_layer`` call ends a layer group, and the frame it publishes.

vLLM calls ``save_kv_layer(layer_name, ...)`` after every attention layer of every forward
(CPU too: ``maybe_transfer_kv_layer`` wraps ``unified_attention_with_output``). While the
forward computes chunks of streamed requests (the step's ``KVPushMetadata.streams``), every
``layer_group`` layers, and after the last one, the worker publishes ONE proto.LayerProgress
for all of them. The plan is made once (layer names → the group each one ends) and the frame's
chunks once per forward, so a layer that ends no group costs one dict lookup.

A refused publish (the link's queue is full, or the daemon is down) ends the forward's
stream: later frames would only queue behind it. Nothing is lost but speed: the seal
(PrefillDone) names every block, and the daemon writes whatever the stream did not.

Pure: no I/O; the shell sends and records events.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvpush import proto
from kvpush.engine_plugin.metadata import StreamChunk


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

    __slots__ = ("ends", "chunks", "refused", "frames")

    def __init__(self, layer_names: Sequence[str], group: int) -> None:
        self.ends = group_ends(layer_names, group)
        self.chunks: tuple[proto.LayerChunk, ...] = ()  # this forward's; () streams nothing
        self.refused = 0  # forwards whose stream a refused frame ended (cumulative)
        self.frames = 0  # frames handed to the link (cumulative)

    def begin(self, streams: Iterable[StreamChunk]) -> None:
        """bind_connector_metadata: the chunks this forward computes (the wire form, once)."""
        self.chunks = tuple(proto.LayerChunk(c.transfer_id, c.epoch, c.first_block, tuple(c.block_ids),
                                             c.first_token, c.num_tokens) for c in streams)

    def span(self, layer_name: str) -> tuple[int, int] | None:
        """The group ``layer_name`` ends, if a frame is due after it."""
        return self.ends.get(layer_name) if self.chunks else None

    def frame(self, span: tuple[int, int], event: int) -> proto.LayerProgress:
        return proto.LayerProgress(span[0], span[1], self.chunks, event)

    def sent(self, ok: bool) -> None:
        """The link took the frame, or refused it: then the forward streams nothing more."""
        if ok:
            self.frames += 1
        else:
            self.refused += 1
            self.chunks = ()

    def end(self) -> None:
        """wait_for_save: the forward is over; its seal (if any) goes out now."""
        self.chunks = ()
