"""The WRITE benchmarks' pacings run end to end on loopback (real daemons, real NIXL): the
pipelined one keeps several pushes in flight, each on its own blocks, and every byte lands
where the registration said; the raw baseline posts the same number of WRITEs together.
The figures themselves are the benchmarks' business, not a test's."""

from __future__ import annotations

import numpy as np
import pytest

from kvpush_dev.bench.raw_nixl import _raw
from kvpush_dev.bench.transfer import BLOCK_BYTES, daemon_e2e_gbps, daemon_pair

pytestmark = pytest.mark.integration

MiB = 1 << 20


def test_pipelined_daemon_pushes_land_each_on_its_own_blocks() -> None:
    size, depth = 1 * MiB, 3
    nb = size // BLOCK_BYTES
    with daemon_pair("peer", nb * depth) as (p, d, pe, de):
        out = daemon_e2e_gbps(p, d, pe, de, size, False, 2, seed=1, depth=depth)
        assert out["gbps"] > 0
        # The daemon's own span (its trace: PrefillDone in -> WRITE done) lies inside the
        # engine-to-engine one of the same batch, so its rate is never the lower.
        assert out["write_gbps"] >= out["gbps"]
        # Every slot of the batch carried its own source blocks onto its own destination blocks.
        assert np.array_equal(de.bytes[: size * depth], pe.bytes[: size * depth])
        with pytest.raises(ValueError, match="cannot hold"):
            daemon_e2e_gbps(p, d, pe, de, size, False, 1, seed=2, depth=depth + 1)


def test_raw_baseline_posts_a_batch_of_writes() -> None:
    gbps, ndesc = _raw(1 * MiB, False, 2, {}, target_poll_s=0.0, depth=3)
    assert gbps > 0 and ndesc == 1
