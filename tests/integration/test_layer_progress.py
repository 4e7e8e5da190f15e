"""Layer-wise progress on real daemons (NIXL, CURVE): the prefill daemon checks every
LayerProgress frame (a bad one is refused whole with an Error) and, with the Register before,
between or after the frames, the transfer still completes byte-exact through the seal."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvpush import proto
from kvpush.testing.daemon_harness import (
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
