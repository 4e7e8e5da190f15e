"""Input checks a message passes before it can become a core event (and ever reach NIXL).

The codec already validated types and ranges; these checks need the attached layout or the
daemon's configured bounds. Each returns ``""`` when the input is acceptable, else a reason
the sender is told. Bounds come from configuration, never from the wire.
"""

from __future__ import annotations

from kvpush.daemon.core.rendezvous import LayersReady
from kvpush.proto.groups import GroupsError, parse
from kvpush.proto.groups import need as groups_need
from kvpush.proto.layout import KVLayout
from kvpush.proto.messages import LayerProgress
from kvpush.proto.params import MAX_NODE, MAX_SECRET


def check_blocks(
    layout: KVLayout, block_ids: tuple[int, ...], num_tokens: int, what: str, first_token: int = 0,
    kv_groups: tuple[int, ...] = (),
) -> str:
    """Empty string if the block list (each KV cache group's, ``kv_groups``: proto.groups)
    can hold tokens [first_token, num_tokens), else why not."""
    if num_tokens <= 0:
        return f"{what}: num_tokens must be positive"
    if first_token % layout.block_size or first_token >= num_tokens:
        return f"{what}: first_token {first_token} must be a block boundary below num_tokens {num_tokens}"
    need = -(-(num_tokens - first_token) // layout.block_size)
    if len(kv_groups) != len(layout.kv_groups):
        return (f"{what}: {len(kv_groups) or 1} block list(s) for an engine of {len(layout.kv_groups) or 1} "
                "KV cache group(s)")
    if kv_groups and sum(kv_groups) != len(block_ids):
        return f"{what}: {len(block_ids)} block IDs for KV cache groups of {sum(kv_groups)}"
    if kv_groups:
        try:
            kinds = [parse(d) for d in layout.kv_groups]
        except GroupsError as exc:
            return f"{what}: {exc}"
        for g, (n, kind) in enumerate(zip(kv_groups, kinds, strict=True)):
            if n < groups_need(kind, num_tokens, first_token):
                return f"{what}: KV cache group {g} ({kind.kind}) of {n} blocks cannot hold {num_tokens} tokens"
    elif len(block_ids) < need:
        return f"{what}: {len(block_ids)} blocks cannot hold {num_tokens} tokens at block size {layout.block_size}"
    if block_ids and max(block_ids) >= layout.num_blocks:
        return f"{what}: block ID {max(block_ids)} out of range [0, {layout.num_blocks})"
    return ""


def check_binding(node: str, secret: str, what: str) -> str:
    """Empty string if a transfer's binding (who may register) fits the bounds every leg is
    parsed with, else why not."""
    if len(node) > MAX_NODE or len(secret) > MAX_SECRET:
        return f"{what}: binding of {len(node)}/{len(secret)} chars exceeds {MAX_NODE}/{MAX_SECRET}"
    return ""


def check_progress(layout: KVLayout, msg: LayerProgress, max_chunks: int, events: int) -> str:
    """Empty string if a LayerProgress fits the attached layout and the configured bounds,
    else why not (the whole frame is refused: nothing of a bad frame reaches a core).
    ``events``: the size of the engine's LayerEvents pool (0: none sent)."""
    if not 0 <= msg.layer_lo < msg.layer_hi <= layout.num_layers:
        return f"progress: layers [{msg.layer_lo}, {msg.layer_hi}) outside [0, {layout.num_layers})"
    if not msg.chunks or len(msg.chunks) > max_chunks:
        return f"progress: {len(msg.chunks)} chunks (1 to {max_chunks} per frame)"
    if msg.event > events:
        return f"progress: event {msg.event} beyond the {events} LayerEvents sent"
    if layout.kv_groups:  # a layer frame names no KV cache group: hybrid engines push whole requests
        return f"progress: the engine has {len(layout.kv_groups)} KV cache groups; layer-wise frames are refused"
    for c in msg.chunks:
        if not c.transfer_id:
            return "progress: empty transfer_id"
        why = check_binding(c.bind_node, c.bind_secret, "progress") or check_blocks(
            layout, c.block_ids, c.num_tokens, "progress", c.first_token - c.first_token % layout.block_size)
        if why:
            return why
        if c.first_block != c.first_token // layout.block_size:
            return (f"progress: first_block {c.first_block} is not the block of first_token "
                    f"{c.first_token} at block size {layout.block_size}")
    return ""


def progress_events(msg: LayerProgress, now: float, hold_s: float) -> list[LayersReady]:
    """A checked LayerProgress as the rendezvous' events, one per chunk, kept ``hold_s``
    (the lease) if nobody registers or seals. Each carries the binding its seal will carry."""
    return [LayersReady(c.transfer_id, c.epoch, msg.layer_lo, msg.layer_hi, c.first_block,
                        tuple(c.block_ids), now, now + hold_s, (c.bind_node, c.bind_secret), c.num_tokens,
                        c.auto)
            for c in msg.chunks]


def bounded_s(asked_ms: int, limit_s: float) -> float:
    """A duration the wire asks for, in seconds, capped by the configured limit."""
    return min(max(0.0, asked_ms / 1000.0), limit_s)
