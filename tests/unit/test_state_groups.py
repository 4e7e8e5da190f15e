"""State groups (Mamba2, gated delta net) beside attention: what is refused and what moves.

vLLM's real KV cache specs and Requests: each group's description on the handshake and what
the daemons read back from it (proto.groups), the running-state slot and per-group block sizes
in the pairing (daemon.core.group_pairs) and the checks (daemon.core.checks), the prefill leg
that drops the prompt's last token once and the decode leg that loads all but it
(engine_plugin.scheduler.half), and the layers a hybrid engine's pages are read through
(engine_plugin.worker.layouts)."""

from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
)
from vllm.v1.request import Request, RequestStatus  # noqa: E402

from kvpush.daemon.core.checks import check_blocks  # noqa: E402
from kvpush.daemon.core.group_pairs import Pairs, pair_groups, plan_pairs  # noqa: E402
from kvpush.daemon.core.planner import PlanError, plan, plan_state  # noqa: E402
from kvpush.engine_plugin.config import PluginConfig  # noqa: E402
from kvpush.engine_plugin.metadata import Send  # noqa: E402
from kvpush.engine_plugin.scheduler.half import KVPushScheduler  # noqa: E402
from kvpush.engine_plugin.worker import lifecycle as wl  # noqa: E402
from kvpush.engine_plugin.worker.layouts import (  # noqa: E402
    LayoutRefused,
    check_kv_cache_config,
    check_pages,
    hybrid_groups,
)
from kvpush.proto.groups import GroupsError, clip_state, describe, need, pack, parse, slice_from  # noqa: E402
from kvpush.proto.layout import KVLayout, vllm_cpu_layout  # noqa: E402
from kvpush.proto.params import PROMPT_TRUNCATED, prompt_truncated  # noqa: E402

# The mamba preset's groups (docs/models.md): Mamba2 state block 2048 beside attention 128, one
# page of 32768 bytes each.
MAMBA = MambaSpec(block_size=2048, shapes=((3, 160), (4, 32, 16)), dtypes=(torch.bfloat16, torch.float32),
                  page_size_padded=32768)
ATTN = FullAttentionSpec(block_size=128, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
# The linear preset's: gated delta net, mode 'align', every group's block 1152.
GDN = MambaSpec(block_size=1152, shapes=((3, 1024), (4, 128, 128)), dtypes=(torch.bfloat16, torch.float32),
                page_size_padded=294912, mamba_cache_mode="align")
ATTN_1152 = FullAttentionSpec(block_size=1152, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)


def test_a_state_group_is_described_with_its_sub_tensors_and_read_back() -> None:
    d = describe(MAMBA)
    assert d.startswith("Mamba block_size=2048 page_bytes=32768 state=3x160:bfloat16,4x32x16:float32")
    assert "mode=none" in d and "spec_blocks=0" in d and "type=MAMBA2" in d
    assert parse(d) == ("Mamba", 2048, True, 0, 960 + 8192) and parse(d).state
    assert "mode=align" in describe(GDN)
    # the state's bytes are vLLM's own count of them (the page's padding is not state)
    assert parse(d).state_bytes == MAMBA.state_content_size_bytes < MAMBA.page_size_bytes
    assert parse(describe(GDN)).state_bytes == GDN.state_content_size_bytes == 6144 + 262144
    a = parse(describe(ATTN))
    assert a == ("FullAttention", 128, False, 0, 0) and not a.state
    assert need(a, 1000) == 8 and need(a, 1000, 256) == 6 and need(parse(d), 1000) == 1


def test_the_running_state_slot_is_the_last_before_the_scratch_slots() -> None:
    assert clip_state((7,), 0) == (7,)
    assert clip_state((0, 0, 5, 6), 0) == (6,)  # align: nulls and a checkpoint before the running slot
    assert clip_state((5, 8, 9), 2) == (5,)  # two speculative scratch slots after it
    assert clip_state((5,), 3) == (5,) and clip_state((), 1) == ()


def test_a_prefix_hit_slices_attention_groups_by_their_own_block_size_never_a_state_slot() -> None:
    ids, groups = pack([(4,), (1, 2, 3, 4, 5, 6, 7, 8)])
    assert slice_from(ids, groups, 256, 128, (0, 128)) == ((4, 3, 4, 5, 6, 7, 8), (1, 6))


def _pair(src, dst, num_tokens, kinds, first=0):
    s_ids, s_g = pack(src)
    d_ids, d_g = pack(dst)
    return pair_groups(s_ids, s_g, d_ids, d_g, num_tokens=num_tokens, dst_first_token=first, block_size=128,
                       kinds=kinds)


KINDS = (parse(describe(MAMBA)), parse(describe(ATTN)))


def test_a_state_group_moves_its_running_slot_and_attention_counts_its_own_blocks() -> None:
    # 999 tokens (a 1000-token prompt less the last): 8 attention blocks of 128, one state slot
    p = _pair([(40,), tuple(range(11, 19))], [(50,), tuple(range(61, 69))], 999, KINDS)
    assert p.src == (40, *range(11, 19)) and p.dst == (50, *range(61, 69)) and p.per_group == (1, 8)
    assert p.nbytes == (9152,) + (0,) * 8 and p.partial  # the state's bytes; attention: whole blocks
    # without the kinds the state list would be read as attention of 128 tokens a block: refused
    with pytest.raises(PlanError, match="group 0 holds 1 blocks"):
        _pair([(40,), tuple(range(11, 19))], [(50,), tuple(range(61, 69))], 999, ())


@pytest.mark.parametrize(("src", "dst", "side"), [((0,), (50,), "prefill"), ((40,), (0,), "decode"),
                                                   ((), (50,), "prefill")])
def test_a_missing_or_null_state_slot_fails_the_whole_transfer(src, dst, side) -> None:
    with pytest.raises(PlanError, match=f"state group 0 has no running-state slot on the {side} side"):
        _pair([src, tuple(range(11, 19))], [dst, tuple(range(61, 69))], 999, KINDS)


def test_a_short_attention_list_beside_a_state_group_fails_the_whole_transfer() -> None:
    with pytest.raises(PlanError, match="group 1 holds 7 blocks"):
        _pair([(40,), tuple(range(11, 19))], [(50,), tuple(range(61, 68))], 999, KINDS)


def _layout(groups: tuple[str, ...], num_layers: int = 1) -> KVLayout:
    lay = vllm_cpu_layout(num_layers=num_layers, num_blocks=128, block_size=128, num_heads=1, head_size=64,
                          dtype="bfloat16", packing="row")
    return KVLayout(**{**lay.__dict__, "kv_groups": groups})


def test_a_state_pair_moves_only_its_states_bytes_and_attention_pairs_their_whole_blocks() -> None:
    """One WRITE's descriptors: each attention pair's whole block, exactly as the planner
    copies any block, and of the state slot's page in each layer only its first 9152 bytes
    (conv 960 + SSM 8192; vLLM pads the page to 32768), never the padding after them."""
    lay = _layout((describe(MAMBA), describe(ATTN)), num_layers=2)
    pairs = _pair([(40,), tuple(range(11, 19))], [(50,), (61, 62, 63, 70, 71, 72, 73, 74)], 999, KINDS)
    got = plan_pairs(lay, lay, pairs)
    whole = plan(lay, list(pairs.src[1:]), lay, list(pairs.dst[1:]), 8 * 128)
    state = len(got) - len(whole)
    assert state == 2  # one descriptor per layer
    for a, b in ((got.src_off, whole.src_off), (got.dst_off, whole.dst_off), (got.length, whole.length)):
        assert np.array_equal(a[:len(whole)], b)
    base = np.asarray(lay.layer_offsets)
    assert np.array_equal(got.src_off[len(whole):], base + 40 * lay.block_stride)
    assert np.array_equal(got.dst_off[len(whole):], base + 50 * lay.block_stride)
    assert np.array_equal(got.length[len(whole):], [9152, 9152])
    assert got.nbytes == 8 * lay.block_bytes + 2 * 9152  # against 9 whole blocks before
    only = plan_pairs(lay, lay, Pairs((40,), (50,), (1,), (9152,)))  # a state slot alone plans too
    assert np.array_equal(only.length, [9152, 9152]) and np.array_equal(only.src_off, got.src_off[len(whole):])
    # attention groups alone (dense, sliding window) are never partial: their blocks move whole
    assert not _pair([tuple(range(11, 19))], [tuple(range(61, 69))], 999, (parse(describe(ATTN)),)).partial


def test_the_state_bytes_are_those_vllm_binds_the_state_layers_sub_tensors_to() -> None:
    """vLLM's own allocation and Mamba layer binding (allocate_kv_cache, MambaBase.bind_kv_cache):
    block b's conv and SSM state are one run of bytes from the page's first byte, the run
    plan_state copies; the rest of the page is padding no state view reaches."""
    from vllm.model_executor.layers.mamba.abstract import MambaBase
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    for order in (KVCacheLayout.LBHNC, KVCacheLayout.LBNHC):
        kv = allocate_kv_cache(_cfg([MAMBA, ATTN], _tensors()), torch.device("cpu"), order)
        layer = SimpleNamespace(get_state_shape=lambda: MAMBA.shapes, get_state_dtype=lambda: MAMBA.dtypes)
        MambaBase.bind_kv_cache(layer, kv["model.layers.0.mixer"])
        attn = kv["model.layers.1.mixer"]
        assert attn.stride(0) * attn.element_size() == 32768
        lay = KVLayout(**{**_layout((describe(MAMBA), describe(ATTN))).__dict__, "num_blocks": 8,
                          "region_size": 8 * 32768})
        for b in (0, 5):
            runs = sorted((s[b].data_ptr() - attn.data_ptr(), s[b].numel() * s[b].element_size())
                          for s in layer.kv_cache)
            assert all(s[b].is_contiguous() for s in layer.kv_cache)
            assert runs == [(b * 32768, 960), (b * 32768 + 960, 8192)]  # back to back from the page start
            p = plan_state(lay, b, lay, 7 - b, parse(describe(MAMBA)).state_bytes)
            assert (int(p.src_off[0]), int(p.length[0])) == (b * 32768, sum(n for _, n in runs))
            assert int(p.dst_off[0]) == (7 - b) * 32768


def test_a_state_that_does_not_fit_its_page_is_never_planned() -> None:
    lay = _layout((describe(MAMBA), describe(ATTN)))
    with pytest.raises(PlanError, match="a state of 32769 bytes does not fit the source's page of 32768"):
        plan_state(lay, 1, lay, 2, 32769)
    with pytest.raises(PlanError, match="block ID 128 out of range"):
        plan_state(lay, 128, lay, 2, 9152)
    bad = describe(MAMBA).replace("page_bytes=32768", "page_bytes=9151")
    with pytest.raises(GroupsError, match="a state of 9152 bytes in a page of 9151"):
        parse(bad)
    for broken in ("state=3x160:complex64", "state=3x0:bfloat16", "state=3x160"):
        with pytest.raises(GroupsError, match="not readable"):
            parse(re.sub(r"state=\S+", broken, describe(MAMBA)))
    with pytest.raises(PlanError, match="a block is in two groups' pairs on the decode side"):
        _pair([(40,), tuple(range(11, 19))], [(61,), tuple(range(61, 69))], 999, KINDS)


def test_registrations_are_checked_per_group() -> None:
    lay = _layout(tuple(describe(s) for s in (MAMBA, ATTN)))
    ids, groups = pack([(40,), tuple(range(11, 19))])
    assert check_blocks(lay, ids, 999, "register", 0, groups) == ""
    ids, groups = pack([(40,), tuple(range(11, 18))])
    assert "KV cache group 1 (FullAttention) of 7 blocks cannot hold 999" in check_blocks(
        lay, ids, 999, "register", 0, groups)
    ids, groups = pack([(), tuple(range(11, 19))])
    assert "KV cache group 0 (Mamba) of 0 blocks" in check_blocks(lay, ids, 999, "register", 0, groups)


# ---------------------------------------------------------------- engine: what is refused


def _cfg(specs, tensors=()) -> KVCacheConfig:
    groups = [KVCacheGroupSpec([f"model.layers.{i}.mixer"], s) for i, s in enumerate(specs)]
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=list(tensors), kv_cache_groups=groups)


def test_state_groups_of_one_page_size_beside_full_attention_pass() -> None:
    check_kv_cache_config(_cfg([MAMBA, ATTN]), pages=False)
    check_kv_cache_config(_cfg([GDN, GDN, GDN, ATTN_1152]), pages=False)
    with pytest.raises(LayoutRefused, match="page sizes"):
        check_kv_cache_config(_cfg([GDN, ATTN]), pages=False)
    with pytest.raises(LayoutRefused, match="no full-attention group"):
        check_kv_cache_config(_cfg([MAMBA, MAMBA]), pages=False)
    every = MambaSpec(block_size=2048, shapes=MAMBA.shapes, dtypes=MAMBA.dtypes, page_size_padded=32768,
                      mamba_cache_mode="all")
    with pytest.raises(LayoutRefused, match="mamba_cache_mode 'all'"):
        check_kv_cache_config(_cfg([every, ATTN]), pages=False)


def _views(state_offset: int = 0, state_stride: int = 32768):
    """An engine's layers over one allocation, as vLLM 0.32 views them: the attention layer
    ``[blocks, heads, tokens, 2 * head]`` bf16 and the Mamba layer's byte view, both at page
    ``b`` = byte ``b * 32768`` (groups overlay each other)."""
    raw = torch.zeros(16 * 32768, dtype=torch.int8)
    attn = torch.as_strided(raw, (8, 1, 128, 256), (32768, 32768, 256, 1)).view(torch.bfloat16)
    state = torch.as_strided(raw, (8, 1, 1, 2 * 480 + 4 * 2048), (state_stride, 1, 1, 1), state_offset)
    return {"model.layers.0.mixer": state, "model.layers.1.mixer": attn}


def _tensors():
    return [KVCacheTensor(size=8 * 32768, layers=["model.layers.0.mixer"], layer_stride=32768, block_stride=32768),
            KVCacheTensor(size=8 * 32768, layers=["model.layers.1.mixer"], layer_stride=32768, block_stride=32768)]


def test_pages_are_read_through_the_attention_layer_the_state_layer_overlays() -> None:
    cfg = _cfg([MAMBA, ATTN], _tensors())
    groups, names = hybrid_groups(cfg, _views())
    assert names == ["model.layers.1.mixer"]  # the state layer's name never orders or picks anything
    assert groups == (describe(MAMBA), describe(ATTN))
    check_pages(cfg, 32768)
    with pytest.raises(LayoutRefused, match="pages of .32768. bytes, the attention view's block holds 16384"):
        check_pages(cfg, 16384)
    for bad in (_views(state_offset=4096), _views(state_stride=65536)):
        with pytest.raises(LayoutRefused, match="state layer model.layers.0.mixer's pages are not"):
            hybrid_groups(cfg, bad)


# ---------------------------------------------------------------- scheduler: one token less


def _sched() -> KVPushScheduler:
    return KVPushScheduler(PluginConfig(daemon="ipc:///x"), block_size=128, kv_groups=2, group_kinds=KINDS)


def _req(rid: str, params: dict, n: int = 1000) -> Request:
    return Request(rid, list(range(n)), SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params}),
                   None)


P_LEG = {"do_remote_decode": True, "transfer_id": "t1", "kvpush_secret": "s1"}
D_LEG = {"do_remote_prefill": True, "transfer_id": "t1", "prefill_endpoints": ["tcp://h:1"], "prefill_tp_size": 1,
         "kvpush_secret": "s1"}


def test_a_prefill_leg_drops_the_prompts_last_token_once_and_says_so() -> None:
    s = _sched()
    r = _req("p", dict(P_LEG))
    s.on_new_request(r)
    assert r.num_prompt_tokens == 999 and len(r.prompt_token_ids) == 999 and r.num_tokens == 999
    assert prompt_truncated(r.kv_transfer_params)
    s.on_new_request(r)  # preempted and added again: never twice
    assert r.num_prompt_tokens == 999
    s.get_num_new_matched_tokens(r, 0)
    r.status = RequestStatus.FINISHED_LENGTH_CAPPED
    hold, answer = s.request_finished_groups(r, ([0, 0, 40, 41], list(range(11, 19))))
    assert hold and answer is not None and answer[PROMPT_TRUNCATED] is True
    (send,) = [e for e in s._meta.events if isinstance(e, Send)]
    assert send.num_tokens == 999 and send.block_ids == (41, *range(11, 19)) and send.kv_groups == (1, 8)


def test_dense_models_and_other_requests_keep_their_prompt() -> None:
    dense = KVPushScheduler(PluginConfig(daemon="ipc:///x"), block_size=128)
    r = _req("p", dict(P_LEG))
    dense.on_new_request(r)
    assert r.num_prompt_tokens == 1000 and not prompt_truncated(r.kv_transfer_params)
    for params in ({}, dict(D_LEG)):  # not a prefill leg
        r = _req("x", params)
        _sched().on_new_request(r)
        assert r.num_prompt_tokens == 1000
    one = _req("o", dict(P_LEG), n=1)  # nothing left to compute without its one token
    _sched().on_new_request(one)
    assert one.num_prompt_tokens == 1


def test_a_decode_leg_loads_all_but_the_last_token_into_its_running_slot() -> None:
    s = _sched()
    r = _req("d", dict(D_LEG))
    assert s.get_num_new_matched_tokens(r, 0) == (999, True)  # vLLM's external_kv_transfer: 999
    s.update_state_after_alloc(r, SimpleNamespace(get_block_ids=lambda: ([0, 52], list(range(61, 69)))), 999)
    meta = s.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=0))  # type: ignore[arg-type]
    (reg,) = [e for e in meta.events if isinstance(e, wl.Register)]
    assert reg.num_tokens == 999 and reg.first_token == 0
    assert reg.block_ids == (52, *range(61, 69)) and reg.kv_groups == (1, 8)
    assert s.get_num_new_matched_tokens(_req("h", dict(D_LEG)), 999) == (0, False)  # all it loads is local


def test_an_attention_block_split_into_kernel_blocks_is_read_as_one_page() -> None:
    """The linear preset's attention block is raised to 1152 tokens (the GDN page); where
    vLLM's CPU backend keeps it as kernel blocks of fewer tokens, kvpush reads each of vLLM's
    blocks as its kernel blocks together: block IDs index pages, one page a block."""
    from kvpush.engine_plugin.worker.half import describe_cpu_kv

    raw = torch.zeros(4 * 294912, dtype=torch.int8)
    attn = raw.view(torch.bfloat16).view(4 * 9, 1, 128, 128)  # 9 kernel blocks of 128 per block of 1152
    groups = (describe(GDN), describe(ATTN_1152))
    _, lay = describe_cpu_kv({"model.layers.3.self_attn.attn": attn}, model="linear", head_start=0, total_heads=1,
                             kv_groups=groups, blocks=4)
    assert (lay.num_blocks, lay.block_size, lay.block_bytes) == (4, 1152, 294912) and lay.kv_groups == groups
    _, whole = describe_cpu_kv({"a": attn}, model="linear", head_start=0, total_heads=1, kv_groups=groups, blocks=36)
    assert (whole.num_blocks, whole.block_size) == (36, 128)
    with pytest.raises(RuntimeError, match="36 kernel blocks for 5 KV cache blocks"):
        describe_cpu_kv({"a": attn}, model="linear", head_start=0, total_heads=1, kv_groups=groups, blocks=5)


def test_engines_agree_on_a_state_groups_bytes_not_on_their_own_bookkeeping() -> None:
    """A prefill engine with prefix caching (GDN in 'align' mode, block 1152) feeds a decode
    engine without it ('none' mode, a block of max_model_len): the running state is the same
    bytes. Different sub-tensors or pages are refused at the handshake, naming the group."""
    from dataclasses import replace

    from kvpush.daemon.core.planner import check_compatible

    none = MambaSpec(block_size=4096, shapes=GDN.shapes, dtypes=GDN.dtypes, page_size_padded=294912)
    p = _layout((describe(GDN), describe(ATTN_1152)))
    d = replace(p, kv_groups=(describe(none), describe(ATTN_1152)))
    check_compatible(p, d, ("there", "here"))
    other = MambaSpec(block_size=1152, shapes=((3, 1024), (4, 64, 128)), dtypes=GDN.dtypes, page_size_padded=294912,
                      mamba_cache_mode="align")
    with pytest.raises(PlanError, match="KV cache group 0 is .*4x128x128.* there, .*4x64x128.* here"):
        check_compatible(p, replace(p, kv_groups=(describe(other), describe(ATTN_1152))), ("there", "here"))
    with pytest.raises(PlanError, match="KV cache group 1"):  # attention: its block size still counts
        check_compatible(p, replace(p, kv_groups=(describe(GDN), describe(ATTN))), ("there", "here"))
