"""A hybrid transfer (several KV cache groups) with one group's blocks missing, short or late,
between real daemons (real processes, NIXL WRITEs, ZeroMQ): the whole transfer fails, soon and
with a cause that names what was wrong, the decode engine is told ReceiveFailed (vLLM then
recomputes), and not one byte of its blocks is written (never some groups written and others
stale). Issue 41 item 8, at the level where the fault can be injected: the engine messages.

The decode engine registers 2 groups (a sliding window kept for its last two blocks, and full
attention) for a 61-token prompt (4 blocks of 16), with a registration deadline of
``TIMEOUT_MS``; "soon" is well inside it: a decode engine must not wait out its deadline for an
outcome its producer already knew.
"""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from kvpush import proto
from kvpush_dev.daemon_harness import amx_layout, engines, tid

pytestmark = pytest.mark.integration

N = 4 * 16 - 3
TIMEOUT_MS = 8_000
SOON_S = TIMEOUT_MS / 1000 / 2
DST = ((0, 0, 20, 21), (22, 23, 24, 25))  # the window group keeps its last two blocks
GROUPS = ("SlidingWindow block_size=16 window=32", "FullAttention block_size=16")


def _layout():
    lay, _ = amx_layout(num_layers=1)
    return replace(lay, kv_groups=GROUPS)


def _packed(lists: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return tuple(b for ids in lists for b in ids), tuple(len(ids) for ids in lists)


# What the prefill engine says it holds, one fault each: (block_ids, kv_groups, what the reason
# names, refused: the prefill daemon refuses the PrefillDone itself, so a registration after it
# meets the refusal's tombstone, "transfer aborted")
FAULTS = {
    # one group's list is missing: a single list for an engine of two groups
    "group_missing": ((3, 4, 5, 6), (), "1 block list(s) for an engine of 2", True),
    # one group's list is shorter than the prompt
    "group_short": (*_packed(((3, 4, 5, 6), (7, 8, 9))), "KV cache group 1 (FullAttention) of 3 blocks", True),
    # a block the decode side needs is gone on the prefill side (null: freed, outside its window)
    "block_gone": (*_packed(((0, 0, 0, 6), (7, 8, 9, 10))), "block 2 of group 0", False),
}


@pytest.mark.parametrize("order", ["register_first", "prefill_first"])
@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_hybrid_transfer_with_one_group_wrong_fails_whole_and_soon(pd, fault: str, order: str) -> None:
    p, d = pd
    src, groups, cause, refused = FAULTS[fault]
    if refused and order == "prefill_first":
        cause = "transfer aborted"
    dst, dst_groups = _packed(DST)
    with engines(p, d, _layout(), seed=9) as (pe, de):
        before = de.bytes.copy()
        t = tid(fault)
        reg = proto.Register(t, 0, dst, N, (p.peer_endpoint,), 1, TIMEOUT_MS, kv_groups=dst_groups)
        done = proto.PrefillDone(t, src, N, 10_000, kv_groups=groups)
        t0 = time.monotonic()
        for msg, eng in ((reg, de), (done, pe)) if order == "register_first" else ((done, pe), (reg, de)):
            eng.send(msg)
            time.sleep(0.3)
        got = de.result(t, timeout=TIMEOUT_MS / 1000 + 10)
        waited = time.monotonic() - t0
        assert isinstance(got, proto.ReceiveFailed), got
        assert waited < SOON_S, f"the decode engine waited {waited:.1f} s (its deadline: {TIMEOUT_MS} ms): {got}"
        assert cause in got.reason, got.reason
        assert isinstance(pe.result(t), proto.SendFailed)
        assert (de.bytes == before).all(), "some of the decode engine's blocks were written"


def test_a_prefill_done_after_the_registrations_deadline_writes_nothing(pd) -> None:
    """Late: the prefill engine's blocks come after the decode engine gave the transfer up (it
    recomputes, and may have given those blocks to another request): nothing is written."""
    p, d = pd
    dst, dst_groups = _packed(DST)
    with engines(p, d, _layout(), seed=10) as (pe, de):
        before = de.bytes.copy()
        t = tid("late")
        de.send(proto.Register(t, 0, dst, N, (p.peer_endpoint,), 1, 1_000, kv_groups=dst_groups))
        assert isinstance(de.result(t, timeout=10), proto.ReceiveFailed)
        ids, groups = _packed(((0, 0, 5, 6), (7, 8, 9, 10)))
        pe.send(proto.PrefillDone(t, ids, N, 2_000, kv_groups=groups))
        got = pe.result(t, timeout=20)
        assert isinstance(got, proto.SendFailed), got
        assert (de.bytes == before).all(), "the late transfer wrote into the decode engine's blocks"
