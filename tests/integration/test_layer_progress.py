"""Layer-wise progress on real daemons (NIXL, CURVE): the prefill daemon checks every
LayerProgress frame (a bad one is refused whole with an Error) and, with the Register before,
between or after the frames, the transfer still completes byte-exact through the seal."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvpush import proto
from kvpush.daemon.core.planner import plan
from kvpush_dev.daemon_harness import (
    Engine,
    amx_layout,
    check_transfer,
    engines,
    prefill_done,
    register,
    tid,
)

pytestmark = pytest.mark.integration


def frames(t: str, src: list[int], n: int, num_layers: int) -> list[proto.LayerProgress]:
    c = proto.LayerChunk(t, 0, 0, tuple(src), 0, n)
    return [proto.LayerProgress(layer, layer + 1, (c,)) for layer in range(num_layers)]


@pytest.mark.parametrize("register_at", [0, 1, 2])  # before, between, after the frames
def test_progress_then_seal_with_the_register_anywhere(pd, register_at):
    p, d = pd
    lay, meta = amx_layout()
    with engines(p, d, lay, seed=3) as (pe, de):
        before = de.bytes.copy()
        t, n = tid(), 3 * 16 + 5
        src, dst = [7, 3, 11, 12], [40, 2, 9, 10]
        fs = frames(t, src, n, lay.num_layers)
        for i in range(len(fs) + 1):
            if i == register_at:
                register(de, [p], t, dst, n)
                time.sleep(0.2)
            if i < len(fs):
                pe.send(fs[i])
        prefill_done(pe, t, src, n)
        assert isinstance(de.result(t), proto.Received)
        assert isinstance(pe.result(t), proto.Sent)
        check_transfer(pe, meta, src, de, meta, dst, n, before)
        pe.pump()
        assert not [m for m in pe.inbox if isinstance(m, proto.Error)], "a good frame was refused"


def test_a_bad_progress_frame_is_refused_and_writes_nothing(pd):
    p, d = pd
    lay, _ = amx_layout()
    with engines(p, d, lay, seed=4) as (pe, de):
        before = de.bytes.copy()
        t = tid()
        register(de, [p], t, [1, 2], 20)
        pe.send(proto.LayerProgress(0, lay.num_layers + 1, (proto.LayerChunk(t, 0, 0, (1, 2), 0, 20),)))
        err = pe.wait_for(lambda m: isinstance(m, proto.Error) and m.code == "progress", 5)
        assert "layers" in err.message
        pe.send(proto.LayerProgress(0, 1, (proto.LayerChunk(t, 0, 0, (1, 9999), 0, 20),)))
        assert "out of range" in pe.wait_for(
            lambda m: isinstance(m, proto.Error) and m.code == "progress", 5).message
        time.sleep(0.3)
        assert np.array_equal(de.bytes, before)


def _layers_equal(pe: Engine, de: Engine, src: list[int], dst: list[int], n: int, lo: int, hi: int) -> bool:
    """Do the decode engine's bytes of layers [lo, hi) equal the prefill engine's (plan-exact)?"""
    p = plan(pe.layout, src, de.layout, dst, n, layers=(lo, hi))
    return all(np.array_equal(pe.bytes[s:s + ln], de.bytes[d:d + ln])
               for s, d, ln in zip(p.src_off.tolist(), p.dst_off.tolist(), p.length.tolist(), strict=True))


def test_groups_land_before_the_seal_and_the_final_write_sends_the_rest(pd):
    """The stream's point: layers reported while the decode side is registered land before the
    seal (group WRITEs), the rest after it, byte-exact; the final WRITE is smaller than the
    whole request. With group WRITEs off in the daemon this fails at the first check."""
    p, d = pd
    lay, meta = amx_layout(num_layers=4)
    with engines(p, d, lay, seed=5) as (pe, de):
        before = de.bytes.copy()
        t, n = tid(), 3 * 16 + 5
        src, dst = [7, 3, 11, 12], [40, 2, 9, 10]
        register(de, [p], t, dst, n)
        time.sleep(0.3)
        for f in frames(t, src, n, lay.num_layers)[:-1]:  # every layer but the last
            pe.send(f)
        deadline = time.monotonic() + 5
        while not _layers_equal(pe, de, src, dst, n, 0, lay.num_layers - 1) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _layers_equal(pe, de, src, dst, n, 0, lay.num_layers - 1), "reported layers did not land before the seal"
        last = plan(pe.layout, src, de.layout, dst, n, layers=(lay.num_layers - 1, lay.num_layers))
        assert all(not de.bytes[o:o + ln].any() for o, ln in zip(last.dst_off.tolist(), last.length.tolist(), strict=True))
        pe.send(proto.PrefillDone(t, tuple(src), n, 10_000, streamed=True, epoch=0))
        assert isinstance(de.result(t), proto.Received)
        assert isinstance(pe.result(t), proto.Sent)
        check_transfer(pe, meta, src, de, meta, dst, n, before)
        (final,) = [w for w in p.ops("transfers")["recent"] if w.get("transfer_id") == t]
        assert final["mode"] == "layerwise" and final["groups"] == lay.num_layers - 1, final
        assert final["first_group_lag_ms"] is not None and final["tail_ms"] is not None
        whole = plan(pe.layout, src, de.layout, dst, n).nbytes
        assert final["bytes"] < whole, (final["bytes"], whole)
