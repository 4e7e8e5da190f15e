"""HookProfiler: step accounting, the idle-wait split, and the JSON flush (no vLLM)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush.engine_plugin.profiling import (
    HookProfiler,
    install,
    output_path,
    percentile,
    summarize_us,
)


class FakeClock:
    """perf_counter_ns stand-in: time moves only when a fake hook says so."""

    def __init__(self) -> None:
        self.now = 1_000_000

    def __call__(self) -> int:
        return self.now

    def advance(self, ns: int) -> None:
        self.now += ns


class FakeClient:
    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock

    def wait(self, timeout_s: float) -> bool:
        self.clock.advance(int(timeout_s * 1e9))
        return False


class FakeWorker:
    def __init__(self, clock: FakeClock) -> None:
        self.client = FakeClient(clock)


class FakeConnector:
    """Connector-shaped: each hook costs a fixed, known number of fake nanoseconds."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.worker = FakeWorker(clock)
        self.shut = False

    # scheduler side
    def get_num_new_matched_tokens(self, n: int) -> tuple[int, bool]:
        self.clock.advance(1_000)
        return n, True

    def build_connector_meta(self, out: Any) -> str:
        self.clock.advance(10_000)
        return "meta"

    def update_connector_output(self, out: Any) -> None:
        self.clock.advance(100)

    def request_finished(self) -> tuple[bool, None]:
        # Calls another (wrapped) hook: counted once in the step total.
        self.update_connector_output(None)
        self.clock.advance(5)
        return False, None

    def boom(self) -> None:
        self.clock.advance(7)
        raise RuntimeError("hook failed")

    # worker side
    def bind_connector_metadata(self, meta: Any) -> None:
        self.clock.advance(200)

    def start_load_kv(self, ctx: Any) -> None:
        self.clock.advance(3_000)

    def get_finished(self, ids: set[str], idle: bool = False) -> tuple[None, None]:
        self.clock.advance(400)
        if idle:
            self.worker.client.wait(0.002)
        return None, None

    def shutdown(self) -> None:
        self.shut = True


SCHED = ("get_num_new_matched_tokens", "build_connector_meta", "update_connector_output",
         "request_finished", "boom")
WORK = ("bind_connector_metadata", "start_load_kv", "get_finished")


def wrap_all(prof: HookProfiler, conn: FakeConnector, names: tuple[str, ...]) -> None:
    for n in names:
        setattr(conn, n, prof.wrap(n, getattr(conn, n)))


def test_scheduler_step_spans_build_to_next_build(tmp_path: Path) -> None:
    clock = FakeClock()
    conn = FakeConnector(clock)
    prof = HookProfiler("scheduler", tmp_path / "s.json", clock=clock, flush_every_s=0)
    wrap_all(prof, conn, SCHED)
    conn.get_num_new_matched_tokens(3)  # before the first boundary: in per-hook stats only
    conn.build_connector_meta(None)  # step 1 opens
    conn.update_connector_output(None)
    conn.get_num_new_matched_tokens(3)
    conn.build_connector_meta(None)  # step 1 closes: 10000 + 100 + 1000
    conn.request_finished()  # nested update_connector_output: 105 once, not 205
    conn.build_connector_meta(None)  # step 2 closes: 10000 + 105
    clock.advance(999_999)  # time outside hooks is not hook time
    conn.build_connector_meta(None)  # step 3 closes: 10000; step 4 stays open
    assert prof.steps == 3
    assert list(prof.step_ns) == [11_100, 10_105, 10_000]
    assert list(prof.step_wait_ns) == [0, 0, 0]
    t = list(prof.step_start_ns)  # each step starts at its boundary's clock
    assert t[1] - t[0] == 11_100 and t[2] - t[1] == 10_105
    h = prof.hooks
    assert h["get_num_new_matched_tokens"].calls == 2
    assert h["build_connector_meta"].calls == 4
    assert h["update_connector_output"].calls == 2
    assert h["request_finished"].total_ns == 105
    assert h["update_connector_output"].max_ns == 100


def test_hook_exception_propagates_and_is_timed(tmp_path: Path) -> None:
    clock = FakeClock()
    conn = FakeConnector(clock)
    prof = HookProfiler("scheduler", tmp_path / "s.json", clock=clock, flush_every_s=0)
    wrap_all(prof, conn, SCHED)
    conn.build_connector_meta(None)
    with pytest.raises(RuntimeError, match="hook failed"):
        conn.boom()
    conn.build_connector_meta(None)
    assert list(prof.step_ns) == [10_007]
    assert prof.hooks["boom"].calls == 1
    # Depth is balanced again: a later nested call still counts once.
    conn.request_finished()
    conn.build_connector_meta(None)
    assert list(prof.step_ns) == [10_007, 10_105]


def test_worker_idle_wait_is_recorded_apart(tmp_path: Path) -> None:
    clock = FakeClock()
    conn = FakeConnector(clock)
    prof = HookProfiler("worker", tmp_path / "w.json", clock=clock, flush_every_s=0)
    wrap_all(prof, conn, WORK)
    conn.worker.client.wait = prof.wrap_wait(conn.worker.client.wait)  # type: ignore[method-assign]
    for idle in (False, True, False):
        conn.bind_connector_metadata(None)
        conn.start_load_kv(None)
        conn.get_finished(set(), idle=idle)
    conn.bind_connector_metadata(None)
    assert list(prof.step_ns) == [3_600, 2_003_600, 3_600]
    assert list(prof.step_wait_ns) == [0, 2_000_000, 0]
    snap = prof.snapshot()
    assert snap["wait"] == {"calls": 1, "total_us": 2000.0, "steps_with_wait": 1}
    assert snap["summary"]["per_step_excl_wait"]["max_us"] == 3.6
    assert snap["summary"]["per_step"]["max_us"] == 2003.6
    assert snap["per_step_us"] == [3.6, 2003.6, 3.6]
    assert snap["per_step_wait_us"] == [0.0, 2000.0, 0.0]


def test_step_list_is_bounded(tmp_path: Path) -> None:
    clock = FakeClock()
    conn = FakeConnector(clock)
    prof = HookProfiler("worker", tmp_path / "w.json", clock=clock, flush_every_s=0, max_steps=5)
    wrap_all(prof, conn, WORK)
    for _ in range(12):
        conn.bind_connector_metadata(None)
    snap = prof.snapshot()
    assert snap["steps"] == 11 and snap["steps_kept"] == 5
    assert len(snap["per_step_us"]) == 5 and len(snap["per_step_wait_us"]) == 5


def test_periodic_flush_from_the_boundary_hook(tmp_path: Path) -> None:
    clock = FakeClock()
    conn = FakeConnector(clock)
    path = tmp_path / "p-scheduler-1.json"
    prof = HookProfiler("scheduler", path, clock=clock, flush_every_s=2.0, meta={"engine_id": "e"})
    wrap_all(prof, conn, SCHED)
    conn.build_connector_meta(None)
    conn.build_connector_meta(None)
    assert not path.exists()  # 20 us of fake time: too early
    clock.advance(2_000_000_000)
    conn.update_connector_output(None)  # not a boundary: never flushes
    assert not path.exists()
    conn.build_connector_meta(None)
    data = json.loads(path.read_text())
    assert data["role"] == "scheduler" and data["engine_id"] == "e" and data["pid"] == os.getpid()
    assert data["steps"] == 2 and data["per_step_us"] == [10.0, 10.1]
    # The flush runs before the third call is timed: it is not in the file yet.
    assert data["per_hook"]["build_connector_meta"]["calls"] == 2
    assert not list(tmp_path.glob("*.tmp"))
    conn.build_connector_meta(None)  # 10 us later: no rewrite yet
    assert json.loads(path.read_text())["steps"] == 2
    prof.close()
    assert json.loads(path.read_text())["steps"] == 3


def test_install_wraps_the_instance_and_flushes_on_shutdown(tmp_path: Path) -> None:
    clock = FakeClock()
    conn = FakeConnector(clock)
    other = FakeConnector(clock)
    prefix = str(tmp_path / "prof")
    prof = install(conn, "worker", prefix, meta={"engine_id": "decode"}, flush_every_s=3600)
    assert "start_load_kv" in vars(conn) and "start_load_kv" not in vars(other)
    assert "wait" in vars(conn.worker.client)
    for _ in range(3):
        conn.bind_connector_metadata(None)
        conn.start_load_kv(None)
        conn.get_finished(set(), idle=True)
    conn.bind_connector_metadata(None)
    path = output_path(prefix, "worker")
    assert path == tmp_path / f"prof-worker-{os.getpid()}.json"
    assert not path.exists()
    conn.shutdown()
    assert conn.shut
    data = json.loads(path.read_text())
    assert data["steps"] == 3 and data["boundary"] == "bind_connector_metadata"
    assert data["wait"]["calls"] == 3 and data["wait"]["steps_with_wait"] == 3
    assert set(data["per_hook"]) >= {"bind_connector_metadata", "start_load_kv", "get_finished"}
    assert all(w > 0 for w in data["per_step_wait_us"])
    assert all(t >= w for t, w in zip(data["per_step_us"], data["per_step_wait_us"], strict=True))
    prof.close()


def test_flush_failure_never_raises(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    prof = HookProfiler("worker", blocker / "sub" / "w.json", flush_every_s=0)
    assert prof.flush() is None


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=10**9), min_size=1, max_size=300),
       st.floats(min_value=0, max_value=100))
def test_percentile_is_nearest_rank(vals: list[int], q: float) -> None:
    s = sorted(vals)
    p = percentile(s, q)
    assert p in s
    rank = q / 100 * len(s)
    assert sum(1 for v in s if v <= p) >= rank - 1e-9  # at least q% are <= p
    assert sum(1 for v in s if v < p) < max(rank, 1) + 1e-9  # fewer than q% are < p


def test_summary_units() -> None:
    s = summarize_us([1_000, 2_000, 3_000, 100_000])
    assert s == {"n": 4, "median_us": 2.0, "p99_us": 100.0, "max_us": 100.0, "mean_us": 26.5}
    assert summarize_us([])["n"] == 0
