"""Input checks a message passes before it can become a core event (and ever reach NIXL).

The codec already validated types and ranges; these checks need the attached layout or the
daemon's configured bounds. Each returns ``""`` when the input is acceptable, else a reason
the sender is told. Bounds come from configuration, never from the wire.
"""

from __future__ import annotations

from kvpush.proto.layout import KVLayout


def check_blocks(
    layout: KVLayout, block_ids: tuple[int, ...], num_tokens: int, what: str, first_token: int = 0
) -> str:
    """Empty string if the block list can hold tokens [first_token, num_tokens), else why not."""
    if num_tokens <= 0:
        return f"{what}: num_tokens must be positive"
    if first_token % layout.block_size or first_token >= num_tokens:
        return f"{what}: first_token {first_token} must be a block boundary below num_tokens {num_tokens}"
    need = -(-(num_tokens - first_token) // layout.block_size)
    if len(block_ids) < need:
        return f"{what}: {len(block_ids)} blocks cannot hold {num_tokens} tokens at block size {layout.block_size}"
    if block_ids and max(block_ids) >= layout.num_blocks:
        return f"{what}: block ID {max(block_ids)} out of range [0, {layout.num_blocks})"
    return ""


def bounded_s(asked_ms: int, limit_s: float) -> float:
    """A duration the wire asks for, in seconds, capped by the configured limit."""
    return min(max(0.0, asked_ms / 1000.0), limit_s)
