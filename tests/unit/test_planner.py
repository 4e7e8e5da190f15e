"""TransferPlanner against a reference executor.

The reference computes every element's byte address from the backends' shape
formulas (written out here, independently of the Packing numbers the planner
uses) and copies token by token, head by head. The plan, applied with numpy
copies, must give the same destination bytes; bytes the reference does not write
must stay untouched (except the unused tail of the last destination block).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpush.daemon.core.planner import (
    Plan,
    PlanError,
    block_pattern,
    expected_producers,
    plan,
    unwritten,
)
from kvpush.proto.layout import flash_layout, vllm_cpu_layout
from kvpush_dev.kvref import apply_plan, make, reference_copy

# ---- strategies ------------------------------------------------------------------


@st.composite
def scenarios(draw):
    dtype = draw(st.sampled_from(["bfloat16", "float32", "int8"]))
    family = draw(st.sampled_from(["amx", "row", "flash", "mixed", "vec"]))
    head_size = (
        draw(st.sampled_from([16, 32]))
        if family in ("amx",)
        else draw(st.sampled_from([8, 16, 32]))
    )
    total_heads = draw(st.sampled_from([1, 2, 4]))
    tps = [t for t in (1, 2, 4) if total_heads % t == 0]
    src_tp, dst_tp = draw(st.sampled_from(tps)), draw(st.sampled_from(tps))
    layers = draw(st.integers(1, 2))
    if family == "amx":
        kinds = ("amx", "amx")
        bsizes = [16, 32, 48, 64]
    elif family == "mixed":
        kinds = draw(st.sampled_from([("row", "flash"), ("flash", "row")]))
        bsizes = [1, 2, 3, 4, 8, 16]
    elif family == "vec":  # vLLM-cpu vec/vec16 kernels: same bytes, any block sizes
        kinds = draw(st.sampled_from([("vec", "vec"), ("vec", "vec16"), ("vec16", "vec")]))
        bsizes = [1, 2, 3, 4, 8, 16, 32]
    else:
        kinds = (family, family)
        bsizes = [1, 2, 3, 4, 8, 16]
    sbs, dbs = draw(st.sampled_from(bsizes)), draw(st.sampled_from(bsizes))
    num_tokens = draw(st.integers(1, 6 * max(sbs, dbs)))
    first = 0
    if draw(st.booleans()) and num_tokens > dbs:
        first = draw(st.integers(0, (num_tokens - 1) // dbs)) * dbs
        if kinds[0] == "amx":
            first -= first % 16
    src_rank = draw(st.integers(0, src_tp - 1))
    sh = total_heads // src_tp
    dh = total_heads // dst_tp
    dst_ranks = [
        r
        for r in range(dst_tp)
        if max(r * dh, src_rank * sh) < min((r + 1) * dh, (src_rank + 1) * sh)
    ]
    dst_rank = draw(st.sampled_from(dst_ranks))
    n_src = -(-num_tokens // sbs)
    n_dst = -(-(num_tokens - first) // dbs)
    src_nb = n_src + draw(st.integers(0, 4))
    dst_nb = n_dst + draw(st.integers(0, 4))
    src_blocks = draw(st.permutations(range(src_nb)))[:n_src]
    dst_blocks = draw(st.permutations(range(dst_nb)))[:n_dst]
    if draw(st.booleans()):  # contiguous runs are the common case: exercise merging
        src_blocks, dst_blocks = sorted(src_blocks), sorted(dst_blocks)
    common = dict(num_layers=layers, head_size=head_size, dtype=dtype, total_heads=total_heads)
    src = make(
        kinds[0],
        num_blocks=src_nb,
        block_size=sbs,
        num_heads=sh,
        head_start=src_rank * sh,
        **common,
    )
    dst = make(
        kinds[1],
        num_blocks=dst_nb,
        block_size=dbs,
        num_heads=dh,
        head_start=dst_rank * dh,
        **common,
    )
    return src, list(src_blocks), dst, list(dst_blocks), num_tokens, first


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.integers(0, 2**32 - 1))
def test_plan_matches_reference_copy(sc, seed):
    (src_lay, src_p), src_blocks, (dst_lay, dst_p), dst_blocks, num_tokens, first = sc
    rng = np.random.default_rng(seed)
    src_buf = rng.integers(0, 256, src_lay.region_size, dtype=np.uint8)
    dst_buf = rng.integers(0, 256, dst_lay.region_size, dtype=np.uint8)
    p = plan(src_lay, src_blocks, dst_lay, dst_blocks, num_tokens, dst_first_token=first)
    got = apply_plan(p, src_buf, dst_buf)
    want, dont_care = reference_copy(
        src_p, src_lay, src_buf, src_blocks, dst_p, dst_lay, dst_buf, dst_blocks, num_tokens, first
    )
    assert np.array_equal(got[~dont_care], want[~dont_care])
    # Descriptors never overlap on the destination (one WRITE, no byte written twice).
    order = np.argsort(p.dst_off)
    assert np.all(p.dst_off[order][1:] >= (p.dst_off + p.length)[order][:-1])


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.integers(0, 2**32 - 1))
def test_block_pattern_copies_what_the_reference_copies(sc, seed):
    """The prepared-list path (pattern x blocks, posted by index) writes the same bytes."""
    (src_lay, src_p), src_blocks, (dst_lay, dst_p), dst_blocks, num_tokens, first = sc
    bp = block_pattern(src_lay, dst_lay)
    if src_lay.block_size != dst_lay.block_size or min(src_lay.num_blocks, dst_lay.num_blocks) < 2:
        assert bp is None
        return
    assert bp is not None  # equal block sizes are always block-periodic
    rng = np.random.default_rng(seed)
    src_buf = rng.integers(0, 256, src_lay.region_size, dtype=np.uint8)
    dst_buf = rng.integers(0, 256, dst_lay.region_size, dtype=np.uint8)
    sb, db = bp.block_pairs(src_lay, src_blocks, dst_blocks, num_tokens, first)
    li, ri = bp.indices(sb, db)
    loc, rem = bp.src_list(), bp.dst_list()
    assert np.array_equal(loc[li, 1], rem[ri, 1])
    got = apply_plan(Plan(loc[li, 0], rem[ri, 0], loc[li, 1]), src_buf, dst_buf)
    want, dont_care = reference_copy(
        src_p, src_lay, src_buf, src_blocks, dst_p, dst_lay, dst_buf, dst_blocks, num_tokens, first
    )
    assert np.array_equal(got[~dont_care], want[~dont_care])


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.integers(0, 2**32 - 1), st.data())
def test_a_stream_then_its_final_write_copy_what_the_whole_plan_copies(sc, seed, data):
    """Layer-wise: group WRITEs (a part's layers over its blocks, sliced from the prepared
    lists) then the final WRITE of what ``unwritten`` leaves give the reference bytes, even
    when every chunk that ends inside a block before the prompt's end landed that block stale
    (the next chunk completes it; the two WRITEs are not ordered): the final WRITE rewrites it.
    A chunk ending on a block boundary or at the prompt's end read its last block whole."""
    (src_lay, src_p), src_blocks, (dst_lay, dst_p), dst_blocks, num_tokens, first = sc
    bp = block_pattern(src_lay, dst_lay)
    if bp is None:
        return
    rng = np.random.default_rng(seed)
    src_buf = rng.integers(0, 256, src_lay.region_size, dtype=np.uint8)
    dst_buf = rng.integers(0, 256, dst_lay.region_size, dtype=np.uint8)
    loc, rem = bp.src_list(), bp.dst_list()
    bs, nl = src_lay.block_size, src_lay.num_layers
    cuts = sorted(set(data.draw(st.lists(st.integers(1, max(1, num_tokens - 1)), max_size=3))) - {num_tokens})
    if data.draw(st.booleans()):  # chunks on block boundaries too
        cuts = sorted({min(num_tokens - 1, -(-c // bs) * bs) for c in cuts} - {0})
    parts = []
    for a, b in zip([0, *cuts], [*cuts, num_tokens], strict=True):
        lo = 0
        while lo < nl:
            hi = data.draw(st.integers(lo + 1, nl))
            if data.draw(st.booleans()):  # this group streamed
                parts.append((lo, hi, a // bs, tuple(src_blocks[a // bs: -(-b // bs)]), b))
            lo = hi
    first_block = first // bs
    stale = rng.integers(0, 256, src_lay.region_size, dtype=np.uint8)  # what an early read saw

    def write(fb: int, ids: tuple[int, ...], lo: int, hi: int, source: np.ndarray, into: np.ndarray) -> np.ndarray:
        li, ri, nbytes = bp.group_indices([(lo, hi, fb, ids)], first_block, tuple(dst_blocks))
        assert nbytes == int(loc[li, 1].sum())
        return apply_plan(Plan(loc[li, 0], rem[ri, 0], loc[li, 1]), source, into) if li.shape[0] else into

    for lo, hi, fb, ids, _ in parts:
        dst_buf = write(fb, ids, lo, hi, src_buf, dst_buf)
    for lo, hi, fb, ids, end in parts:  # the next chunk's tokens were not there yet
        if end % bs and end < num_tokens:
            dst_buf = write(fb + len(ids) - 1, ids[-1:], lo, hi, stale, dst_buf)
    sb, db = bp.block_pairs(src_lay, src_blocks, dst_blocks, num_tokens, first)
    keep = unwritten(bp, int(sb.shape[0]), first_block, ((lo, hi, fb, len(ids), end) for lo, hi, fb, ids, end in parts),
                     bs, num_tokens)
    li, ri = bp.indices(sb, db, keep)
    got = apply_plan(Plan(loc[li, 0], rem[ri, 0], loc[li, 1]), src_buf, dst_buf)
    want, dont_care = reference_copy(
        src_p, src_lay, src_buf, src_blocks, dst_p, dst_lay, dst_buf, dst_blocks, num_tokens, first
    )
    assert np.array_equal(got[~dont_care], want[~dont_care])
    assert keep.any()  # the notification has a WRITE to ride on


def test_layer_plans_partition_the_whole_plan():
    lay, _ = make("amx", num_layers=4, num_blocks=8, block_size=16, num_heads=2, head_size=32, dtype="bfloat16")
    whole = plan(lay, [3, 1, 5], lay, [2, 6, 7], 40)
    parts = [plan(lay, [3, 1, 5], lay, [2, 6, 7], 40, layers=(lo, lo + 2), by_layer=True) for lo in (0, 2)]
    assert sum(p.nbytes for p in parts) == whole.nbytes
    assert sorted(np.concatenate([p.layer for p in parts]).tolist()) == sorted(
        np.repeat(np.arange(4), len(parts[0]) // 2).tolist())
    with pytest.raises(PlanError, match="layers"):
        plan(lay, [3, 1, 5], lay, [2, 6, 7], 40, layers=(3, 5))


def test_block_pattern_of_vllm_cpu_layout_is_one_slab_per_layer():
    lay = vllm_cpu_layout(num_layers=3, num_blocks=16, block_size=16, num_heads=2, head_size=8,
                          dtype="bfloat16", packing="row")
    bp = block_pattern(lay, lay)
    assert bp is not None and bp.entries == 3 and (bp.length == lay.block_stride).all()
    assert bp.src_list().shape == (3 * 16, 2)
    with pytest.raises(PlanError):
        bp.block_pairs(lay, [0, 1], [0, 16], 32)  # destination block out of range
    assert block_pattern(lay, lay, max_descriptors=10) is None


def test_reference_executor_can_fail():
    """A plan off by one block must be caught by the comparison above."""
    src, sp = make(
        "amx",
        num_layers=1,
        num_blocks=4,
        block_size=16,
        num_heads=1,
        head_size=16,
        dtype="bfloat16",
    )
    dst, dp = make(
        "amx",
        num_layers=1,
        num_blocks=4,
        block_size=16,
        num_heads=1,
        head_size=16,
        dtype="bfloat16",
    )
    rng = np.random.default_rng(0)
    sbuf = rng.integers(0, 256, src.region_size, dtype=np.uint8)
    dbuf = rng.integers(0, 256, dst.region_size, dtype=np.uint8)
    wrong = plan(src, [1, 2], dst, [0, 1], 32)  # should be source blocks [0, 1]
    want, dc = reference_copy(sp, src, sbuf, [0, 1], dp, dst, dbuf, [0, 1], 32, 0)
    assert not np.array_equal(apply_plan(wrong, sbuf, dbuf)[~dc], want[~dc])


def test_contiguous_blocks_merge_to_one_descriptor_per_layer():
    lay = vllm_cpu_layout(
        num_layers=4,
        num_blocks=64,
        block_size=16,
        num_heads=2,
        head_size=32,
        dtype="bfloat16",
        layer_stride=None,
    )
    p = plan(lay, list(range(8, 24)), lay, list(range(30, 46)), 16 * 16)
    assert len(p) == 4  # one run per layer: K/V, heads and blocks all folded
    assert p.nbytes == 4 * 16 * lay.block_stride


def test_flash_layout_merges_k_and_v_runs_separately():
    lay = flash_layout(
        num_layers=2, num_blocks=32, block_size=16, num_heads=4, head_size=64, dtype="float16"
    )
    p = plan(lay, list(range(10)), lay, list(range(5, 15)), 150)
    assert len(p) == 2 * 2  # per layer: one K run, one V run


def test_scattered_blocks_one_descriptor_per_block_and_layer():
    lay = vllm_cpu_layout(
        num_layers=2, num_blocks=64, block_size=16, num_heads=2, head_size=32, dtype="bfloat16"
    )
    src_blocks = [1, 3, 5, 7]
    p = plan(lay, src_blocks, lay, [2, 4, 6, 8], 64)
    assert len(p) == 2 * 4


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(src_blocks=[0, 99]), "out of range"),
        (dict(src_blocks=[0]), "blocks, 2 needed"),
        (dict(dst_blocks=[3, 3]), "repeat"),
        (dict(num_tokens=0), "positive"),
        (dict(src_blocks=["a", 1]), "integers"),
        (dict(dst_first_token=5), "multiple"),
    ],
)
def test_invalid_input_raises_before_planning(change, message):
    lay = vllm_cpu_layout(
        num_layers=1, num_blocks=8, block_size=16, num_heads=1, head_size=32, dtype="bfloat16"
    )
    args = dict(src_blocks=[0, 1], dst_blocks=[2, 3], num_tokens=20, dst_first_token=0)
    args.update(change)
    with pytest.raises(PlanError, match=message):
        plan(
            lay,
            args["src_blocks"],
            lay,
            args["dst_blocks"],
            args["num_tokens"],
            dst_first_token=args["dst_first_token"],
        )


def test_incompatible_layouts_name_both_values():
    a = vllm_cpu_layout(
        num_layers=1, num_blocks=8, block_size=16, num_heads=1, head_size=32, dtype="bfloat16"
    )
    b = vllm_cpu_layout(
        num_layers=1, num_blocks=8, block_size=16, num_heads=1, head_size=64, dtype="bfloat16"
    )
    with pytest.raises(PlanError, match="head_size is 32 on the source, 64 on the destination"):
        plan(a, [0], b, [0], 4)
    c = vllm_cpu_layout(
        num_layers=1,
        num_blocks=8,
        block_size=16,
        num_heads=1,
        head_size=32,
        dtype="bfloat16",
        packing="row",
    )
    with pytest.raises(PlanError, match="packing"):
        plan(a, [0], c, [0], 4)


def test_expected_producers_for_tp_ratios():
    # P TP 4 (1 head each) -> D TP 2 (2 heads each): two producers per destination.
    d1 = flash_layout(
        num_layers=1,
        num_blocks=2,
        block_size=4,
        num_heads=2,
        head_size=8,
        dtype="float16",
        head_start=2,
        total_heads=4,
    )
    assert expected_producers(d1, 4, 1) == [2, 3]
    # P TP 1 -> D TP 2: the single producer serves both destinations.
    assert expected_producers(d1, 1, 4) == [0]


def _split_layers(lay, buf):
    """The same bytes as one region per layer (vLLM on GPU): per-layer copies of ``buf``."""
    from kvpush.proto.layout import per_layer_regions

    ext = lay.max_extent()
    return per_layer_regions(lay), [buf[o:o + ext].copy() for o in lay.layer_offsets]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.integers(0, 2**32 - 1), st.sampled_from(["src", "dst", "both"]))
def test_one_region_per_layer_plans_the_same_bytes(sc, seed, split):
    """Multi-region layouts (either side or both): the plan's (region, offset) descriptors,
    applied region by region, give the reference copy; none crosses a region."""
    from kvpush.proto.layout import split_address
    from kvpush_dev.kvref import apply_plan_regions

    (src_lay, src_p), src_blocks, (dst_lay, dst_p), dst_blocks, num_tokens, first = sc
    rng = np.random.default_rng(seed)
    src_buf = rng.integers(0, 256, src_lay.region_size, dtype=np.uint8)
    dst_buf = rng.integers(0, 256, dst_lay.region_size, dtype=np.uint8)
    want, dont_care = reference_copy(
        src_p, src_lay, src_buf, src_blocks, dst_p, dst_lay, dst_buf, dst_blocks, num_tokens, first
    )
    s_lay, s_regions = _split_layers(src_lay, src_buf) if split in ("src", "both") else (src_lay, [src_buf])
    d_lay, d_regions = _split_layers(dst_lay, dst_buf) if split in ("dst", "both") else (dst_lay, [dst_buf.copy()])
    p = plan(s_lay, src_blocks, d_lay, dst_blocks, num_tokens, dst_first_token=first)
    for off, sizes in ((p.src_off, s_lay.regions), (p.dst_off, d_lay.regions)):
        region, local = split_address(off)
        assert np.all(local + p.length <= np.asarray(sizes)[region])
    apply_plan_regions(p, s_regions, d_regions)
    got = np.zeros_like(dst_buf)
    if len(d_regions) == 1:
        got = d_regions[0]
    else:
        got[:] = dst_buf
        for o, r in zip(dst_lay.layer_offsets, d_regions, strict=True):
            got[o:o + r.shape[0]] = r
    assert np.array_equal(got[~dont_care], want[~dont_care])


def test_mla_layout_plans_the_latent_once_and_fp8_is_one_byte():
    from kvpush.proto.layout import mla_layout

    lay = mla_layout(num_layers=4, num_blocks=8, block_size=16, head_size=576, dtype="float8_e4m3fn",
                     per_layer=True)
    p = plan(lay, [1, 2, 5], lay, [0, 1, 2], 40)
    assert p.nbytes == 4 * 3 * 16 * 576  # 4 layers x 3 blocks x 16 tokens x 576 one-byte elements
    assert len(p) == 4 * 2  # blocks 1, 2 -> 0, 1 merge; 5 -> 2 alone: two runs per layer
