"""One supervised device daemon's lifecycle as a transition table: no processes, no clock.

The supervisor (:mod:`kvpush.daemon.node.supervisor`) is the shell: it starts and reaps
processes, turns what it sees (a start, a ready event, an exit code, a poll) into the events
below, drives the child's facts with :data:`TABLE` (``machine.drive`` over
``machine.Single(TABLE, policy, child)``) and carries out the actions it gets back, in order. Every
state a child can be in, and every change of it, is one row of :data:`TABLE` (a
:class:`kvpush.common.machine.Table`, the one machine idiom of kvpush); the restart policy
(backoff, the crash-loop window, the ready timeout) is decided by guard rows here, never by
the shell. Tested row by row in tests/unit/test_children.py.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Final

from kvpush.common.machine import Row, Table, row

__all__ = [
    "STABLE_S", "TABLE", "WINDOW_S", "Act", "ChildFacts", "ChildState", "Exited", "Policy",
    "Ready", "Start", "Stop", "Stopped", "Tick", "handle",
]

WINDOW_S = 60.0  # restart-rate window
STABLE_S = 60.0  # a child that ran this long resets its backoff


class ChildState(enum.StrEnum):
    """Where one device daemon's process is (`kvpushctl status` shows the value)."""

    STARTING = "starting"
    UP = "up"
    KILLING = "killing"  # not ready in time: killed, restarted once reaped
    BACKOFF = "backoff"  # exited: restarts after a delay
    CRASH_LOOP = "crash-loop"  # exited too often: restarts after the long delay
    FAILED = "failed"  # will not be restarted
    STOPPING = "stopping"
    STOPPED = "stopped"


class Act(enum.StrEnum):
    """What the shell does, in the order given."""

    SPAWN = "spawn"  # start a fresh process (a restart when ChildFacts.restarts grew)
    KILL = "kill"  # SIGKILL: not ready in time (reaped, and restarted, on a later poll)
    TERMINATE = "terminate"  # SIGTERM: stopping
    LOG_UP = "log_up"
    LOG_NOT_READY = "log_not_ready"
    LOG_FAILED = "log_failed"  # exited with restarts disabled
    LOG_BACKOFF = "log_backoff"
    LOG_CRASH_LOOP = "log_crash_loop"


@dataclass(frozen=True)
class Policy:
    """The node's restart policy (NodeConfig): bounds from configuration only."""

    max_restarts_per_minute: int
    restart_backoff_s: float
    restart_backoff_max_s: float
    ready_timeout_s: float  # 0: wait for ready forever


@dataclass(eq=False)
class ChildFacts:
    """What the table knows of one child; the shell keeps its process handles beside it."""

    state: ChildState = ChildState.STOPPED
    started_at: float = 0.0
    up_since: float | None = None
    next_start: float = 0.0
    restarts: int = 0
    consecutive: int = 0  # exits in a row that ran less than STABLE_S
    restart_times: deque[float] = field(default_factory=deque)  # within the last WINDOW_S
    last_exit: int | None = None
    ran_s: float = 0.0  # how long the last process ran
    delay_s: float = 0.0  # the backoff chosen at the last exit


# ---- events --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Start:
    """The supervisor starts: the first process."""

    now: float


@dataclass(frozen=True)
class Ready:
    """The child set its ready event (its sockets are bound)."""

    now: float


@dataclass(frozen=True)
class Exited:
    """The child's process was reaped on a poll, with its exit code."""

    now: float
    code: int | None


@dataclass(frozen=True)
class Tick:
    """A supervision poll: timeouts and due restarts."""

    now: float


@dataclass(frozen=True)
class Stop:
    """The supervisor shuts down."""


@dataclass(frozen=True)
class Stopped:
    """Shutdown reaped the process (after SIGTERM, or SIGKILL past stop_timeout_s)."""

    code: int | None


EVENTS: Final = (Start, Ready, Exited, Tick, Stop, Stopped)


# ---- guards (pure; before any step) ---------------------------------------------------------


def _recent_restarts(c: ChildFacts, now: float) -> int:
    return sum(now - t < WINDOW_S for t in c.restart_times)


def restarts_disabled(p: Policy, c: ChildFacts, ev: Exited) -> bool:
    return p.max_restarts_per_minute == 0


def too_often(p: Policy, c: ChildFacts, ev: Exited) -> bool:
    """As many restarts in the last WINDOW_S as the policy allows: hold it down."""
    return _recent_restarts(c, ev.now) >= p.max_restarts_per_minute


def ready_timed_out(p: Policy, c: ChildFacts, ev: Tick) -> bool:
    return bool(p.ready_timeout_s) and ev.now - c.started_at > p.ready_timeout_s


def restart_due(p: Policy, c: ChildFacts, ev: Tick) -> bool:
    return ev.now >= c.next_start


# ---- steps (facts and actions; never the state) ---------------------------------------------


def spawn(p: Policy, c: ChildFacts, ev: Start | Tick, out: list[Act]) -> None:
    c.started_at, c.up_since = ev.now, None
    out.append(Act.SPAWN)


def count_restart(p: Policy, c: ChildFacts, ev: Tick, out: list[Act]) -> None:
    c.restarts += 1
    c.restart_times.append(ev.now)


def came_up(p: Policy, c: ChildFacts, ev: Ready, out: list[Act]) -> None:
    c.up_since = ev.now
    out.append(Act.LOG_UP)


def reaped(p: Policy, c: ChildFacts, ev: Exited, out: list[Act]) -> None:
    c.last_exit = ev.code
    c.ran_s = ev.now - c.started_at
    c.up_since = None
    c.consecutive = 1 if c.ran_s >= STABLE_S else c.consecutive + 1
    while c.restart_times and ev.now - c.restart_times[0] >= WINDOW_S:
        c.restart_times.popleft()
    c.delay_s = min(p.restart_backoff_s * 2 ** (c.consecutive - 1), p.restart_backoff_max_s)


def hold_failed(p: Policy, c: ChildFacts, ev: Exited, out: list[Act]) -> None:
    c.next_start = math.inf
    out.append(Act.LOG_FAILED)


def back_off(p: Policy, c: ChildFacts, ev: Exited, out: list[Act]) -> None:
    c.next_start = ev.now + c.delay_s
    out.append(Act.LOG_BACKOFF)


def hold_down(p: Policy, c: ChildFacts, ev: Exited, out: list[Act]) -> None:
    """Until the window has room again (and at least the backoff)."""
    c.next_start = max(ev.now + c.delay_s, c.restart_times[0] + WINDOW_S)
    out.append(Act.LOG_CRASH_LOOP)


def kill(p: Policy, c: ChildFacts, ev: Tick, out: list[Act]) -> None:
    out += (Act.LOG_NOT_READY, Act.KILL)


def terminate(p: Policy, c: ChildFacts, ev: Stop, out: list[Act]) -> None:
    out.append(Act.TERMINATE)


def stopped(p: Policy, c: ChildFacts, ev: Stopped, out: list[Act]) -> None:
    c.last_exit, c.up_since = ev.code, None


# ---- the table -------------------------------------------------------------------------------

S = ChildState
_RUNNING = (S.STARTING, S.UP, S.KILLING)  # a process exists
_WAITING = (S.BACKOFF, S.CRASH_LOOP)
_NO_PROCESS = (*_WAITING, S.FAILED, S.STOPPED)
_REAPED_ONLY_IF_RUNNING = "only a process is reaped, and only children in these states have one"
_STARTED_ONCE = "the supervisor starts each child once"
_NO_POLLS_WHEN_STOPPING = "the supervisor polls only between start and shutdown"
_STOP_REAPS = "shutdown reaps only the children it is stopping"


def _rows() -> list[Row]:
    r: list[Row] = [row(S.STOPPED, Start, None, S.STARTING, spawn)]
    r += [row(s, Start, None, s, unreachable=_STARTED_ONCE) for s in S if s is not S.STOPPED]
    r += [row(S.STARTING, Ready, None, S.UP, came_up)]
    r += [row(s, Ready, None, s) for s in (S.UP, S.KILLING)]  # late or repeated
    r += [row(S.STOPPING, Ready, None, S.STOPPING, unreachable=_NO_POLLS_WHEN_STOPPING)]
    r += [row(s, Ready, None, s, unreachable=_REAPED_ONLY_IF_RUNNING) for s in _NO_PROCESS]
    # Any exit the supervisor did not ask for is a crash.
    for s in _RUNNING:
        r += [row(s, Exited, restarts_disabled, S.FAILED, reaped, hold_failed),
              row(s, Exited, too_often, S.CRASH_LOOP, reaped, hold_down),
              row(s, Exited, None, S.BACKOFF, reaped, back_off)]
    r += [row(S.STOPPING, Exited, None, S.STOPPED, stopped)]  # a poll raced the shutdown
    r += [row(s, Exited, None, s, unreachable=_REAPED_ONLY_IF_RUNNING) for s in _NO_PROCESS]
    r += [row(S.STARTING, Tick, ready_timed_out, S.KILLING, kill),
          row(S.STARTING, Tick, None, S.STARTING)]
    r += [row(s, Tick, restart_due, S.STARTING, count_restart, spawn) for s in _WAITING]
    r += [row(s, Tick, None, s) for s in (S.UP, S.KILLING, *_WAITING, S.FAILED)]
    r += [row(s, Tick, None, s, unreachable=_NO_POLLS_WHEN_STOPPING) for s in (S.STOPPING, S.STOPPED)]
    r += [row(s, Stop, None, S.STOPPING, terminate) for s in _RUNNING]
    r += [row(s, Stop, None, S.STOPPED) for s in _NO_PROCESS]  # STOPPED: a start that failed
    r += [row(S.STOPPING, Stop, None, S.STOPPING)]  # asked again: still reaping
    r += [row(S.STOPPING, Stopped, None, S.STOPPED, stopped)]
    r += [row(s, Stopped, None, s, unreachable=_STOP_REAPS) for s in S if s is not S.STOPPING]
    return r


TABLE: Final = Table(ChildState, EVENTS, _rows(), keyed=False)


def handle(policy: Policy, child: ChildFacts, ev: Any) -> tuple[list[Act], Row]:
    """Apply one event to one child: the actions to carry out, in order, and the row taken
    (what the supervisor's ``drive(Single(TABLE, policy, child), ...)`` does, for tests)."""
    out: list[Act] = []
    taken = TABLE.take(policy, child, ev, out)
    return out, taken
