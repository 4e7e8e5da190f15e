"""Many regions per engine rank, end to end: real daemons, real NIXL WRITEs, real ZeroMQ.

Engine stand-ins hold their KV the way vLLM allocates it on GPU (one allocation per layer, in
the attention backend's shape; or the installed vLLM's one backing allocation), exported as
one shared-memory region per allocation; the layouts come from
:func:`kvpush.engine_plugin.worker.layouts.derive_layout`. After each transfer the decode caches,
read through the backends' own views, equal the reference copy made token by token.
"""

from __future__ import annotations

import itertools
import os

import pytest

from kvpush import proto
from kvpush.engine_plugin.worker.layouts import BACKENDS, derive_layout, shape_for_backend
from kvpush_dev.daemon_harness import Daemon, Engine, device_config
from kvpush_dev.vllm_layouts import (
    caches_equal,
    clone_caches,
    ignore_tail,
    legacy_caches,
    reference_copy,
    v032_caches,
)

pytestmark = [pytest.mark.integration, pytest.mark.multiregion]

_ids = itertools.count()
FA = BACKENDS["FLASH_ATTN@legacy"]
FI_HND = BACKENDS["FLASHINFER@legacy-HND"]
GEOM = dict(num_layers=4, num_blocks=32, head_size=64, dtype="bfloat16")
TOTAL_HEADS = 4


def tid() -> str:
    return f"mr{os.getpid()}-{next(_ids)}"


@pytest.fixture(scope="module")
def daemons(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mr")
    ds = [Daemon(device_config(tmp, i)) for i in range(4)]
    yield ds
    for d in ds:
        d.stop()


class Rank:
    """One engine rank: its per-layer caches, their layout, and the attached stand-in."""

    def __init__(self, daemon: Daemon, shape, role: str, *, rank: int, tp: int, block_size: int,
                 fill: str = "random", seed: int = 0, v032: str = "") -> None:
        heads = 1 if shape.mla else TOTAL_HEADS // tp
        if v032:
            self.caches = v032_caches(v032, block_size=block_size, num_heads=heads, fill=fill, seed=seed, **GEOM)
        else:
            self.caches = legacy_caches(shape, block_size=block_size, num_heads=heads, fill=fill, seed=seed,
                                        **GEOM)
        self.shape = shape
        regions, self.layout = derive_layout(self.caches, shape, head_size=GEOM["head_size"], num_kv_heads=heads,
                                             head_start=rank * heads, total_heads=heads if shape.mla else TOTAL_HEADS,
                                             model="m")
        self.engine = Engine(daemon, self.layout, role, rank=rank, tp=tp, engine_id=role[0].upper(),
                             regions=regions)

    def close(self) -> None:
        self.engine.close()


def run_transfer(producers: list[tuple[Rank, list[int]]], consumers: list[tuple[Rank, list[int]]],
                 p_daemons: list[Daemon], num_tokens: int) -> str:
    t = tid()
    expected = []
    for c, dst in consumers:
        want = clone_caches(c.caches)
        for p, src in producers:
            if p.layout.replicated or max(p.layout.head_start, c.layout.head_start) < min(
                    p.layout.head_start + p.layout.num_heads, c.layout.head_start + c.layout.num_heads):
                reference_copy(p.caches, p.shape, p.layout, src, want, c.shape, c.layout, dst, num_tokens)
        expected.append(want)
    for c, dst in consumers:
        c.engine.send(proto.Register(t, 0, tuple(dst), num_tokens, tuple(d.peer_endpoint for d in p_daemons),
                                     len(p_daemons), 10_000))
    for p, src in producers:
        p.engine.send(proto.PrefillDone(t, tuple(src), num_tokens, 10_000))
    for c, _ in consumers:
        assert isinstance(c.engine.result(t), proto.Received)
    for p, _ in producers:
        assert isinstance(p.engine.result(t), proto.Sent)
    for (c, dst), want in zip(consumers, expected, strict=True):
        ignore_tail(want, c.caches, c.shape, c.layout, dst, num_tokens)
        assert caches_equal(c.caches, c.shape, want, c.shape, GEOM["head_size"]), "decode KV differs from the reference"
    return t


def writes_of(daemon: Daemon, t: str) -> list[dict]:
    return [r for r in daemon.ops("transfers")["recent"] if r["transfer_id"] == t and r["side"] == "prefill"]


def test_equal_layouts_one_region_per_layer(daemons):
    p = Rank(daemons[0], FA, "prefill", rank=0, tp=1, block_size=16, seed=1)
    d = Rank(daemons[1], FA, "decode", rank=0, tp=1, block_size=16, fill="zeros")
    try:
        assert len(p.layout.regions) == len(d.layout.regions) == GEOM["num_layers"]
        run_transfer([(p, [5, 6, 7, 30])], [(d, [0, 9, 10, 11])], [daemons[0]], 3 * 16 + 9)
        run_transfer([(p, [1, 2])], [(d, [20, 21])], [daemons[0]], 32)
        # Equal block sizes: prepared descriptor lists per (regions, peer), posted by index.
        t = run_transfer([(p, [8])], [(d, [8])], [daemons[0]], 16)
        assert [r["prepped"] for r in writes_of(daemons[0], t)] == [True]
    finally:
        p.close()
        d.close()


def test_block_size_mismatch_installed_vllm_to_per_layer(daemons):
    """Installed vLLM's one backing allocation (LBNHC, block 16) into per-layer FlashInfer HND
    caches of block size 8: one region to four, tokens split across blocks."""
    from vllm.v1.kv_cache_interface import KVCacheLayout

    shape = shape_for_backend("FLASH_ATTN", KVCacheLayout.LBNHC.layer_view_order)
    p = Rank(daemons[0], shape, "prefill", rank=0, tp=1, block_size=16, seed=2, v032="LBNHC")
    d = Rank(daemons[1], FI_HND, "decode", rank=0, tp=1, block_size=8, fill="zeros")
    try:
        assert len(p.layout.regions) == 1 and len(d.layout.regions) == 4
        run_transfer([(p, [3, 1, 4])], [(d, [7, 2, 9, 12, 13, 30])], [daemons[0]], 45)
    finally:
        p.close()
        d.close()


def test_tp2_to_tp1_per_layer(daemons):
    ps = [Rank(daemons[i], FA, "prefill", rank=i, tp=2, block_size=16, seed=3 + i) for i in range(2)]
    d = Rank(daemons[2], FI_HND, "decode", rank=0, tp=1, block_size=16, fill="zeros")
    try:
        run_transfer([(ps[0], [1, 2, 3]), (ps[1], [8, 9, 10])], [(d, [4, 6, 8])], daemons[:2], 40)
    finally:
        for r in (*ps, d):
            r.close()


def test_tp1_to_tp2_per_layer(daemons):
    p = Rank(daemons[0], FI_HND, "prefill", rank=0, tp=1, block_size=16, seed=5)
    ds = [Rank(daemons[1 + i], FA, "decode", rank=i, tp=2, block_size=8, fill="zeros") for i in range(2)]
    try:
        run_transfer([(p, [11, 12, 13])], [(ds[0], [1, 2, 3, 4, 5]), (ds[1], [6, 7, 8, 9, 10])], daemons[:1], 37)
    finally:
        for r in (p, *ds):
            r.close()


def test_mla_tp2_to_tp2_one_producer_per_destination(daemons):
    """MLA: every rank holds the same latent, so each decode rank is written by one prefill
    rank (its own index), once; the other prefill rank writes nothing to it."""
    mla = BACKENDS["MLA@legacy"]
    ps = [Rank(daemons[i], mla, "prefill", rank=i, tp=2, block_size=16, seed=7) for i in range(2)]
    ds = [Rank(daemons[2 + i], mla, "decode", rank=i, tp=2, block_size=16, fill="zeros") for i in range(2)]
    try:
        t = run_transfer([(ps[0], [1, 2]), (ps[1], [1, 2])], [(ds[0], [3, 4]), (ds[1], [5, 6])], daemons[:2], 20)
        for i, d in enumerate(daemons[:2]):
            rows = writes_of(d, t)
            assert [r["dest_rank"] for r in rows] == [i], rows  # one WRITE, to its own index
            assert rows[0]["bytes"] == GEOM["num_layers"] * 2 * 16 * GEOM["head_size"] * 2  # the latent once
    finally:
        for r in (*ps, *ds):
            r.close()


def test_gpu_check_daemon_step_passes_on_cpu_regions():
    """scripts/gpu_check.sh's daemon step, run with shm regions: the check itself can pass
    (its reference, comparison and clean-up are right); on a GPU it runs with CUDA IPC."""
    from kvpush_dev.gpu_check import step_daemon

    line = step_daemon("cpu")
    assert line.count("bytes equal") == 2 and "4+4 cpu regions" in line
