"""The one driver of every machine (kvpush.common.machine.drive), alone and in the daemon.

Alone, over random scripts of events, actions and follow-ups: the actions of each event are
carried out in the order it returned them, one batch after the other; follow-up events are
applied first in, first out, after the batch that produced them; the machine is never
re-entered while its actions are being carried out; a drive that keeps producing follow-ups
stops with a clear error at its bound; HALT ends a drive at once.

In the daemon: the two shells that used to re-enter their core from inside its actions (a
WRITE that could not be posted, a registration that could not be forwarded) tell it after the
batch instead.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush import proto
from kvpush.common.machine import HALT, FeedbackLoop, Single, drive
from kvpush.daemon.node import children as cm
from kvpush_dev.inmemory import Fabric, MemNode, Net
from kvpush_dev.kvref import make

# ------------------------------------------------------------------ a scripted machine


class Scripted:
    """Event ``e`` answers ``actions[e]`` (cycling), and carrying out action ``a`` returns
    ``follow[a]`` new events: a random machine and shell. Records everything in order and
    fails on re-entrance (handle called while a batch of its actions is being carried out)."""

    def __init__(self, actions: list[int], follow: list[int], halt_at: int | None = None) -> None:
        self.n_actions, self.n_follow, self.halt_at = actions, follow, halt_at
        self.ids = itertools.count(1)
        self.applied: list[int] = []  # events, in the order handle saw them
        self.batches: dict[int, list[int]] = {}  # event -> the actions it returned
        self.done: list[int] = []  # actions, in the order they were carried out
        self.made: list[int] = []  # follow-up events, in the order carry_out returned them
        self.busy = False  # a batch is being carried out

    def handle(self, ev: int) -> Iterator[int]:
        assert not self.busy, "re-entered while its actions were being carried out"
        self.applied.append(ev)
        acts = [next(self.ids) for _ in range(self.n_actions[ev % len(self.n_actions)])]
        self.batches[ev] = acts

        def batch() -> Iterator[int]:
            self.busy = True
            yield from acts
            self.busy = False

        return batch()

    def carry_out(self, act: int) -> Any:
        assert self.busy
        self.done.append(act)
        if self.halt_at is not None and len(self.done) == self.halt_at:
            return HALT
        new = [-next(self.ids) for _ in range(self.n_follow[act % len(self.n_follow)])]
        self.made += new
        return new


SCRIPTS = st.tuples(st.lists(st.integers(0, 3), min_size=1, max_size=8),
                    st.lists(st.integers(0, 2), min_size=1, max_size=8))


@settings(max_examples=300, deadline=None)
@given(SCRIPTS, st.integers(20, 200))
def test_batches_in_order_follow_ups_first_in_first_out_and_no_reentrance(script, cap):
    m = Scripted(*script)
    try:
        drive(m, 0, m.carry_out, max_follow_ups=cap)
    except FeedbackLoop:
        assert len(m.made) > cap and len(m.applied) <= cap + 1  # stopped at the bound
        assert m.applied == [0, *m.made][:len(m.applied)]
    else:
        assert len(m.made) <= cap
        assert m.applied == [0, *m.made]  # every follow-up applied, in the order it was made
    # every batch carried out whole and in order, batches in the order the events were applied
    full = [a for ev in m.applied for a in m.batches[ev]]
    assert m.done == full[:len(m.done)]
    if m.applied == [0, *m.made]:  # it ran out of events: everything was carried out
        assert m.done == full


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 40))
def test_a_loop_between_machine_and_shell_stops_at_the_bound(cap):
    m = Scripted([1], [1])  # every action asks for one more event: forever
    with pytest.raises(FeedbackLoop, match=f"more than {cap} follow-up events in one drive"):
        drive(m, 0, m.carry_out, max_follow_ups=cap)
    assert len(m.applied) == cap + 1 and len(m.made) == cap + 1


@settings(max_examples=200, deadline=None)
@given(SCRIPTS, st.integers(1, 30))
def test_halt_ends_the_drive_at_once(script, at):
    m = Scripted(*script, halt_at=at)
    drive(m, 0, m.carry_out, max_follow_ups=10_000)
    full = [a for ev in m.applied for a in m.batches[ev]]
    assert len(m.done) <= at and m.done == full[:len(m.done)]
    if len(m.done) == at:  # halted: nothing carried out or applied after it
        assert m.done[-1] in m.batches[m.applied[-1]]
    else:  # ran out of events: everything was carried out
        assert m.done == full and m.applied == [0, *m.made]


def test_a_single_record_is_driven_like_a_core():
    """``Single``: the child's table driven through ``drive`` does what ``handle`` says."""
    policy = cm.Policy(3, 0.5, 4.0, 10.0)
    a, b = cm.ChildFacts(), cm.ChildFacts()
    for ev in (cm.Start(0.0), cm.Ready(1.0), cm.Exited(2.0, 1), cm.Tick(2.1), cm.Tick(3.0), cm.Stop()):
        want, _ = cm.handle(policy, a, ev)
        got: list[Any] = []
        drive(Single(cm.TABLE, policy, b), ev, got.append)
        assert got == want and a.state is b.state


# ------------------------------------------------------------------ in the daemon


def watch(core: Any) -> list[str]:
    """Wrap ``core.handle`` so that being called while one of its batches is still being
    carried out is recorded (what the re-entrant shells did)."""
    handle, busy, seen = core.handle, [False], []

    def wrapped(ev: Any) -> Iterator[Any]:
        if busy[0]:
            seen.append(type(ev).__name__)
        acts = handle(ev)

        def batch() -> Iterator[Any]:
            busy[0] = True
            try:
                yield from acts
            finally:
                busy[0] = False

        return batch()

    core.handle = wrapped
    return seen


def _pair() -> tuple[Net, MemNode, MemNode]:
    lay, _ = make("row", num_layers=2, num_blocks=16, block_size=16, num_heads=2, head_size=8,
                  dtype="bfloat16", head_start=0, total_heads=2)
    net, fab = Net(), Fabric()
    p, d = MemNode(net, fab, "p"), MemNode(net, fab, "d")
    p.attach(lay, np.zeros(lay.region_size, dtype=np.uint8), role="prefill")
    d.attach(lay, np.zeros(lay.region_size, dtype=np.uint8), role="decode")
    return net, p, d


def test_the_decode_side_tells_its_counter_a_failed_forward_after_the_batch():
    """A registration whose producer cannot be dialled fails (ReceiveFailed), and the counter
    hears it after the batch that asked to forward it, not from inside it."""
    net, p, d = _pair()
    seen = watch(d.decode.counter)
    got = d.engine(proto.Register("t", 0, (1, 2), 20, ("nowhere://x",), 1, 20000))
    assert isinstance(got, proto.ReceiveFailed) and "cannot connect" in got.reason
    assert seen == []


def test_the_prefill_side_tells_its_rendezvous_a_failed_post_after_the_batch(monkeypatch):
    """A WRITE NIXL refuses fails the transfer on both sides, and the rendezvous hears it after
    the batch that asked for the WRITE, not from inside it."""
    net, p, d = _pair()
    d.engine(proto.Register("warm", 0, (1, 2), 20, (p.endpoint,), 1, 20000))
    p.engine(proto.PrefillDone("warm", (3, 4), 20, 5000))
    net.run()
    seen = watch(p.prefill.rdv)

    def refuse(*a: Any, **k: Any) -> Any:
        raise RuntimeError("NIXL said no")

    monkeypatch.setattr(p.transport, "write_prepped", refuse)
    d.engine(proto.Register("t", 0, (1, 2), 20, (p.endpoint,), 1, 20000))
    net.run()
    assert isinstance(p.engine(proto.PrefillDone("t", (3, 4), 20, 5000)), proto.SendFailed)
    net.run()
    assert seen == []
    assert isinstance(d.answers()[-1], proto.ReceiveFailed) and "NIXL said no" in d.answers()[-1].reason
