"""A small soak of both plugin halves (dev/kvpush_dev/bench/soak.py): after 5,000 transfers of every
kind (success, abort while loading, preemption, failure) every collection the halves keep is
back at its baseline, once the scheduler's tombstones have had their time; caches with a cap
of their own are at most at it. (The halves' attribute walk finds any collection, declared or
not: the old scheduler's ``_attempts`` ended this at 5,000.)"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from kvpush_dev.bench.soak import grown, run_plugin  # noqa: E402


def test_plugin_halves_end_a_5k_soak_at_their_baseline() -> None:
    res = run_plugin(5000, report=False)
    assert res["transfers"] == 5000
    snaps = res["snaps"]
    assert grown(snaps) == {}
    # The walk saw the halves' own state, and the tombstones were there before their time ran out.
    before = snaps["end_before_purge"][0]
    assert before["decode.scheduler.lifecycle.records"] > 0
    assert "prefill.worker.trace._t" in before and "decode.worker.lifecycle.records" in before
