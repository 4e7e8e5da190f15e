"""Reference KV copy used by the planner's and the daemon's tests.

Every element's byte address is computed from the backends' tensor shapes
(written out here, independently of the Packing numbers the planner uses), and
the copy goes token by token, head by head.
"""

from __future__ import annotations

import numpy as np

from kvpush.daemon.core.planner import head_overlap
from kvpush.proto.layout import DTYPE_SIZES, KVLayout, flash_layout, vllm_cpu_layout

# ---- reference element addresses (from the backends' tensor shapes) -------------


def _cpu_addr(p: dict, layer, kv, block, head, t, c):
    """vLLM-cpu: [layers][blocks, heads, 2*bs, D]; kernel-specific order inside each half."""
    bs, d, e, h, nb = p["block_size"], p["head_size"], p["e"], p["num_heads"], p["num_blocks"]
    base = layer * nb * h * 2 * bs * d * e + (block * h + head) * 2 * bs * d * e + kv * bs * d * e
    packing = p["packing"]
    if packing in ("row", "opaque"):
        idx = t * d + c
    elif packing in ("vec", "vec16"):
        # Decoded from cpu_attn_reshape_and_cache's output: K [c][t], V [t][c].
        idx = c * bs + t if kv == 0 else t * d + c
    elif kv == 0:  # AMX K: [t/16][c/2][t%16][c%2]
        idx = ((t // 16) * (d // 2) + c // 2) * 32 + (t % 16) * 2 + c % 2
    else:  # AMX V: [c/16][t/2][c%16][t%2]
        idx = ((c // 16) * (bs // 2) + t // 2) * 32 + (c % 16) * 2 + t % 2
    return base + idx * e


def _flash_addr(p: dict, layer, kv, block, head, t, c):
    """GPU flash layout: [layers][2, blocks, bs, heads, D]."""
    bs, d, e, h, nb = p["block_size"], p["head_size"], p["e"], p["num_heads"], p["num_blocks"]
    return layer * 2 * nb * bs * h * d * e + ((((kv * nb + block) * bs + t) * h + head) * d + c) * e


def make(kind: str, **kw) -> tuple[KVLayout, dict]:
    """kind: "flash" or a vLLM-cpu packing ("amx", "row", "vec", "vec16", "opaque")."""
    p = dict(kw)
    p["e"] = DTYPE_SIZES[kw["dtype"]]
    p["packing"] = kind
    lay = flash_layout(**kw) if kind == "flash" else vllm_cpu_layout(**kw, packing=kind)
    p["kind"] = kind
    return lay, p


def reference_copy(
    src_p, src_lay, src_buf, src_blocks, dst_p, dst_lay, dst_buf, dst_blocks, num_tokens, first
):
    """Token-by-token, head-by-head copy of the overlapping heads; also returns a
    mask of destination bytes whose value does not matter (tail of the last block)."""
    addr_s = _flash_addr if src_p["kind"] == "flash" else _cpu_addr
    addr_d = _flash_addr if dst_p["kind"] == "flash" else _cpu_addr
    e = src_p["e"]
    sbs, dbs = src_lay.block_size, dst_lay.block_size
    head0, nheads = head_overlap(src_lay, dst_lay)
    c = np.arange(src_lay.head_size)
    out = dst_buf.copy()
    dont_care = np.zeros(dst_buf.shape[0], dtype=bool)
    n_dst_blocks = -(-(num_tokens - first) // dbs)
    last_tok = first + n_dst_blocks * dbs
    for layer in range(src_lay.num_layers):
        for kv in (0, 1):
            for g in range(head0, head0 + nheads):
                hs, hd = g - src_lay.head_start, g - dst_lay.head_start
                for t in range(first, last_tok):
                    db = dst_blocks[(t - first) // dbs]
                    da = addr_d(dst_p, layer, kv, db, hd, (t - first) % dbs, c)
                    if t >= num_tokens:
                        for b in range(e):
                            dont_care[da + b] = True
                        continue
                    sa = addr_s(src_p, layer, kv, src_blocks[t // sbs], hs, t % sbs, c)
                    for b in range(e):
                        out[da + b] = src_buf[sa + b]
    return out, dont_care


def apply_plan(p, src_buf, dst_buf):
    out = dst_buf.copy()
    for s, d, n in zip(p.src_off.tolist(), p.dst_off.tolist(), p.length.tolist(), strict=True):
        out[d : d + n] = src_buf[s : s + n]
    return out




def apply_plan_regions(p, src_regions: list[np.ndarray], dst_regions: list[np.ndarray]) -> None:
    """Apply a plan in place between regions (plan addresses: region << REGION_SHIFT | offset)."""
    from kvpush.proto.layout import split_address

    sr, so = split_address(p.src_off)
    dr, do = split_address(p.dst_off)
    for a, b, c, d, n in zip(sr.tolist(), so.tolist(), dr.tolist(), do.tolist(), p.length.tolist(), strict=True):
        dst_regions[c][d:d + n] = src_regions[a][b:b + n]


def small_engine() -> tuple[KVLayout, dict]:
    """The KV every daemon-level test engine attaches (two layers, 32 blocks of 16 tokens, AMX
    packing, bf16) and its reference parameters: one definition for the security tests, the
    fleet fixture and the rotation bench."""
    return make("amx", num_layers=2, num_blocks=32, block_size=16, num_heads=2, head_size=64, dtype="bfloat16")


def small_layout() -> KVLayout:
    return small_engine()[0]
