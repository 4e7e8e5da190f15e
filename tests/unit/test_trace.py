"""The per-request timeline ring: bounded, ordered, and merged by time across sources."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvpush.proto.trace import HOPS, Row, TraceRing, breakdown, merge


def test_stamps_keep_order_and_time() -> None:
    r = TraceRing()
    r.stamp("t1", "d.daemon.register_in", 10)
    r.stamp("t1", "d.daemon.register_forwarded", 25)
    assert r.get("t1") == [("d.daemon.register_in", 10), ("d.daemon.register_forwarded", 25)]
    assert r.get("missing") == []
    assert r.pop("t1") and "t1" not in r


@given(st.lists(st.tuples(st.integers(0, 300), st.sampled_from(HOPS)), max_size=2000),
       st.integers(1, 50), st.integers(1, 10))
def test_ring_is_bounded_and_evicts_oldest(stamps, max_transfers, max_events) -> None:
    r = TraceRing(max_transfers, max_events)
    started: list[str] = []
    for i, (tid, hop) in enumerate(stamps):
        key = f"t{tid}"
        if key not in r:
            started.append(key)
        r.stamp(key, hop, i)
    assert len(r) <= max_transfers
    assert all(len(r.get(f"t{t}")) <= max_events for t, _ in stamps)
    # what remains is a suffix of the start order: only the oldest were evicted
    live = [t for t in started if t in r]
    assert r.recent(len(r)) == list(reversed(live))[: len(r)]


def test_merge_sorts_by_time_with_deltas() -> None:
    rows = [Row(3_000_000, "router", "router.decode_first_byte"),
            Row(1_000_000, "router", "router.request_in"),
            Row(1_500_000, "daemon cpu1", "d.daemon.register_in")]
    out = merge(rows)
    assert [r.hop for r, _, _ in out] == ["router.request_in", "d.daemon.register_in",
                                          "router.decode_first_byte"]
    assert [(t, d) for _, t, d in out] == [(0.0, 0.0), (0.5, 0.5), (2.0, 1.5)]


def test_breakdown_segments_follow_time() -> None:
    ev = {"router.request_in": 0, "p.daemon.write_posted": 4_000_000, "p.daemon.write_done": 5_000_000}
    assert breakdown(ev) == {"router.request_in -> p.daemon.write_posted": 4.0,
                             "p.daemon.write_posted -> p.daemon.write_done": 1.0}


def test_view_is_the_trace_answer_of_every_process() -> None:
    r = TraceRing()
    r.stamp("t1", "router.request_in", 5)
    v = r.view("t1")
    assert v["transfer_id"] == "t1" and v["events"] == [["router.request_in", 5]]
    assert set(v["clock"]) == {"monotonic_ns", "wall_ns"}
    assert r.view("")["recent"] == ["t1"] and "events" not in r.view("")
