"""A hybrid transfer with one KV cache group's blocks missing or short fails whole, with a cause
naming the group, never in part (issue 41 item 8), in the pure parts: the pairing of each
group's blocks (daemon.core.group_pairs), the checks a grouped list passes first
(daemon.core.checks.check_blocks), and the rendezvous around them, fed what the prefill
daemon's shell feeds it when the pairing fails (its StartWrite answered WriteFailed).

Random hybrid requests (hypothesis): every group a sliding window (decode keeps its last few
blocks, null before) or full attention, any prompt length, any decode prefix hit; then one
fault in one group.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush.daemon.core.checks import check_blocks
from kvpush.daemon.core.group_pairs import pair_groups
from kvpush.daemon.core.planner import PlanError
from kvpush.daemon.core.rendezvous import (
    Cause,
    NotifyFailure,
    Prefilled,
    Registered,
    ReleaseBlocks,
    Rendezvous,
    StartWrite,
    WriteDone,
    WriteFailed,
)
from kvpush.proto.groups import NULL_BLOCK, pack
from kvpush.proto.layout import KVLayout, vllm_cpu_layout

BS = 16
NUM_BLOCKS = 4096


@dataclass(frozen=True)
class Hybrid:
    """One request's lists on both sides: ``src[g]`` from the prompt's block 0, ``dst[g]`` from
    the decode engine's first block to load (``first``); ``windows[g]``: blocks a window group
    keeps (0: full attention)."""

    num_tokens: int
    first: int  # first block to load on the decode side (its prefix hit, in blocks)
    windows: tuple[int, ...]
    src: tuple[tuple[int, ...], ...]
    dst: tuple[tuple[int, ...], ...]

    @property
    def need(self) -> int:
        return -(-self.num_tokens // BS)

    def pair(self, src=None, dst=None):
        s_ids, s_g = pack(self.src if src is None else src)
        d_ids, d_g = pack(self.dst if dst is None else dst)
        return pair_groups(s_ids, s_g, d_ids, d_g, num_tokens=self.num_tokens, dst_first_token=self.first * BS,
                           block_size=BS)


@st.composite
def hybrids(draw: st.DrawFn) -> Hybrid:
    num_tokens = draw(st.integers(1, 12 * BS))
    need = -(-num_tokens // BS)
    first = draw(st.integers(0, need - 1))
    windows = tuple(draw(st.lists(st.integers(0, 3), min_size=2, max_size=5)))
    fresh = iter(draw(st.permutations(range(1, 2 * len(windows) * need + 1))))  # distinct, never null
    src, dst = [], []
    for w in windows:
        kept = range(need) if w == 0 else range(max(0, need - w), need)  # both sides keep the window
        src.append(tuple(next(fresh) if j in kept else NULL_BLOCK for j in range(need)))
        dst.append(tuple(next(fresh) if j in kept else NULL_BLOCK for j in range(first, need)))
    return Hybrid(num_tokens, first, windows, tuple(src), tuple(dst))


@settings(max_examples=300, deadline=None)
@given(hybrids())
def test_every_group_moves_exactly_the_blocks_the_decode_side_holds(h: Hybrid) -> None:
    pairs = h.pair()
    want = [(s[j], d[j - h.first]) for s, d in zip(h.src, h.dst, strict=True)
            for j in range(h.first, h.need) if d[j - h.first] != NULL_BLOCK]
    assert list(zip(pairs.src, pairs.dst, strict=True)) == want
    assert pairs.per_group == tuple(sum(b != NULL_BLOCK for b in d) for d in h.dst)
    assert NULL_BLOCK not in pairs.src and NULL_BLOCK not in pairs.dst


@st.composite
def faulty(draw: st.DrawFn) -> tuple[Hybrid, tuple, tuple, str]:
    """A hybrid request and one fault in one group: (it, src lists, dst lists, what the error names)."""
    h = draw(hybrids())
    g = draw(st.integers(0, len(h.windows) - 1))
    src, dst = list(h.src), list(h.dst)
    kind = draw(st.sampled_from(["src_group_missing", "dst_group_missing", "src_short", "dst_short", "src_gone"]))
    if kind == "src_group_missing":
        del src[g]
        names = "KV cache groups"
    elif kind == "dst_group_missing":
        del dst[g]
        names = "KV cache groups"
    elif kind == "src_short":  # P's list ends before the last block D needs (its last always is)
        src[g] = src[g][: draw(st.integers(0, h.need - 1))]
        names = f"of group {g}"
    elif kind == "dst_short":
        dst[g] = dst[g][: draw(st.integers(0, len(dst[g]) - 1))]
        names = f"group {g} holds"
    else:  # a block D needs is gone on P (freed, or out of its window there)
        needed = [j for j in range(h.first, h.need) if h.dst[g][j - h.first] != NULL_BLOCK]
        j = draw(st.sampled_from(needed))
        src[g] = src[g][:j] + (NULL_BLOCK,) + src[g][j + 1:]
        names = f"block {j} of group {g}"
    return h, tuple(src), tuple(dst), names


@settings(max_examples=300, deadline=None)
@given(faulty())
def test_one_group_missing_short_or_gone_fails_the_whole_transfer_naming_it(case) -> None:
    h, src, dst, names = case
    if len(src) == 1 or len(dst) == 1:  # one list left packs as a dense request's: no group count
        return
    with pytest.raises(PlanError, match=names):
        h.pair(src, dst)


def _layout(groups: int) -> KVLayout:
    lay = vllm_cpu_layout(num_layers=1, num_blocks=NUM_BLOCKS, block_size=BS, num_heads=1, head_size=16,
                          dtype="float32", packing="row")
    return KVLayout(**{**lay.__dict__, "kv_groups": tuple(f"G{i} block_size={BS}" for i in range(groups))})


@settings(max_examples=200, deadline=None)
@given(hybrids(), st.data())
def test_a_prefill_list_without_one_group_or_with_one_short_is_refused_before_the_rendezvous(
        h: Hybrid, data: st.DataObject) -> None:
    """What the prefill daemon checks a PrefillDone with (``check_blocks``): the engine's lists,
    one per group, each long enough for the prompt; a group missing or short is refused."""
    lay = _layout(len(h.windows))
    ids, groups = pack(h.src)
    assert check_blocks(lay, ids, h.num_tokens, "prefill", 0, groups) == ""
    g = data.draw(st.integers(0, len(h.windows) - 1))
    ids, groups = pack(h.src[:g] + h.src[g + 1:])  # one list left packs as a dense engine's
    assert "block list(s) for an engine of" in check_blocks(lay, ids, h.num_tokens, "prefill", 0, groups)
    short = h.src[:g] + (h.src[g][: data.draw(st.integers(0, h.need - 1))],) + h.src[g + 1:]
    ids, groups = pack(short)
    assert "cannot hold" in check_blocks(lay, ids, h.num_tokens, "prefill", 0, groups)


def _shell_pairs(a: StartWrite) -> str:
    """What the prefill daemon's shell does with a hybrid StartWrite before posting anything
    (prefill_side.start_write): pair the groups; "" when it may post, else its WriteFailed reason."""
    assert a.src_kv_groups, "the shell pairs only what names groups"
    try:
        pair_groups(a.src_block_ids, a.src_kv_groups, a.dst_block_ids, a.dst_kv_groups, num_tokens=a.num_tokens,
                    dst_first_token=a.dst_first_token, block_size=BS)
    except PlanError as exc:
        return f"plan: {exc}"
    return ""


@settings(max_examples=200, deadline=None)
@given(faulty(), st.booleans())
def test_the_rendezvous_fails_the_transfer_whole_and_tells_both_sides_why(case, prefill_first: bool) -> None:
    """Registered and Prefilled with each side's grouped lists (either order): the rendezvous
    starts one WRITE carrying every group; the shell cannot pair them (a group missing, short or
    gone), so nothing is posted and it answers WriteFailed; the rendezvous then tells the decode
    peer (NotifyFailure, with the reason naming the group) and gives P's blocks back as failed,
    and never starts another WRITE for the transfer. Without the fault the same run succeeds."""
    h, src, dst, names = case
    if len(src) == 1 or len(dst) == 1:
        return
    for lists, broken in (((h.src, h.dst), False), ((src, dst), True)):
        rv = Rendezvous()
        s_ids, s_g = pack(lists[0])
        d_ids, d_g = pack(lists[1])
        reg = Registered("t", 0, "d0", 0, 1, d_ids, h.num_tokens, 0.0, 100.0, first_token=h.first * BS, kv_groups=d_g)
        pf = Prefilled("t", s_ids, h.num_tokens, 0.0, 50.0, kv_groups=s_g)
        out = [a for ev in ((pf, reg) if prefill_first else (reg, pf)) for a in rv.handle(ev)]
        (start,) = out
        assert isinstance(start, StartWrite) and (start.src_kv_groups, start.dst_kv_groups) == (s_g, d_g)
        why = _shell_pairs(start)
        assert bool(why) is broken, why
        if not broken:
            assert rv.handle(WriteDone("t", 0, 0, 1.0)) == [ReleaseBlocks("t", s_ids, True, "")]
            continue
        assert names in why
        end = rv.handle(WriteFailed("t", 0, 0, why, 1.0))
        told = [a for a in end if isinstance(a, NotifyFailure)]
        released = [a for a in end if isinstance(a, ReleaseBlocks)]
        assert len(told) == 1 and told[0].peer == "d0" and names in told[0].reason, end
        assert released == [ReleaseBlocks("t", s_ids, False, released[0].reason, Cause.WRITE_FAILED)], end
        assert names in released[0].reason
        assert not [a for a in end if isinstance(a, StartWrite)]
        # the decode side registering again (same attempt) is not written either
        assert not [a for a in rv.handle(reg) if isinstance(a, StartWrite)]
