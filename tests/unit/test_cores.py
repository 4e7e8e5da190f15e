"""The transition tables of both pure cores, and the machinery they share (daemon.core).

* every row of each table is taken by some event sequence, or is documented unreachable
  and is never taken;
* after any event sequence the record is in the state the taken row names, and that state
  agrees with the record's facts (an independent derivation, the one the cores used
  before the table named states) and with the deadline rule of that state;
* every cause agrees with its reason, so callers can switch from matching strings;
* the counter's registration queries agree with the actions it emitted.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush.common.machine import core
from kvpush.common.machine.core import Row, Table, row
from kvpush.common.machine.deadlines import Deadlines
from kvpush.daemon.core import counter as cm
from kvpush.daemon.core import rendezvous as rz
from kvpush.daemon.core.causes import Cause
from kvpush.daemon.core.quotas import Quota
from kvpush.proto.notif import Notification, authentic

# ------------------------------------------------------------------ the Table itself


class _S(core.enum.Enum):
    A = "a"
    B = "b"


class _E:
    pass


def _always(core_: Any, rec: Any, ev: Any) -> bool:
    return True


def test_table_must_be_total() -> None:
    rows = [row(None, _E, None, _S.A), row(_S.A, _E, None, _S.B)]
    with pytest.raises(ValueError, match="no row for"):
        Table(_S, (_E,), rows)  # (B, _E) missing


def test_table_last_row_and_only_the_last_is_unguarded() -> None:
    ok = [row(None, _E, None, None), row(_S.A, _E, None, _S.A), row(_S.B, _E, None, _S.B)]
    Table(_S, (_E,), ok)
    with pytest.raises(ValueError, match="last row"):
        Table(_S, (_E,), [*ok, row(_S.B, _E, _always, _S.A)])  # guarded after the fallback
    with pytest.raises(ValueError, match="last row"):
        Table(_S, (_E,), [row(None, _E, _always, None), *ok[1:]])  # no fallback for None


def test_table_rejects_foreign_events() -> None:
    class Other:
        pass

    with pytest.raises(ValueError, match="not an event"):
        Table(_S, (_E,), [row(None, Other, None, None)])


def test_rows_print_as_transitions() -> None:
    text = rz.TABLE.describe()
    assert "WAIT_REGISTER --Registered[completes_set]--> WRITING: open_attempt, add_reg, start_reg" in text
    assert "WAITING --_Deadline[graceless]--> FAILED: fail_timeout" in cm.TABLE.describe()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.one_of(st.none(), st.integers(0, 50)), st.integers(0, 50)),
                max_size=80))
def test_deadlines_pop_what_is_due_and_earliest_is_a_lower_bound(ops: list) -> None:
    """The deadline store against a dict: ``pop_due`` yields exactly the keys due, earliest
    first, and ``earliest`` never passes a live deadline (Core skips expiry on it)."""
    d: Deadlines[int] = Deadlines()
    model: dict[int, int] = {}
    for key, due, now in ops:
        d.set(key, due)
        if due is None:
            model.pop(key, None)
        else:
            model[key] = due
        assert d.earliest <= min(model.values(), default=float("inf"))
        if now % 3 == 0:
            got = list(d.pop_due(now))
            want = sorted((k for k, t in model.items() if t <= now), key=lambda k: model[k])
            assert sorted(got) == sorted(want) and [model[k] for k in got] == sorted(model[k] for k in got)
            for k in got:
                del model[k]
            assert d.earliest <= min(model.values(), default=float("inf"))
            assert all(d.get(k) == t for k, t in model.items())


def test_states_are_str_enums_with_the_old_values() -> None:
    assert rz.State.WRITING == "writing" and cm.State.WAITING == "waiting"
    assert {"done", "failed", "expired"} == set(rz.TOMBSTONES)
    assert {"completed", "failed", "released"} == set(cm.TOMBSTONES)
    assert Cause.TIMEOUT == "timeout"


# ------------------------------------------------------------------- event sources

TIDS = ("a", "b", "c")
PEERS = ("p0", "p1")
NODES = {"p0": "n0", "p1": "n1"}  # each peer session's certificate identity


def _rz_scripts() -> list[list[Any]]:
    """Sequences the random source rarely finds: a deferred final write whose groups land
    after the registration's deadline (with and without the seal's full set, last or not),
    an older attempt's group failing, a duplicate while WRITING, a cancelled attempt's last
    group failing, a rival parked meanwhile taking over once it has landed."""
    def reg(dest: int, exp: int, attempt: int = 0, deadline: float = 5.0) -> rz.Registered:
        return rz.Registered("a", attempt, "p0", dest, exp, (dest, 9), 16, 0.0, deadline)

    lr = rz.LayersReady("a", 0, 0, 1, 0, (100, 101), 0.0, 30.0, ("", ""))
    seal = rz.Prefilled("a", (100, 101), 16, 0.0, 30.0, epoch=0)
    late = [rz.WriteDone("a", 0, 0, 6.0, 1)]
    owner, rival = (dataclasses.replace(reg(0, 1, attempt), peer=f"p{attempt}", identity=f"n{attempt}")
                    for attempt in (0, 1))
    return [
        [reg(0, 1), lr, seal, *late],  # WRITING, last flight -> FAILED
        [reg(0, 2), reg(1, 2), lr, seal, *late],  # WRITING, another flight -> DRAINING
        [reg(0, 2), lr, seal, *late],  # WAIT_REGISTER, last -> FAILED
        [reg(0, 3), reg(1, 3), lr, seal, *late],  # WAIT_REGISTER -> DRAINING
        [reg(0, 1), lr, reg(0, 1, attempt=1), rz.WriteFailed("a", 0, 0, "x", 1.0, group=1)],
        [reg(0, 2), reg(1, 2), lr, rz.WriteFailed("a", 0, 0, "x", 1.0, group=1)],  # another dest's group flies
        [reg(0, 2), reg(1, 2), seal, rz.WriteDone("a", 0, 0, 1.0), reg(0, 2)],
        [reg(0, 1), seal, rz.WriteDone("a", 0, 0, 1.0), rz.LayersReady("a", 0, 1, 2, 0, (100, 101), 2.0, 9.0, ("", ""))],
        [reg(0, 1), lr, rz.Aborted("a", 0, "x", "peer", 1.0, "p0"), rz.WriteFailed("a", 0, 0, "x", 1.0, group=1)],
        *[[owner, lr, rz.Aborted("a", 0, "x", "peer", 1.0, "p0"), rival, end] for end in (  # the rival takes over
            rz.WriteDone("a", 0, 0, 1.0, group=1), rz.WriteFailed("a", 0, 0, "x", 1.0, group=1))],
    ]


def rz_events(rng: random.Random, n: int, bind: bool = False) -> Iterator[Any]:
    """Registrations, prefills, write results (also stray ones), aborts, peer losses and
    time, over few names so that they collide. ``bind``: registrations now and then by
    another node or with a secret, prefills now and then bound to a node or a secret."""
    now = 0.0
    stream = rng.random() < 0.5  # half the runs: group WRITE answers and short deadlines
    if rng.random() < 0.1:
        yield from rng.choice(_rz_scripts())
        now = 10.0
    for _ in range(n):
        k, tid = rng.random(), rng.choice(TIDS)
        if k < 0.3:
            exp = rng.choice([1, 1, 2, 2, 3])
            bad = rng.random() < 0.05
            attempt = -1 if bad else rng.choice([0, 0, 1, 2])  # (draws in the order they always had)
            peer = rng.choice(PEERS)  # its node, mostly; now and then another node's session
            node = "" if not bind else NODES[peer] if rng.random() < 0.8 else rng.choice(list(NODES.values()))
            yield rz.Registered(
                tid, attempt, peer,
                rng.randrange(exp + bad), exp + (rng.random() < 0.05), (rng.randrange(5), 9),
                rng.choice([16, 16, 16, 17]), now, now + rng.uniform(-1, 6 if stream else 20), rng.choice([0, 0, 16]),
                node, rng.choice(["", "", "s", "x"]) if bind else "",
            )  # fmt: skip
        elif k < 0.45:
            binding = rng.choice([("", ""), ("", ""), ("n0", ""), ("", "s")]) if bind else ("", "")
            if rng.random() < (0.6 if stream else 0.0):  # layer progress (streaming), epochs colliding
                lo = rng.randrange(4)
                yield rz.LayersReady(tid, rng.choice([0, 0, 0, 1]), lo, lo + 1, 0, (100, 101), now,
                                     now + rng.uniform(0.5, 30), binding if rng.random() < 0.9 else None)
            else:
                yield rz.Prefilled(tid, (100, 101), rng.choice([16, 16, 17]), now, now + rng.uniform(0.5, 30),
                                   *binding, epoch=rng.choice([-1, 0, 0, 1]))
        elif k < 0.65:
            a, d, g = rng.randrange(3), rng.randrange(3), rng.choice([0, 1, 1, 2, 3] if stream else [0])
            if rng.random() < 0.7:
                yield rz.WriteDone(tid, a, d, now, g)
            else:
                yield rz.WriteFailed(tid, a, d, "boom", now, rng.choice([Cause.WRITE_FAILED, Cause.TIMEOUT]), g)
        elif k < 0.75:
            if rng.random() < 0.5:
                yield rz.Aborted(tid, rng.choice([None, 0, 1, 2]), "x", "peer", now, rng.choice(PEERS))
            else:
                yield rz.Aborted(tid, None, "stop", "local", now)
        elif k < 0.8:
            yield rz.PeerLost(rng.choice(PEERS), now)
        else:
            now += rng.uniform(0, 6)
            yield rz.Tick(now)
    yield rz.Tick(now + 1e4)


def _key(tid: str, attempt: int, rank: int) -> bytes:
    """The key cm_events' registrations give producer ``rank`` of (tid, attempt)."""
    return f"{tid}/{attempt}/{rank}".encode()


def cm_events(rng: random.Random, n: int) -> Iterator[Any]:
    """Registrations (with endpoints, ranks, forwards) and producer results aimed mostly
    at them, with stale, duplicate, out-of-range and unknown ones mixed in."""
    now, known = 0.0, []
    for _ in range(n):
        k = rng.random()
        if k < 0.15 or not known:
            tid, att = rng.choice("ab"), rng.randrange(-1 if rng.random() < 0.03 else 0, 3)
            p = rng.randrange(0 if rng.random() < 0.03 else 1, 4)
            eps = tuple(rng.sample(["e0", "e1", "e2", "e3"], p))
            ranks = tuple(rng.sample(range(8), p))
            known.append((tid, att, p))
            fwds = tuple(f"fwd{r}" for r in ranks)
            keys = tuple(_key(tid, att, r) for r in ranks)
            yield cm.Registered(tid, att, p, now, now + rng.uniform(-1, 30), eps, ranks, fwds, keys)
            continue
        tid, att, p = rng.choice(known) if rng.random() < 0.85 else (rng.choice("ab"), rng.randrange(3), 2)
        r = rng.randrange(p + 1)
        named: int | str = r if rng.random() < 0.8 else rng.choice(["e0", "e1", "e2", "e3"])  # or by endpoint
        if k < 0.5:
            yield cm.Notified(tid, att, r, now)
        elif k < 0.58:
            cause = rng.choice([Cause.PRODUCER_FAILED, Cause.PEER_LOST])
            yield cm.ProducerFailed(tid, att, named, "boom", now, cause, rng.random() < 0.2, rng.random() < 0.5)
        elif k < 0.66:
            yield cm.ProducerCancelled(tid, att, named, now)
        elif k < 0.72:
            yield cm.Aborted(tid, att, "stop", now)
        elif k < 0.78:
            yield cm.Announced(tid, att, rng.randrange(8), rng.choice([0, 0, 1, 2]), rng.random() < 0.5, now)
        elif k < 0.84:
            senders = frozenset(rng.sample(["e0", "e1", "e2", "e3"], rng.choice([0, 1, 1, 4])))
            rank = rng.randrange(8)
            signer = (tid, att) if rng.random() < 0.6 else (rng.choice("ab"), rng.randrange(3))  # or a forgery
            tag = Notification.signed(_key(*signer, rank), tid, att, rank).tag
            yield cm.Noticed(tid, att, rank, "agent", senders, now, tag)
        else:
            now += rng.uniform(0, 6)
            yield cm.Tick(now)
    yield cm.Tick(now + 1e4)


# ------------------------------------------------------------ every row, or why not


def rz_bound_events(rng: random.Random, n: int) -> Iterator[Any]:
    return rz_events(rng, n, bind=True)


def _taken_rows(make: Any, events: Any, seeds: range) -> set[Row]:
    taken: set[Row] = set()
    for seed in seeds:
        c = make()
        c.on_transition = lambda key, old, ev, r: taken.add(r)
        for ev in events(random.Random(seed), 300):
            c.handle(ev)
    return taken


@pytest.mark.parametrize(
    "table, makes, events",
    [
        (
            rz.TABLE,
            [lambda: rz.Rendezvous(tombstone_s=5.0, max_transfers=2), lambda: rz.Rendezvous(tombstone_s=5.0),
             lambda: rz.Rendezvous(tombstone_s=5.0, quota=Quota(2, 40))],
            [rz_events, rz_bound_events],
        ),
        (cm.TABLE, [lambda: cm.CompletionCounter(tombstone_s=3.0, max_attempts=3),
                    lambda: cm.CompletionCounter(tombstone_s=3.0, max_attempts=3, cancel_grace_s=2.0)], [cm_events]),
    ],
    ids=["rendezvous", "counter"],
)
def test_every_row_is_taken_or_documented_unreachable(table: Table, makes: list, events: list) -> None:
    taken: set[Row] = set()
    for make in makes:
        for source in events:
            taken |= _taken_rows(make, source, range(400))
    never = [str(r) for r in table.rows if r not in taken and not r.unreachable]
    assert never == [], "rows never taken (take them, or document why they cannot be):\n" + "\n".join(never)
    wrong = [str(r) for r in table.rows if r in taken and r.unreachable]
    assert wrong == [], "rows documented unreachable but taken:\n" + "\n".join(wrong)


# ---------------------------------------------- the state is the one the table names


def _rz_state_from_facts(rec: Any) -> rz.State:
    """The state implied by a transfer's facts, derived independently of the table (the
    rules the core applied before its table named the states)."""
    v = rec.verdict
    if v is not None:
        if rec.writes.inflight:
            return rz.State.DRAINING
        return rz.State.DONE if v.ok else rz.State.FAILED
    if rec.prefill is None:
        if (rec.live and rec.regs) or rec.writes.inflight:  # or a cancelled attempt's groups drain
            return rz.State.WAIT_PREFILL
        return rz.State.STREAMED if rec.attempt < 0 else rz.State.EXPIRED  # progress only
    if rec.live and len(rec.regs) == rec.expected:
        return rz.State.WRITING
    return rz.State.WAIT_REGISTER


_RZ_CAUSES = [  # reason prefix -> cause, as callers matched strings before causes existed
    ("superseded by attempt", Cause.SUPERSEDED),
    ("write failed", None),  # the transport's cause, carried by WriteFailed
    ("peer lost", Cause.PEER_LOST),
    ("aborted", Cause.ABORTED),
    ("cancelled by", Cause.CANCELLED),
    ("lease expired: no decode side registered", Cause.UNCLAIMED),
    ("lease expired", Cause.LEASE_EXPIRED),
    ("prefill did not complete in time", Cause.TIMEOUT),
    ("num_tokens mismatch", Cause.MISMATCH),
    ("overloaded", Cause.OVERLOADED),
    ("transfer is bound to another party", Cause.UNBOUND),
    ("transfer ended before its prefill", Cause.CLOSED),
    ("quota: ", Cause.QUOTA),
    ("source blocks released", Cause.CLOSED),
    ("transfer aborted", Cause.CLOSED),
    ("attempt", Cause.CLOSED),  # "attempt N already failed or ended"
    ("", Cause.INVALID),
]


def _rz_cause_of(reason: str) -> Cause | None:
    return next(c for prefix, c in _RZ_CAUSES if reason.startswith(prefix))


class _Watch:
    """Checks every transition of a core as it happens."""

    def __init__(self, c: Any, facts: Any) -> None:
        self.c, self.facts = c, facts
        c.on_transition = self.saw

    def saw(self, key: Any, old: Any, ev: Any, r: Row) -> None:
        rec = self.c._get(key)
        assert r.state is old and isinstance(ev, r.event), r
        if r.to is None:
            assert rec is None, f"{r}: record kept"
            return
        assert rec is not None and rec.state is r.to, f"{r}: in {rec and rec.state}"
        self.facts(self.c, key, rec, r)
        due = self.c._deadlines.get(key)
        if r.to in self.c._tombstones:
            assert due is not None and due <= self.c.now + self.c.tombstone_s, r
        else:
            assert due == self.c._due[r.to](rec), f"{r}: deadline {due}"


def _rz_facts(c: rz.Rendezvous, key: str, rec: Any, r: Row) -> None:
    assert _rz_state_from_facts(rec) is rec.state, f"{r}: facts say {_rz_state_from_facts(rec)}"
    if rec.state is rz.State.WRITING:
        assert rec.writes.inflight, "WRITING without a write in flight"
    assert not rec.contest.parked or rec.state is rz.State.WAIT_PREFILL, "parked rivals outlive WAIT_PREFILL"


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 2**32), st.sampled_from([(5.0, 2, None), (5.0, 1000, None), (1e9, 1000, None),
                                               (5.0, 1000, Quota(2, 40))]))
def test_rendezvous_states_follow_the_table_and_the_facts(seed: int, cfg: tuple) -> None:
    rng = random.Random(seed)  # a seed, not st.randoms: the sequences are long
    rv = rz.Rendezvous(tombstone_s=cfg[0], max_transfers=cfg[1], quota=cfg[2])
    _Watch(rv, _rz_facts)
    for ev in rz_events(rng, 120, bind=seed % 2 == 1):
        for a in rv.handle(ev):
            if isinstance(a, rz.NotifyFailure) or (isinstance(a, rz.ReleaseBlocks) and not a.ok):
                want = _rz_cause_of(a.reason)
                if want is None:  # a write failure: the transport said why
                    assert a.cause in (Cause.WRITE_FAILED, Cause.TIMEOUT), a
                else:
                    assert a.cause is want, a
            elif isinstance(a, rz.ReleaseBlocks):
                assert a.cause is Cause.OK and a.reason == "", a
            if isinstance(a, rz.ReleaseBlocks):
                assert not rv.live(a.transfer_id), "released but still live"
        for tid in TIDS:
            info = rv.info(tid)
            assert rv.live(tid) == (info is not None and info.state not in rz.TOMBSTONES)
            assert info is None or type(info.state) is rz.State


def _cm_facts(c: cm.CompletionCounter, key: tuple, rec: Any, r: Row) -> None:
    s, n = rec.state, rec.producers
    assert rec.notified <= rec.resolved <= set(range(n))
    if s not in cm.TOMBSTONES:
        assert len(rec.resolved) < n, f"{r}: live with every producer resolved"
    if s is cm.State.WAITING:
        assert rec.resolved == rec.notified and c.current(rec.transfer_id) == rec.attempt
    elif s is cm.State.FAILING:
        assert rec.reason and (rec.resolved != rec.notified or rec.tainted)
    elif s is cm.State.SUPERSEDED:  # the newest may be purged before this one settles
        assert c.current(rec.transfer_id) != rec.attempt
    elif s is cm.State.COMPLETED:
        assert len(rec.notified) == n


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 2**32), st.sampled_from([3.0, 1e9]))
def test_counter_states_follow_the_table_and_the_queries_agree(seed: int, tomb: float) -> None:
    rng = random.Random(seed)
    cc = cm.CompletionCounter(tombstone_s=tomb)
    _Watch(cc, _cm_facts)
    told: set[tuple[str, int]] = set()  # the engine heard the outcome
    gone: dict[tuple[str, int], set[int]] = {}  # producers whose final word was sent
    for ev in cm_events(rng, 120):
        if isinstance(ev, (cm.Notified, cm.ProducerFailed, cm.ProducerCancelled)):
            p, rec = ev.producer, cc._recs.get((ev.transfer_id, ev.attempt))
            if isinstance(p, str):  # named by its endpoint: the first producer there
                p = rec.endpoints.index(p) if rec is not None and p in rec.endpoints else None
            if p is not None:
                gone.setdefault((ev.transfer_id, ev.attempt), set()).add(p)
        elif isinstance(ev, cm.Noticed):  # a final word only for the newest live attempt, from its producer
            rec = cc._recs.get((ev.transfer_id, ev.attempt))
            if (rec is not None and rec.state not in cm.TOMBSTONES and not rec.superseded
                    and ev.producer_rank in rec.ranks
                    and authentic(_key(ev.transfer_id, ev.attempt, ev.producer_rank),
                                  Notification(ev.transfer_id, ev.attempt, ev.producer_rank, ev.tag))
                    and rec.endpoints[rec.ranks.index(ev.producer_rank)] in ev.senders):
                gone.setdefault((ev.transfer_id, ev.attempt), set()).add(rec.ranks.index(ev.producer_rank))
        for a in cc.handle(ev):
            key = (a.transfer_id, a.attempt)
            if isinstance(a, cm.Accepted):  # answers the Expect just handled
                e = ev
                assert isinstance(e, cm.Registered) and key == (e.transfer_id, e.attempt)
                assert (a.forwards, a.endpoints) == (e.forwards, e.endpoints)
                reg = cc.registration(a.transfer_id)
                assert reg is not None and reg.live and reg.attempt == a.attempt
                assert (reg.endpoints, reg.ranks, reg.forwards) == (e.endpoints, e.ranks, e.forwards)
                assert (reg.since, reg.deadline, reg.producers) == (e.now, e.deadline, e.producers)
                for i, (ep, rank) in enumerate(zip(e.endpoints, e.ranks, strict=True)):
                    assert cc.producer_index(a.transfer_id, ep) == i
                    assert cc.rank_index(a.transfer_id, rank, a.attempt) == i
                assert cc.producer_index(a.transfer_id, "nowhere") is None
                told.discard(key)
                gone.pop(key, None)  # a new record under a purged one's key
            elif isinstance(a, (cm.Complete, cm.Fail, cm.Release)) and key in cc._recs:
                told.add(key)
                reg = cc.registration(*key)
                assert reg is not None and not reg.live and reg.state in cm.TOMBSTONES
            if isinstance(a, (cm.Fail, cm.SendCancel)):
                # what callers matched before causes: the same set of actions
                assert ("timed out" in a.reason) == (a.cause is Cause.TIMEOUT), a
        for tid in "ab":
            reg = cc.registration(tid)
            assert cc.live(tid) == (reg is not None and reg.live)
            if reg is not None:
                assert (reg.state in cm.TOMBSTONES) == ((tid, reg.attempt) in told)
        for ep in ("e0", "e1", "e2", "e3"):  # brute force over the records
            want = sorted(
                (r.transfer_id, r.attempt, r.endpoints.index(ep))
                for k, r in cc._recs.items()
                if r.state not in cm.TOMBSTONES
                and ep in r.endpoints
                and r.endpoints.index(ep) not in gone.get(k, set())
            )
            assert cc.waiting_on(ep) == want
    assert cc.pending() == [] and cc.waiting_on("e0") == []
