"""Which blocks of a hybrid model's KV cache groups a transfer moves: the pairs, per group.

A hybrid request has one block list per KV cache group on each side (``proto.groups``). The
decode engine's lists say what it needs: vLLM gives a sliding-window group's positions
before the window the null block there, so those positions are not moved; a full-attention
group needs every position from its first block to load. The prefill engine's list at the
same position is the source. This is the rule vLLM's NixlConnector follows too (it reads only
the window's blocks of a sliding-window group on the decode side).

Anything that does not add up fails the whole transfer (the decode engine recomputes), never
a part of it: a different number of groups, a decode list too short for the prompt, or a
position the decode engine needs whose prefill block is gone (null: outside the window there,
or freed). Every group moves in the one WRITE, with its one notification, so the decode engine
never sees some groups written and others stale.

A state group (Mamba, linear attention: ``proto.groups``) moves its one running-state slot
into the decode engine's: both lists are that slot (or clip to it); a null or missing slot on
either side fails the whole transfer. Each attention group counts its blocks with its own
block size (Mamba2 hybrids: attention 128 beside a state block of 2048); vLLM gives every
group the same page bytes, so each pair is one page of every layer tensor.

The pairs come out as two flat lists in group order, with each pair's bytes (``Pairs.nbytes``):
an attention pair (0) is copied as its whole block (all tokens; a partial last block's tail is
never read before the decode engine writes it), as ``num_tokens = len(pairs) * block_size``
from token 0; a state pair only as the leading bytes of its page that hold the state's
sub-tensors (``Group.state_bytes``, from the engine's own layout, never the wire), as vLLM's
NixlConnector moves it: :func:`plan_pairs` plans both kinds into the one WRITE. A block in two
pairs on either side (two groups claiming it) fails the whole transfer.

Pure: block IDs in, block IDs (and descriptors) out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from kvpush.daemon.core.planner import Plan, PlanError, check_bounds, plan, plan_state
from kvpush.proto.groups import NULL_BLOCK, Group, GroupsError, clip_state, split
from kvpush.proto.layout import KVLayout

__all__ = ["Pairs", "pair_groups", "plan_pairs"]


class Pairs(NamedTuple):
    """The flat pairs, each group's count and each pair's bytes per layer (0: the whole block;
    a state pair: its state's bytes)."""

    src: tuple[int, ...]
    dst: tuple[int, ...]
    per_group: tuple[int, ...]
    nbytes: tuple[int, ...]

    @property
    def partial(self) -> bool:
        """Does a pair move less than its whole block (a state pair)?"""
        return any(self.nbytes)


def pair_groups(src_ids: Sequence[int], src_groups: Sequence[int], dst_ids: Sequence[int],
                dst_groups: Sequence[int], *, num_tokens: int, dst_first_token: int, block_size: int,
                kinds: Sequence[Group] = ()) -> Pairs:
    """The block pairs of every group (see the module doc); raises PlanError naming the group.
    ``kinds``: each group as ``proto.groups.parse`` reads the engine's layout (empty: every
    group is attention of ``block_size``)."""
    if block_size <= 0 or num_tokens <= 0:
        raise PlanError(f"groups: block size {block_size} and num_tokens {num_tokens} must be positive")
    if dst_first_token % block_size or not 0 <= dst_first_token < num_tokens:
        raise PlanError(f"groups: first token {dst_first_token} is not a block boundary below {num_tokens}")
    try:
        src_lists, dst_lists = split(src_ids, src_groups), split(dst_ids, dst_groups)
    except GroupsError as exc:
        raise PlanError(f"groups: {exc}") from exc
    if len(src_lists) != len(dst_lists):
        raise PlanError(f"groups: the prefill side has {len(src_lists)} KV cache groups, the decode side "
                        f"{len(dst_lists)}")
    if kinds and len(kinds) != len(dst_lists):
        raise PlanError(f"groups: {len(dst_lists)} block lists for an engine of {len(kinds)} KV cache groups")
    src_out: list[int] = []
    dst_out: list[int] = []
    nbytes: list[int] = []
    counts = []
    for g, (s, d) in enumerate(zip(src_lists, dst_lists, strict=True)):
        kind = kinds[g] if kinds else None
        if kind is not None and kind.state:
            ss, ds = clip_state(s, kind.spec_blocks), clip_state(d, kind.spec_blocks)
            if not ss or not ds or NULL_BLOCK in ss + ds:
                raise PlanError(f"groups: state group {g} has no running-state slot on the "
                                f"{'prefill' if not ss or NULL_BLOCK in ss else 'decode'} side")
            src_out.append(ss[0])
            dst_out.append(ds[0])
            nbytes.append(kind.state_bytes)
            counts.append(1)
            continue
        bs = kind.block_size if kind is not None else block_size
        if dst_first_token % bs:
            raise PlanError(f"groups: first token {dst_first_token} is not a block boundary of group {g} "
                            f"(block size {bs})")
        need, first = -(-num_tokens // bs), dst_first_token // bs
        if len(d) < need - first:
            raise PlanError(f"groups: the decode side's group {g} holds {len(d)} blocks from block {first}, "
                            f"the prompt needs {need - first}")
        n = 0
        for j in range(first, need):
            db = d[j - first]
            if db == NULL_BLOCK:
                continue  # not kept there (before a window): nothing to move
            sb = s[j] if j < len(s) else NULL_BLOCK
            if sb == NULL_BLOCK:
                raise PlanError(f"groups: the decode side needs block {j} of group {g}, which the prefill "
                                "side no longer holds")
            src_out.append(int(sb))
            dst_out.append(int(db))
            nbytes.append(0)
            n += 1
        counts.append(n)
    if not src_out:
        raise PlanError("groups: no block to move")
    for side, ids in (("prefill", src_out), ("decode", dst_out)):
        if len(set(ids)) != len(ids):
            raise PlanError(f"groups: a block is in two groups' pairs on the {side} side")
    return Pairs(tuple(src_out), tuple(dst_out), tuple(counts), tuple(nbytes))


def plan_pairs(src: KVLayout, dst: KVLayout, pairs: Pairs) -> Plan:
    """The one WRITE of every pair: each attention pair's whole block (``planner.plan``), each
    state pair's leading ``nbytes`` of its page in every layer (``planner.plan_state``); raises
    PlanError before producing anything."""
    whole = [i for i, n in enumerate(pairs.nbytes) if n == 0]
    parts = []
    if whole:
        parts.append(plan(src, [pairs.src[i] for i in whole], dst, [pairs.dst[i] for i in whole],
                          len(whole) * src.block_size))
    for i, n in enumerate(pairs.nbytes):
        if n:
            parts.append(plan_state(src, pairs.src[i], dst, pairs.dst[i], n))
    out = Plan(*(np.concatenate(c) for c in zip(*((p.src_off, p.dst_off, p.length) for p in parts), strict=True)))
    check_bounds(out, src.regions, dst.regions)
    return out
