"""CompletionCounter (decode side): examples, a plain reference model, and invariants.

The reference model restates the rules with dicts of sets and full scans (no heap, no
table) and must produce the same actions for every random event sequence; the
invariant checker restates the safety rules on the actions alone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush.daemon.core import counter as cm
from kvpush.daemon.core.counter import (
    Aborted,
    Accepted,
    Cause,
    Complete,
    CompletionCounter,
    Fail,
    Notified,
    ProducerCancelled,
    ProducerFailed,
    Refuse,
    Registered,
    Release,
    SendCancel,
    State,
    Tick,
)
from kvpush.proto.notif import Notification


def run(cc: CompletionCounter, *events: object) -> list:
    return [a for e in events for a in cc.handle(e)]  # type: ignore[arg-type]


# ------------------------------------------------------------------------ examples


def test_table_covers_every_state_and_event() -> None:
    for ev in (Registered, Notified, ProducerFailed, ProducerCancelled, Aborted, cm._Deadline, cm.Announced,
               cm.Noticed):
        for state in (None, *State):
            assert cm.TABLE.rows_for(state, ev), (state, ev)


def test_complete_needs_every_producer_of_this_attempt() -> None:
    cc = CompletionCounter()
    assert cc.handle(Registered("t", 1, 3, 0.0, 10.0)) == [Accepted("t", 1)]
    out = run(
        cc,
        Notified("t", 1, 0, 1.0),
        Notified("t", 1, 0, 1.0),  # duplicate
        Notified("t", 0, 1, 1.0),  # other attempt
        Notified("t", 1, 7, 1.0),  # out of range
        Notified("x", 1, 1, 1.0),  # other transfer
        Notified("t", 1, 2, 1.0),
    )
    assert out == []
    assert cc.handle(Notified("t", 1, 1, 2.0)) == [Complete("t", 1)]
    assert run(cc, Notified("t", 1, 1, 2.0), Tick(20.0)) == []


def test_deadline_fails_and_cancels() -> None:
    cc = CompletionCounter()
    run(cc, Registered("t", 0, 2, 0.0, 10.0), Notified("t", 0, 1, 1.0))
    out = cc.handle(Tick(10.0))
    why = "timed out waiting for 1 of 2 producers"
    # a producer never answered: its WRITE may still land, so the Fail says so (the daemon fences)
    assert out == [Fail("t", 0, why, Cause.TIMEOUT, unsafe=True), SendCancel("t", 0, why, Cause.TIMEOUT)]
    assert run(cc, Notified("t", 0, 0, 11.0)) == []  # too late: never Complete after Fail


def test_a_producer_given_up_with_a_write_on_its_way_makes_the_fail_unsafe() -> None:
    cc = CompletionCounter()
    run(cc, Registered("t", 0, 2, 0.0, 10.0), Notified("t", 0, 1, 1.0))
    out = cc.handle(ProducerFailed("t", 0, 0, "silent", 2.0, Cause.PEER_LOST, may_land=True))
    assert out == [Fail("t", 0, "producer 0: silent", Cause.PEER_LOST, unsafe=True)]
    cc = CompletionCounter()
    run(cc, Registered("u", 0, 1, 0.0, 10.0))
    assert cc.handle(ProducerFailed("u", 0, 0, "ucx error", 2.0)) == [
        Fail("u", 0, "producer 0: ucx error", Cause.PRODUCER_FAILED)]  # its WRITE is over: safe
    cc = CompletionCounter()
    run(cc, Registered("v", 0, 1, 0.0, 10.0), Aborted("v", 0, "client gone", 1.0))
    assert cc.handle(Tick(10.0)) == [Release("v", 0, unsafe=True)]  # aborted, no answer by the deadline


def test_producer_failure_cancels_the_rest_and_fails_once_they_answer() -> None:
    cc = CompletionCounter()
    run(cc, Registered("t", 0, 3, 0.0, 10.0), Notified("t", 0, 0, 1.0))
    out = cc.handle(ProducerFailed("t", 0, 1, "ucx", 2.0))
    assert out == [SendCancel("t", 0, "producer 1: ucx", Cause.PRODUCER_FAILED)]
    assert cc.counts()["failing"] == 1
    assert cc.handle(ProducerCancelled("t", 0, 2, 3.0)) == [
        Fail("t", 0, "producer 1: ucx", Cause.PRODUCER_FAILED)
    ]


def test_single_producer_failure_fails_at_once() -> None:
    cc = CompletionCounter()
    run(cc, Registered("t", 0, 1, 0.0, 10.0))
    out = cc.handle(ProducerFailed("t", 0, 0, "gone", 1.0, Cause.PEER_LOST))
    assert out == [Fail("t", 0, "producer 0: gone", Cause.PEER_LOST)]


def test_abort_releases_only_after_every_producer_answered() -> None:
    cc = CompletionCounter()
    run(cc, Registered("t", 0, 2, 0.0, 10.0))
    assert cc.handle(Aborted("t", 0, "preempted", 1.0)) == [SendCancel("t", 0, "aborted: preempted")]
    assert cc.handle(ProducerCancelled("t", 0, 0, 2.0)) == []
    assert cc.handle(Notified("t", 0, 1, 3.0)) == [Release("t", 0)]  # no Complete: aborted
    assert run(cc, Aborted("t", 0, "again", 4.0), Tick(50.0)) == []


def test_abort_releases_at_the_hard_deadline_if_a_producer_hangs() -> None:
    cc = CompletionCounter()
    run(cc, Registered("t", 0, 2, 0.0, 10.0), Aborted("t", 0, "x", 1.0))
    assert cc.handle(Tick(9.0)) == []
    assert cc.handle(Tick(10.0)) == [Release("t", 0, unsafe=True)]  # hung: the daemon fences


def test_abort_after_complete_or_of_unknown_releases_at_once() -> None:
    cc = CompletionCounter()
    run(cc, Registered("t", 0, 1, 0.0, 10.0), Notified("t", 0, 0, 1.0))
    assert cc.handle(Aborted("t", 0, "x", 2.0)) == [Release("t", 0)]
    assert cc.handle(Aborted("never", 3, "x", 2.0)) == [Release("never", 3)]


def test_newer_attempt_supersedes_silently() -> None:
    cc = CompletionCounter()
    run(cc, Registered("t", 0, 2, 0.0, 10.0), Notified("t", 0, 0, 1.0))
    out = cc.handle(Registered("t", 1, 1, 2.0, 12.0))
    assert out == [SendCancel("t", 0, "superseded by attempt 1", Cause.SUPERSEDED), Accepted("t", 1)]
    assert run(cc, Notified("t", 0, 1, 3.0)) == []  # old attempt settles: no Complete
    assert cc.counts()["superseded"] == 0  # and is forgotten
    assert cc.handle(Registered("t", 0, 1, 4.0, 12.0))[0].reason.startswith("stale attempt")
    assert cc.handle(Registered("t", 1, 1, 4.0, 12.0)) == []  # duplicate
    assert cc.handle(Notified("t", 1, 0, 5.0)) == [Complete("t", 1)]


def test_aborted_attempt_still_owes_release_after_supersession() -> None:
    cc = CompletionCounter()
    run(cc, Registered("t", 0, 1, 0.0, 10.0), Aborted("t", 0, "preempt", 1.0))
    assert cc.handle(Registered("t", 1, 1, 2.0, 12.0)) == [Accepted("t", 1)]
    assert cc.handle(ProducerCancelled("t", 0, 0, 3.0)) == [Release("t", 0)]


def test_invalid_registrations_fail_at_once() -> None:
    cc = CompletionCounter()
    assert cc.handle(Registered("t", 0, 0, 0.0, 10.0)) == [Fail("t", 0, "invalid registration", Cause.INVALID)]
    assert cc.handle(Registered("t", 0, 1, 5.0, 5.0))[0] == Fail(
        "t", 0, "registration deadline already passed", Cause.INVALID
    )
    # per-producer tuples must have one entry per producer
    assert cc.handle(Registered("t", 0, 2, 5.0, 9.0, ("e0",)))[0].cause is Cause.INVALID


@pytest.mark.parametrize("order", [[30.0, 10.0, 20.0, 5.0], [5.0, 10.0, 20.0, 30.0]])
def test_expiry_does_not_stop_at_first_unexpired_entry(order: list[float]) -> None:
    cc = CompletionCounter(tombstone_s=100.0)
    for i, d in enumerate(order):
        cc.handle(Registered(f"t{i}", 0, 1, 0.0, d))
    out = cc.handle(Tick(15.0))
    assert {a.transfer_id for a in out if isinstance(a, Fail)} == {
        f"t{i}" for i, d in enumerate(order) if d <= 15.0
    }
    assert all(p.deadline > 15.0 for p in cc.pending()) and len(cc.pending()) == 2


def test_expiry_skips_past_stale_heap_entries() -> None:
    """Completed records leave stale deadline entries in the heap; an entry that is due
    behind them must still expire."""
    cc = CompletionCounter(tombstone_s=1e9)
    for i in range(10):
        run(cc, Registered(f"s{i}", 0, 1, 0.0, 5.0), Notified(f"s{i}", 0, 0, 1.0))
    cc.handle(Registered("late", 0, 1, 0.0, 6.0))
    assert [a for a in cc.handle(Tick(7.0)) if isinstance(a, Fail)][0].transfer_id == "late"
    assert cc.pending() == []


def test_tombstones_purged_and_tick_cheap() -> None:
    cc = CompletionCounter(tombstone_s=1.0)
    for i in range(20_000):
        cc.handle(Registered(f"t{i}", 0, 1, 0.0, 1e6 - i))
    t0 = time.perf_counter()
    for k in range(2_000):
        cc.handle(Tick(float(k)))
    assert time.perf_counter() - t0 < 1.0
    for i in range(20_000):
        cc.handle(Notified(f"t{i}", 0, 0, 2_000.0))
    cc.handle(Tick(2_002.0))
    assert sum(cc.counts().values()) == 0 and not cc._index
    assert len(cc._deadlines._heap) <= 64


def test_zero_tombstones_with_heap_compaction_during_expiry() -> None:
    cc = CompletionCounter(tombstone_s=0.0)
    for i in range(500):
        cc.handle(Registered(f"t{i}", 0, 1, 0.0, 1.0 + i % 7))
    cc.handle(Tick(100.0))
    assert sum(cc.counts().values()) == 0 and cc._deadlines._heap == []


# ---------------------------------------------------------------- reference model


@dataclass
class _R:
    producers: int
    deadline: float
    state: str = "waiting"
    notified: set[int] = field(default_factory=set)
    resolved: set[int] = field(default_factory=set)
    reason: str = ""
    cause: Cause = Cause.PRODUCER_FAILED
    may_land: bool = False
    until: float = 0.0  # tombstone end


class RefCounter:
    """The rules, stated plainly: every step scans everything."""

    TOMB = ("completed", "failed", "released")

    def __init__(self, tombstone_s: float) -> None:
        self.tomb = tombstone_s
        self.now = float("-inf")
        self.recs: dict[tuple[str, int], _R] = {}
        self.cur: dict[str, int] = {}

    def step(self, ev: object) -> list:
        self.now = max(self.now, ev.now)  # type: ignore[attr-defined]
        out = self.expire()
        if isinstance(ev, Registered):
            self.expect(ev, out)
        elif not isinstance(ev, Tick):
            key = (ev.transfer_id, ev.attempt)  # type: ignore[attr-defined]
            r = self.recs.get(key)
            if isinstance(ev, Aborted):
                self.abort(key, r, ev, out)
            elif r is not None and r.state not in self.TOMB:
                self.result(key, r, ev, out)
        return out + self.expire()

    def end(self, key: tuple[str, int], r: _R, state: str) -> None:
        r.state, r.until = state, self.now + self.tomb

    def forget(self, key: tuple[str, int]) -> None:
        del self.recs[key]
        if self.cur.get(key[0]) == key[1]:
            del self.cur[key[0]]

    def cancel(self, key: tuple[str, int], r: _R, why: str, cause: Cause, out: list) -> None:
        if len(r.resolved) < r.producers:
            out.append(SendCancel(*key, why, cause))

    def settle(self, key: tuple[str, int], r: _R, out: list) -> None:
        if r.state == "waiting" and len(r.notified) == r.producers:
            out.append(Complete(*key))
            self.end(key, r, "completed")
        elif r.state != "waiting" and len(r.resolved) == r.producers:
            if r.state == "failing":
                out.append(Fail(*key, r.reason, r.cause, r.may_land))
                self.end(key, r, "failed")
            elif r.state == "aborting":
                out.append(Release(*key, r.may_land))
                self.end(key, r, "released")
            elif r.state == "superseded":
                self.forget(key)

    def expire(self) -> list:
        out: list = []
        while True:
            due = sorted(
                (r.until if r.state in self.TOMB else r.deadline, k)
                for k, r in self.recs.items()
                if (r.until if r.state in self.TOMB else r.deadline) <= self.now
            )
            if not due:
                return out
            for _, key in due:
                r = self.recs[key]
                # a live record at its deadline has a producer unresolved: unsafe by definition
                if r.state == "waiting":
                    why = f"timed out waiting for {r.producers - len(r.notified)} of {r.producers} producers"
                    out.append(Fail(*key, why, Cause.TIMEOUT, True))
                    self.cancel(key, r, why, Cause.TIMEOUT, out)
                    self.end(key, r, "failed")
                elif r.state == "failing":
                    out.append(Fail(*key, r.reason, r.cause, True))
                    self.end(key, r, "failed")
                elif r.state == "aborting":
                    out.append(Release(*key, True))
                    self.end(key, r, "released")
                else:
                    self.forget(key)

    def expect(self, ev: Registered, out: list) -> None:
        key = (ev.transfer_id, ev.attempt)
        cur = self.cur.get(ev.transfer_id)
        if key in self.recs:  # registered again: older than the newest, told, or a duplicate
            r = self.recs[key]
            if cur != ev.attempt:
                why = f"stale attempt: attempt {cur} is newer" if cur is not None else "stale attempt: superseded"
                out.append(Refuse(*key, why, Cause.SUPERSEDED))
            elif r.state in self.TOMB:
                why = f"attempt {ev.attempt} of this transfer already ended ({r.state}); register a new attempt"
                out.append(Refuse(*key, why, Cause.CLOSED))
            return
        if ev.attempt < 0 or ev.producers < 1:
            out.append(Fail(*key, "invalid registration", Cause.INVALID))
        elif ev.deadline <= self.now:
            out.append(Fail(*key, "registration deadline already passed", Cause.INVALID))
        elif cur is not None and ev.attempt < cur:
            out.append(Refuse(*key, f"stale attempt: attempt {cur} is newer", Cause.SUPERSEDED))
        else:
            old = self.recs.get((ev.transfer_id, cur)) if cur is not None else None
            if old is not None and old.state in ("waiting", "failing"):
                if old.state == "waiting":
                    why = f"superseded by attempt {ev.attempt}"
                    old_key = (ev.transfer_id, cur)
                    self.cancel(old_key, old, why, Cause.SUPERSEDED, out)  # type: ignore[arg-type]
                old.state = "superseded"
                self.settle((ev.transfer_id, cur), old, out)  # type: ignore[arg-type]
            self.recs[key] = _R(ev.producers, ev.deadline)
            self.cur[ev.transfer_id] = ev.attempt
            out.append(Accepted(*key))

    def abort(self, key: tuple[str, int], r: _R | None, ev: Aborted, out: list) -> None:
        if r is None:
            out.append(Release(*key))
        elif r.state in ("completed", "failed"):
            out.append(Release(*key))
            self.end(key, r, "released")
        elif r.state in ("waiting", "failing", "superseded"):
            if r.state == "waiting":
                self.cancel(key, r, f"aborted: {ev.reason}", Cause.ABORTED, out)
            r.state = "aborting"
            self.settle(key, r, out)

    def result(self, key: tuple[str, int], r: _R, ev: object, out: list) -> None:
        p = ev.producer  # type: ignore[attr-defined]
        if not 0 <= p < r.producers or p in r.resolved:
            return
        r.resolved.add(p)
        if isinstance(ev, Notified):
            r.notified.add(p)
        else:
            r.may_land |= isinstance(ev, ProducerFailed) and ev.may_land
            if not r.reason:
                why = ev.reason if isinstance(ev, ProducerFailed) else "cancelled"
                r.reason = f"producer {p}: {why}"
                r.cause = ev.cause if isinstance(ev, ProducerFailed) else Cause.CANCELLED
            if r.state == "waiting":
                r.state = "failing"
                self.cancel(key, r, r.reason, r.cause, out)
        self.settle(key, r, out)


# ------------------------------------------------------------------ invariants


@dataclass
class _Seen:
    producers: int
    deadline: float
    notified: set[int] = field(default_factory=set)
    resolved: set[int] = field(default_factory=set)
    completed: bool = False
    failed: bool = False
    aborts: int = 0
    releases: int = 0
    superseded: bool = False


REJECTIONS = ("invalid registration", "registration deadline already passed")


class Checker:
    """The safety rules, restated on the events sent and the actions seen."""

    def __init__(self) -> None:
        self.seen: dict[tuple[str, int], _Seen] = {}
        self.pending_expect: dict[tuple[str, int], Registered] = {}
        self.aborts: dict[tuple[str, int], int] = {}
        self.releases: dict[tuple[str, int], int] = {}

    def before(self, ev: object) -> None:
        if isinstance(ev, Registered):
            self.pending_expect[(ev.transfer_id, ev.attempt)] = ev
        elif isinstance(ev, Aborted):
            key = (ev.transfer_id, ev.attempt)
            self.aborts[key] = self.aborts.get(key, 0) + 1
            if key in self.seen:
                self.seen[key].aborts += 1
        elif not isinstance(ev, Tick):
            s = self.seen.get((ev.transfer_id, ev.attempt))  # type: ignore[attr-defined]
            p = ev.producer  # type: ignore[attr-defined]
            if s is not None and 0 <= p < s.producers and p not in s.resolved:
                s.resolved.add(p)  # a producer's first word is its final word
                if isinstance(ev, Notified):
                    s.notified.add(p)

    def after(self, now: float, actions: list) -> None:
        for a in actions:
            key = (a.transfer_id, a.attempt)
            s = self.seen.get(key)
            if isinstance(a, Accepted):
                e = self.pending_expect[key]
                for k, old in self.seen.items():
                    if k[0] == key[0] and k[1] < key[1]:
                        old.superseded = True
                self.seen[key] = _Seen(e.producers, e.deadline)
            elif isinstance(a, Complete):
                assert s is not None and not s.completed and not s.failed, a
                assert s.notified == set(range(s.producers)), "Complete on a partial set"
                assert now < s.deadline and not s.superseded and not s.aborts, a
                s.completed = True
            elif isinstance(a, Refuse):
                assert s is None or s.superseded or s.completed or s.failed or s.releases, a
            elif isinstance(a, Fail) and a.reason.startswith(REJECTIONS):
                pass  # an Registered refused outright: nothing was forwarded to producers
            elif isinstance(a, Fail):
                assert s is not None and not s.completed and not s.failed, a
                # blocks get recomputed into: nobody may still be writing them
                assert len(s.resolved) == s.producers or now >= s.deadline, "Fail mid-write"
                assert not s.superseded and not s.aborts, a
                s.failed = True
            elif isinstance(a, Release):
                self.releases[key] = self.releases.get(key, 0) + 1
                assert self.releases[key] <= self.aborts.get(key, 0), "Release without Aborted"
                if s is not None:
                    assert len(s.resolved) == s.producers or now >= s.deadline, "early Release"
                    s.releases += 1
            elif isinstance(a, SendCancel):
                assert s is not None, a

    def final(self) -> None:
        for key, s in self.seen.items():
            if s.aborts:
                assert s.releases >= 1, f"{key}: aborted but never released"
            elif not s.superseded:
                assert s.completed != s.failed, f"{key}: no outcome"


# --------------------------------------------------------------- random sequences

TIDS = ("a", "b")
KINDS = ["expect"] * 2 + ["notified"] * 7 + ["failed", "confirmed", "abort", "tick", "tick"]


def _draw_events(data: st.DataObject) -> list[object]:
    """Mostly events aimed at registered attempts (else nothing ever completes), with
    stale, duplicate, out-of-range and unknown ones mixed in."""
    now, evs, known = 0.0, [], []  # known: (tid, attempt, producers)
    for _ in range(data.draw(st.integers(5, 60), label="steps")):
        kind = data.draw(st.sampled_from(KINDS))
        if kind == "tick":
            now += data.draw(st.floats(0, 6))
            evs.append(Tick(now))
            continue
        if kind == "expect" or not known or data.draw(st.integers(0, 5)) == 0:
            tid, attempt = data.draw(st.sampled_from(TIDS)), data.draw(st.integers(0, 2))
            n = data.draw(st.integers(1, 3))
        else:
            tid, attempt, n = data.draw(st.sampled_from(known))
        rank = data.draw(st.integers(0, n))  # n: out of range
        if kind == "expect":
            evs.append(Registered(tid, attempt, n, now, now + data.draw(st.floats(1, 30))))
            known.append((tid, attempt, n))
        elif kind == "notified":
            evs.append(Notified(tid, attempt, rank, now))
        elif kind == "failed":
            cause = data.draw(st.sampled_from([Cause.PRODUCER_FAILED, Cause.PEER_LOST]))
            evs.append(ProducerFailed(tid, attempt, rank, "boom", now, cause, data.draw(st.booleans())))
        elif kind == "confirmed":
            evs.append(ProducerCancelled(tid, attempt, rank, now))
        else:
            evs.append(Aborted(tid, attempt, "stop", now))
    evs.append(Tick(now + 1e4))
    return evs


@settings(max_examples=200, deadline=None)
@given(st.data(), st.sampled_from([3.0, 1e9]))
def test_random_sequences_match_reference_and_invariants(data: st.DataObject, tomb: float) -> None:
    cc, ref, chk = CompletionCounter(tombstone_s=tomb), RefCounter(tomb), Checker()
    for ev in _draw_events(data):
        chk.before(ev)
        got = cc.handle(ev)  # type: ignore[arg-type]
        want = ref.step(ev)
        assert sorted(map(repr, got)) == sorted(map(repr, want)), ev
        chk.after(ev.now, got)  # type: ignore[attr-defined]
        assert all(p.deadline > ev.now for p in cc.pending())  # type: ignore[attr-defined]
        live = sum(n for s, n in cc.counts().items() if s not in RefCounter.TOMB)
        assert live == len(cc.pending())
    if tomb > 1e6:  # with tombstones kept, every accepted attempt ended correctly
        chk.final()


def test_a_timeout_with_grace_fails_safely_once_the_late_producer_confirms_its_cancel() -> None:
    cc = CompletionCounter(cancel_grace_s=2.0)
    run(cc, Registered("t", 0, 2, 0.0, 10.0), Notified("t", 0, 1, 1.0))
    why = "timed out waiting for 1 of 2 producers"
    assert cc.handle(Tick(10.0)) == [SendCancel("t", 0, why, Cause.TIMEOUT)]  # no Fail yet
    assert cc.handle(ProducerCancelled("t", 0, 0, 10.1)) == [Fail("t", 0, why, Cause.TIMEOUT)]  # safe
    # a producer that stays silent through the grace: unsafe (the daemon fences)
    cc = CompletionCounter(cancel_grace_s=2.0)
    run(cc, Registered("u", 0, 1, 0.0, 10.0), Tick(10.0))
    assert cc.handle(Tick(11.9)) == []
    assert cc.handle(Tick(12.0)) == [Fail("u", 0, "timed out waiting for 1 of 1 producers", Cause.TIMEOUT,
                                          unsafe=True)]


def test_registered_again_the_counter_refuses_what_the_shell_used_to() -> None:
    """decode_side.on_register feeds every registration; these rows decide: an attempt whose
    outcome was told, or one older than the newest (live or not), is refused at once; the
    newest one still counting is a silent duplicate."""
    cc = CompletionCounter()
    run(cc, Registered("t", 0, 1, 0.0, 10.0), Notified("t", 0, 0, 1.0))
    assert cc.handle(Registered("t", 0, 1, 2.0, 12.0)) == [Refuse(
        "t", 0, "attempt 0 of this transfer already ended (completed); register a new attempt", Cause.CLOSED)]
    assert cc.handle(Registered("t", 1, 2, 2.0, 12.0)) == [Accepted("t", 1)]
    assert cc.handle(Registered("t", 1, 2, 2.0, 12.0)) == []  # duplicate
    assert cc.handle(Registered("t", 0, 1, 2.0, 12.0))[0] == Refuse(
        "t", 0, "stale attempt: attempt 1 is newer", Cause.SUPERSEDED)
    assert cc.handle(Registered("t", 2, 1, 3.0, 12.0)) == [
        SendCancel("t", 1, "superseded by attempt 2", Cause.SUPERSEDED), Accepted("t", 2)]
    assert cc.handle(Registered("t", 1, 2, 3.0, 12.0))[0].cause is Cause.SUPERSEDED  # superseded, live
    assert cc.current("t") == 2 and cc.live("t")


# ----------------------------------------- every fact of a registration is the counter's


KEYS = {4: b"k4" * 16, 5: b"k5" * 16}  # producer rank -> its key, in every attempt of _reg


def _reg(tid: str = "t", attempt: int = 0, now: float = 0.0) -> Registered:
    return Registered(tid, attempt, 2, now, now + 30.0, ("e0", "e1"), (4, 5), ("f0", "f1"),
                      (KEYS[4] + bytes([attempt]), KEYS[5] + bytes([attempt])))


def _tag(attempt: int, rank: int, tid: str = "t", key_attempt: int | None = None) -> str:
    """The tag producer ``rank`` of _reg's attempt ``key_attempt`` (default: ``attempt``) puts on
    a notification saying (tid, attempt, rank)."""
    ka = attempt if key_attempt is None else key_attempt
    return Notification.signed(KEYS.get(rank, b"x") + bytes([ka]), tid, attempt, rank).tag


def test_announced_writes_decide_how_tightly_to_poll() -> None:
    """A posted final WRITE keeps the poll tight for the write timeout, a completed one for
    hint_s and has the notifications looked for at once; a group WRITE only while in flight
    (up to max_group_hints, then as a final WRITE); an ended attempt asks for nothing."""
    cc = CompletionCounter(write_timeout_s=5.0, hint_s=0.02, max_group_hints=2)
    run(cc, _reg())
    assert not cc.tight(0.0)
    assert cc.handle(cm.Announced("t", 0, 4, 0, False, 1.0)) == []
    assert cc.tight(6.0) and not cc.tight(6.01)
    assert cc.handle(cm.Announced("t", 0, 4, 0, True, 7.0)) == [cm.PollNow("t", 0, 7.0)]
    assert cc.tight(7.02) and not cc.tight(7.03)
    run(cc, cm.Announced("t", 0, 5, 1, False, 8.0), cm.Announced("t", 0, 5, 2, False, 8.0))
    assert cc.tight(100.0)  # in flight: however long the layers take
    run(cc, cm.Announced("t", 0, 5, 1, True, 8.1))
    assert cc.tight(100.0)
    run(cc, cm.Announced("t", 0, 5, 2, True, 8.2))
    assert not cc.tight(8.3)  # between groups: the next layers are being computed
    run(cc, *(cm.Announced("t", 0, 5, g, False, 9.0) for g in (3, 4, 5)))  # one more than tracked
    assert cc.tight(13.9)
    run(cc, *(cm.Announced("t", 0, 5, g, True, 9.0) for g in (3, 4)))
    assert cc.tight(13.9) and not cc.tight(14.1)
    run(cc, cm.Announced("t", 0, 5, 6, False, 20.0), Notified("t", 0, 0, 20.0), Notified("t", 0, 1, 20.0))
    assert not cc.tight(20.0)  # completed: nothing more to poll for
    assert cc.handle(cm.Announced("t", 0, 4, 0, True, 21.0)) == [] and not cc.tight(21.0)
    assert cc.handle(cm.Announced("x", 0, 4, 0, True, 21.0)) == []  # unknown


def test_a_lost_link_may_land_only_what_was_announced_within_its_window() -> None:
    for announced_at, unsafe in ((None, False), (9.0, True), (0.0, False)):  # write timeout 5 s
        cc = CompletionCounter(write_timeout_s=5.0)
        run(cc, _reg())
        if announced_at is not None:
            run(cc, cm.Announced("t", 0, 4, 0, False, announced_at))
        out = run(cc, ProducerFailed("t", 0, "e0", "lost", 10.0, Cause.PEER_LOST, True, announced_only=True),
                  ProducerCancelled("t", 0, "e1", 10.1))
        assert [type(a) for a in out] == [SendCancel, Fail] and out[-1].unsafe is unsafe, announced_at


def test_a_notification_counts_for_the_newest_attempt_from_its_producers_agent_only() -> None:
    """Noticed names a producer by TP rank and comes with the endpoints whose producer's agent
    sent it: it counts (Arrived, then what Notified does) for the newest live attempt from that
    producer's agent; another agent is a Stranger, never counted; an unknown rank, a superseded
    or ended attempt, an unknown transfer are ignored by design."""
    def noticed(attempt: int, rank: int, *senders: str, tid: str = "t") -> cm.Noticed:
        return cm.Noticed(tid, attempt, rank, "agent", frozenset(senders), 1.0, _tag(attempt, rank, tid))

    cc = CompletionCounter()
    run(cc, _reg())
    assert cc.handle(noticed(0, 5, "e0")) == [cm.Stranger("t", 0, "agent")]  # e1's rank, e0's agent
    assert cc.handle(noticed(0, 5)) == [cm.Stranger("t", 0, "agent")]  # no link has that agent
    assert cc.info("t", 0).notified == 0
    assert cc.handle(noticed(0, 5, "e1", "e9")) == [cm.Arrived("t", 0)]
    assert cc.info("t", 0).notified == 1
    assert cc.handle(noticed(0, 7, "e1")) == []  # no producer of that rank
    assert cc.handle(noticed(0, 5, "e1", tid="x")) == []
    run(cc, Aborted("t", 0, "stop", 1.5), _reg(attempt=1, now=2.0))  # attempt 0 aborting, superseded
    assert cc.handle(noticed(0, 4, "e0")) == []
    assert cc.handle(noticed(1, 4, "e0")) == [cm.Arrived("t", 1)]
    assert cc.handle(noticed(1, 5, "e1")) == [cm.Arrived("t", 1), Complete("t", 1)]
    assert cc.handle(noticed(1, 5, "e1")) == [cm.Tampered("t", 1, "agent", "replayed")]  # told already


def test_a_notification_its_producer_did_not_send_is_never_counted_and_fails_the_attempt() -> None:
    """Issue 44, item 1: the agent name is the sender's choice, the tag is not. A tag that does
    not verify under the producer's key of this attempt (none, a guess, another attempt's or
    transfer's), or a second notification of a producer already counted, is Tampered: not
    counted, and the attempt fails once its producers answered the cancel (never Complete:
    blocks an impostor may have written are recomputed). Ended or superseded: reported only."""
    def noticed(tag: str, attempt: int = 0, rank: int = 4) -> cm.Noticed:
        return cm.Noticed("t", attempt, rank, "pagent", frozenset({"e0", "e1"}), 1.0, tag)

    for tag, why in (("", "forged"), ("0" * 64, "forged"), (_tag(0, 4, key_attempt=1), "forged"),
                     (_tag(0, 4, tid="u"), "forged"), (_tag(0, 5), "forged")):
        cc = CompletionCounter()
        run(cc, _reg())
        out = cc.handle(noticed(tag))
        assert out[0] == cm.Tampered("t", 0, "pagent", why) and isinstance(out[1], SendCancel), tag
        assert out[1].cause is Cause.FORGED and cc.info("t", 0).notified == 0
        # the producers answer (the genuine notifications even): the attempt fails all the same
        out = run(cc, cm.Noticed("t", 0, 4, "pagent", frozenset({"e0"}), 1.1, _tag(0, 4)),
                  ProducerCancelled("t", 0, "e1", 1.2))
        assert [type(a) for a in out] == [cm.Arrived, Fail] and out[-1].cause is Cause.FORGED, out
        assert not out[-1].unsafe and "forged notification for producer rank 4" in out[-1].reason

    cc = CompletionCounter()  # a replay while the other producer is still out
    run(cc, _reg())
    assert cc.handle(noticed(_tag(0, 4))) == [cm.Arrived("t", 0)]
    out = cc.handle(noticed(_tag(0, 4)))
    assert out == [cm.Tampered("t", 0, "pagent", "replayed"), SendCancel("t", 0, out[1].reason, Cause.FORGED)]
    assert [type(a) for a in run(cc, ProducerCancelled("t", 0, "e1", 1.2))] == [Fail]

    cc = CompletionCounter()  # another attempt's tag, claiming the newest attempt
    run(cc, _reg(), _reg(attempt=1, now=0.5))
    assert cc.handle(noticed(_tag(1, 4, key_attempt=0), attempt=1))[0] == cm.Tampered("t", 1, "pagent", "forged")
    assert cc.handle(noticed("0" * 64, attempt=0)) == [cm.Tampered("t", 0, "pagent", "forged")]  # superseded
    assert cc.handle(noticed(_tag(0, 4), attempt=0)) == []  # the old attempt's own: ignored as before


def test_a_producer_named_by_endpoint_is_the_one_at_that_endpoint() -> None:
    by_index, by_endpoint = CompletionCounter(), CompletionCounter()
    run(by_index, _reg())
    run(by_endpoint, _reg())
    for a, b in ((ProducerFailed("t", 0, 1, "boom", 1.0), ProducerFailed("t", 0, "e1", "boom", 1.0)),
                 (ProducerCancelled("t", 0, 0, 1.1), ProducerCancelled("t", 0, "e0", 1.1))):
        assert by_index.handle(a) == by_endpoint.handle(b)
    assert by_endpoint.handle(ProducerFailed("t", 0, "nowhere", "boom", 1.2)) == []


def test_actions_carry_what_the_shell_needs_to_carry_them_out() -> None:
    cc = CompletionCounter()
    (acc,) = cc.handle(_reg(now=1.0))
    assert acc.endpoints == ("e0", "e1") and acc.forwards == ("f0", "f1")
    (cancel,) = cc.handle(ProducerFailed("t", 0, 0, "boom", 2.0))
    assert cancel.endpoints == ("e0", "e1")  # whom to tell
    (fail,) = cc.handle(ProducerCancelled("t", 0, 1, 3.0))
    assert (fail.since, fail.producers) == (1.0, 2)  # the history's
    run(cc, _reg("u", now=4.0))
    cancel, accepted = cc.handle(_reg("u", attempt=1, now=5.0))
    assert cancel.endpoints == () and isinstance(accepted, Accepted)  # superseded: the newer registration ends it
    (complete,) = run(cc, Notified("u", 1, 0, 6.0), Notified("u", 1, 1, 6.0))
    assert (complete.since, complete.producers) == (5.0, 2)
