"""Rendezvous (prefill side): examples for each rule, then random interleavings.

The random harness plays the transport honestly (every StartWrite gets exactly one
WriteDone or WriteFailed, at a random later point) and checks the safety invariants
on every action the core emits.
"""

from __future__ import annotations

import random
import time
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvpush.daemon.core import rendezvous as rz
from kvpush.daemon.core.rendezvous import (
    Aborted,
    Cause,
    ConfirmCancel,
    NotifyFailure,
    PeerLost,
    Prefilled,
    Registered,
    ReleaseBlocks,
    Rendezvous,
    StartWrite,
    State,
    Tick,
    WriteDone,
    WriteFailed,
)

SRC = (1, 2, 3)


def reg(
    tid: str = "t",
    attempt: int = 0,
    dest: int = 0,
    expected: int = 1,
    *,
    peer: str | None = None,
    now: float = 0.0,
    deadline: float = 100.0,
    tokens: int = 40,
    blocks: tuple[int, ...] = (7, 8, 9),
) -> Registered:
    return Registered(tid, attempt, peer or f"d{dest}", dest, expected, blocks, tokens, now, deadline)


def pf(tid: str = "t", *, now: float = 0.0, lease: float = 50.0, tokens: int = 40) -> Prefilled:
    return Prefilled(tid, SRC, tokens, now, lease)


def of(kind: type, actions: list) -> list:
    return [a for a in actions if isinstance(a, kind)]


# ------------------------------------------------------------------------ examples


def test_table_covers_every_state_and_event() -> None:
    events = (Registered, Prefilled, WriteDone, WriteFailed, Aborted, PeerLost, rz._Deadline)
    for state in (None, *State):
        for ev in events:
            assert rz.TABLE.rows_for(state, ev), (state, ev)


@pytest.mark.parametrize("prefill_first", [True, False])
def test_happy_path_either_order(prefill_first: bool) -> None:
    rv = Rendezvous()
    first, second = (pf(), reg()) if prefill_first else (reg(), pf())
    assert rv.handle(first) == []
    out = rv.handle(second)
    assert out == [StartWrite("t", 0, "d0", 0, SRC, (7, 8, 9), 40)]
    assert rv.counts()["writing"] == 1
    assert rv.handle(WriteDone("t", 0, 0, 1.0)) == [ReleaseBlocks("t", SRC, True, "")]
    assert rv.counts()["done"] == 1 and rv.pending() == []


def test_one_write_per_destination_and_completion_needs_all() -> None:
    rv = Rendezvous()
    rv.handle(pf())
    a = rv.handle(reg(dest=1, expected=2))
    assert of(StartWrite, a)[0].dest_rank == 1
    assert rv.handle(reg(dest=1, expected=2)) == []  # duplicate
    assert rv.handle(WriteDone("t", 0, 1, 1.0)) == []  # dest 0 still missing
    assert len(of(StartWrite, rv.handle(reg(dest=0, expected=2, now=1.0)))) == 1
    assert of(ReleaseBlocks, rv.handle(WriteDone("t", 0, 0, 2.0)))[0].ok


def test_newer_attempt_supersedes_but_blocks_stay_until_old_write_ends() -> None:
    rv = Rendezvous()
    rv.handle(pf())
    rv.handle(reg(attempt=0, dest=0, expected=1))
    out = rv.handle(reg(attempt=1, dest=0, expected=1, blocks=(4, 5), now=1.0))
    assert of(StartWrite, out) == [StartWrite("t", 1, "d0", 0, SRC, (4, 5), 40)]
    assert rv.handle(WriteDone("t", 1, 0, 2.0)) == []  # attempt 0 still reads SRC
    assert rv.counts()["draining"] == 1
    assert rv.handle(WriteDone("t", 0, 0, 3.0)) == [ReleaseBlocks("t", SRC, True, "")]
    # an older attempt arriving late is refused and told so
    late = rv.handle(reg(attempt=0, dest=0, now=4.0))
    assert of(NotifyFailure, late) and not of(StartWrite, late)


def test_late_duplicate_of_a_superseded_write_in_flight_gets_no_answer() -> None:
    """Regression (found by the random harness): "superseded" to a peer whose write of
    that attempt is still in flight would let it free blocks NIXL is writing into."""
    rv = Rendezvous()
    rv.handle(pf())
    rv.handle(reg(attempt=0))
    rv.handle(reg(attempt=1, now=1.0))
    assert rv.handle(reg(attempt=0, now=2.0)) == []
    assert rv.handle(Aborted("t", 0, "x", "peer", 3.0, peer="d0")) == []
    assert rv.handle(WriteDone("t", 0, 0, 4.0)) == [ConfirmCancel("t", 0, "d0")]


def test_stale_attempt_is_refused_while_live() -> None:
    rv = Rendezvous()
    rv.handle(reg(attempt=2, dest=0, expected=2))
    out = rv.handle(reg(attempt=1, dest=1, expected=2))
    assert out == [NotifyFailure("t", 1, "d1", 1, "superseded by attempt 2", Cause.SUPERSEDED)]
    out = rv.handle(reg(attempt=3, dest=1, expected=2))  # supersedes attempt 2's dest 0
    assert out == [NotifyFailure("t", 2, "d0", 0, "superseded by attempt 3", Cause.SUPERSEDED)]


def test_num_tokens_mismatch_fails_the_attempt_and_a_correct_one_still_works() -> None:
    rv = Rendezvous()
    rv.handle(reg(tokens=41))
    out = rv.handle(pf(tokens=40))
    assert [type(a) for a in out] == [NotifyFailure] and "num_tokens" in out[0].reason
    assert rv.counts()["wait_register"] == 1
    assert of(StartWrite, rv.handle(reg(attempt=1, now=1.0)))
    assert of(ReleaseBlocks, rv.handle(WriteDone("t", 1, 0, 2.0)))[0].ok


def test_lease_expiry_releases_and_notifies_but_waits_for_inflight_write() -> None:
    rv = Rendezvous()
    rv.handle(pf(lease=10.0))
    rv.handle(reg(dest=0, expected=2))
    out = rv.handle(Tick(10.0))
    assert out == [] and rv.counts()["draining"] == 1  # dest 0 write still in flight
    out = rv.handle(WriteDone("t", 0, 0, 11.0))
    assert out == [ReleaseBlocks("t", SRC, False, "lease expired", Cause.LEASE_EXPIRED)]
    assert of(NotifyFailure, rv.handle(reg(dest=1, expected=2, now=12.0)))


def test_lease_expiry_without_writes() -> None:
    rv = Rendezvous()
    rv.handle(pf(lease=10.0))
    rv.handle(reg(tokens=1))  # mismatch: notified, not written
    assert rv.handle(Tick(9.99)) == []
    assert rv.handle(Tick(10.0)) == [
        ReleaseBlocks("t", SRC, False, "lease expired", Cause.LEASE_EXPIRED)
    ]


def test_a_lease_nobody_registered_for_ends_unclaimed() -> None:
    rv = Rendezvous()
    rv.handle(pf(lease=10.0))
    assert rv.handle(Tick(10.0)) == [
        ReleaseBlocks("t", SRC, False, "lease expired: no decode side registered", Cause.UNCLAIMED)
    ]


def test_registration_without_prefill_expires() -> None:
    rv = Rendezvous()
    rv.handle(reg(deadline=5.0))
    out = rv.handle(Tick(5.0))
    assert out == [NotifyFailure("t", 0, "d0", 0, "prefill did not complete in time", Cause.TIMEOUT)]
    assert rv.counts()["expired"] == 1
    # the prefill arriving later holds its blocks for a newer attempt, until the lease
    assert rv.handle(pf(now=6.0, lease=20.0)) == []
    assert of(StartWrite, rv.handle(reg(attempt=1, now=7.0)))


def test_earliest_registration_deadline_ends_the_attempt() -> None:
    rv = Rendezvous()
    rv.handle(reg(dest=0, expected=2, deadline=10.0))
    rv.handle(reg(dest=1, expected=2, deadline=5.0))
    out = rv.handle(pf(now=6.0))  # dest 1's blocks may already be reused: no write
    assert not of(StartWrite, out)
    assert {a.dest_rank for a in of(NotifyFailure, out)} == {0, 1}


def test_write_failed_notifies_peer_and_releases_not_ok() -> None:
    rv = Rendezvous()
    rv.handle(pf())
    rv.handle(reg(dest=0, expected=2))
    rv.handle(reg(dest=1, expected=2))
    out = rv.handle(WriteFailed("t", 0, 0, "ucx error", 1.0))
    assert out == [NotifyFailure("t", 0, "d0", 0, "write failed: ucx error", Cause.WRITE_FAILED)]
    assert rv.counts()["draining"] == 1  # dest 1 still writing
    out = rv.handle(WriteDone("t", 0, 1, 2.0))
    assert out == [ReleaseBlocks("t", SRC, False, "write failed: ucx error", Cause.WRITE_FAILED)]


def test_peer_abort_before_and_during_write() -> None:
    rv = Rendezvous()
    rv.handle(reg(dest=0, expected=2))
    rv.handle(reg(dest=1, expected=2))
    out = rv.handle(Aborted("t", 0, "preempted", "peer", 1.0, peer="d0"))
    assert ConfirmCancel("t", 0, "d0") in out
    assert of(NotifyFailure, out) == [
        NotifyFailure("t", 0, "d1", 1, "cancelled by d0: preempted", Cause.CANCELLED)
    ]
    assert rv.handle(pf(now=2.0)) == []  # dead attempt: nothing written
    # a new attempt; its peer cancels during the write: confirm only after the write
    rv.handle(reg(attempt=1, dest=0, expected=1, now=3.0))
    assert rv.handle(Aborted("t", 1, "gone", "peer", 4.0, peer="d0")) == []
    assert rv.handle(WriteDone("t", 1, 0, 5.0)) == [ConfirmCancel("t", 1, "d0")]
    assert rv.counts()["wait_register"] == 1  # still waiting for a newer attempt


def test_cancel_is_confirmed_after_the_last_write_to_that_peer() -> None:
    rv = Rendezvous()
    rv.handle(pf())
    rv.handle(reg(dest=0, expected=2, peer="p"))
    rv.handle(reg(dest=1, expected=2, peer="p"))
    assert rv.handle(Aborted("t", 0, "x", "peer", 1.0, peer="p")) == []
    assert rv.handle(WriteDone("t", 0, 1, 2.0)) == []
    assert rv.handle(WriteFailed("t", 0, 0, "e", 3.0)) == [ConfirmCancel("t", 0, "p")]
    assert rv.counts()["wait_register"] == 1


def test_peer_abort_for_unknown_transfer_is_confirmed() -> None:
    rv = Rendezvous()
    assert rv.handle(Aborted("x", 3, "r", "peer", 0.0, peer="d0")) == [ConfirmCancel("x", 3, "d0")]


def test_local_abort_fails_everything_after_writes_end() -> None:
    rv = Rendezvous()
    rv.handle(pf())
    rv.handle(reg(dest=0, expected=2))
    assert rv.handle(Aborted("t", None, "client gone", "local", 1.0)) == []
    assert rv.handle(WriteDone("t", 0, 0, 2.0)) == [
        ReleaseBlocks("t", SRC, False, "aborted: client gone", Cause.ABORTED)
    ]
    # before prefill: registrations hear at once; a later Prefilled is released at once
    rv.handle(reg("u", dest=0))
    out = rv.handle(Aborted("u", None, "x", "local", 3.0))
    assert of(NotifyFailure, out) and rv.counts()["failed"] == 2
    assert rv.handle(pf("u", now=4.0)) == [ReleaseBlocks("u", SRC, False, "aborted: x", Cause.ABORTED)]


def test_a_local_abort_of_an_unknown_transfer_is_remembered() -> None:
    """The engine gave a prefill up before this daemon saw it (issue 43): its registration is
    refused at once instead of waiting its deadline, a late PrefillDone is released at once,
    and the memory ends with the tombstone's time."""
    rv = Rendezvous(tombstone_s=10.0)
    assert rv.handle(Aborted("g", None, "given up", "local", 0.0)) == []
    out = rv.handle(reg("g", now=1.0))
    assert [type(a) for a in out] == [NotifyFailure] and out[0].cause is Cause.CLOSED
    assert rv.handle(pf("g", now=2.0)) == [ReleaseBlocks("g", SRC, False, "aborted: given up", Cause.ABORTED)]
    rv.handle(Tick(20.0))
    assert rv.info("g") is None


def test_peer_lost_fails_its_transfers_only() -> None:
    rv = Rendezvous()
    rv.handle(reg("a", peer="p1"))
    rv.handle(reg("b", peer="p2"))
    rv.handle(pf("c"))
    rv.handle(reg("c", peer="p1"))  # writing to p1
    out = rv.handle(PeerLost("p1", 1.0))
    assert NotifyFailure("a", 0, "p1", 0, "peer lost: p1", Cause.PEER_LOST) in out
    assert not of(ReleaseBlocks, out)  # c's write to p1 is still in flight
    out = rv.handle(WriteFailed("c", 0, 0, "peer gone", 2.0))
    assert of(ReleaseBlocks, out)[0].ok is False
    assert {p.transfer_id for p in rv.pending()} == {"b"}


def test_overload() -> None:
    rv = Rendezvous(max_transfers=2)
    rv.handle(reg("a"))
    rv.handle(pf("b"))
    assert rv.handle(reg("c")) == [NotifyFailure("c", 0, "d0", 0, "overloaded", Cause.OVERLOADED)]
    assert rv.handle(pf("d")) == [ReleaseBlocks("d", SRC, False, "overloaded", Cause.OVERLOADED)]
    rv.handle(pf("a"))
    rv.handle(WriteDone("a", 0, 0, 1.0))  # a done: room again
    assert rv.handle(reg("c", now=2.0)) == []  # accepted
    assert {p.transfer_id for p in rv.pending()} == {"b", "c"}


def test_register_after_done_and_invalid_registrations() -> None:
    rv = Rendezvous()
    rv.handle(pf())
    rv.handle(reg())
    rv.handle(WriteDone("t", 0, 0, 1.0))
    assert rv.handle(reg(now=2.0)) == []  # duplicate of the finished one
    out = rv.handle(reg(attempt=1, now=2.0))
    assert out == [NotifyFailure("t", 1, "d0", 0, "source blocks released", Cause.CLOSED)]
    # Destinations are consumer TP ranks (TP 2 -> 4: producer 1 writes ranks 2 and 3) ...
    assert rv.handle(reg("v", dest=2, expected=2)) == []
    assert rv.handle(reg("v", dest=3, expected=2)) == []
    # ... but never more distinct ones than expected_dests.
    assert of(NotifyFailure, rv.handle(reg("v", dest=0, expected=2)))
    assert of(NotifyFailure, rv.handle(reg("v", now=3.0, deadline=3.0)))
    assert rv.handle(pf("t", now=4.0)) == []  # duplicate Prefilled


def test_tombstones_are_purged() -> None:
    rv = Rendezvous(tombstone_s=10.0)
    rv.handle(pf())
    rv.handle(reg())
    rv.handle(WriteDone("t", 0, 0, 1.0))
    rv.handle(reg("u", deadline=2.0))
    rv.handle(Tick(5.0))
    assert rv.counts()["done"] == 1 and rv.counts()["expired"] == 1
    rv.handle(Tick(20.0))
    assert sum(rv.counts().values()) == 0 and rv._index == {} and rv.info("t") is None


@pytest.mark.parametrize("kind", ["register", "lease"])
def test_expiry_does_not_stop_at_first_unexpired_entry(kind: str) -> None:
    """Regression: deadlines inserted out of order must all expire on time."""
    rv = Rendezvous()
    deadlines = [100.0, 3.0, 50.0, 1.0, 7.0, 99.0, 2.0, 60.0]
    for i, d in enumerate(deadlines):
        rv.handle(reg(f"t{i}", deadline=d) if kind == "register" else pf(f"t{i}", lease=d))
    out = rv.handle(Tick(10.0))
    expired = {a.transfer_id for a in out}
    assert expired == {f"t{i}" for i, d in enumerate(deadlines) if d <= 10.0}
    assert all(p.deadline is not None and p.deadline > 10.0 for p in rv.pending())
    assert len(rv.pending()) == 4


def test_expiry_skips_past_stale_heap_entries() -> None:
    rv = Rendezvous()
    for i in range(10):  # finished transfers leave stale lease entries at 5.0
        rv.handle(pf(f"s{i}", lease=5.0))
        rv.handle(reg(f"s{i}"))
        rv.handle(WriteDone(f"s{i}", 0, 0, 1.0))
    rv.handle(reg("late", deadline=6.0))
    assert of(NotifyFailure, rv.handle(Tick(7.0)))[0].transfer_id == "late"
    assert rv.pending() == []


def test_tick_is_cheap_when_nothing_is_due() -> None:
    rv = Rendezvous()
    for i in range(20_000):
        rv.handle(reg(f"t{i}", deadline=1e6 - i))
    t0 = time.perf_counter()
    for k in range(2_000):
        rv.handle(Tick(float(k)))
    assert time.perf_counter() - t0 < 1.0  # a scan: ~4e7 steps


def test_heap_stays_bounded_under_rescheduling() -> None:
    rv = Rendezvous(tombstone_s=0.5)
    for i in range(5_000):
        rv.handle(reg(f"t{i}", now=float(i), deadline=i + 10.0))
        rv.handle(pf(f"t{i}", now=float(i), lease=i + 20.0))
        rv.handle(WriteDone(f"t{i}", 0, 0, float(i)))
    assert len(rv._deadlines._heap) <= 2 * len(rv._recs) + 64


def test_zero_tombstones_with_heap_compaction_during_expiry() -> None:
    rv = Rendezvous(tombstone_s=0.0)
    for i in range(500):
        rv.handle(reg(f"t{i}", deadline=1.0 + i % 7))
    rv.handle(Tick(100.0))
    assert sum(rv.counts().values()) == 0 and rv._deadlines._heap == [] and rv._index == {}


# --------------------------------------------------------- order does not matter


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 4), st.randoms(use_true_random=False), st.randoms(use_true_random=False))
def test_register_and_prefill_in_any_order_give_the_same_writes(
    n: int, r1: random.Random, r2: random.Random
) -> None:
    def run(rng: random.Random) -> tuple[set[StartWrite], list]:
        evs: list = [pf(lease=50.0)] + [
            reg(dest=d, expected=n, blocks=(10 * d, 10 * d + 1)) for d in range(n)
        ]
        rng.shuffle(evs)
        rv = Rendezvous()
        writes = [a for e in evs for a in rv.handle(e) if isinstance(a, StartWrite)]
        assert len(writes) == n
        ends = [a for w in writes for a in rv.handle(WriteDone("t", 0, w.dest_rank, 1.0))]
        return set(writes), ends

    assert run(r1) == run(r2)


# ------------------------------------------------------------ random interleavings

TIDS = ("a", "b")  # few names and peers: collisions are what find bugs
PEERS = ("p0", "p1")


class RendezvousMachine(RuleBasedStateMachine):
    """Drives the core with random events and plays an honest transport."""

    @initialize(tombstone=st.sampled_from([1e9, 5.0]))
    def setup(self, tombstone: float) -> None:
        self.rv = Rendezvous(tombstone_s=tombstone, max_transfers=1_000)
        self.purging = tombstone < 1e6
        self.now = 0.0
        self.expected: dict[tuple[str, int], int] = {}
        self.regs: dict[tuple[str, int, int], Registered] = {}
        self.prefill: dict[str, Prefilled] = {}
        self.released: dict[str, int] = {}
        self.max_attempt: dict[str, int] = {}
        self.started: set[tuple[str, int, int]] = set()
        self.outstanding: dict[tuple[str, int, int], StartWrite] = {}
        self.notified: set[tuple[str, int, int]] = set()
        self.peer_aborts: set[tuple[str, int, str]] = set()
        self.confirmed: set[tuple[str, int, str]] = set()

    # -- the checks, applied to every action

    def send(self, ev: object) -> None:
        self.check(self.rv.handle(ev))  # type: ignore[arg-type]
        self.forget_purged()

    def sync(self) -> None:
        """Expire what is due now, so a purge is seen before we record a new fact."""
        self.send(Tick(self.now))

    def forget_purged(self) -> None:
        """A purged transfer id may be reused by a new transfer: drop what we knew."""
        for tid in TIDS:
            if self.rv.info(tid) is None:
                assert not [k for k in self.outstanding if k[0] == tid], "purged mid-write"
                if tid in self.prefill:
                    assert self.released.get(tid) == 1, "purged without releasing"
                self.prefill.pop(tid, None)
                self.released.pop(tid, None)
                self.max_attempt.pop(tid, None)
                for keys in (self.regs, self.started):
                    for k in [k for k in keys if k[0] == tid]:
                        keys.remove(k) if isinstance(keys, set) else keys.pop(k)

    def check(self, actions: list) -> None:
        for a in actions:
            if isinstance(a, StartWrite):
                key = (a.transfer_id, a.attempt, a.dest_rank)
                assert key not in self.started, f"second StartWrite for {key}"
                self.started.add(key)
                p, r = self.prefill.get(a.transfer_id), self.regs.get(key)
                assert p is not None and r is not None, "write without prefill or registration"
                assert self.released.get(a.transfer_id, 0) == 0, "write after release"
                assert a.src_block_ids == p.block_ids and a.dst_block_ids == r.block_ids
                assert a.num_tokens == p.num_tokens == r.num_tokens
                assert a.peer == r.peer
                assert a.attempt == self.max_attempt[a.transfer_id], "superseded attempt writes"
                assert self.now < r.deadline, "write after the registration's deadline"
                self.outstanding[key] = a
            elif isinstance(a, ReleaseBlocks):
                tid = a.transfer_id
                assert tid in self.prefill and a.block_ids == self.prefill[tid].block_ids
                assert not [k for k in self.outstanding if k[0] == tid], "released mid-write"
                self.released[tid] = self.released.get(tid, 0) + 1
                assert self.released[tid] == 1, "ReleaseBlocks twice"
            elif isinstance(a, NotifyFailure):
                key = (a.transfer_id, a.attempt, a.dest_rank)
                assert key not in self.outstanding, "NotifyFailure while writing into it"
                self.notified.add(key)
            elif isinstance(a, ConfirmCancel):
                busy = [
                    k
                    for k, w in self.outstanding.items()
                    if k[:2] == (a.transfer_id, a.attempt) and w.peer == a.peer
                ]
                assert not busy, "ConfirmCancel while a write to that peer is in flight"
                self.confirmed.add((a.transfer_id, a.attempt, a.peer))

    # -- rules

    @rule(
        tid=st.sampled_from(TIDS),
        attempt=st.integers(0, 2),
        expected=st.integers(1, 2),
        dest=st.integers(0, 1),
        peer=st.sampled_from(("p0", "p0", "p1")),  # often one peer owns both dests
        tokens=st.sampled_from([16, 16, 16, 17]),
        dt=st.floats(0.5, 20),
    )
    def register(
        self, tid: str, attempt: int, expected: int, dest: int, peer: str, tokens: int, dt: float
    ) -> None:
        self.sync()
        n = self.expected.setdefault((tid, attempt), expected)
        key = (tid, attempt, dest % n)
        first = self.regs.get(key)  # a duplicate repeats the first one (new times)
        ev = Registered(tid, attempt, peer, dest % n, n, (dest, 9), tokens, self.now, self.now + dt)
        if first is not None:
            ev = replace(first, now=self.now, deadline=self.now + dt)
        self.regs.setdefault(key, ev)
        self.max_attempt[tid] = max(self.max_attempt.get(tid, 0), attempt)
        self.send(ev)

    @precondition(lambda self: self.prefill)
    @rule(
        data=st.data(),
        attempt=st.integers(0, 2),
        dest=st.integers(0, 1),
        peer=st.sampled_from(("p0", "p0", "p1")),
        dt=st.floats(0.5, 20),
    )
    def register_for_a_prefill(
        self, data: st.DataObject, attempt: int, dest: int, peer: str, dt: float
    ) -> None:
        """Registrations that match a held prefill: these are the ones that write."""
        tid = data.draw(st.sampled_from(sorted(self.prefill)))
        attempt = max(attempt, self.max_attempt.get(tid, 0))
        self.register(tid, attempt, 2, dest, peer, self.prefill[tid].num_tokens, dt)

    @rule(tid=st.sampled_from(TIDS), tokens=st.sampled_from([16, 16, 17]), dt=st.floats(0.5, 30))
    def prefill_done(self, tid: str, tokens: int, dt: float) -> None:
        ev = Prefilled(tid, (100, 101), tokens, self.now, self.now + dt)
        self.sync()
        self.prefill.setdefault(tid, ev)
        self.send(ev)

    @precondition(lambda self: self.outstanding)
    @rule(data=st.data(), ok=st.sampled_from([True, True, False]))
    def write_ends(self, data: st.DataObject, ok: bool) -> None:
        key = data.draw(st.sampled_from(sorted(self.outstanding)))
        del self.outstanding[key]
        tid, attempt, dest = key
        self.send(
            WriteDone(tid, attempt, dest, self.now)
            if ok
            else WriteFailed(tid, attempt, dest, "boom", self.now)
        )

    @precondition(lambda self: self.outstanding)
    @rule(data=st.data())
    def cancel_a_write_in_flight(self, data: st.DataObject) -> None:
        tid, attempt, _ = key = data.draw(st.sampled_from(sorted(self.outstanding)))
        self.peer_abort(tid, attempt, self.outstanding[key].peer)

    @precondition(lambda self: self.outstanding)
    @rule(data=st.data(), bump=st.integers(-1, 1), dt=st.floats(0.5, 20))
    def reregister_a_write_in_flight(self, data: st.DataObject, bump: int, dt: float) -> None:
        tid, attempt, dest = data.draw(st.sampled_from(sorted(self.outstanding)))
        r = self.regs[(tid, attempt, dest)]
        self.register(tid, max(0, attempt + bump), r.expected_dests, dest, r.peer, 16, dt)

    @rule(
        kind=st.sampled_from(["peer_abort", "local_abort", "peer_lost", "bogus_write_done"]),
        tid=st.sampled_from(TIDS),
        attempt=st.integers(0, 2),
        dest=st.integers(0, 1),
        peer=st.sampled_from(PEERS),
    )
    def disrupt(self, kind: str, tid: str, attempt: int, dest: int, peer: str) -> None:
        """One rule for the destructive events, so they do not dominate the runs."""
        if kind == "peer_abort":
            self.peer_abort(tid, attempt, peer)
        elif kind == "local_abort":
            self.send(Aborted(tid, None, "stop", "local", self.now))
        elif kind == "peer_lost":
            self.send(PeerLost(peer, self.now))
        elif (tid, attempt, dest) not in self.outstanding:  # the transport never lies
            self.send(WriteDone(tid, attempt, dest, self.now))

    def peer_abort(self, tid: str, attempt: int, peer: str) -> None:
        self.peer_aborts.add((tid, attempt, peer))
        self.send(Aborted(tid, attempt, "cancel", "peer", self.now, peer=peer))

    @rule(dt=st.floats(0, 6))
    def tick(self, dt: float) -> None:
        self.now += dt
        self.send(Tick(self.now))

    # -- invariants between steps

    @invariant()
    def nothing_waits_past_its_deadline(self) -> None:
        for p in self.rv.pending():
            assert p.state in ("wait_prefill", "wait_register", "writing", "draining", "streamed")
            if p.state.startswith("wait") or p.state == "streamed":
                assert p.deadline is not None and p.deadline > self.now, p
            else:  # the transport owes an answer, so no deadline is needed
                assert p.deadline is None and p.writes_in_flight > 0, p
        live = sum(n for s, n in self.rv.counts().items() if s not in ("done", "failed", "expired"))
        assert live == len(self.rv.pending())

    def teardown(self) -> None:
        if not hasattr(self, "rv"):
            return
        # the transport answers everything still in flight, then time runs out
        while self.outstanding:
            key = min(self.outstanding)
            del self.outstanding[key]
            self.send(WriteDone(*key, self.now))
        self.now += 1e3
        self.send(Tick(self.now))
        assert self.rv.pending() == []
        for tid in self.prefill:
            assert self.released.get(tid) == 1, f"{tid}: blocks never released"
        if not self.purging:
            for (tid, attempt, dest), r in self.regs.items():
                assert (
                    (tid, attempt, dest) in self.started
                    or (tid, attempt, dest) in self.notified
                    or (tid, attempt, r.peer) in self.peer_aborts
                ), f"registration {(tid, attempt, dest)} never answered"
            assert self.peer_aborts <= self.confirmed, "a peer cancel was never confirmed"


RendezvousMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestRendezvousInterleavings = RendezvousMachine.TestCase


# ------------------------------------------------------------------------ identities


def _as(identity: str, r: Registered) -> Registered:
    return replace(r, identity=identity)


def test_only_the_registering_identity_may_supersede_or_add_destinations() -> None:
    rv = Rendezvous()
    rv.handle(_as("nodeD", reg(dest=0, expected=2)))
    # Another node before the prefill: parked (it might be the bound party), not accepted.
    for r in (reg(attempt=5, peer="evil"), reg(dest=1, expected=2, peer="evil")):
        assert rv.handle(_as("nodeX", r)) == []
    assert rv.info("t").attempt == 0
    # An unbound prefill keeps the first registrant: the parked rivals are refused then.
    out = rv.handle(pf())
    assert sorted((a.peer, a.attempt) for a in of(NotifyFailure, out)) == [("evil", 0), ("evil", 5)]
    assert all("another peer" in a.reason for a in of(NotifyFailure, out))
    assert [w.peer for w in of(StartWrite, out)] == ["d0"]
    # After the prefill a rival is refused at once.
    out = rv.handle(_as("nodeX", reg(dest=1, expected=2, peer="evil")))
    assert [type(a) for a in out] == [NotifyFailure] and "another peer" in out[0].reason
    # The owner still completes its transfer.
    assert of(StartWrite, rv.handle(_as("nodeD", reg(dest=1, expected=2, now=1.0))))


def _bound(**kw) -> Prefilled:
    return replace(pf(), **kw)


@pytest.mark.parametrize("binding", [{"bind_identity": "nodeD"}, {"bind_secret": "s3cret"}])
def test_bound_party_wins_over_a_hijacker_that_registered_first(binding) -> None:
    """The hijacker registers first (it owns the record), the bound decode side is parked; the
    bound prefill ousts the hijacker (never written) and writes to the bound party."""
    rv = Rendezvous()
    secret = binding.get("bind_secret", "")
    assert rv.handle(_as("nodeX", reg(attempt=3, peer="evil"))) == []
    assert rv.handle(replace(_as("nodeD", reg(peer="good")), secret=secret)) == []
    out = rv.handle(_bound(**binding))
    assert [(type(a).__name__, a.peer) for a in out] == [("NotifyFailure", "evil"), ("StartWrite", "good")]
    assert out[0].cause == rz.Cause.UNBOUND
    # The hijacker cannot come back, under any attempt.
    out = rv.handle(_as("nodeX", reg(attempt=9, peer="evil", now=1.0)))
    assert [(type(a), a.cause) for a in out] == [(NotifyFailure, rz.Cause.UNBOUND)]
    assert of(ReleaseBlocks, rv.handle(WriteDone("t", 0, 0, 2.0)))[0].ok


@pytest.mark.parametrize("binding", [{"bind_identity": "nodeD"}, {"bind_secret": "s3cret"}])
def test_bound_prefill_first_refuses_others_and_admits_the_bound_party(binding) -> None:
    rv = Rendezvous()
    secret = binding.get("bind_secret", "")
    assert rv.handle(_bound(**binding)) == []
    for r in (_as("nodeX", reg(peer="evil")), replace(_as("nodeX", reg(peer="evil")), secret="guess")):
        out = rv.handle(r)
        assert [(type(a), a.cause) for a in out] == [(NotifyFailure, rz.Cause.UNBOUND)]
    out = rv.handle(replace(_as("nodeD", reg(peer="good", now=1.0)), secret=secret))
    assert [(type(a), a.peer) for a in out] == [(StartWrite, "good")]


def test_bound_prefill_without_the_bound_party_waits_for_it() -> None:
    """Only the hijacker registered before the prefill: it is refused, and the transfer waits
    (attempt reset) for the bound party, which then gets its write."""
    rv = Rendezvous()
    rv.handle(_as("nodeX", reg(attempt=4, peer="evil")))
    out = rv.handle(_bound(bind_identity="nodeD"))
    assert [(type(a), a.peer, a.cause) for a in out] == [(NotifyFailure, "evil", rz.Cause.UNBOUND)]
    assert rv.info("t").state == State.WAIT_REGISTER
    assert [(type(a), a.peer) for a in rv.handle(_as("nodeD", reg(peer="good", now=1.0)))] == [(StartWrite, "good")]


def test_a_hijacker_ending_its_attempt_hands_the_transfer_to_the_parked_party() -> None:
    """A hijacker's short registration timing out (or its cancel) does not take the parked
    registration down with it."""
    rv = Rendezvous()
    rv.handle(_as("nodeX", reg(peer="evil", deadline=5.0)))
    rv.handle(_as("nodeD", reg(peer="good", deadline=50.0)))
    out = rv.handle(rz.Tick(6.0))
    assert [(type(a), a.peer) for a in out] == [(NotifyFailure, "evil")]
    assert rv.info("t").state == State.WAIT_PREFILL
    assert [(type(a), a.peer) for a in rv.handle(_bound(now=7.0, lease_deadline=60.0, bind_identity="nodeD"))] == [
        (StartWrite, "good")]


def test_a_parked_party_that_cancelled_is_never_promoted() -> None:
    """Its cancel is confirmed at once (nothing was written to it), so the decode side may reuse
    those blocks: when the owner's attempt ends later, it must not take the transfer over."""
    rv = Rendezvous()
    rv.handle(_as("nodeX", reg(peer="evil")))
    rv.handle(_as("nodeD", reg(peer="good", attempt=1)))
    out = rv.handle(rz.Aborted("t", 1, "cancel", "peer", 1.0, peer="good"))
    assert [(type(a), a.peer) for a in out] == [(ConfirmCancel, "good")]
    out = rv.handle(rz.Aborted("t", 0, "cancel", "peer", 2.0, peer="evil"))
    assert [(type(a), a.peer) for a in out] == [(ConfirmCancel, "evil")]
    assert rv.info("t").state == State.EXPIRED
    assert of(StartWrite, rv.handle(pf(now=3.0))) == []


def test_parked_registrations_are_bounded_and_count_in_quota() -> None:
    rv = Rendezvous(max_parked=2)
    rv.handle(_as("nodeD", reg(dest=0, expected=4)))
    assert rv.handle(_as("nodeX", reg(dest=1, expected=4, peer="x1"))) == []
    assert rv.handle(_as("nodeX", reg(dest=2, expected=4, peer="x2"))) == []
    out = rv.handle(_as("nodeX", reg(dest=3, expected=4, peer="x3")))
    assert [(type(a), a.cause) for a in out] == [(NotifyFailure, rz.Cause.OVERLOADED)]
    assert rv.peer_held("nodeX").units == 6


@given(st.lists(st.tuples(st.sampled_from(["a", "b"]), st.integers(0, 3), st.integers(0, 1)), max_size=12))
def test_no_write_ever_targets_a_peer_of_another_identity(regs) -> None:
    rv = Rendezvous()
    peer_of = {"a": "pa", "b": "pb"}
    owner = None
    out = rv.handle(pf())
    for i, (who, attempt, dest) in enumerate(regs):
        out = rv.handle(_as(who, reg(attempt=attempt, dest=dest, expected=2, peer=peer_of[who], now=i * 0.01)))
        owner = owner or who
        for w in of(StartWrite, out):
            assert w.peer == peer_of[owner]
