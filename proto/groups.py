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

**State groups** (Mamba2, gated delta net: vLLM's ``MambaSpec``) hold no per-token KV: a
request's list holds its running-state slot (and, in ``mamba_cache_mode='align'``, null or
checkpoint slots before it, speculative scratch slots after it). Only the running state moves
(:func:`clip_state`, vLLM's NixlConnector's rule), so on the wire a state group's list is that
one slot, never sliced by a prefix hit. Of that slot's page only the state itself moves
(:attr:`Group.state_bytes`): vLLM 0.32 packs a state layer's sub-tensors (conv, then SSM)
back to back from the page's first byte (``MambaBase.bind_kv_cache`` slices them from offset 0
of each block's ``[B, 1, 1, state bytes]`` view; vLLM 0.34 may align each sub-tensor's start,
``state_alignment``, described as ``align=``) and pads the page to the attention page
after them; the padding is never read. The state is cumulative: the decode engine loads the
state after the prompt's first ``N - 1`` tokens and computes the last one itself (the prefill
engine drops the prompt's last token, :data:`STATE_BACKOFF`). A group's own block size
(attention 128 beside a Mamba2 state block of 2048) decides how many of its blocks hold a
prompt; vLLM gives every group the same page bytes, so block ``b`` is page ``b`` of every
layer tensor, whichever group owns it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from math import prod
from typing import Any, NamedTuple

from kvpush.proto.layout import DTYPE_SIZES

__all__ = ["NULL_BLOCK", "STATE_BACKOFF", "Group", "GroupsError", "clip_state", "compat", "describe", "need",
           "pack", "parse", "slice_from", "split"]

#: vLLM's null block (``BlockPool.null_block``, always block 0): a placeholder, never a request's KV.
NULL_BLOCK = 0
#: Prompt tokens the prefill engine of a model with state groups does not compute (the decode
#: engine derives the last state from the one before it, as vLLM's NixlConnector does).
STATE_BACKOFF = 1
#: The kind :func:`describe` gives a state group (vLLM's ``MambaSpec``).
STATE_KIND = "Mamba"


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


def slice_from(block_ids: Sequence[int], groups: Sequence[int], first_token: int, block_size: int,
               sizes: Sequence[int] = ()) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Each group's list from its block holding ``first_token`` on, packed again (a decode
    engine's local prefix hit: it loads only the blocks after it, in every group).
    ``sizes``: each group's own block size, 0 for a state group (its one slot is kept
    whole); empty: every group's is ``block_size``."""
    lists = split(block_ids, groups)
    if not groups:
        return lists[0][first_token // block_size:], ()
    if sizes and len(sizes) != len(lists):
        raise GroupsError(f"{len(lists)} block lists for {len(sizes)} KV cache groups")
    sizes = tuple(sizes) or (block_size,) * len(lists)
    return pack([ids if bs == 0 else ids[first_token // bs:] for ids, bs in zip(lists, sizes, strict=True)])


def clip_state(ids: Sequence[int], spec_blocks: int) -> tuple[int, ...]:
    """A state group's running-state slot: its list without the trailing ``spec_blocks``
    speculative scratch slots, last entry (one entry is always kept; empty stays empty)."""
    ids = tuple(int(b) for b in ids)
    if not ids:
        return ids
    scratch = min(max(0, spec_blocks), len(ids) - 1)
    return (ids[: len(ids) - scratch])[-1:]


class Group(NamedTuple):
    """One group, read back from its description."""

    kind: str
    block_size: int
    state: bool
    spec_blocks: int
    state_bytes: int  # a state group's sub-tensors' bytes, from its page's first byte (0: attention)


@functools.lru_cache(maxsize=64)
def parse(desc: str) -> Group:
    """What a group's :func:`describe` string says the planner needs; raises GroupsError.
    Cached: the checks, the pairing and every WRITE read the same few attached layouts' groups
    (a refusal is not cached; it raises again)."""
    words = str(desc).split()
    if not words:
        raise GroupsError("an empty KV cache group description")
    kv = dict(w.split("=", 1) for w in words[1:] if "=" in w)
    try:
        bs = int(kv.get("block_size", "0"))
        spec = int(kv.get("spec_blocks", "0"))
    except ValueError as exc:
        raise GroupsError(f"KV cache group {desc!r}: {exc}") from exc
    if bs <= 0 or spec < 0:
        raise GroupsError(f"KV cache group {desc!r}: block size {bs}, speculative slots {spec}")
    state = words[0] == STATE_KIND
    return Group(words[0], bs, state, spec, _state_bytes(desc, kv) if state else 0)


def _state_bytes(desc: str, kv: dict[str, str]) -> int:
    """Bytes of a state group's sub-tensors (``state=3x160:bfloat16,...``: each shape's elements
    x its dtype's size, each rounded up to ``align=`` bytes where the description has it, as
    vLLM's ``MambaSpec.state_content_size_bytes``), at most its page."""
    try:
        total = 0
        align = int(kv.get("align", "1"))
        if align <= 0:
            raise ValueError(f"alignment {align}")
        for sub in kv["state"].split(","):
            shape, dtype = sub.rsplit(":", 1)
            dims = [int(x) for x in shape.split("x")]
            if any(d <= 0 for d in dims):
                raise ValueError(f"shape {shape}")
            total += -(-prod(dims) * DTYPE_SIZES[dtype] // align) * align
        page = int(kv["page_bytes"])
    except (KeyError, ValueError) as exc:
        raise GroupsError(f"KV cache group {desc!r}: its state's sub-tensors and page are not readable "
                          f"({type(exc).__name__}: {exc})") from exc
    if not 0 < total <= page:
        raise GroupsError(f"KV cache group {desc!r}: a state of {total} bytes in a page of {page}")
    return total


# Words of a state group's description that are each engine's own bookkeeping: how many
# tokens a block stands for, whether it keeps prefix-cache checkpoints ('align' with prefix
# caching on, 'none' without), its speculative scratch slots. The running state they hold is
# the same bytes either way.
_LOCAL = ("block_size=", "mode=", "spec_blocks=")


def compat(desc: str) -> str:
    """What two engines' descriptions of a group must agree on: all of it for an attention
    group; a state group's kind, page and sub-tensors (not its block size, cache mode or
    scratch slots: a prefill engine with prefix caching in 'align' mode may feed a decode
    engine without it, in 'none' mode)."""
    words = str(desc).split()
    if not words or words[0] != STATE_KIND:
        return str(desc)
    return " ".join(w for w in words if not w.startswith(_LOCAL))


def need(group: Group, num_tokens: int, first_token: int = 0) -> int:
    """Entries a group's list must have for tokens [first_token, num_tokens): a state group's
    one slot, an attention group's blocks from the one holding ``first_token``."""
    if group.state:
        return 1
    return -(-num_tokens // group.block_size) - first_token // group.block_size


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
    shapes = getattr(spec, "shapes", None)
    if shapes is not None:  # a state group (MambaSpec): its sub-tensors, type and cache mode
        dtypes = getattr(spec, "dtypes", ())
        subs = ",".join(f"{'x'.join(map(str, s))}:{str(d).removeprefix('torch.')}"
                        for s, d in zip(shapes, dtypes, strict=True))
        mtype = getattr(spec, "mamba_type", "")
        align = int(getattr(spec, "state_alignment", 1) or 1)  # vLLM 0.34: each sub-tensor's start aligned
        parts += [f"state={subs}", *([f"align={align}"] if align > 1 else []), f"type={getattr(mtype, 'name', mtype)}",
                  f"mode={getattr(spec, 'mamba_cache_mode', 'none')}",
                  f"spec_blocks={int(getattr(spec, 'num_speculative_blocks', 0) or 0)}"]
    return " ".join(parts)
