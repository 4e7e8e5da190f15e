"""The planner against vLLM-cpu's own cache-write kernel, across block sizes.

Why: the "vec"/"vec16" packing in :func:`kvpush.proto.layout.vllm_cpu_layout` was
decoded from the kernel's output; here the kernel itself is the reference. The
same K/V tokens are written with ``cpu_attn_reshape_and_cache`` into a source
cache (block size A) and a destination cache (block size B); the plan, applied
with numpy copies to a zeroed destination, must reproduce every byte the kernel
wrote for tokens < num_tokens, and write nothing outside the request's tokens
(nothing outside its blocks when A == B, where the last block's tail goes too).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from kvpush.daemon.core.planner import PlanError, plan
from kvpush.proto.layout import KVLayout, vllm_cpu_layout

pytestmark = pytest.mark.e2e

LAYERS = 2


@pytest.fixture(scope="module")
def ops():
    pytest.importorskip("vllm")
    import vllm._custom_ops as vllm_ops

    return vllm_ops


@dataclass
class Cache:
    """One rank's KV: all layers as views of one storage, like vLLM-cpu's."""

    isa: str
    layout: KVLayout
    flat: torch.Tensor  # the whole region
    layers: list[torch.Tensor]  # [num_blocks, heads, block_size, 2*head_size] each


def new_cache(isa: str, block_size: int, num_blocks: int, heads: int, head_size: int,
              dtype: torch.dtype, head_start: int, total_heads: int, fill: torch.Tensor | None = None) -> Cache:
    per_layer = num_blocks * heads * block_size * 2 * head_size
    flat = torch.zeros(LAYERS * per_layer, dtype=dtype) if fill is None else fill
    layers = [flat[i * per_layer:(i + 1) * per_layer].view(num_blocks, heads, block_size, 2 * head_size)
              for i in range(LAYERS)]
    lay = vllm_cpu_layout(num_layers=LAYERS, num_blocks=num_blocks, block_size=block_size, num_heads=heads,
                          head_size=head_size, dtype=str(dtype).removeprefix("torch."), packing=isa,
                          head_start=head_start, total_heads=total_heads)
    assert lay.region_size == flat.numel() * flat.element_size()
    return Cache(isa, lay, flat, layers)


def write(ops, cache: Cache, kv: list[tuple[torch.Tensor, torch.Tensor]], blocks: list[int], first: int) -> None:
    """Tokens [first, N) of every layer into ``blocks`` (from ``first``), with the real kernel."""
    bs = cache.layout.block_size
    h0 = cache.layout.head_start
    n = kv[0][0].shape[0]
    t = torch.arange(first, n)
    slots = torch.tensor(blocks, dtype=torch.int64)[(t - first) // bs] * bs + (t - first) % bs
    for layer, (k, v) in zip(cache.layers, kv, strict=True):
        nb, heads, _, two_d = layer.shape
        key_cache, value_cache = layer.view(nb, heads, 2 * bs, two_d // 2).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(
            k[first:, h0:h0 + heads].contiguous(), v[first:, h0:h0 + heads].contiguous(),
            key_cache, value_cache, slots, cache.isa,
        )


def as_bytes(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.uint8).numpy()


CASES = [
    # (src isa, src block, dst isa, dst block, heads src/dst/total, head_size, dtype, tokens, dst first)
    ("vec", 32, "vec", 64, (2, 2, 2), 64, torch.float32, 157, 0),
    ("vec", 64, "vec", 32, (2, 2, 2), 64, torch.float32, 157, 0),
    ("vec", 64, "vec", 128, (2, 2, 2), 128, torch.float32, 301, 0),
    ("vec", 128, "vec", 64, (2, 2, 2), 128, torch.float32, 301, 0),
    ("vec", 128, "vec", 32, (4, 2, 4), 64, torch.float32, 250, 64),  # TP 1 -> 2, prefix hit
    ("vec16", 16, "vec16", 48, (2, 2, 2), 64, torch.float32, 101, 0),
    ("vec16", 48, "vec16", 16, (1, 2, 2), 64, torch.float32, 101, 0),  # TP 2 -> 1
    ("vec16", 16, "vec", 32, (2, 2, 2), 64, torch.float32, 77, 0),
    ("vec", 64, "vec16", 48, (2, 2, 2), 64, torch.bfloat16, 133, 48),
    ("vec", 64, "vec", 64, (2, 2, 2), 64, torch.float32, 150, 0),  # same block size: whole blocks
    ("vec16", 16, "vec16", 16, (2, 2, 2), 128, torch.bfloat16, 40, 16),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}{c[1]}-{c[2]}{c[3]}-h{c[5]}-{c[6]}".replace("torch.", ""))
def test_plan_reproduces_the_kernel_across_block_sizes(ops, case) -> None:
    s_isa, sbs, d_isa, dbs, (s_heads, d_heads, total), head_size, dtype, n, first = case
    assert n % sbs and n % dbs or sbs == dbs
    rng = np.random.default_rng(sbs * 1000 + dbs)
    kv = [tuple(torch.from_numpy(rng.standard_normal((n, total, head_size), dtype=np.float32)).to(dtype)
                for _ in range(2)) for _ in range(LAYERS)]
    s_start = 0 if s_heads == total else total - s_heads
    d_start = 0 if d_heads == total else total - d_heads
    n_src, n_dst = -(-n // sbs), -(-(n - first) // dbs)
    s_nb, d_nb = n_src + 5, n_dst + 5
    src_blocks = [int(b) for b in rng.permutation(s_nb)[:n_src]]
    dst_blocks = [int(b) for b in rng.permutation(d_nb)[:n_dst]]

    # Source: stale garbage everywhere, then the prompt written by the kernel.
    garbage = torch.from_numpy(rng.standard_normal(LAYERS * s_nb * s_heads * sbs * 2 * head_size,
                                                   dtype=np.float32)).to(dtype)
    src = new_cache(s_isa, sbs, s_nb, s_heads, head_size, dtype, s_start, total, fill=garbage)
    write(ops, src, kv, src_blocks, 0)
    # Reference destination: the kernel writes the same tokens at block size B.
    want = new_cache(d_isa, dbs, d_nb, d_heads, head_size, dtype, d_start, total)
    write(ops, want, kv, dst_blocks, first)
    # Which destination bytes the kernel wrote (for tokens first..n-1): ones into zeros.
    mask_cache = new_cache(d_isa, dbs, d_nb, d_heads, head_size, dtype, d_start, total)
    ones = torch.zeros_like(kv[0][0])
    ones[:, s_start:s_start + s_heads] = 1  # only the heads this source holds
    write(ops, mask_cache, [(ones, ones)] * LAYERS, dst_blocks, first)
    overlap = min(s_start + s_heads, d_start + d_heads) - max(s_start, d_start)
    mask = as_bytes(mask_cache.flat).reshape(-1, mask_cache.flat.element_size()).any(axis=1)
    mask = np.repeat(mask, mask_cache.flat.element_size())
    assert mask.sum() == LAYERS * 2 * (n - first) * overlap * head_size * mask_cache.flat.element_size()

    dst = new_cache(d_isa, dbs, d_nb, d_heads, head_size, dtype, d_start, total)  # zeroed blocks
    p = plan(src.layout, src_blocks, dst.layout, dst_blocks, n, dst_first_token=first)
    sbuf, dbuf = as_bytes(src.flat), as_bytes(dst.flat)
    for s, d, ln in zip(p.src_off.tolist(), p.dst_off.tolist(), p.length.tolist(), strict=True):
        dbuf[d:d + ln] = sbuf[s:s + ln]

    got, ref = as_bytes(dst.flat), as_bytes(want.flat)
    bad = np.flatnonzero(got[mask] != ref[mask])
    assert bad.size == 0, f"{bad.size} of {mask.sum()} K/V bytes differ from the kernel's"
    if sbs != dbs:
        # Token-granular copy: nothing but the request's K/V positions is written.
        assert not got[~mask].any()
    else:
        # Whole blocks (the last one's tail too): nothing outside the request's blocks.
        per_block = dst.layout.block_stride
        inside = np.zeros(got.shape[0], dtype=bool)
        for off in dst.layout.layer_offsets:
            for b in dst_blocks:
                inside[off + b * per_block: off + (b + 1) * per_block] = True
        assert not got[~inside].any()


def test_kernel_writes_what_the_layout_says(ops) -> None:
    """The decoded formula, element by element: K at c*bs + t, V at t*D + c in each half."""
    for isa, bs in (("vec", 32), ("vec", 128), ("vec16", 16), ("vec16", 48)):
        d, n = 64, 2 * bs
        t = torch.arange(n, dtype=torch.float32).view(n, 1, 1)
        c = torch.arange(d, dtype=torch.float32).view(1, 1, d)
        cache = torch.zeros(2, 1, bs, 2 * d)
        kc, vc = cache.view(2, 1, 2 * bs, d).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(t * 1000 + c, t * 1000 + c + 1e6, kc, vc, torch.arange(n), isa)
        half = cache.view(2, 2, bs * d)
        tt, cc = np.meshgrid(np.arange(bs), np.arange(d), indexing="ij")
        for blk in range(2):
            k = half[blk, 0].numpy()[cc * bs + tt]
            v = half[blk, 1].numpy()[tt * d + cc]
            assert np.array_equal(k, (blk * bs + tt) * 1000 + cc), isa
            assert np.array_equal(v, (blk * bs + tt) * 1000 + cc + 1e6), isa


def test_opaque_blocks_refuse_a_block_size_mismatch() -> None:
    """An unknown kernel's blocks copy whole; a mismatch is refused, not garbled."""
    a = vllm_cpu_layout(num_layers=1, num_blocks=8, block_size=32, num_heads=1, head_size=64,
                        dtype="float32", packing="opaque")
    b = vllm_cpu_layout(num_layers=1, num_blocks=8, block_size=64, num_heads=1, head_size=64,
                        dtype="float32", packing="opaque")
    with pytest.raises(PlanError, match="packing"):
        plan(a, [0, 1], b, [0], 40)
    assert plan(a, [3, 1], a, [0, 5], 40).nbytes == 2 * a.block_stride
    v = vllm_cpu_layout(num_layers=1, num_blocks=8, block_size=32, num_heads=1, head_size=64,
                        dtype="float32", packing="vec")
    with pytest.raises(PlanError, match="packing"):
        plan(a, [0], v, [0], 20)
