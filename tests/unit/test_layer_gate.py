"""The daemon's gate on the engine's GPU events (kvpush.daemon.io.layer_gate), with a fake event port.

The fake is a model of one CUDA stream and its interprocess events: a record gets the next
serial number on the stream, the stream completes its work in order (``run``), and an event
reads done when its *newest* record has completed — what ``query()`` on an event opened from
its IPC handle answers. The real port (CudaEventPort) needs a GPU: scripts/gpu_check.sh's
``events`` step drives it; here only what it does without CUDA is checked.
"""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush.daemon.io.layer_gate import (
    CUDA_IPC_EVENT_HANDLE_BYTES,
    CudaEventPort,
    EventError,
    LayerGate,
)


class FakeStream:
    """One worker stream: records in order, completed in order."""

    def __init__(self, size: int) -> None:
        self.latest = [0] * size  # serial of each event's newest record (0: the creation record)
        self.serial = 0  # records so far
        self.completed = 0  # every record up to this serial has completed

    def record(self, i: int) -> int:
        self.serial += 1
        self.latest[i] = self.serial
        return self.serial

    def run(self, k: int | None = None) -> None:
        self.completed = self.serial if k is None else min(self.serial, self.completed + k)

    def handles(self) -> tuple[bytes, ...]:
        return tuple(b"fake-%d" % i for i in range(len(self.latest)))


class FakePort:
    """EventPort over a FakeStream; ``bad_open`` / ``bad_query``: indices whose open / query fails."""

    def __init__(self, stream: FakeStream, bad_open: frozenset[int] = frozenset(),
                 bad_query: frozenset[int] = frozenset()) -> None:
        self.stream = stream
        self.bad_open, self.bad_query = bad_open, bad_query
        self.open_now: set[int] = set()
        self.queries = 0

    def open(self, handle: bytes, device: int) -> int:
        i = int(handle.removeprefix(b"fake-"))
        if i in self.bad_open:
            raise EventError(f"cannot open fake event {i}")
        assert i not in self.open_now
        self.open_now.add(i)
        return i

    def done(self, ev: int) -> bool:
        assert ev in self.open_now, "queried a closed event"
        self.queries += 1
        if ev in self.bad_query:
            raise RuntimeError("CUDA error: the exporter is gone")
        return self.stream.latest[ev] <= self.stream.completed

    def close(self, ev: int) -> None:
        self.open_now.remove(ev)


def gate(size: int = 4, max_waiting: int = 100, max_wait_s: float = 1.0, **bad: frozenset[int]
         ) -> tuple[LayerGate[str], FakeStream, FakePort]:
    s = FakeStream(size)
    p = FakePort(s, **bad)
    g: LayerGate[str] = LayerGate(max_waiting, max_wait_s, p)
    g.open_pool(s.handles(), 0)
    return g, s, p


def frame(s: FakeStream, i: int) -> int:
    """The plugin: record pool slot ``i``, the frame names event ``i + 1``."""
    s.record(i)
    return i + 1


# ---------------------------------------------------------------------------- examples


def test_event_zero_passes_at_once_without_a_pool():
    g: LayerGate[str] = LayerGate(4, 1.0, FakePort(FakeStream(1)))
    assert g.admit(0, ["a", "b"], 0.0) == ["a", "b"]
    assert g.stats.passed == 2 and g.waiting == 0


def test_held_until_the_event_fires_then_released_once():
    g, s, _ = gate()
    assert g.admit(frame(s, 0), ["a", "b"], 0.0) == []
    assert g.waiting == 2 and g.oldest() == 0.0
    assert g.poll(0.1) == []
    s.run()
    assert g.poll(0.2) == ["a", "b"]
    assert g.poll(0.3) == [] and g.waiting == 0 and g.stats.released == 2 and g.oldest() is None


def test_admit_releases_at_once_when_the_event_already_fired():
    g, s, _ = gate()
    e = frame(s, 1)
    s.run()
    assert g.admit(e, ["a"], 0.0) == ["a"]


def test_a_later_event_firing_releases_the_earlier_groups_first():
    g, s, _ = gate()
    e1 = frame(s, 0)
    assert g.admit(e1, ["g1"], 0.0) == []
    e2 = frame(s, 1)
    s.run()  # the stream passed both records
    assert g.admit(e2, ["g2"], 0.1) == ["g1", "g2"]


def test_poll_is_oldest_first_across_indices():
    g, s, _ = gate()
    for n, i in enumerate((2, 0, 3, 1)):
        g.admit(frame(s, i), [f"x{n}"], 0.0)
    s.run()
    assert g.poll(0.1) == ["x0", "x1", "x2", "x3"]


def test_a_reused_index_waits_for_its_newest_record_and_keeps_fifo():
    """Items under an earlier record of a re-recorded index go only with the newer record (the
    query answers for it), in arrival order: later, never earlier (module doc)."""
    g, s, _ = gate(size=2)
    e = frame(s, 0)
    g.admit(e, ["old"], 0.0)
    s.run()  # the first record completed ...
    frame(s, 1)
    assert frame(s, 0) == e  # ... but the pool came round: slot 0 recorded again
    assert g.admit(e, ["new"], 0.1) == []  # the newest record is pending: both wait
    s.run(1)  # slot 1's record completes, slot 0's newest not yet
    assert g.poll(0.2) == []
    s.run()
    assert g.poll(0.3) == ["old", "new"]


def test_past_max_waiting_the_newest_items_are_dropped_and_counted():
    g, s, _ = gate(max_waiting=3)
    assert g.admit(frame(s, 0), ["a", "b"], 0.0) == []
    assert g.admit(frame(s, 1), ["c", "d", "e"], 0.0) == []
    assert g.waiting == 3 and g.stats.dropped_full == 2
    assert g.admit(frame(s, 2), ["f"], 0.0) == [] and g.stats.dropped_full == 3
    s.run()
    assert g.poll(0.1) == ["a", "b", "c"]


def test_max_waiting_zero_holds_nothing():
    g, s, _ = gate(max_waiting=0)
    assert g.admit(frame(s, 0), ["a"], 0.0) == [] and g.stats.dropped_full == 1
    assert g.admit(0, ["cpu"], 0.0) == ["cpu"]


def test_an_item_waiting_max_wait_s_is_dropped_not_waited_for():
    g, s, _ = gate(max_wait_s=0.5)
    g.admit(frame(s, 0), ["a"], 0.0)
    g.admit(frame(s, 1), ["b"], 0.3)
    assert g.poll(0.49) == [] and g.waiting == 2
    assert g.poll(0.5) == [] and g.waiting == 1 and g.stats.dropped_late == 1
    assert g.oldest() == 0.3
    s.run()
    assert g.poll(0.6) == ["b"]


def test_a_fired_event_is_released_even_when_overdue():
    g, s, _ = gate(max_wait_s=0.5)
    g.admit(frame(s, 0), ["a"], 0.0)
    s.run()
    assert g.poll(10.0) == ["a"] and g.stats.dropped_late == 0


def test_time_going_back_does_not_stretch_the_wait():
    g, s, _ = gate(max_wait_s=0.5)
    g.admit(frame(s, 0), ["a"], 1.0)
    g.admit(frame(s, 0), ["b"], 0.0)  # a stale now: admitted at 1.0 too
    assert g.oldest() == 1.0
    assert g.poll(1.5) == [] and g.waiting == 0 and g.stats.dropped_late == 2


def test_unknown_event_is_dropped_and_counted():
    g, s, _ = gate(size=2)
    assert g.admit(3, ["a"], 0.0) == [] and g.stats.dropped_unknown == 1
    none: LayerGate[str] = LayerGate(4, 1.0, FakePort(FakeStream(1)))
    assert none.admit(1, ["a", "b"], 0.0) == [] and none.stats.dropped_unknown == 2


def test_a_failing_query_drops_that_index_and_says_why(caplog):
    g, s, _ = gate(bad_query=frozenset({1}))
    g.admit(frame(s, 0), ["a"], 0.0)
    with caplog.at_level(logging.WARNING, logger="kvpush.daemon.io.layer_gate"):
        assert g.admit(frame(s, 1), ["b", "c"], 0.0) == []
    assert g.stats.dropped_error == 2 and g.waiting == 1
    assert "event 2" in g.stats.last_error and "exporter is gone" in g.stats.last_error
    assert caplog.text.count("event 2") == 1
    with caplog.at_level(logging.WARNING, logger="kvpush.daemon.io.layer_gate"):
        g.admit(frame(s, 1), ["d"], 0.0)
    assert caplog.text.count("event 2") == 1 and g.stats.dropped_error == 3  # said once per cause
    s.run()
    assert g.poll(0.1) == ["a"]


def test_open_pool_is_all_or_nothing_and_names_the_bad_event():
    s = FakeStream(4)
    p = FakePort(s, bad_open=frozenset({2}))
    g: LayerGate[str] = LayerGate(10, 1.0, p)
    with pytest.raises(EventError, match=r"event 3 of 4: cannot open fake event 2"):
        g.open_pool(s.handles(), 0)
    assert p.open_now == set() and g.pool_size == 0
    assert g.admit(1, ["a"], 0.0) == [] and g.stats.dropped_unknown == 1


def test_reset_and_reopen_close_the_events_and_count_what_waited():
    g, s, p = gate()
    g.admit(frame(s, 0), ["a", "b"], 0.0)
    g.open_pool(s.handles(), 0)  # a new Attach sends the pool again
    assert g.stats.dropped_reset == 2 and g.waiting == 0 and p.open_now == {0, 1, 2, 3}
    g.admit(frame(s, 1), ["c"], 0.0)
    g.reset()
    assert p.open_now == set() and g.stats.dropped_reset == 3 and g.pool_size == 0
    assert g.poll(1.0) == []


def test_bad_arguments():
    g, _, _ = gate()
    with pytest.raises(ValueError, match="never negative"):
        g.admit(-1, ["a"], 0.0)
    for args in ((-1, 1.0), (4, 0.0), (4, float("nan")), (4, float("inf"))):
        with pytest.raises(ValueError):
            LayerGate(*args, FakePort(FakeStream(1)))


def test_poll_queries_only_indices_that_hold_items():
    g, s, p = gate(size=8)
    g.poll(0.0)
    assert p.queries == 0
    g.admit(frame(s, 5), ["a"], 0.0)
    before = p.queries
    g.poll(0.1)
    assert p.queries == before + 1


# ------------------------------------------------------------------- the real port, no GPU


def test_cuda_port_refuses_a_malformed_handle_before_touching_cuda():
    with pytest.raises(EventError, match=f"has {CUDA_IPC_EVENT_HANDLE_BYTES} bytes, got 3"):
        CudaEventPort().open(b"abc", 0)


def test_cuda_port_without_cuda_is_a_clear_error():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: scripts/gpu_check.sh checks the real port")
    g: LayerGate[str] = LayerGate(4, 1.0)  # the default port is CudaEventPort
    with pytest.raises(EventError, match="event 1 of 1: .*this daemon has no CUDA"):
        g.open_pool((bytes(CUDA_IPC_EVENT_HANDLE_BYTES),), 0)


def test_the_gate_imports_without_torch():
    code = "import sys, kvpush.daemon.io.layer_gate; assert 'torch' not in sys.modules, 'torch imported'"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


# ------------------------------------------------------------------------ the property

SIZE = 4
ops = st.lists(st.one_of(
    st.tuples(st.just("frame"), st.integers(0, SIZE - 1), st.integers(0, 4)),  # record, then admit
    st.tuples(st.just("admit_stale"), st.integers(0, SIZE - 1), st.integers(1, 3)),  # no new record
    st.tuples(st.just("cpu"), st.integers(1, 3)),
    st.tuples(st.just("unknown"), st.integers(SIZE + 1, SIZE + 3)),
    st.tuples(st.just("run"), st.integers(0, 5)),
    st.tuples(st.just("poll"), st.floats(0.0, 0.4)),
    st.tuples(st.just("reopen"),),
), max_size=80)


@settings(max_examples=600, deadline=None)
@given(ops=ops, max_waiting=st.integers(0, 12), max_wait_s=st.floats(0.05, 1.0),
       bad=st.frozensets(st.integers(0, SIZE - 1), max_size=1))
def test_every_item_leaves_once_or_is_counted_dropped_never_before_its_event(ops, max_waiting, max_wait_s, bad):
    s = FakeStream(SIZE)
    p = FakePort(s, bad_query=bad)
    g: LayerGate[tuple[int, int, int, int]] = LayerGate(max_waiting, max_wait_s, p)
    g.open_pool(s.handles(), 0)
    now, uid, epoch, admitted = 0.0, 0, 0, 0
    out: list[tuple[int, int, int, int]] = []  # (uid, record serial, index, pool epoch)

    def take(got: list, when: float) -> None:
        for it in got:
            assert it[1] <= s.completed, f"{it} left before its record completed"
        assert [it[0] for it in got] == sorted(it[0] for it in got), "not oldest first"
        out.extend(got)
        old = g.oldest()
        assert old is None or old > when - max_wait_s, "an item waited past max_wait_s"

    for op in ops:
        kind = op[0]
        before_waiting, before_full = g.waiting, g.stats.dropped_full
        if kind in ("frame", "admit_stale"):
            i, n = op[1], op[2]
            serial = s.record(i) if kind == "frame" else s.latest[i]
            items = []
            for _ in range(n):
                uid += 1
                items.append((uid, serial, i, epoch))
            admitted += n
            take(g.admit(i + 1, items, now), now)
            assert g.stats.dropped_full - before_full == max(0, before_waiting + n - max_waiting)
        elif kind == "cpu":
            items = [(uid + k + 1, 0, -1, epoch) for k in range(op[1])]
            uid += op[1]
            admitted += op[1]
            assert g.admit(0, items, now) == items
            out.extend(items)
        elif kind == "unknown":
            uid += 1
            admitted += 1
            assert g.admit(op[1], [(uid, 0, -1, epoch)], now) == []
        elif kind == "run":
            s.run(op[1])
        elif kind == "poll":
            now += op[1]
            take(g.poll(now), now)
            if s.completed == s.serial:  # every event fired: nothing may still wait
                assert g.waiting == 0
        else:
            g.open_pool(s.handles(), 0)
            epoch += 1
            assert p.open_now == set(range(SIZE))
        assert 0 <= g.waiting <= max_waiting
        st_ = g.stats
        assert admitted == st_.passed + st_.released + st_.dropped + g.waiting

    s.run()
    take(g.poll(now), now)
    assert g.waiting == 0
    uids = [it[0] for it in out]
    assert len(uids) == len(set(uids)), "an item left twice"
    assert admitted == g.stats.passed + g.stats.released + g.stats.dropped
    assert len(out) == g.stats.passed + g.stats.released
    assert not any(it[2] in bad for it in out if it[2] >= 0), "an item of a failing event left"
    for i in range(SIZE):  # FIFO per index (and pool)
        for e in range(epoch + 1):
            seq = [it[0] for it in out if it[2] == i and it[3] == e]
            assert seq == sorted(seq)
    g.reset()
    assert p.open_now == set()
