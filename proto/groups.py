"""KV cache groups on the wire: one block list per group, and what a group is.

vLLM's hybrid KV cache allocator gives a model one KV cache *group* per kind of layer
(Gemma 3: three sliding-window groups and one full-attention group) and a request one block
list per group. Every group's blocks live in the same allocation (vLLM 0.32 overlays the
groups' tensors: a block ID belongs to one group at a time), so a group's block is moved as
the pages of every layer tensor at that block ID.

On the wire (``Register``, ``PeerRegister``, ``PrefillDone``) the lists travel as
``block_ids``, the groups' lists one after the other, and ``kv_groups``, each list's length.
``kv_groups == ()`` is one group (a dense or MLA model): ``block_ids`` is its list.
:data:`NULL_BLOCK` in a list is vLLM's null block: the engine holds nothing there (a
sliding-window group's blocks before the window). A decode engine's lists start at its first
block to load (``first_token // block_size``), a prefill engine's at the prompt's first block.

:func:`describe` names a group for the handshake (``KVLayout.kv_groups``): both sides must
agree on each group's kind, window and block size, or the handshake names the group and
both values.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["NULL_BLOCK", "GroupsError", "describe", "pack", "slice_from", "split"]

#: vLLM's null block (``BlockPool.null_block``, always block 0): a placeholder, never a request's KV.
NULL_BLOCK = 0


class GroupsError(ValueError):
    """A grouped block list that does not add up."""


def pack(lists: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(block_ids, groups)`` of per-group lists; one list packs as ``(its ids, ())``."""
    if len(lists) == 1:
        return tuple(int(b) for b in lists[0]), ()
    return tuple(int(b) for ids in lists for b in ids), tuple(len(ids) for ids in lists)


def split(block_ids: Sequence[int], groups: Sequence[int]) -> list[tuple[int, ...]]:
    """The per-group lists of ``block_ids`` (``groups`` as on the wire)."""
    ids = tuple(block_ids)
    if not groups:
        return [ids]
    if sum(groups) != len(ids):
        raise GroupsError(f"{len(ids)} block IDs for groups of {sum(groups)} ({', '.join(map(str, groups))})")
    out, at = [], 0
    for n in groups:
        out.append(ids[at: at + n])
        at += n
    return out


def slice_from(block_ids: Sequence[int], groups: Sequence[int], first_block: int,
               ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Each group's list from index ``first_block`` on, packed again (a decode engine's
    local prefix hit: it loads only the blocks after it, in every group)."""
    lists = split(block_ids, groups)
    if not groups:
        return lists[0][first_block:], ()
    return pack([ids[first_block:] for ids in lists])


def describe(spec: Any) -> str:
    """One group's kind, window and block size, from vLLM's KV cache spec (by attribute):
    what P and D must agree on, as the handshake compares it."""
    kind = type(spec).__name__.removesuffix("Spec")
    parts = [kind, f"block_size={int(getattr(spec, 'block_size', 0))}"]
    window = getattr(spec, "sliding_window", None) or getattr(spec, "attention_chunk_size", None)
    if window:
        parts.append(f"window={int(window)}")
    page = getattr(spec, "page_size_bytes", None)
    if isinstance(page, int):
        parts.append(f"page_bytes={page}")
    return " ".join(parts)
