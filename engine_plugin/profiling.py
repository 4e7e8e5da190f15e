"""Opt-in timing of the connector's hooks, per engine step.

Why: the plugin runs on vLLM's engine loop, so every microsecond it spends in a
hook is a microsecond of step latency. Setting ``KVPUSH_PROFILE_HOOKS=/path/prefix``
makes the connector wrap its hooks (instance attributes over the bound methods);
unset, nothing is wrapped and nothing costs anything.

A *step* starts at a boundary hook (scheduler: ``build_connector_meta``; worker:
``bind_connector_metadata``) and collects every hook's time until the next
boundary. The worker's idle-step wait (``client.wait``, a deliberate bounded
sleep) is also recorded separately so it can be subtracted.

Results go to ``<prefix>-<role>-<pid>.json``: at exit, at connector shutdown and,
because engines are often SIGKILLed, from the hook itself every ``flush_every_s``
(no thread). The file write is never inside a timed region.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

ENV = "KVPUSH_PROFILE_HOOKS"
ENV_FLUSH = "KVPUSH_PROFILE_FLUSH_S"
MAX_SAMPLES = 100_000

SCHEDULER_HOOKS = (
    "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
    "request_finished", "update_connector_output", "has_pending_push_work",
    "get_kv_connector_stats", "take_events", "on_new_request",
)
WORKER_HOOKS = (
    "bind_connector_metadata", "handle_preemptions", "start_load_kv", "wait_for_layer_load",
    "save_kv_layer", "wait_for_save", "get_finished", "get_block_ids_with_load_errors",
    "get_kv_connector_stats", "get_kv_connector_kv_cache_events", "build_connector_worker_meta",
    "clear_connector_metadata",
)
BOUNDARY = {"scheduler": "build_connector_meta", "worker": "bind_connector_metadata"}

F = TypeVar("F", bound=Callable[..., Any])


def percentile(sorted_vals: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of an ascending list; 0.0 when empty."""
    if not sorted_vals:
        return 0.0
    k = max(0, min(len(sorted_vals) - 1, math.ceil(q / 100.0 * len(sorted_vals)) - 1))
    return sorted_vals[k]


def summarize_us(ns: list[int] | deque[int]) -> dict[str, float]:
    """median / p99 / max / mean in microseconds of a list of nanosecond samples."""
    vals = sorted(ns)
    if not vals:
        return {"n": 0, "median_us": 0.0, "p99_us": 0.0, "max_us": 0.0, "mean_us": 0.0}
    return {
        "n": len(vals),
        "median_us": percentile(vals, 50) / 1e3,
        "p99_us": percentile(vals, 99) / 1e3,
        "max_us": vals[-1] / 1e3,
        "mean_us": sum(vals) / len(vals) / 1e3,
    }


@dataclass
class HookStats:
    calls: int = 0
    total_ns: int = 0
    cpu_ns: int = 0  # this thread's CPU time inside the hook (no preemption, no waits)
    max_ns: int = 0
    samples: deque[int] = field(default_factory=lambda: deque(maxlen=MAX_SAMPLES))

    def to_json(self) -> dict[str, float]:
        s = summarize_us(self.samples)
        return {"calls": self.calls, "total_us": self.total_ns / 1e3, "cpu_total_us": self.cpu_ns / 1e3,
                "median_us": s["median_us"],
                "p99_us": s["p99_us"], "max_us": self.max_ns / 1e3,
                "mean_us": self.total_ns / self.calls / 1e3 if self.calls else 0.0}


class HookProfiler:
    """Per-hook and per-step time accounting for one connector role in one process."""

    def __init__(self, role: str, path: Path | str, *, boundary: str | None = None,
                 max_steps: int = MAX_SAMPLES, flush_every_s: float = 2.0,
                 meta: dict[str, Any] | None = None,
                 clock: Callable[[], int] = time.perf_counter_ns) -> None:
        self.role = role
        self.path = Path(path)
        self.boundary = boundary if boundary is not None else BOUNDARY.get(role, "")
        self.meta = dict(meta or {})
        self.clock = clock
        self.flush_every_ns = int(flush_every_s * 1e9)
        self.hooks: dict[str, HookStats] = {}
        self.step_ns: deque[int] = deque(maxlen=max_steps)
        self.step_wait_ns: deque[int] = deque(maxlen=max_steps)
        # The same steps in this thread's CPU time: what the hooks cost, without the time
        # the thread spent preempted (on a shared core, e.g. by the daemon a send wakes, or
        # by other processes) or blocked in the idle-step wait.
        self.step_cpu_ns: deque[int] = deque(maxlen=max_steps)
        self._cur_cpu_ns = 0
        self.step_start_ns: deque[int] = deque(maxlen=max_steps)  # clock at each step's boundary
        self.steps = 0
        self.wait_calls = 0
        self.wait_total_ns = 0
        self._cur_ns = 0
        self._cur_wait_ns = 0
        self._cur_start = 0
        self._in_step = False
        self._depth = 0
        self._pid = os.getpid()
        self._t_start = clock()
        self._last_flush = self._t_start
        self._closed = False

    # ------------------------------------------------------------------ wrapping

    def wrap(self, name: str, fn: F) -> F:
        """``fn`` timed as hook ``name``; nested wrapped calls count once per step."""
        stats = self.hooks.setdefault(name, HookStats())
        is_boundary = name == self.boundary
        clock = self.clock

        def hook(*args: Any, **kwargs: Any) -> Any:
            if is_boundary and self._depth == 0:
                self._next_step()
            self._depth += 1
            t0 = clock()
            c0 = time.thread_time_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = clock() - t0
                dc = time.thread_time_ns() - c0
                stats.cpu_ns += dc
                if self._depth == 1:
                    self._cur_cpu_ns += dc
                self._depth -= 1
                stats.calls += 1
                stats.total_ns += dt
                stats.samples.append(dt)
                if dt > stats.max_ns:
                    stats.max_ns = dt
                if self._depth == 0:
                    self._cur_ns += dt

        hook.__wrapped__ = fn  # type: ignore[attr-defined]
        hook.__name__ = getattr(fn, "__name__", name)
        return hook  # type: ignore[return-value]

    def wrap_wait(self, fn: F) -> F:
        """``fn`` (the worker's idle-step wait) timed apart: it runs inside a hook, so
        its time is already in the step total; recording it lets readers subtract it."""
        clock = self.clock

        def wait(*args: Any, **kwargs: Any) -> Any:
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = clock() - t0
                self.wait_calls += 1
                self.wait_total_ns += dt
                self._cur_wait_ns += dt

        wait.__wrapped__ = fn  # type: ignore[attr-defined]
        return wait  # type: ignore[return-value]

    # ------------------------------------------------------------------ steps

    def _next_step(self) -> None:
        """Close the running step (if any), maybe flush, open a new one."""
        now = self.clock()
        if self._in_step:
            self.step_ns.append(self._cur_ns)
            self.step_wait_ns.append(self._cur_wait_ns)
            self.step_cpu_ns.append(self._cur_cpu_ns)
            self.step_start_ns.append(self._cur_start)
            self.steps += 1
        self._in_step = True
        self._cur_ns = 0
        self._cur_wait_ns = 0
        self._cur_cpu_ns = 0
        self._cur_start = now
        if self.flush_every_ns and now - self._last_flush >= self.flush_every_ns:
            self.flush()

    # ------------------------------------------------------------------ output

    def snapshot(self) -> dict[str, Any]:
        """Everything measured so far (closed steps only), JSON-ready."""
        per_step = list(self.step_ns)
        waits = list(self.step_wait_ns)
        excl = [t - w for t, w in zip(per_step, waits, strict=True)]
        return {
            "role": self.role,
            "pid": self._pid,
            **self.meta,
            "boundary": self.boundary,
            "steps": self.steps,
            "steps_kept": len(per_step),
            "wall_s": (self.clock() - self._t_start) / 1e9,
            "wait": {"calls": self.wait_calls, "total_us": self.wait_total_ns / 1e3,
                     "steps_with_wait": sum(1 for w in waits if w)},
            "summary": {"per_step": summarize_us(per_step), "per_step_excl_wait": summarize_us(excl)},
            "per_hook": {k: v.to_json() for k, v in self.hooks.items()},
            "per_step_us": [round(t / 1e3, 3) for t in per_step],
            "per_step_wait_us": [round(w / 1e3, 3) for w in waits],
            "per_step_cpu_us": [round(c / 1e3, 3) for c in self.step_cpu_ns],
            # The default clock (perf_counter = CLOCK_MONOTONIC on Linux) is shared by all
            # processes of the host, so a harness can cut the steps to its load window.
            "per_step_start_s": [round(t / 1e9, 6) for t in self.step_start_ns],
        }

    def flush(self) -> Path | None:
        """Write the snapshot atomically; never from a forked child of the owner."""
        self._last_flush = self.clock()
        if os.getpid() != self._pid:
            return None
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(self.snapshot()))
            os.replace(tmp, self.path)
        except OSError:  # profiling must never take the engine down
            return None
        return self.path

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.flush()


def output_path(prefix: str, role: str, pid: int | None = None) -> Path:
    return Path(f"{prefix}-{role}-{os.getpid() if pid is None else pid}.json")


def install(connector: Any, role: str, prefix: str, *, meta: dict[str, Any] | None = None,
            hooks: tuple[str, ...] | None = None, flush_every_s: float | None = None) -> HookProfiler:
    """Wrap ``connector``'s hooks for ``role`` ("scheduler" | "worker") in place.

    On the worker role, ``connector.worker.client.wait`` (if present) is wrapped as
    the idle wait. ``shutdown`` (if present) flushes after running.
    """
    if flush_every_s is None:
        flush_every_s = float(os.environ.get(ENV_FLUSH, "2"))
    prof = HookProfiler(role, output_path(prefix, role), meta=meta, flush_every_s=flush_every_s)
    names = hooks if hooks is not None else (SCHEDULER_HOOKS if role == "scheduler" else WORKER_HOOKS)
    for name in names:
        fn = getattr(connector, name, None)
        if callable(fn):
            setattr(connector, name, prof.wrap(name, fn))
    client = getattr(getattr(connector, "worker", None), "client", None)
    if role == "worker" and client is not None and callable(getattr(client, "wait", None)):
        client.wait = prof.wrap_wait(client.wait)
    shutdown = getattr(connector, "shutdown", None)
    if callable(shutdown):
        def shutdown_and_flush(*args: Any, **kwargs: Any) -> Any:
            try:
                return shutdown(*args, **kwargs)
            finally:
                prof.flush()

        connector.shutdown = shutdown_and_flush
    atexit.register(prof.close)
    return prof
