"""Rendezvous, layer-wise streaming: examples, then the random interleavings of
test_rendezvous.py with layer progress, epochs, group WRITEs and their answers mixed in.

The checks: no WRITE (group or final) targets blocks of an ended attempt; the final write
(the notification) and any failure or cancel answer to a peer come only once no WRITE of that
attempt and destination is in flight; the engine's blocks go back only when nothing reads
them; nothing of a new epoch is posted over a WRITE of an older one; a final write skips only
parts read from the blocks the seal names, in the seal's epoch.
"""

from __future__ import annotations

import dataclasses

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from kvpush.daemon.core.rendezvous import (
    Aborted,
    ConfirmCancel,
    LayersReady,
    NotifyFailure,
    PeerLost,
    Prefilled,
    Registered,
    ReleaseBlocks,
    Rendezvous,
    StartGroupWrite,
    StartWrite,
    State,
    Tick,
    WriteDone,
    WriteFailed,
)
from tests.unit.test_rendezvous import RendezvousMachine, _as, of, pf, reg

UNBOUND = ("", "")  # a stream that announced no binding (a client-named transfer)

SRC = (1, 2, 3)


def lr(lo: int, hi: int, *, tid: str = "t", epoch: int = 0, first: int = 0, blocks=SRC, now: float = 0.0):
    return LayersReady(tid, epoch, lo, hi, first, blocks, now, now + 50, UNBOUND)


def sealed(epoch: int = 0, **kw) -> Prefilled:
    p = pf(**kw)
    return Prefilled(p.transfer_id, p.block_ids, p.num_tokens, p.now, p.lease_deadline, epoch=epoch)


# ------------------------------------------------------------------------ examples


def test_a_stream_writes_only_to_the_party_its_binding_admits() -> None:
    """A bound transfer streams before its seal only to the identity (or secret) the stream
    announced; a hijacker that registered first gets no group, and while a rival is parked
    nobody does (the seal decides). A stream whose binding is unknown streams nothing."""

    def bound(ev: LayersReady) -> LayersReady:
        return dataclasses.replace(ev, binding=("dnode", ""))

    rv = Rendezvous()
    rv.handle(bound(lr(0, 2)))
    assert of(StartGroupWrite, rv.handle(_as("evil", reg(peer="x")))) == []  # first, but not admitted
    assert of(StartGroupWrite, rv.handle(bound(lr(2, 4)))) == []
    rv = Rendezvous()
    rv.handle(bound(lr(0, 2)))
    (g,) = of(StartGroupWrite, rv.handle(_as("dnode", reg(peer="d0"))))
    assert g.peer == "d0"
    assert rv.handle(_as("evil", reg(peer="x", attempt=1))) == []  # a rival is parked: no more groups until the seal picks
    assert rv._recs["t"].contest.parked  # the core's record (no view shows rivals)
    assert of(StartGroupWrite, rv.handle(bound(lr(2, 4)))) == []
    rv = Rendezvous()
    rv.handle(dataclasses.replace(lr(0, 2), binding=None))
    assert of(StartGroupWrite, rv.handle(reg())) == []



def test_groups_before_register_go_out_together_then_each_at_once() -> None:
    rv = Rendezvous()
    assert rv.handle(lr(0, 2)) == [] and rv.handle(lr(2, 4)) == []
    assert rv.info("t").state is State.STREAMED
    (g,) = of(StartGroupWrite, rv.handle(reg()))
    assert [(p.layer_lo, p.layer_hi) for p in g.parts] == [(0, 2), (2, 4)]
    (g2,) = of(StartGroupWrite, rv.handle(lr(4, 6)))
    assert [(p.layer_lo, p.layer_hi) for p in g2.parts] == [(4, 6)] and g2.group > g.group


def test_final_write_waits_for_every_group_and_skips_what_they_wrote() -> None:
    rv = Rendezvous()
    rv.handle(reg())
    (g,) = of(StartGroupWrite, rv.handle(lr(0, 2)))
    assert of(StartWrite, rv.handle(sealed())) == []  # a group is in flight: no notification yet
    assert rv.info("t").state is State.WRITING
    (w,) = of(StartWrite, rv.handle(WriteDone("t", 0, 0, 1.0, group=g.group)))
    assert [(p.layer_lo, p.layer_hi) for p in w.written] == [(0, 2)]
    out = rv.handle(WriteDone("t", 0, 0, 2.0))
    assert of(ReleaseBlocks, out)[0].ok and rv.info("t").state is State.DONE


def test_seal_of_unknown_or_other_epoch_trusts_nothing_streamed() -> None:
    for seal in (pf(), sealed(epoch=1)):
        rv = Rendezvous()
        rv.handle(reg())
        (g,) = of(StartGroupWrite, rv.handle(lr(0, 2)))
        rv.handle(seal)
        (w,) = of(StartWrite, rv.handle(WriteDone("t", 0, 0, 1.0, group=g.group)))
        assert w.written == ()


def test_new_epoch_drains_the_old_one_before_posting() -> None:
    rv = Rendezvous()
    rv.handle(reg())
    (g,) = of(StartGroupWrite, rv.handle(lr(0, 2)))
    assert rv.handle(lr(0, 2, epoch=1, blocks=(4, 5, 6))) == []  # old epoch still in flight
    (g2,) = of(StartGroupWrite, rv.handle(WriteDone("t", 0, 0, 1.0, group=g.group)))
    assert g2.parts[0].epoch == 1 and g2.parts[0].src_block_ids == (4, 5, 6)


def test_local_abort_mid_stream_answers_the_peer_only_after_the_group_lands() -> None:
    rv = Rendezvous()
    rv.handle(reg())
    (g,) = of(StartGroupWrite, rv.handle(lr(0, 2)))
    assert of(NotifyFailure, rv.handle(Aborted("t", None, "stop", "local", 1.0))) == []
    assert rv.info("t").state is State.DRAINING
    (n,) = of(NotifyFailure, rv.handle(WriteDone("t", 0, 0, 2.0, group=g.group)))
    assert n.dest_rank == 0 and rv.info("t").state is State.FAILED
    (r,) = of(ReleaseBlocks, rv.handle(pf(now=3.0)))  # the seal that comes later goes back
    assert not r.ok


def test_peer_cancel_mid_stream_is_confirmed_after_the_group_lands() -> None:
    rv = Rendezvous()
    rv.handle(reg())
    (g,) = of(StartGroupWrite, rv.handle(lr(0, 2)))
    assert of(ConfirmCancel, rv.handle(Aborted("t", 0, "cancel", "peer", 1.0, peer="d0"))) == []
    assert rv.handle(lr(2, 4)) == []  # an ended attempt gets no more writes
    assert rv.info("t").state is State.WAIT_PREFILL  # its group drains first
    assert of(ConfirmCancel, rv.handle(WriteDone("t", 0, 0, 2.0, group=g.group)))
    assert rv.info("t").state is State.EXPIRED  # drained: as if it had been cancelled idle
    (g2,) = of(StartGroupWrite, rv.handle(reg(attempt=1, now=3.0)))  # a new attempt gets the kept progress
    assert g2.attempt == 1 and [(p.layer_lo, p.layer_hi) for p in g2.parts] == [(0, 2), (2, 4)]


def test_a_rival_parked_during_a_stream_is_answered_when_the_stream_ends() -> None:
    """A rival that registers while the owner's group WRITE flies is parked (the seal may yet
    pick it). If the owner cancelled, the rival takes the transfer over once the group has
    landed, and gets the progress; if the group fails, the transfer fails and so is the rival
    told, not left parked."""

    rv = Rendezvous()
    rv.handle(_as("nodeA", reg(peer="a")))
    (g,) = of(StartGroupWrite, rv.handle(lr(0, 2)))
    rv.handle(Aborted("t", 0, "cancel", "peer", 1.0, peer="a"))
    assert rv.handle(_as("nodeB", reg(peer="b", attempt=1))) == []  # parked: the owner's group still flies
    out = rv.handle(WriteDone("t", 0, 0, 2.0, group=g.group))
    assert [type(a) for a in out] == [ConfirmCancel, StartGroupWrite]
    assert (out[1].peer, out[1].attempt) == ("b", 1) and rv.info("t").state is State.WAIT_PREFILL

    rv = Rendezvous()
    rv.handle(_as("nodeA", reg(peer="a")))
    (g,) = of(StartGroupWrite, rv.handle(lr(0, 2)))
    assert rv.handle(_as("nodeB", reg(peer="b", attempt=1))) == []
    out = rv.handle(WriteFailed("t", 0, 0, "boom", 2.0, group=g.group))
    assert sorted((a.peer, a.cause.value) for a in of(NotifyFailure, out)) == [("a", "write_failed"), ("b", "closed")]
    assert rv.info("t").state is State.FAILED and not rv._recs["t"].contest.parked


def test_a_party_that_takes_over_gets_every_layer_not_the_owners_skips() -> None:
    """Groups written to the owner's blocks are not in the heir's: when a parked party takes
    the transfer over (the owner cancelled, timed out or was lost), its final write skips
    nothing the owner got, and the groups kept go to it."""
    ends = [Aborted("t", 0, "cancel", "peer", 2.0, peer="a"), Tick(6.0), PeerLost("a", 2.0)]
    for end in ends:
        rv = Rendezvous()
        rv.handle(_as("nodeA", reg(peer="a", deadline=5.0)))
        (g,) = of(StartGroupWrite, rv.handle(lr(0, 2)))
        rv.handle(WriteDone("t", 0, 0, 1.0, group=g.group))
        assert rv.handle(_as("nodeB", reg(peer="b", attempt=1))) == []  # parked
        out = rv.handle(end)
        (g2,) = of(StartGroupWrite, out)
        assert (g2.peer, [(p.layer_lo, p.layer_hi) for p in g2.parts]) == ("b", [(0, 2)]), end
        rv.handle(WriteDone("t", 1, 0, 7.0, group=g2.group))
        (w,) = of(StartWrite, rv.handle(sealed(now=7.0)))
        assert w.peer == "b" and [(p.layer_lo, p.layer_hi) for p in w.written] == [(0, 2)], end


def test_group_bound_per_transfer_queues_the_rest() -> None:
    rv = Rendezvous(max_group_writes=1)
    rv.handle(reg())
    (g,) = of(StartGroupWrite, rv.handle(lr(0, 1)))
    assert rv.handle(lr(1, 2)) == [] and rv.handle(lr(2, 3)) == []
    (g2,) = of(StartGroupWrite, rv.handle(WriteDone("t", 0, 0, 1.0, group=g.group)))
    assert [(p.layer_lo, p.layer_hi) for p in g2.parts] == [(1, 2), (2, 3)]


def test_too_many_groups_turns_streaming_off() -> None:
    rv = Rendezvous(max_groups=2)
    for i in range(5):
        rv.handle(lr(i, i + 1))
    assert rv.handle(reg()) == []  # nothing streamed; the seal writes everything
    (w,) = of(StartWrite, rv.handle(sealed()))
    assert w.written == ()


def test_auto_streams_only_to_registrations_worth_it_and_on_streams_anyway() -> None:
    """An "auto" stream goes only to a registration the shell judged worth it (its whole WRITE
    is long over that link); the other gets everything in the final write. "on" ignores it."""
    import dataclasses

    def auto(ev: LayersReady, on: bool = True) -> LayersReady:
        return dataclasses.replace(ev, auto=on)

    rv = Rendezvous()
    rv.handle(auto(lr(0, 2)))
    assert of(StartGroupWrite, rv.handle(dataclasses.replace(reg(), stream=False))) == []
    assert of(StartGroupWrite, rv.handle(auto(lr(2, 4)))) == []
    (w,) = of(StartWrite, rv.handle(sealed()))
    assert w.written == ()
    rv = Rendezvous()
    rv.handle(auto(lr(0, 2)))
    (g,) = of(StartGroupWrite, rv.handle(reg()))  # worth it
    assert [(p.layer_lo, p.layer_hi) for p in g.parts] == [(0, 2)]
    rv = Rendezvous()
    rv.handle(auto(lr(0, 2), on=False))  # "on"
    assert of(StartGroupWrite, rv.handle(dataclasses.replace(reg(), stream=False)))


def test_progress_nobody_claims_is_forgotten() -> None:
    rv = Rendezvous(tombstone_s=1.0)
    rv.handle(lr(0, 2))
    rv.handle(Tick(51.0))
    assert rv.info("t") is None


# ------------------------------------------------- who got which layers, two parties

_PARTIES = {"a": ("nodeA", (7, 8, 9)), "b": ("nodeB", (4, 5, 6))}  # peer -> node, its blocks


@st.composite
def _race(draw: st.DrawFn) -> list:
    """The steps of a two-party race, in any order: both register, two layer groups, their
    WRITEs' ends, how the first party ends, the seal, and a few steps more of any kind (a
    preemption on P among them: a new epoch, its layers in other blocks)."""
    na, nb = draw(st.integers(0, 1)), draw(st.integers(0, 2))
    end = draw(st.sampled_from(["cancel", "lost", "tick", "fail", "land"]))
    steps = [("reg", "a", na), ("reg", "b", nb), ("lr", "a", 0), ("lr", "a", 1), ("land", "a", 0),
             ("land", "a", 0), (end, "a", na if end == "cancel" else 3), ("seal", "a", 0)]
    steps += draw(st.lists(st.tuples(st.sampled_from(["reg", "lr", "land", "fail", "cancel", "lost", "tick",
                                                      "preempt"]),
                                     st.sampled_from("ab"), st.integers(0, 2)), max_size=4))
    return draw(st.permutations(steps))


@settings(max_examples=300, deadline=None)
@given(_race())
def test_a_final_write_skips_only_layers_that_registrations_blocks_got(ops: list) -> None:
    """Two decode nodes race for one streamed transfer (the second is parked, and takes over
    when the first ends: cancel, loss, timeout). Whatever the order, a final write may skip
    only parts a group WRITE landed in the very blocks it writes, for its attempt; and no
    WRITE goes to an attempt that ended, and what it skips is of the seal's epoch and blocks.
    An honest transport answers only what is in flight."""
    rv, now, flying, landed, ended, epoch = Rendezvous(), 0.0, {}, set(), set(), 0
    src = SRC
    for op, peer, n in ops:
        node, blocks = _PARTIES[peer]
        if op == "reg":
            ended.discard((n, peer))  # registers afresh (the decode side's new blocks)
            ev: object = _as(node, reg(peer=peer, attempt=n, now=now, deadline=now + 5, blocks=blocks))
        elif op == "lr":
            ev = lr(n, n + 1, now=now, epoch=epoch, blocks=src)
        elif op == "preempt":  # P restarts the request: its KV is computed again, elsewhere
            epoch, src = epoch + 1, tuple(b + 10 * (epoch + 1) for b in SRC)
            ev = lr(n, n + 1, now=now, epoch=epoch, blocks=src)
        elif op in ("land", "fail") and flying:
            key = sorted(flying)[n % len(flying)]
            g = flying.pop(key)
            if op == "land":
                landed.update((g.attempt, g.peer, g.dst_block_ids, p) for p in g.parts)
            ev = (WriteDone(g.transfer_id, g.attempt, g.dest_rank, now, group=g.group) if op == "land"
                  else WriteFailed(g.transfer_id, g.attempt, g.dest_rank, "boom", now, group=g.group))
        elif op == "cancel":
            ev = Aborted("t", n, "cancel", "peer", now, peer=peer)
        elif op == "lost":
            ev = PeerLost(peer, now)
        elif op == "tick":
            now += 2.0 * n
            ev = Tick(now)
        elif op == "seal":
            seal = Prefilled("t", src, 40, now, now + 30, epoch=epoch)
            ev = seal
        else:
            continue
        for a in rv.handle(ev):
            if isinstance(a, (NotifyFailure, ConfirmCancel)):
                ended.add((a.attempt, a.peer))
            if isinstance(a, StartGroupWrite):
                assert (a.attempt, a.peer) not in ended, "group to an ended attempt"
                flying[a.group] = a
            elif isinstance(a, StartWrite):
                assert (a.attempt, a.peer) not in ended, "final write to an ended attempt"
                got = {(a.attempt, a.peer, a.dst_block_ids, p) for p in a.written}
                assert got <= landed, f"skips layers its blocks never got: {got - landed}"
                assert all(p.epoch == seal.epoch and p.src_block_ids == seal.block_ids for p in a.written)


# ------------------------------------------------------------ random interleavings


class StreamMachine(RendezvousMachine):
    """RendezvousMachine plus layer progress, epochs and group WRITEs."""

    def _send(self, ev: object) -> None:
        if not hasattr(self, "gout"):
            self.gout: dict[tuple[str, int, int, int], StartGroupWrite] = {}
            self.epoch: dict[str, int] = {}
            self.auto: dict[str, bool] = {}
            self.final_posted: set[tuple[str, int, int]] = set()
        super().send(ev)

    def forget_purged(self) -> None:
        for tid in ("a", "b"):
            if self.rv.info(tid) is None:
                assert not [k for k in getattr(self, "gout", {}) if k[0] == tid], "purged mid-group"
                getattr(self, "epoch", {}).pop(tid, None)
                for keys in (getattr(self, "final_posted", set()), self.notified):
                    keys -= {k for k in keys if k[0] == tid}  # a new transfer of the same name
        super().forget_purged()

    def busy(self, tid: str, attempt: int | None = None, dest: int | None = None, peer=None) -> list:
        return [k for k, g in self.gout.items() if k[0] == tid and attempt in (None, k[1])
                and dest in (None, k[2]) and peer in (None, g.peer)]

    def send(self, ev: object) -> None:
        if isinstance(ev, Registered):  # peer p1 sits behind a link too fast to stream over
            ev = dataclasses.replace(ev, stream=ev.peer != "p1")
        self._send(ev)

    def check(self, actions: list) -> None:
        for a in actions:
            if isinstance(a, StartGroupWrite):
                key = (a.transfer_id, a.attempt, a.dest_rank)
                r = self.regs.get(key)
                assert r is not None and a.dst_block_ids == r.block_ids, "group without registration"
                assert not (self.auto.get(a.transfer_id) and a.peer == "p1"), "auto streamed where not worth it"
                assert a.attempt == self.max_attempt[a.transfer_id], "group of a superseded attempt"
                assert key not in self.notified, "group after the peer heard the attempt failed"
                assert key not in self.started and key not in self.final_posted, "group after the final"
                assert self.released.get(a.transfer_id, 0) == 0, "group after release"
                assert self.now < r.deadline, "group after the registration's deadline"
                ep = self.epoch[a.transfer_id]
                assert all(p.epoch == ep for p in a.parts), "void progress written"
                old = [k for k in self.busy(*key) if self.gout[k].parts[0].epoch != ep]
                assert not old, "new epoch posted over an older one in flight"
                self.gout[(*key, a.group)] = a
            elif isinstance(a, StartWrite):
                key = (a.transfer_id, a.attempt, a.dest_rank)
                assert not self.busy(*key), "notification posted before the groups were done"
                assert key not in self.notified
                p = self.prefill[a.transfer_id]
                for part in a.written:
                    assert p.epoch >= 0 and part.epoch == p.epoch, "skipped a part of another epoch"
                    n = len(part.src_block_ids)
                    assert p.block_ids[part.first_block:part.first_block + n] == part.src_block_ids
                self.final_posted.add(key)
            elif isinstance(a, ReleaseBlocks):
                assert not self.busy(a.transfer_id), "released while a group reads the blocks"
            elif isinstance(a, NotifyFailure):
                assert not self.busy(a.transfer_id, a.attempt, a.dest_rank), "failure told mid-group"
            elif isinstance(a, ConfirmCancel):
                assert not self.busy(a.transfer_id, a.attempt, peer=a.peer), "cancel confirmed mid-group"
        super().check([a for a in actions if not isinstance(a, StartGroupWrite)])

    @rule(tid=st.sampled_from(("a", "b")), bump=st.sampled_from([0, 0, 0, 1]), lo=st.integers(0, 3),
          first=st.integers(0, 1), dt=st.floats(0.5, 30), auto=st.booleans())
    def layers_ready(self, tid: str, bump: int, lo: int, first: int, dt: float, auto: bool) -> None:
        self.sync()
        if not hasattr(self, "gout"):
            self.send(Tick(self.now))
        ep = self.epoch.get(tid, 0) + bump
        self.epoch[tid] = ep
        self.auto[tid] = auto
        blocks = (100, 101)[first:] if ep == 0 else (200 + ep, 300 + ep)[first:]
        self.send(LayersReady(tid, ep, lo, lo + 1, first, blocks, self.now, self.now + dt, UNBOUND, auto=auto))

    @rule(tid=st.sampled_from(("a", "b")), tokens=st.sampled_from([16, 16, 17]), dt=st.floats(0.5, 30))
    def prefill_sealed(self, tid: str, tokens: int, dt: float) -> None:
        self.sync()
        ep = getattr(self, "epoch", {}).get(tid, 0)
        blocks = (100, 101) if ep == 0 else (200 + ep, 300 + ep)
        ev = Prefilled(tid, blocks, tokens, self.now, self.now + dt, epoch=ep)
        self.prefill.setdefault(tid, ev)
        self.send(ev)

    @precondition(lambda self: getattr(self, "gout", None))
    @rule(data=st.data(), ok=st.sampled_from([True, True, True, False]))
    def group_ends(self, data: st.DataObject, ok: bool) -> None:
        key = data.draw(st.sampled_from(sorted(self.gout)))
        del self.gout[key]
        tid, attempt, dest, group = key
        self.send(WriteDone(tid, attempt, dest, self.now, group=group) if ok
                  else WriteFailed(tid, attempt, dest, "boom", self.now, group=group))

    def teardown(self) -> None:
        if not hasattr(self, "rv"):
            return
        while getattr(self, "gout", None):
            key = min(self.gout)
            del self.gout[key]
            self.send(WriteDone(*key[:3], self.now, group=key[3]))
        super().teardown()


StreamMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=60, deadline=None, suppress_health_check=[HealthCheck.too_slow],
)
TestStreamInterleavings = StreamMachine.TestCase
