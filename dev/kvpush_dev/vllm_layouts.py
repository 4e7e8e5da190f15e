"""Engine stand-ins whose KV caches are allocated the way vLLM allocates them on GPU, and the
reference copy that reads them through the backends' own tensor semantics.

Two allocators:

- :func:`legacy_caches`: vLLM 0.10/0.11 on GPU (pinned shapes, see
  :mod:`kvpush.engine_plugin.worker.layouts`): one allocation per layer in the backend's physical
  order, handed to the connector permuted back to the logical shape (``get_kv_cache_shape``
  + ``get_kv_cache_stride_order``).
- :func:`v032_caches`: the installed vLLM's own ``allocate_kv_cache`` (one backing allocation,
  per-layer ``[B, H, N, C]`` views in a ``KVCacheLayout``), on CPU.

:func:`semantic` views a layer's tensor as ``[kv, block, token, head, elem]`` by the backend's
meaning (for vLLM 0.32: ``.split(head_size, -1)`` as FlashAttention / FlashInfer / Triton do),
with torch indexing only: the reference :func:`reference_copy` copies token by token through
those views, independently of the planner's numbers.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kvpush.engine_plugin.worker.layouts import BackendShape
from kvpush.proto.layout import KVLayout

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
          "float8_e4m3fn": torch.float8_e4m3fn, "uint8": torch.uint8}


def _legacy_logical(shape: BackendShape, nb: int, bs: int, heads: int, hs: int) -> tuple[int, ...]:
    size = {"kv": 2, "block": nb, "token": bs, "head": heads, "elem": hs}
    return tuple(size[d] for d in shape.dims)


def legacy_caches(shape: BackendShape, *, num_layers: int, num_blocks: int, block_size: int, num_heads: int,
                  head_size: int, dtype: str, seed: int = 0, fill: str = "random",
                  shared: int = 1) -> dict[str, torch.Tensor]:
    """Per-layer tensors as vLLM <= 0.11 gave them on GPU: ``shared`` consecutive layers share
    one allocation (1: one per layer), each allocated in physical order, viewed logically."""
    logical = _legacy_logical(shape, num_blocks, block_size, num_heads, head_size)
    phys = tuple(logical[i] for i in shape.physical)
    inv = [shape.physical.index(i) for i in range(len(logical))]
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    n = 0
    for first in range(0, num_layers, shared):
        count = min(shared, num_layers - first)
        numel = count * int(torch.tensor(phys).prod())
        if fill == "random":
            raw = torch.randint(0, 256, (numel * torch.empty((), dtype=DTYPES[dtype]).element_size(),),
                                dtype=torch.uint8, generator=g)
        else:
            raw = torch.zeros(numel * torch.empty((), dtype=DTYPES[dtype]).element_size(), dtype=torch.uint8)
        flat = raw.view(DTYPES[dtype])
        per = numel // count
        for k in range(count):
            out[f"model.layers.{n}.self_attn.attn"] = flat[k * per:(k + 1) * per].view(phys).permute(*inv)
            n += 1
    return out


def v032_caches(layout_name: str, *, num_layers: int, num_blocks: int, block_size: int, num_heads: int,
                head_size: int, dtype: str, mla: bool = False, seed: int = 0,
                fill: str = "random") -> dict[str, torch.Tensor]:
    """The installed vLLM's ``allocate_kv_cache`` on CPU for one full-attention (or MLA) group."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheLayout,
        KVCacheTensor,
        MLAAttentionSpec,
        compute_layout_strides,
    )
    from vllm.v1.worker.utils import allocate_kv_cache

    lay = KVCacheLayout[layout_name]
    cls = MLAAttentionSpec if mla else FullAttentionSpec
    spec = cls(block_size=block_size, num_kv_heads=1 if mla else num_heads, head_size=head_size,
               dtype=DTYPES[dtype])
    names = [f"model.layers.{i}.self_attn.attn" for i in range(num_layers)]
    sl, sb, *_ = compute_layout_strides(spec, num_blocks, num_layers, lay)
    size = num_layers * num_blocks * spec.page_size_bytes
    cfg = KVCacheConfig(num_blocks=num_blocks,
                        kv_cache_tensors=[KVCacheTensor(size=size, layers=names, layer_stride=sl, block_stride=sb)],
                        kv_cache_groups=[KVCacheGroupSpec(names, spec)])
    kv = allocate_kv_cache(cfg, torch.device("cpu"), lay)
    _whole(kv, fill, seed)  # fills the allocation in place
    return kv


def semantic(t: torch.Tensor, shape: BackendShape, head_size: int) -> torch.Tensor:
    """``[kv, block, token, head, elem]`` view of one layer (MLA: kv and head of size 1)."""
    d = shape.dims
    if "kvelem" in d:  # vLLM 0.32: (B, H, N, K|V)
        k, v = t.permute(d.index("block"), d.index("token"), d.index("head"), d.index("kvelem")).split(
            head_size, dim=-1)
        return torch.stack((k, v))  # a copy: read-only use (the reference); writes go through copy_into
    if shape.mla and "head" not in d:  # legacy MLA (B, N, D)
        return t.permute(d.index("block"), d.index("token"), d.index("elem"))[None, :, :, None, :]
    if shape.mla:  # vLLM 0.32 MLA (B, 1, N, D)
        return t.permute(d.index("block"), d.index("token"), d.index("head"), d.index("elem"))[None]
    return t.permute(d.index("kv"), d.index("block"), d.index("token"), d.index("head"), d.index("elem"))


def _kv_parts(t: torch.Tensor, shape: BackendShape, head_size: int) -> list[torch.Tensor]:
    """Writable ``[block, token, head, elem]`` views of K and V (MLA: the latent)."""
    d = shape.dims
    if "kvelem" in d:
        bnhc = t.permute(d.index("block"), d.index("token"), d.index("head"), d.index("kvelem"))
        return list(bnhc.split(head_size, dim=-1)) if not shape.mla else [bnhc]
    s = semantic(t, shape, head_size)
    return [s[i] for i in range(s.shape[0])]


def reference_copy(src: Mapping[str, torch.Tensor], src_shape: BackendShape, src_lay: KVLayout, src_blocks: list[int],
                   dst: Mapping[str, torch.Tensor], dst_shape: BackendShape, dst_lay: KVLayout,
                   dst_blocks: list[int], num_tokens: int) -> None:
    """Copy tokens [0, num_tokens) of the heads both ranks hold into ``dst`` in place, token by
    token through the backends' own views."""
    hs = src_lay.head_size
    head0 = max(src_lay.head_start, dst_lay.head_start)
    nheads = min(src_lay.head_start + src_lay.num_heads, dst_lay.head_start + dst_lay.num_heads) - head0
    if src_lay.replicated:
        head0, nheads = 0, 1
    for name_s, name_d in zip(src, dst, strict=True):
        sp = _kv_parts(src[name_s], src_shape, hs)
        dp = _kv_parts(dst[name_d], dst_shape, hs)
        for kv in range(len(sp)):
            for t in range(num_tokens):
                sb, st_ = src_blocks[t // src_lay.block_size], t % src_lay.block_size
                db, dt = dst_blocks[t // dst_lay.block_size], t % dst_lay.block_size
                hsrc = head0 - (0 if src_lay.replicated else src_lay.head_start)
                hdst = head0 - (0 if dst_lay.replicated else dst_lay.head_start)
                dp[kv][db, dt, hdst:hdst + nheads] = sp[kv][sb, st_, hsrc:hsrc + nheads]


def caches_equal(a: Mapping[str, torch.Tensor], a_shape: BackendShape, b: Mapping[str, torch.Tensor],
                 b_shape: BackendShape, head_size: int) -> bool:
    """Every element of every layer equal, compared through the backends' views."""
    for na, nb in zip(a, b, strict=True):
        for x, y in zip(_kv_parts(a[na], a_shape, head_size), _kv_parts(b[nb], b_shape, head_size), strict=True):
            if not torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)):
                return False
    return True


def ignore_tail(expected: Mapping[str, torch.Tensor], actual: Mapping[str, torch.Tensor], shape: BackendShape,
                lay: KVLayout, dst_blocks: list[int], num_tokens: int) -> None:
    """The last destination block's tokens past ``num_tokens`` may hold anything (the block
    belongs to this request alone): take them from ``actual`` into ``expected``."""
    n_blocks = -(-num_tokens // lay.block_size)
    for ne, na in zip(expected, actual, strict=True):
        for e, a in zip(_kv_parts(expected[ne], shape, lay.head_size), _kv_parts(actual[na], shape, lay.head_size),
                        strict=True):
            for t in range(num_tokens, n_blocks * lay.block_size):
                b = dst_blocks[t // lay.block_size]
                e[b, t % lay.block_size] = a[b, t % lay.block_size]


def clone_caches(kv: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A deep copy keeping each layer's strides and the sharing of allocations between layers."""
    out: dict[str, torch.Tensor] = {}
    copies: dict[int, torch.Tensor] = {}
    for name, t in kv.items():
        stor = t.untyped_storage()
        if stor.data_ptr() not in copies:
            whole = torch.empty(0, dtype=torch.uint8)
            whole.set_(stor, 0, (stor.nbytes(),))
            copies[stor.data_ptr()] = whole.clone()
        base = copies[stor.data_ptr()]
        off = (t.data_ptr() - stor.data_ptr()) // t.element_size()
        out[name] = torch.as_strided(base.view(t.dtype), t.shape, t.stride(), off)
    return out


def v032_hybrid_caches(groups: list[tuple[list[str], object]], layout_name: str, *, num_blocks: int,
                       kernel_block_sizes: list[int] | None = None, seed: int = 0,
                       fill: str = "random", device: str = "cpu") -> tuple[dict[str, torch.Tensor], object]:
    """A hybrid engine's KV as the installed vLLM lays it out on GPU: its ``KVCacheConfig``
    from vLLM's own ``get_kv_cache_config_from_groups`` (the groups overlaid from byte 0 of
    one allocation) and the per-layer views from its ``allocate_kv_cache`` (attention layers
    ``[B, H, N, C]`` in the layout, state layers their raw ``[B, 1, 1, bytes]`` pages), on
    ``device``. ``groups``: (layer names, KV cache spec) per group. Returns (views, config)."""
    from types import SimpleNamespace

    try:  # vLLM 0.33+
        from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
    except ImportError:  # vLLM 0.32
        from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec, KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    lay = KVCacheLayout[layout_name]
    stand_in = SimpleNamespace(  # what the config builder reads of vLLM's VllmConfig
        attention_config=SimpleNamespace(hisparse_config=None),
        cache_config=SimpleNamespace(get_resolved_kv_cache_layout=lambda: lay, num_gpu_blocks_override=num_blocks,
                                     prefix_cache_retention_interval=None))
    specs = [KVCacheGroupSpec(list(names), spec) for names, spec in groups]
    cfg = get_kv_cache_config_from_groups(stand_in, specs, available_memory=1 << 40)  # type: ignore[arg-type]
    kv = allocate_kv_cache(cfg, torch.device("cpu"), lay, kernel_block_sizes)
    whole = _whole(kv, fill, seed)
    if device != "cpu":  # the same views over a copy of the allocation on the device
        kv = views_over(kv, whole.to(device))
    return kv, cfg


def views_over(kv: Mapping[str, torch.Tensor], raw: torch.Tensor) -> dict[str, torch.Tensor]:
    """The same per-layer views (shape, strides, offset, dtype) over ``raw``, another
    one-byte-per-element allocation of the same size (a copy, or one on another device)."""
    base = next(iter(kv.values())).untyped_storage().data_ptr()
    return {n: torch.as_strided(raw.view(t.dtype), t.shape, t.stride(), (t.data_ptr() - base) // t.element_size())
            for n, t in kv.items()}


def bind_state(kv: torch.Tensor, shapes: tuple[tuple[int, ...], ...], dtypes: tuple[torch.dtype, ...],
               state_alignment: int = 1) -> tuple[torch.Tensor, ...]:
    """A state layer's sub-tensor views (conv, SSM) of its raw ``[B, 1, 1, bytes]`` pages, by
    the installed vLLM's own ``MambaBase.bind_kv_cache`` (vLLM 0.34 aligns each sub-tensor's
    start to the layer's ``state_alignment``)."""
    from vllm.model_executor.layers.mamba.abstract import MambaBase

    class _Layer:  # what bind_kv_cache reads of a Mamba layer
        def __init__(self) -> None:
            self.state_alignment = state_alignment

        def get_state_shape(self) -> tuple[tuple[int, ...], ...]:
            return shapes

        def get_state_dtype(self) -> tuple[torch.dtype, ...]:
            return dtypes

    layer = _Layer()
    MambaBase.bind_kv_cache(layer, kv)  # type: ignore[arg-type]
    return layer.kv_cache  # type: ignore[attr-defined]


def _whole(kv: dict[str, torch.Tensor], fill: str, seed: int) -> torch.Tensor:
    """The allocation behind vLLM's views, as bytes (random where ``fill`` says so)."""
    raw = next(iter(kv.values())).untyped_storage()
    whole = torch.empty(0, dtype=torch.uint8)
    whole.set_(raw, 0, (raw.nbytes(),))
    if fill == "random":
        whole.copy_(torch.randint(0, 256, (raw.nbytes(),), dtype=torch.uint8,
                                  generator=torch.Generator().manual_seed(seed)))
    return whole
