"""Each model family's KV as vLLM lays it out on GPU, what kvpush derives from it, and a
request moved between two such engines (tests/unit/test_gpu_hybrid_layouts.py,
tests/compat/test_gpu_families_releases.py for vLLM 0.33 / 0.34, scripts/gpu_check.sh's
``families`` step on CUDA).

An engine's KV is what vLLM's GPU model runner builds: its ``KVCacheConfig`` from vLLM's own
``get_kv_cache_config_from_groups`` (a hybrid's groups overlaid from byte 0 of one allocation),
its per-layer views from vLLM's ``allocate_kv_cache`` (:func:`kvpush_dev.vllm_layouts.v032_hybrid_caches`),
a state layer's conv and SSM views from vLLM's ``MambaBase.bind_kv_cache``. kvpush's side is
the GPU engine's own derivation (``layouts.describe_gpu_kv``). :func:`check` moves a request
through the daemon's pairing and plan (:func:`move`) and compares the whole decode allocation
with a copy written through vLLM's views (:func:`expect`): every byte vLLM reads for the
request is the prefill engine's, and no other byte changed. :func:`daemon_check` makes two
real kvpushd processes do the WRITE instead (CUDA IPC regions on a GPU, shm on CPU).

``python -m kvpush_dev.gpu_families`` runs :func:`check` for every family with the vLLM on the
path and prints one JSON object (family: "ok ..." or the error).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import torch

from kvpush.engine_plugin.worker.layouts import EngineGeometry, describe_gpu_kv
from kvpush.proto.groups import NULL_BLOCK, pack, parse
from kvpush_dev.kvref import apply_plan_regions
from kvpush_dev.vllm_layouts import bind_state, v032_hybrid_caches, views_over

BF16 = torch.bfloat16


def layers(prefix: str, ids: range) -> list[str]:
    return [f"model.layers.{i}.{prefix}" for i in ids]


def specs() -> dict[str, Any]:
    """vLLM's specs of each family (imported from the vLLM on the path)."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    s = {
        # gpt-oss / Gemma 3: full attention and sliding-window layers of the same heads.
        "FULL": FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=BF16),
        "SWA": SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=BF16, sliding_window=32),
        # the mamba preset's groups: Mamba2 conv + SSM padded to the attention page of 32768 bytes
        "MAMBA": MambaSpec(block_size=2048, shapes=((3, 160), (4, 32, 16)), dtypes=(BF16, torch.float32),
                           page_size_padded=32768),
        "ATTN": FullAttentionSpec(block_size=128, num_kv_heads=1, head_size=64, dtype=BF16),
        # the linear preset's: gated delta net in mode 'align', every group's block 1152 tokens
        "GDN": MambaSpec(block_size=1152, shapes=((3, 1024), (4, 128, 128)), dtypes=(BF16, torch.float32),
                         page_size_padded=294912, mamba_cache_mode="align"),
        "ATTN_1152": FullAttentionSpec(block_size=1152, num_kv_heads=1, head_size=64, dtype=BF16),
        # FlashMLA: one 576-wide latent a token, bf16, kernel blocks of 64
        "MLA": MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576, dtype=BF16),
    }
    if "state_alignment" in {f.name for f in fields(MambaSpec)}:  # vLLM 0.34: FlashInfer's ReplaySSM aligns
        s["MAMBA_ALIGNED"] = replace(s["MAMBA"], shapes=((3, 161), (4, 32, 16)), state_alignment=16)
    return s


def family_groups(family: str) -> list[tuple[list[str], Any]]:
    s = specs()
    return {
        "swa": [(layers("attn", range(0, 6, 2)), s["FULL"]), (layers("attn", range(1, 6, 2)), s["SWA"])],
        "mamba": [(layers("mixer", range(0, 4, 2)), s["MAMBA"]), (layers("attn", range(1, 4, 2)), s["ATTN"])],
        "mamba-aligned": [(layers("mixer", range(0, 4, 2)), s.get("MAMBA_ALIGNED")),
                          (layers("attn", range(1, 4, 2)), s["ATTN"])],
        "gdn": [(layers("linear_attn", range(0, 6, 2)), s["GDN"]), (layers("attn", range(1, 6, 2)), s["ATTN_1152"])],
        "mla": [(layers("attn", range(3)), s["MLA"])],
    }[family]


class Engine:
    """One engine rank's KV as vLLM allocates it, and what kvpush derives from it."""

    def __init__(self, groups: list[tuple[list[str], Any]], layout: str, *, backend: str = "FLASH_ATTN",
                 num_blocks: int = 12, kernel: list[int] | None = None, seed: int = 0, fill: str = "random",
                 rank: int = 0, heads: int | None = None, device: str = "cpu") -> None:
        from vllm.v1.kv_cache_interface import KVCacheLayout, MLAAttentionSpec

        if heads is not None:  # this rank's share of the attention heads (TP 2)
            groups = [(n, replace(s, num_kv_heads=heads) if hasattr(s, "num_kv_heads") else s) for n, s in groups]
        self.groups = groups
        self.kv, self.cfg = v032_hybrid_caches(groups, layout, num_blocks=num_blocks, kernel_block_sizes=kernel,
                                               seed=seed, fill=fill, device=device)
        attn = next(s for _, s in groups if hasattr(s, "num_kv_heads"))
        self.geo = EngineGeometry(backend, KVCacheLayout[layout].layer_view_order, attn.head_size,
                                  attn.num_kv_heads, self.cfg.num_blocks, isinstance(attn, MLAAttentionSpec))
        total = attn.num_kv_heads * (2 if heads is not None else 1)
        self.regions, self.layout, self.names = describe_gpu_kv(
            self.kv, self.geo, self.cfg, rank=rank, total_heads=total, model="m")
        self.raw = self.regions[0]  # the one allocation every layer views

    def pages(self, group: int, block: int, raw: torch.Tensor | None = None) -> list[torch.Tensor]:
        """What vLLM reads of block ``block`` in every layer of group ``group``: an attention
        layer's ``[H, N, C]`` block (kernel blocks grouped), a state layer's sub-tensors
        (``raw``: the same views over another allocation of this size)."""
        names, spec = self.groups[group]
        kv = self.kv if raw is None else views_over(self.kv, raw)
        out: list[torch.Tensor] = []
        for n in names:
            t = kv[n]
            if hasattr(spec, "shapes"):  # a state layer (MambaSpec)
                out += [s[block] for s in bind_state(t, spec.shapes, spec.dtypes,
                                                     getattr(spec, "state_alignment", 1))]
            else:
                k = t.shape[0] // self.cfg.num_blocks
                out.append(t[block * k:(block + 1) * k])
        return out


    def gaps(self, group: int, block: int, raw: torch.Tensor | None = None) -> list[torch.Tensor]:
        """A state layer's alignment gaps between its sub-tensors in block ``block`` (vLLM 0.34's
        ``state_alignment``): inside vLLM's ``state_content_size_bytes``, never read by it."""
        names, spec = self.groups[group]
        align = int(getattr(spec, "state_alignment", 1) or 1)
        if not hasattr(spec, "shapes") or align == 1:
            return []
        kv = self.kv if raw is None else views_over(self.kv, raw)
        out, at = [], 0
        for shape, dtype in zip(spec.shapes, spec.dtypes, strict=True):
            end = at + int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
            at = -(-end // align) * align
            out += [kv[n].squeeze(1).squeeze(1)[block, end:at] for n in names if at > end]
        return out


def pairs_of(src: Engine, dst: Engine, src_lists: list[list[int]], dst_lists: list[list[int]],
             num_tokens: int) -> Any:
    """The daemon's pairing of one request (``group_pairs.pair_groups``)."""
    from kvpush.daemon.core.group_pairs import pair_groups

    s_ids, s_groups = pack(src_lists)
    d_ids, d_groups = pack(dst_lists)
    kinds = tuple(parse(g) for g in dst.layout.kv_groups)
    return pair_groups(s_ids, s_groups, d_ids, d_groups, num_tokens=num_tokens, dst_first_token=0,
                       block_size=dst.layout.block_size, kinds=kinds)


def by_group(pairs: Any) -> list[tuple[int, int, int]]:
    """(group, source block, destination block) of every pair."""
    out, at = [], 0
    for g, n in enumerate(pairs.per_group):
        out += [(g, pairs.src[i], pairs.dst[i]) for i in range(at, at + n)]
        at += n
    return out


def move(src: Engine, dst: Engine, src_lists: list[list[int]], dst_lists: list[list[int]],
         num_tokens: int) -> list[tuple[int, int, int]]:
    """Pair and plan one request as the daemon does and apply the plan to the raw bytes."""
    from kvpush.daemon.core.group_pairs import plan_pairs

    pairs = pairs_of(src, dst, src_lists, dst_lists, num_tokens)
    p = plan_pairs(src.layout, dst.layout, pairs)
    apply_plan_regions(p, [r.numpy() for r in src.regions], [r.numpy() for r in dst.regions])
    return by_group(pairs)


def expect(src: Engine, dst: Engine, pairs: list[tuple[int, int, int]], before: torch.Tensor) -> torch.Tensor:
    """The decode allocation after the request, written through vLLM's own views on a copy of
    ``before`` (CPU)."""
    want = before.clone()
    src_cpu = src.raw.cpu()
    for g, sb, db in pairs:
        for s, d in zip(src.pages(g, sb, src_cpu), dst.pages(g, db, want), strict=True):
            d.copy_(s)
        for s, d in zip(src.gaps(g, sb, src_cpu), dst.gaps(g, db, want), strict=True):
            d.copy_(s)  # moved with the state as vLLM counts it (its NixlConnector too); never read
    return want


def compare(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    diff = (got != want).nonzero()
    if diff.numel():
        raise AssertionError(f"{what}: {diff.numel()} bytes differ from vLLM's views, first at byte {int(diff[0])}")


def check(src: Engine, dst: Engine, src_lists: list[list[int]], dst_lists: list[list[int]],
          num_tokens: int) -> list[tuple[int, int, int]]:
    """Move one request through the plan; the decode allocation must be :func:`expect`'s."""
    before = dst.raw.clone()
    pairs = move(src, dst, src_lists, dst_lists, num_tokens)
    compare(dst.raw, expect(src, dst, pairs, before), "plan")
    return pairs


#: Each family's canonical case: engines (prefill, decode) and one request's block lists.
def cases() -> dict[str, tuple[dict[str, Any], dict[str, Any], list[list[int]], list[list[int]], int]]:
    gdn = dict(backend="FLASHINFER", num_blocks=5, kernel=[1152, 64])
    out = {
        "swa": (dict(layout="LBNHC"), dict(layout="BLHNC"),
                [[3, 7, 9, 11, 5], [NULL_BLOCK, NULL_BLOCK, 2, 4, 6]],
                [[1, 2, 3, 4, 5], [NULL_BLOCK, NULL_BLOCK, 8, 9, 10]], 70),
        "mamba": (dict(layout="LBHNC"), dict(layout="BLHNC"), [[4], [1, 2, 3]], [[7], [5, 6, 9]], 300),
        "gdn": ({"layout": "LBNHC", **gdn}, {"layout": "LBNHC", **gdn}, [[NULL_BLOCK, 2, 3], [1, 4]],
                [[1], [2, 3]], 2000),
        "mla": (dict(layout="LBHNC", backend="FLASHMLA", num_blocks=6), dict(layout="LBHNC", backend="FLASHMLA",
                num_blocks=6), [[4, 1]], [[2, 5]], 128),
    }
    if "MAMBA_ALIGNED" in specs():
        out["mamba-aligned"] = (dict(layout="LBHNC"), dict(layout="LBHNC"), [[4], [1, 2, 3]], [[7], [5, 6, 9]], 300)
    return out


def engines(family: str, device: str = "cpu") -> tuple[Engine, Engine, list[list[int]], list[list[int]], int]:
    p_kw, d_kw, sl, dl, n = cases()[family]
    groups = family_groups(family)
    return (Engine(groups, seed=1, device=device, **p_kw), Engine(groups, fill="zeros", device=device, **d_kw),
            sl, dl, n)


def check_family(family: str) -> str:
    p, d, sl, dl, n = engines(family)
    pairs = check(p, d, sl, dl, n)
    return (f"ok: {len(p.layout.kv_groups) or 1} group(s), {len(pairs)} pairs, {p.layout.num_layers} layers "
            f"of {p.layout.block_bytes // p.layout.num_layers} bytes a block")


def daemon_check(family: str, device: str = "cuda") -> str:
    """Two real kvpushd processes: the prefill daemon WRITEs one request of ``family`` between
    two engines' allocations on ``device`` (CUDA IPC regions on a GPU, shm files on CPU); the
    decode allocation, read back, must be :func:`expect`'s byte for byte."""
    from kvpush import proto
    from kvpush_dev.daemon_harness import Daemon, device_config, push
    from kvpush_dev.daemon_harness import Engine as Attached

    p, d, sl, dl, n = engines(family, device)
    s_ids, s_groups = pack(sl)
    d_ids, d_groups = pack(dl)
    before = d.raw.cpu()
    want = expect(p, d, by_group(pairs_of(p, d, sl, dl, n)), before)
    with tempfile.TemporaryDirectory(prefix="kvpush-gpu-families-") as tmp:
        p_d, d_d = Daemon(device_config(Path(tmp), 0)), Daemon(device_config(Path(tmp), 1))
        pe = de = None
        try:
            pe = Attached(p_d, p.layout, "prefill", regions=p.regions, engine_id="P")
            de = Attached(d_d, d.layout, "decode", regions=d.regions, engine_id="D")
            t = f"families-{family}-{time.monotonic_ns()}"
            push(pe, de, proto.Register(t, 0, d_ids, n, (p_d.peer_endpoint,), 1, 10_000, kv_groups=d_groups),
                 proto.PrefillDone(t, s_ids, n, 10_000, kv_groups=s_groups), family)
            if device == "cuda":
                torch.cuda.synchronize()
            compare(d.raw.cpu(), want, f"{family} daemon WRITE")
            return f"{family}: {len(d.layout.kv_groups) or 1} group(s), {device} regions, bytes equal"
        finally:
            for e in (pe, de):
                if e is not None:
                    e.close()
            p_d.stop()
            d_d.stop()


def main() -> int:
    out: dict[str, str] = {}
    for family in cases():
        try:
            out[family] = check_family(family)
        except Exception as exc:
            out[family] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(out))
    return 0 if all(v.startswith("ok") for v in out.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
