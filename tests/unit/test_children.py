"""The supervisor's per-child lifecycle (daemon.children), alone: its table row by row.

No processes and no clock: a simulated supervisor feeds what it would see (a process exits,
sets its ready event, or neither) and checks the restart policy against an independent
reading of the module docstring of daemon.supervisor.
"""

from __future__ import annotations

import math
import random

import pytest

from kvpush.common.machine import Row
from kvpush.daemon.node import children as cm
from kvpush.daemon.node.children import TABLE, ChildFacts, ChildState, Policy

S = ChildState
POLICY = Policy(max_restarts_per_minute=3, restart_backoff_s=0.5, restart_backoff_max_s=4.0,
                ready_timeout_s=10.0)


def test_the_table_is_total_and_closed_over_its_states() -> None:
    for s in S:
        for e in cm.EVENTS:
            assert TABLE.rows_for(s, e)
    assert all(r.to is not None for r in TABLE.rows)


def _sim(rng: random.Random, policy: Policy, taken: set[Row], n: int) -> None:
    """A supervisor's view of one child: it exists (a process) only in STARTING, UP, KILLING,
    STOPPING; every event it feeds is one the real shell can feed in that state."""
    c, now = ChildFacts(), 0.0

    def feed(ev: object) -> list[cm.Act]:
        before = c.state
        acts, r = cm.handle(policy, c, ev)
        assert not r.unreachable, f"{r} taken"
        assert r.state is before and c.state is r.to
        taken.add(r)
        return acts

    assert feed(cm.Start(now)) == [cm.Act.SPAWN]
    for _ in range(n):
        now += rng.choice([0.0, 0.1, 1.0, 5.0, 11.0, 30.0, 70.0])
        running = c.state in (S.STARTING, S.UP, S.KILLING, S.STOPPING)
        k = rng.random()
        if running and k < 0.3:
            restarts, times = c.restarts, [t for t in c.restart_times if now - t < cm.WINDOW_S]
            ran = now - c.started_at
            was = c.state
            acts = feed(cm.Exited(now, rng.choice([0, 1, -9])))
            if was is S.STOPPING:
                assert c.state is S.STOPPED and acts == []
                return
            if policy.max_restarts_per_minute == 0:
                assert c.state is S.FAILED and c.next_start == math.inf
            elif len(times) >= policy.max_restarts_per_minute:
                assert c.state is S.CRASH_LOOP and c.next_start >= times[0] + cm.WINDOW_S
            else:
                assert c.state is S.BACKOFF and now <= c.next_start <= now + policy.restart_backoff_max_s
            assert c.restarts == restarts and (ran < cm.STABLE_S or c.consecutive == 1)
        elif running and k < 0.5 and c.state is not S.STOPPING:
            feed(cm.Ready(now))
        elif k < 0.97:
            was, due = c.state, c.next_start
            acts = feed(cm.Tick(now))
            if was in (S.BACKOFF, S.CRASH_LOOP) and now >= due:
                assert acts == [cm.Act.SPAWN] and c.state is S.STARTING
            elif was is S.STARTING and policy.ready_timeout_s and now - c.started_at > policy.ready_timeout_s:
                assert cm.Act.KILL in acts and c.state is S.KILLING
            else:
                assert acts == [] and c.state is was
        else:
            acts = feed(cm.Stop())
            assert (acts == [cm.Act.TERMINATE]) == running
            if not running:
                assert c.state is S.STOPPED
                return
            if rng.random() < 0.5:
                feed(cm.Stop())  # asked twice
            feed(cm.Stopped(0) if rng.random() < 0.7 else cm.Exited(now, 0))
            assert c.state is S.STOPPED
            return
        assert len(c.restart_times) <= c.restarts


def test_every_row_is_taken_or_documented_unreachable_and_never_taken() -> None:
    taken: set[Row] = set()
    rng = random.Random(3)
    policies = [POLICY, Policy(0, 0.5, 4.0, 10.0), Policy(3, 0.0, 0.0, 0.0)]
    for i in range(600):
        _sim(rng, policies[i % 3], taken, 60)
    never_started = ChildFacts()  # shutdown after a start() that raised
    acts, r = cm.handle(POLICY, never_started, cm.Stop())
    assert acts == [] and never_started.state is S.STOPPED
    taken.add(r)
    missing = [str(r) for r in TABLE.rows if r not in taken and not r.unreachable]
    assert not missing, "\n".join(missing)


@pytest.mark.parametrize("r", [r for r in TABLE.rows if r.unreachable], ids=str)
def test_unreachable_rows_change_nothing(r: Row) -> None:
    """Were the shell ever to feed one, the child keeps its state and nothing is done."""
    assert r.to is r.state and r.steps == ()


def test_backoff_doubles_then_resets_after_a_stable_run() -> None:
    c = ChildFacts()
    p = Policy(100, 0.5, 4.0, 0.0)
    cm.handle(p, c, cm.Start(0.0))
    now, delays = 0.0, []
    for _ in range(5):
        now += 1.0
        cm.handle(p, c, cm.Exited(now, 1))
        delays.append(c.delay_s)
        now = c.next_start
        cm.handle(p, c, cm.Tick(now))
    assert delays == [0.5, 1.0, 2.0, 4.0, 4.0] and c.restarts == 5
    now += cm.STABLE_S
    cm.handle(p, c, cm.Exited(now, 1))
    assert c.delay_s == 0.5 and c.state is S.BACKOFF
