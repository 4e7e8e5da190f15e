"""Which blocks of a hybrid request's KV cache groups move (daemon.core.group_pairs), and the
checks a grouped block list passes first (daemon.core.checks.check_blocks)."""

from __future__ import annotations

import pytest

from kvpush.daemon.core.checks import check_blocks
from kvpush.daemon.core.group_pairs import pair_groups
from kvpush.daemon.core.planner import PlanError, check_compatible
from kvpush.proto.groups import pack, slice_from, split
from kvpush.proto.layout import KVLayout, vllm_cpu_layout

BS = 16


def _pair(src, dst, num_tokens, first=0):
    s_ids, s_g = pack(src)
    d_ids, d_g = pack(dst)
    return pair_groups(s_ids, s_g, d_ids, d_g, num_tokens=num_tokens, dst_first_token=first, block_size=BS)


def test_window_blocks_move_where_decode_holds_them_and_full_attention_moves_all() -> None:
    # 70 tokens = 5 blocks; window group: decode keeps the last two (null before), full: all.
    p = _pair([(11, 12, 13, 14, 15), (21, 22, 23, 24, 25)], [(0, 0, 0, 34, 35), (41, 42, 43, 44, 45)], 70)
    assert p.src == (14, 15, 21, 22, 23, 24, 25) and p.dst == (34, 35, 41, 42, 43, 44, 45)
    assert p.per_group == (2, 5)


def test_a_decode_prefix_hit_skips_its_blocks_in_every_group() -> None:
    p = _pair([(11, 12, 13, 14), (21, 22, 23, 24)], [(0, 33, 34), (42, 43, 44)], 64, first=BS)
    assert p.src == (13, 14, 22, 23, 24) and p.dst == (33, 34, 42, 43, 44)


def test_a_needed_block_the_prefill_side_no_longer_holds_fails_the_whole_transfer() -> None:
    with pytest.raises(PlanError, match="block 2 of group 0"):
        _pair([(0, 0, 0, 14), (21, 22, 23, 24)], [(0, 0, 33, 34), (41, 42, 43, 44)], 64)
    with pytest.raises(PlanError, match="block 3 of group 1"):  # a short prefill list
        _pair([(0, 0, 13, 14), (21, 22, 23)], [(0, 0, 33, 34), (41, 42, 43, 44)], 64)


def test_group_count_or_short_decode_lists_fail() -> None:
    with pytest.raises(PlanError, match="prefill side has 2 KV cache groups, the decode side 3"):
        _pair([(1, 2), (3, 4)], [(5, 6), (7, 8), (9, 10)], 32)
    with pytest.raises(PlanError, match="group 1 holds 1 blocks"):
        _pair([(1, 2), (3, 4)], [(5, 6), (7,)], 32)


def test_pack_split_slice_round_trip() -> None:
    ids, groups = pack([(1, 2, 3), (0, 5, 6)])
    assert (ids, groups) == ((1, 2, 3, 0, 5, 6), (3, 3))
    assert split(ids, groups) == [(1, 2, 3), (0, 5, 6)]
    assert slice_from(ids, groups, 16, 16) == ((2, 3, 5, 6), (2, 2))
    assert pack([(4, 5)]) == ((4, 5), ()) and slice_from((4, 5), (), 16, 16) == ((5,), ())


def _layout(groups: tuple[str, ...]) -> KVLayout:
    lay = vllm_cpu_layout(num_layers=1, num_blocks=8, block_size=BS, num_heads=1, head_size=16, dtype="float32",
                          packing="row")
    return KVLayout(**{**lay.__dict__, "kv_groups": groups})


def test_grouped_lists_must_match_the_engines_groups() -> None:
    two = _layout(("SlidingWindow block_size=16 window=32", "FullAttention block_size=16"))
    assert check_blocks(two, (0, 3, 4, 5), 32, "register", 0, (2, 2)) == ""
    assert "1 block list(s) for an engine of 2" in check_blocks(two, (4, 5), 32, "register")
    assert "3 block IDs for KV cache groups of 4" in check_blocks(two, (1, 2, 3), 32, "register", 0, (2, 2))
    assert "cannot hold" in check_blocks(two, (1, 2, 3), 32, "register", 0, (2, 1))
    assert "2 block list(s) for an engine of 1" in check_blocks(_layout(()), (1, 2, 3, 4), 32, "r", 0, (2, 2))


def test_handshake_names_the_group_and_both_values() -> None:
    a = _layout(("SlidingWindow block_size=16 window=32", "FullAttention block_size=16"))
    b = _layout(("SlidingWindow block_size=16 window=64", "FullAttention block_size=16"))
    with pytest.raises(PlanError, match="KV cache group 0 is 'SlidingWindow block_size=16 window=32' there, "
                                        "'SlidingWindow block_size=16 window=64' here"):
        check_compatible(a, b, ("there", "here"))
    with pytest.raises(PlanError, match="2 KV cache group.s. there, 1 here"):
        check_compatible(a, _layout(()), ("there", "here"))
    assert a.compat_key() != b.compat_key()
