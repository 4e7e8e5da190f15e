"""Each family's GPU KV layout, as the installed vLLM lays it out on CUDA, derived and moved.

The engines' KV is what vLLM's GPU model runner builds: the ``KVCacheConfig`` from vLLM's own
``get_kv_cache_config_from_groups`` (a hybrid's groups overlaid from byte 0 of one allocation),
the per-layer views from its ``allocate_kv_cache`` (the same code runs on CUDA; here on CPU
tensors of the same shapes and strides), a state layer's conv and SSM views from its own
``MambaBase.bind_kv_cache``. kvpush derives its layout from them the way the GPU engine does
(``layouts.describe_gpu_kv``: the attention backend's shape, the groups attached as on the CPU
path), pairs and plans a request as the daemon does (``group_pairs``), and the plan is applied
to the raw bytes. Right means: every byte the decode engine's vLLM reads for the request,
through every layer's own view (the other groups' layers included, and the state's sub-tensors),
is the prefill engine's, and no other byte of the decode allocation changed (a state page's
padding included).

Families: FlashAttention with sliding-window groups beside full attention (gpt-oss / Gemma 3),
Mamba2 state (conv + SSM in one padded page) beside attention, gated delta net state (mode
'align', attention raised to the state's page, split into FlashInfer's kernel blocks), and
FlashMLA (a 576-wide bf16 latent in blocks of 64).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.kv_cache_interface import KVCacheLayout  # noqa: E402

from kvpush.daemon.core.planner import PlanError, check_compatible, plan, producer_fanout  # noqa: E402
from kvpush.engine_plugin.worker.layouts import LayoutRefused  # noqa: E402
from kvpush.proto.groups import NULL_BLOCK, describe, parse  # noqa: E402
from kvpush_dev.gpu_families import (  # noqa: E402
    Engine,
    cases,
    check,
    check_family,
    family_groups,
    move,
)
from kvpush_dev.gpu_families import layers as _layers  # noqa: E402
from kvpush_dev.gpu_families import specs as _specs  # noqa: E402
from kvpush_dev.kvref import apply_plan_regions  # noqa: E402
from kvpush_dev.vllm_layouts import views_over  # noqa: E402

BF16 = torch.bfloat16
S = _specs()
FULL, SWA, MAMBA, ATTN, MLA = S["FULL"], S["SWA"], S["MAMBA"], S["ATTN"], S["MLA"]
SWA_GROUPS, MAMBA_GROUPS, GDN_GROUPS = family_groups("swa"), family_groups("mamba"), family_groups("gdn")
layers = _layers


# ---------------------------------------------------------------- sliding window beside full attention


@pytest.mark.parametrize("p_layout, d_layout", [("LBHNC", "LBHNC"), ("LBNHC", "BLHNC"), ("BLHNC", "LHBNC")])
def test_sliding_window_groups_beside_full_attention(p_layout, d_layout):
    """gpt-oss / Gemma 3 on FlashAttention: each group's blocks land in the decode engine's
    pages, read through both groups' layers; the window's null blocks are not moved."""
    p = Engine(SWA_GROUPS, p_layout, seed=1)
    d = Engine(SWA_GROUPS, d_layout, fill="zeros")
    assert p.layout.kv_groups == (describe(FULL), describe(SWA)) and len(p.regions) == 1
    assert p.names == SWA_GROUPS[0][0]  # group 0's layers describe the pages (the others overlay them)
    n = 70  # 5 blocks; the window (32 tokens) keeps the last 3 in the sliding-window group
    pairs = check(p, d, [[3, 7, 9, 11, 5], [NULL_BLOCK, NULL_BLOCK, 2, 4, 6]],
                  [[1, 2, 3, 4, 5], [NULL_BLOCK, NULL_BLOCK, 8, 9, 10]], n)
    assert [g for g, _, _ in pairs] == [0] * 5 + [1] * 3


def test_sliding_window_groups_across_tp():
    """TP 2 -> 2: each rank's KV heads (head_start = rank) land in its peer's pages, both groups.
    Different TP sizes are refused at the handshake: a hybrid's group descriptions carry each
    rank's page bytes, which differ (the CPU path's rule, unchanged here)."""
    src_lists, dst_lists = [[3, 7, 9], [NULL_BLOCK, 2, 4]], [[1, 2, 3], [NULL_BLOCK, 8, 9]]
    for rank in range(2):
        p = Engine(SWA_GROUPS, "LBNHC", seed=5 + rank, rank=rank, heads=1)
        d = Engine(SWA_GROUPS, "BLHNC", fill="zeros", rank=rank, heads=1)
        assert (p.layout.head_start, p.layout.num_heads, p.layout.model_heads) == (rank, 1, 2)
        check(p, d, src_lists, dst_lists, 40)
    with pytest.raises(PlanError, match="KV cache group 0 .*page_bytes=4096.*page_bytes=8192"):
        check_compatible(p.layout, Engine(SWA_GROUPS, "LBHNC").layout)


def test_sliding_window_block_sizes_must_agree():
    """A hybrid's groups are compared whole at the handshake: another block size is refused,
    naming the group (dense and MLA caches map across block sizes, below)."""
    p = Engine(SWA_GROUPS, "LBHNC")
    other = [(n, replace(s, block_size=32)) for n, s in SWA_GROUPS]
    d = Engine(other, "LBHNC", num_blocks=6)
    with pytest.raises(PlanError, match="KV cache group 0"):
        check_compatible(p.layout, d.layout)


# ---------------------------------------------------------------- state groups (Mamba2, gated delta net)


@pytest.mark.parametrize("p_layout, d_layout", [("LBHNC", "LBHNC"), ("LBNHC", "BLHNC")])
def test_mamba2_state_beside_attention(p_layout, d_layout):
    """The running state's conv and SSM sub-tensors, as vLLM binds them in the padded page,
    land in the decode engine's state slot; the page's padding is never written; the
    attention group's blocks move whole."""
    p = Engine(MAMBA_GROUPS, p_layout, seed=2)
    d = Engine(MAMBA_GROUPS, d_layout, fill="zeros")
    assert parse(p.layout.kv_groups[0]).state_bytes == MAMBA.state_content_size_bytes == 9152
    assert p.names == MAMBA_GROUPS[1][0] and p.layout.block_bytes // p.layout.num_layers == 32768
    pairs = check(p, d, [[4], [1, 2, 3]], [[7], [5, 6, 9]], 300)
    assert pairs[0] == (0, 4, 7)
    page = d.raw.view(-1)  # the state slot's padding, in every state layer, is still zero
    for t in (d.kv[n] for n in MAMBA_GROUPS[0][0]):
        start = t.data_ptr() - d.raw.data_ptr() + 7 * t.stride(0)
        assert not page[start + 9152:start + 32768].any()


def test_gated_delta_net_state_with_kernel_blocks():
    """The linear preset on FlashInfer: attention raised to the state's 1152-token page and
    split into kernel blocks of 64 (vLLM's kernel block splitting, layer-compact LBNHC): a
    page is read as its kernel blocks together; the 'align' state slot moves its state."""
    p = Engine(GDN_GROUPS, "LBNHC", backend="FLASHINFER", num_blocks=5, kernel=[1152, 64], seed=3)
    d = Engine(GDN_GROUPS, "LBNHC", backend="FLASHINFER", num_blocks=5, kernel=[1152, 64], fill="zeros")
    t = p.kv[GDN_GROUPS[1][0][0]]
    assert t.shape[0] == 5 * 18 and (p.layout.num_blocks, p.layout.block_size) == (5, 1152)
    check(p, d, [[NULL_BLOCK, 2, 3], [1, 4]], [[1], [2, 3]], 2000)


def test_a_state_page_moves_whole_never_split_by_tp():
    p = Engine(MAMBA_GROUPS, "LBHNC", rank=1, heads=1)
    d = Engine(MAMBA_GROUPS, "LBHNC", fill="zeros")
    with pytest.raises(PlanError, match="KV heads|model_heads"):
        move(p, d, [[4], [1, 2, 3]], [[7], [5, 6, 9]], 300)


def test_state_layers_not_on_the_attention_pages_are_refused():
    """vLLM's head-outermost layout with several heads: an attention block is no page, a
    state page is none of its blocks: refused at start-up, naming the state layer."""
    groups = [(layers("mixer", range(0, 4, 2)), replace(MAMBA, page_size_padded=65536)),
              (layers("attn", range(1, 4, 2)), replace(ATTN, num_kv_heads=2))]
    with pytest.raises(LayoutRefused, match="state layer model.layers.0.mixer's pages"):
        Engine(groups, "LHBNC")


# ---------------------------------------------------------------- FlashMLA


@pytest.mark.parametrize("d_backend, d_block", [("FLASHMLA", 64), ("TRITON_MLA", 16)])
def test_flashmla_latent(d_backend, d_block):
    """FlashMLA's 576-wide bf16 latent in blocks of 64, into FlashMLA or Triton MLA (blocks of
    16): token by token through vLLM's views; one producer per decode rank across TP."""
    p = Engine([(layers("attn", range(3)), MLA)], "LBHNC", backend="FLASHMLA", num_blocks=6, seed=4)
    d = Engine([(layers("attn", range(3)), replace(MLA, block_size=d_block))], "LBHNC", backend=d_backend,
               num_blocks=6 * 64 // d_block, fill="zeros")
    assert p.layout.kv_groups == () and p.layout.replicated and p.layout.num_kv == 1
    assert (p.layout.head_size, p.layout.elem_size, p.layout.block_size) == (576, 2, 64)
    n, sb = 100, [4, 1]
    db = list(range(3, 3 + -(-n // d_block)))
    before = d.raw.clone()
    pl = plan(p.layout, sb, d.layout, db, n)
    apply_plan_regions(pl, [r.numpy() for r in p.regions], [r.numpy() for r in d.regions])
    assert 3 * n * 576 * 2 <= pl.nbytes <= 3 * len(db) * d_block * 576 * 2  # the latent once a token
    want = before.clone()
    wv = views_over(d.kv, want)
    for name_s, name_d in zip(p.kv, d.kv, strict=True):
        s = p.kv[name_s]
        for tok in range(n):
            wv[name_d][db[tok // d_block], 0, tok % d_block] = s[sb[tok // 64], 0, tok % 64]
        last = wv[name_d][db[-1], 0, n % d_block or d_block:]  # the last block's tail: never read
        last.copy_(d.kv[name_d][db[-1], 0, n % d_block or d_block:])
    assert torch.equal(d.raw, want)
    assert [producer_fanout(d.layout, 2, 4, r) for r in range(2)] == [[(0, 1)], [(1, 1)]]


def test_gpu_families_each_derive_from_one_allocation():
    """One CUDA IPC handle per distinct allocation: every family is one region."""
    for groups, layout, kw in ((SWA_GROUPS, "BLHNC", {}), (MAMBA_GROUPS, "LBHNC", {}),
                               ([(layers("attn", range(2)), MLA)], "LBHNC", {"backend": "FLASHMLA"})):
        e = Engine(groups, layout, **kw)
        assert len(e.regions) == 1 and e.regions[0].numel() == e.raw.numel()
        assert np.all(np.asarray(e.layout.layer_offsets) < e.raw.numel())


@pytest.mark.parametrize("family", list(cases()))
def test_each_familys_canonical_case(family):
    """What ``python -m kvpush_dev.gpu_families`` runs with each vLLM release (tests/compat)
    and scripts/gpu_check.sh's ``families`` step moves through two kvpushd on CUDA."""
    assert check_family(family).startswith("ok")


def test_a_wrong_state_size_is_caught_by_the_comparison():
    """The comparison can fail: a description whose state is a few bytes short (a sub-tensor
    aligned differently than vLLM binds it) leaves bytes vLLM reads unwritten."""
    p, d = Engine(MAMBA_GROUPS, "LBHNC", seed=2), Engine(MAMBA_GROUPS, "LBHNC", fill="zeros")
    short = replace(d.layout, kv_groups=(d.layout.kv_groups[0].replace("3x160", "3x152"), d.layout.kv_groups[1]))
    p.layout = replace(p.layout, kv_groups=short.kv_groups)
    d.layout = short
    with pytest.raises(AssertionError, match="bytes differ from vLLM's views"):
        check(p, d, [[4], [1, 2, 3]], [[7], [5, 6, 9]], 300)



def _engine_config(layout: str, layers_backends: dict[str, type], head_size: int, heads: int):
    """What engine_geometry reads of vLLM's VllmConfig, the layers' backends real classes."""
    from types import SimpleNamespace

    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    class Layer(AttentionLayerBase):
        def __init__(self, backend: type) -> None:
            self.backend = backend

        def get_attn_backend(self) -> type:
            return self.backend

        def get_kv_cache_spec(self, vllm_config):  # not read here
            return None

    return SimpleNamespace(
        compilation_config=SimpleNamespace(static_forward_context={n: Layer(b) for n, b in layers_backends.items()}),
        model_config=SimpleNamespace(get_head_size=lambda: head_size, get_num_kv_heads=lambda pc: heads,
                                     use_mla=False),
        parallel_config=None,
        cache_config=SimpleNamespace(get_resolved_kv_cache_layout=lambda: KVCacheLayout[layout]))


def test_the_gpu_engine_reads_a_hybrids_attention_backend_not_its_state_layers():
    """What ``_register_gpu_kv_caches`` runs before exporting: engine_geometry over vLLM's
    layers (a Mamba2 layer's backend is not the KV layout's), then describe_gpu_kv."""
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.attention.backends.mamba2_attn import Mamba2AttentionBackend
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend

    from kvpush.engine_plugin.worker.layouts import describe_gpu_kv, engine_geometry

    e = Engine(MAMBA_GROUPS, "LBHNC")
    backends = {**dict.fromkeys(MAMBA_GROUPS[0][0], Mamba2AttentionBackend),
                **dict.fromkeys(MAMBA_GROUPS[1][0], FlashAttentionBackend)}
    geo = engine_geometry(_engine_config("LBHNC", backends, 64, 1), e.cfg)
    assert (geo.backend, geo.layer_view_order, geo.num_blocks, geo.mla) == ("FLASH_ATTN", (0, 1, 2, 3), 12, False)
    _, layout, names = describe_gpu_kv(e.kv, geo, e.cfg, rank=0, total_heads=1, model="m")
    assert layout == e.layout and names == MAMBA_GROUPS[1][0]
    mixed = {**backends, MAMBA_GROUPS[1][0][1]: TritonAttentionBackend}
    with pytest.raises(LayoutRefused, match="2 attention backends"):
        engine_geometry(_engine_config("LBHNC", mixed, 64, 1), e.cfg)
    with pytest.raises(LayoutRefused, match="the cache holds 128 elements per head and token, the model's head size "
                                            "is 32"):
        describe_gpu_kv(e.kv, engine_geometry(_engine_config("LBHNC", backends, 32, 1), e.cfg), e.cfg, rank=0,
                        total_heads=1)


def test_what_the_gpu_engine_still_refuses_names_the_family():
    """Chunked local attention, quantized pages in a hybrid group, state groups of cache mode
    'all' and MLA beside other groups stay refused at start-up, each naming what."""
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, KVQuantMode

    from kvpush.engine_plugin.worker.layouts import check_kv_cache_config

    def cfg(*specs):
        from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

        return KVCacheConfig(num_blocks=4, kv_cache_tensors=[], kv_cache_groups=[
            KVCacheGroupSpec([f"l{i}"], s) for i, s in enumerate(specs)])

    chunked = ChunkedLocalAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=BF16,
                                        attention_chunk_size=64)
    with pytest.raises(LayoutRefused, match="ChunkedLocalAttentionSpec"):
        check_kv_cache_config(cfg(FULL, chunked))
    quant = replace(SWA, dtype=torch.uint8, kv_quant_mode=KVQuantMode.FP8_PER_TOKEN_HEAD)
    full8 = replace(FULL, dtype=torch.uint8)  # pages of one size beside it
    with pytest.raises(LayoutRefused, match="FP8_PER_TOKEN_HEAD"):
        check_kv_cache_config(cfg(full8, quant))
    with pytest.raises(LayoutRefused, match="mamba_cache_mode 'all'"):
        check_kv_cache_config(cfg(ATTN, replace(MAMBA, mamba_cache_mode="all")))
    with pytest.raises(LayoutRefused, match="MLAAttentionSpec"):
        check_kv_cache_config(cfg(MLA, replace(MLA, block_size=16)))
