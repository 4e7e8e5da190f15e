"""The daemon's parts (engine session, prefill side, decode side) driven in one process.

Real parts, real codec and real byte copies; the only stand-ins are the ports: ZeroMQ is an
in-order message queue and NIXL an in-memory fabric (kvpush_dev.inmemory). The bytes a
decode engine ends up with are compared with the token-by-token reference copy.
"""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpush import proto
from kvpush.common.machine import Single
from kvpush.daemon.core import peers as pr
from kvpush.daemon.core.peers import LINK_TABLE, LinkAction, PeerLinkState, Producer
from kvpush.daemon.handshake import make_hello
from kvpush_dev.inmemory import Fabric, MemNode, Net
from kvpush_dev.kvref import make, reference_copy

_ids = itertools.count()


def tid() -> str:
    return f"t-{next(_ids)}"


def cpu(heads: int = 2, head_start: int = 0, total_heads: int = 2, block_size: int = 16, num_blocks: int = 16):
    return make("row", num_layers=2, num_blocks=num_blocks, block_size=block_size, num_heads=heads,
                head_size=8, dtype="bfloat16", head_start=head_start, total_heads=total_heads)


def buf(layout, seed: int | None) -> np.ndarray:
    if seed is None:
        return np.zeros(layout.region_size, dtype=np.uint8)
    return np.random.default_rng(seed).integers(0, 256, layout.region_size, dtype=np.uint8)


@pytest.fixture
def lab():
    return Net(), Fabric()


def pair(net: Net, fab: Fabric, **cfg) -> tuple[MemNode, MemNode]:
    """A prefill and a decode daemon, each with an engine stand-in attached (equal layouts)."""
    lay, _ = cpu()
    p, d = MemNode(net, fab, "p", **cfg), MemNode(net, fab, "d", **cfg)
    p.attach(lay, buf(lay, 1), role="prefill")
    d.attach(lay, buf(lay, None), role="decode")
    return p, d


def register(d: MemNode, t: str, blocks, n: int, producers: list[MemNode], attempt: int = 0, timeout_ms: int = 20000):
    eps = tuple(p.endpoint for p in producers)
    return d.engine(proto.Register(t, attempt, tuple(blocks), n, eps, len(eps), timeout_ms))


def prefill_done(p: MemNode, t: str, blocks, n: int):
    return p.engine(proto.PrefillDone(t, tuple(blocks), n, 5000))


def kinds(node: MemNode) -> list[str]:
    return [type(m).__name__ for m in node.answers() if not isinstance(m, proto.AttachAck)]


@pytest.mark.parametrize("prefill_first", [False, True])
def test_one_transfer_lands_byte_exact_in_either_order(lab, prefill_first):
    net, fab = lab
    (lay, meta) = cpu()
    p, d = MemNode(net, fab, "p"), MemNode(net, fab, "d")
    pbuf, dbuf = buf(lay, 1), buf(lay, None)
    assert isinstance(p.attach(lay, pbuf, role="prefill"), proto.AttachAck)
    assert isinstance(d.attach(lay, dbuf, role="decode"), proto.AttachAck)
    before = dbuf.copy()
    t, n, src, dst = tid(), 40, [5, 1, 9], [2, 7, 3]
    steps = [lambda: prefill_done(p, t, src, n), lambda: register(d, t, dst, n, [p])]
    for step in (steps if prefill_first else steps[::-1]):
        step()
        net.run()
    assert kinds(d) == ["Received"] and kinds(p) == ["Sent"]
    want, dont_care = reference_copy(meta, lay, pbuf, src, meta, lay, before, dst, n, 0)
    assert np.array_equal(dbuf[~dont_care], want[~dont_care])
    assert p.transport.writes == 1  # one WRITE for the whole transfer
    # Equal layouts: the WRITE went through the lists prepared at handshake.
    assert p.ctx.history.items[-1]["prepped"] is True


def test_tp2_to_tp1_counts_both_producers_before_received(lab):
    net, fab = lab
    (l0, m0), (l1, m1), (ld, md) = cpu(1, 0), cpu(1, 1), cpu(2, 0)
    p0, p1, d = MemNode(net, fab, "p0"), MemNode(net, fab, "p1"), MemNode(net, fab, "d")
    b0, b1, bd = buf(l0, 4), buf(l1, 5), buf(ld, None)
    p0.attach(l0, b0, role="prefill", rank=0, tp_size=2, engine_id="P")
    p1.attach(l1, b1, role="prefill", rank=1, tp_size=2, engine_id="P")
    d.attach(ld, bd, role="decode", engine_id="D")
    before = bd.copy()
    t, n, s0, s1, dst = tid(), 30, [1, 2], [9, 8], [4, 6]
    register(d, t, dst, n, [p0, p1])
    net.run()
    prefill_done(p0, t, s0, n)
    net.run()
    assert kinds(d) == [], "Received after one of two producers"
    prefill_done(p1, t, s1, n)
    net.run()
    assert kinds(d) == ["Received"]
    w, dc0 = reference_copy(m0, l0, b0, s0, md, ld, before, dst, n, 0)
    w, dc1 = reference_copy(m1, l1, b1, s1, md, ld, w, dst, n, 0)
    care = ~(dc0 | dc1)
    assert np.array_equal(bd[care], w[care])


def test_failed_write_fails_both_engines_and_never_reports_received(lab):
    net, fab = lab
    p, d = pair(net, fab)
    t = tid()
    register(d, t, [1, 2], 20, [p])
    net.run()
    fab.fail_writes = True
    prefill_done(p, t, [3, 4], 20)
    net.run()
    assert kinds(d) == ["ReceiveFailed"] and kinds(p) == ["SendFailed"]


def test_a_write_that_may_still_land_fences_the_decode_daemon_instead_of_freeing_blocks(lab):
    """A WRITE posted into a partition times out at the producer: NIXL cannot recall it and
    UCX delivers it once the link heals. The decode daemon must not hand the blocks back (its
    engine would reuse them): it fences (a real daemon exits); the engine hears nothing."""
    net, fab = lab
    p, d = pair(net, fab, write_timeout_s=1.0)
    t = tid()
    register(d, t, [1, 2], 20, [p])
    net.run()
    fab.hold_writes = True
    prefill_done(p, t, [3, 4], 20)
    net.run()
    p.poll()
    assert p.prefill.in_flight and not d.fenced
    p.prefill.progress(time.monotonic() + 2.0)  # past write_timeout_s
    net.run()
    assert kinds(p) == ["SendFailed"]
    assert len(d.fenced) == 1 and "may still arrive" in d.fenced[0] and kinds(d) == []


def test_a_ready_producer_gone_silent_fences_but_a_failed_handshake_does_not(lab):
    net, fab = lab
    p, d = pair(net, fab, peer_timeout_s=2.0)
    t = tid()
    register(d, t, [1, 2], 20, [p])
    net.run()  # the link is ready and the registration forwarded: the producer may write any time
    net.cut.add(p.endpoint)
    d.tick(time.monotonic() + 3.0)
    assert len(d.fenced) == 1 and kinds(d) == []
    # the same silence after the producer's connection closed (it died): a plain, safe Fail
    t2 = tid()
    p2, d2 = pair(net, fab, peer_timeout_s=2.0)
    register(d2, t2, [1, 2], 20, [p2])
    net.run()
    net.cut.add(p2.endpoint)
    net.closed.add(p2.endpoint)
    d2.tick(time.monotonic() + 3.0)
    assert kinds(d2) == ["ReceiveFailed"] and not d2.fenced


def test_decode_abort_cancels_at_the_producer_then_releases(lab):
    net, fab = lab
    p, d = pair(net, fab)
    t = tid()
    register(d, t, [1, 2], 20, [p])
    net.run()
    d.engine(proto.Abort(t, 0, "client went away"))
    net.run()
    assert kinds(d) == ["Released"]
    # The producer forgot the registration: a late PrefillDone writes nothing to the decoder.
    prefill_done(p, t, [3, 4], 20)
    net.run()
    assert p.transport.writes == 0 and kinds(d) == ["Released"]


def test_a_newer_attempt_supersedes_and_only_it_is_received(lab):
    net, fab = lab
    p, d = pair(net, fab)
    t = tid()
    register(d, t, [1, 2], 20, [p], attempt=0)
    net.run()
    register(d, t, [5, 6], 20, [p], attempt=1)
    net.run()
    prefill_done(p, t, [3, 4], 20)
    net.run()
    got = [m for m in d.answers() if isinstance(m, (proto.Received, proto.ReceiveFailed))]
    assert [(type(m).__name__, m.attempt) for m in got if isinstance(m, proto.Received)] == [("Received", 1)]
    assert isinstance(register(d, t, [1, 2], 20, [p], attempt=0), proto.ReceiveFailed)  # older: refused


def test_a_repeated_registration_of_an_ended_attempt_is_refused_not_ignored(lab):
    """Once the outcome is told, the same (transfer, attempt) registered again gets a reason at
    once: silence would leave the engine waiting out its timeout, and a repeated Received would
    vouch for blocks nobody wrote for it."""
    net, fab = lab
    p, d = pair(net, fab)
    t = tid()
    register(d, t, [1, 2], 20, [p])
    prefill_done(p, t, [3, 4], 20)
    net.run()
    assert kinds(d) == ["Received"]
    again = register(d, t, [5, 6], 20, [p])
    assert isinstance(again, proto.ReceiveFailed) and "already ended (completed)" in again.reason, again
    net.run()
    assert p.transport.writes == 1 and kinds(d) == ["Received", "ReceiveFailed"]  # nothing forwarded


def test_unreachable_producer_fails_the_registration_at_the_handshake_timeout(lab):
    net, fab = lab
    p, d = pair(net, fab, peer_timeout_s=2.0)
    net.cut.add(p.endpoint)
    t = tid()
    register(d, t, [1, 2], 20, [p])
    net.run()
    d.tick(time.monotonic() + 1.0)
    assert kinds(d) == []
    d.tick(time.monotonic() + 3.0)
    assert kinds(d) == ["ReceiveFailed"] and "handshake" in d.answers()[-1].reason
    # Known down now: the link re-handshakes, and a registration for it fails at once.
    assert d.decode.producers[p.endpoint].state is PeerLinkState.RECOVERING
    late = register(d, tid(), [3, 4], 20, [p])
    assert isinstance(late, proto.ReceiveFailed) and "re-handshaking" in late.reason, late
    # Back: the Hello sent on recovering is answered and registrations flow again.
    net.cut.discard(p.endpoint)
    d.tick(time.monotonic() + 6.0)  # its handshake timed out again: a fresh Hello
    net.run()
    assert d.decode.producers[p.endpoint].state is PeerLinkState.READY
    t3 = tid()
    register(d, t3, [5, 6], 20, [p])
    prefill_done(p, t3, [7, 8], 20)
    net.run()
    assert kinds(d)[-1] == "Received"


@pytest.mark.parametrize("note", [True, False])
def test_a_producer_a_fenced_daemon_knew_lost_fails_its_successors_registrations_at_once(lab, tmp_path, note):
    """The decode daemon fences (a producer went silent with a registration forwarded): the
    daemon its supervisor starts next fails a registration for that producer at once while it
    is still away (the decode engine recomputes now, not after the producer's return), and
    never forwards it: the producer, back, has nothing of it to write. Without the note it
    left, the successor queues the registration behind a handshake the producer cannot answer."""
    net, fab = lab
    lay, _ = cpu()
    p = MemNode(net, fab, "p", peer_timeout_s=2.0)
    p.attach(lay, buf(lay, 1), role="prefill")
    d = MemNode(net, fab, "d", peer_timeout_s=2.0, runtime_dir=str(tmp_path))
    d.attach(lay, buf(lay, None), role="decode")
    register(d, tid(), [1, 2], 20, [p])
    net.run()  # ready, forwarded: a WRITE may come any time
    net.cut.add(p.endpoint)  # the producer is frozen
    d.tick(time.monotonic() + 3.0)
    assert len(d.fenced) == 1
    if not note:
        (tmp_path / "lost-producers-d.json").unlink(missing_ok=True)
    d2 = MemNode(net, fab, "d", peer_timeout_s=2.0, runtime_dir=str(tmp_path))  # its supervisor's next one
    d2.attach(lay, buf(lay, None), role="decode")
    t = tid()
    got = register(d2, t, [3, 4], 20, [p])
    if not note:
        assert got is None and d2.decode.producers[p.endpoint].state is PeerLinkState.HANDSHAKING
        return
    assert isinstance(got, proto.ReceiveFailed) and "fenced with it lost" in got.reason, got
    assert not (tmp_path / "lost-producers-d.json").exists()  # taken once
    # Back: the registration failed early never reached it, so nothing of it is written.
    net.cut.discard(p.endpoint)
    d2.tick(time.monotonic() + 1.0)  # a recovering link's Hello goes again every quarter timeout
    net.run()
    assert d2.decode.producers[p.endpoint].state is PeerLinkState.READY
    prefill_done(p, t, [5, 6], 20)
    net.run()
    assert p.transport.writes == 0 and kinds(d2) == ["ReceiveFailed"]
    t2 = tid()  # and registrations flow again
    register(d2, t2, [7, 8], 20, [p])
    prefill_done(p, t2, [9, 10], 20)
    net.run()
    assert kinds(d2)[-1] == "Received"


def test_a_lost_producers_note_is_bounded_and_a_stale_one_ignored(tmp_path):
    from kvpush.daemon.io import peer_note

    path = str(tmp_path / "note.json")
    peer_note.leave(path, ["tcp://c:1", "tcp://a:1", "tcp://b:1"], now=100.0)
    assert peer_note.take(path, 40.0, 2, now=120.0) == {"tcp://a:1", "tcp://b:1"}
    assert peer_note.take(path, 40.0, 2, now=120.0) == set()  # taken once
    peer_note.leave(path, ["tcp://a:1"], now=100.0)
    assert peer_note.take(path, 40.0, 8, now=141.0) == set()  # older than its bound
    (tmp_path / "note.json").write_text("{not json")
    assert peer_note.take(path, 40.0, 8) == set()
    peer_note.leave(path, [], now=100.0)
    assert not (tmp_path / "note.json").exists()  # nothing lost: no note


def test_restarted_producer_fails_what_waited_on_it_and_is_dialled_again(lab):
    net, fab = lab
    p, d = pair(net, fab)
    t = tid()
    register(d, t, [1, 2], 20, [p])
    net.run()
    p.prefill.consumers.clear()  # the prefill daemon restarted: it knows no one
    d.wire.to_producer(p.endpoint, proto.Heartbeat(1))
    net.run()
    assert kinds(d) == ["ReceiveFailed"] and "restarted" in d.answers()[-1].reason
    t2 = tid()
    register(d, t2, [3, 4], 20, [p])
    net.run()
    prefill_done(p, t2, [5, 6], 20)
    net.run()
    assert kinds(d)[-1] == "Received"


def test_bounds_come_from_config_not_the_wire(lab):
    net, fab = lab
    p, d = pair(net, fab, register_timeout_s=8.0, write_timeout_s=1.0)
    t = tid()
    register(d, t, [1, 2], 20, [p], timeout_ms=2**40)  # asks for ~35 years
    net.run()
    d.tick(time.monotonic() + 5.0)
    assert kinds(d) == []
    reg = d.decode.counter.registration(t)
    assert reg.deadline - reg.since <= 8.0  # the config's bound, not the wire's
    d.tick(time.monotonic() + 9.0)  # past it: cancel the prefill daemon, which confirms
    net.run()
    assert kinds(d) == ["ReceiveFailed"] and not d.fenced  # a confirmed cancel: a safe Fail


def test_bad_inputs_are_refused_with_a_reason_and_nothing_is_written(lab):
    net, fab = lab
    p, d = pair(net, fab)
    assert "out of range" in register(d, tid(), [1, 99], 20, [p]).reason
    assert "cannot hold" in register(d, tid(), [1], 20, [p]).reason
    assert isinstance(prefill_done(p, tid(), [1, 99], 20), proto.SendFailed)
    assert isinstance(d.engine(proto.Heartbeat(3)), proto.HeartbeatAck)
    net.run()
    assert p.transport.writes == 0


# ---------------------------------------------------------------------------- link table


@given(st.lists(st.sampled_from(pr.EVENTS), max_size=30), st.booleans())
def test_link_walk_flushes_only_into_ready_and_fails_at_once_only_when_recovering(events, lost_before):
    state: PeerLinkState | None = None
    hello = False  # a Hello reply was accepted since the link was (re)created
    # the record the decode side drives (the first one, maybe known lost by a fenced predecessor)
    link = Producer("e", since=0.0, state=None, lost_before=lost_before)
    for ev_type in events:
        actions = Single(LINK_TABLE, None, link).handle(ev_type())
        new = link.state
        if state is None and new is not None:
            assert actions[0] is LinkAction.DIAL
            hello = False
        if LinkAction.FLUSH in actions:
            assert new is PeerLinkState.READY and ev_type is pr.HelloOk
        # A registration fails at once where the producer is known down: recovering, or a first
        # link to one the daemon before us knew lost. Nothing of it was sent.
        known_down = state is PeerLinkState.RECOVERING or (state is None and link.lost_before)
        assert (LinkAction.FAIL_NOW in actions) == (known_down and ev_type is pr.Forward)
        if LinkAction.FAIL_NOW in actions:
            assert LinkAction.SEND not in actions and LinkAction.QUEUE not in actions
        assert (LinkAction.QUEUE in actions) == (new is PeerLinkState.HANDSHAKING and ev_type is pr.Forward)
        assert (LinkAction.SEND in actions) == (state is PeerLinkState.READY and ev_type is pr.Forward)
        if new is None and state is not None:
            assert LinkAction.CLOSE in actions, "a forgotten link is closed"
            link = Producer("e", since=0.0, state=None)  # the shell's next record: the note was used
        if state is PeerLinkState.READY and new is not PeerLinkState.READY:
            assert LinkAction.FAIL_WAITING in actions, "what waited on a lost link fails"
        hello |= ev_type is pr.HelloOk and new is PeerLinkState.READY
        if new is PeerLinkState.READY:
            assert hello
        state = new


@given(st.floats(0, 100), st.floats(0.1, 20), st.floats(0, 100))
def test_link_clock_events(dt, timeout, idle):
    p = Producer("e", since=0.0, last_seen=0.0, wanted=0.0)
    assert p.due(dt, timeout, idle) == (pr.HandshakeTimeout() if dt > timeout else None)
    p.state = PeerLinkState.RECOVERING
    # a lost producer is asked again every quarter timeout (a Hello it dropped is not answered)
    assert p.due(dt, timeout, idle) == (None if dt <= timeout / 4 else pr.Idle() if dt > idle else pr.HandshakeTimeout())
    p.state = PeerLinkState.READY
    ev = p.due(dt, timeout, idle)
    assert ev == (pr.Silent() if dt > timeout else pr.PingDue() if dt > timeout / 4 else None)
    p.resumed(dt)  # we were frozen dt: not the producer's silence, but ping it now
    assert p.due(dt, timeout, idle) == pr.PingDue()


def test_every_link_row_is_taken_or_documented_unreachable(lab):
    """The decode side's shell over the in-memory net, through every reachable transition:
    each row is taken by a real frame or clock event, and no row documented unreachable is."""
    taken: set[tuple] = set()
    net, fab = lab
    p, d = pair(net, fab, peer_timeout_s=2.0)
    dec = d.decode
    dec.on_link_row = lambda r: taken.add((r.state, r.event))

    def link():
        return dec.producers.get(p.endpoint)

    def reply(msg):
        net.post("to_decode", d.endpoint, p.endpoint, msg)
        net.run()

    register(d, tid(), [1, 2], 20, [p])  # None -Forward-> HANDSHAKING
    register(d, tid(), [3, 4], 20, [p])  # HANDSHAKING -Forward-> HANDSHAKING
    net.run()  # -HelloOk-> READY
    register(d, tid(), [5, 6], 20, [p])  # READY -Forward-> READY
    hello = make_hello(p.ctx, reply=True)
    reply(hello)  # READY -HelloOk-> READY (a repeated reply)
    import dataclasses
    reply(dataclasses.replace(hello, version=hello.version + 1))  # READY -Refused-> READY
    assert link().state is PeerLinkState.READY
    d.tick(time.monotonic() + 0.6)  # READY -PingDue-> READY
    net.run()
    p.prefill.consumers.clear()  # the producer forgot us (restarted, or evicted us)
    d.wire.to_producer(p.endpoint, proto.Heartbeat(1))
    d.wire.to_producer(p.endpoint, proto.Heartbeat(2))
    # READY -HandshakeLost-> RECOVERING; the second answer: RECOVERING -HandshakeLost-> RECOVERING;
    # the Hello sent on recovering is answered: RECOVERING -HelloOk-> READY
    net.run()
    assert link().state is PeerLinkState.READY
    dec.rotate("test")  # READY -Rotated-> HANDSHAKING (our new Hello), answered: -HelloOk-> READY
    assert link().state is PeerLinkState.HANDSHAKING
    net.run()
    assert link().state is PeerLinkState.READY
    net.cut.add(p.endpoint)
    d.tick(time.monotonic() + 3.0)  # READY -Silent-> RECOVERING
    assert link().state is PeerLinkState.RECOVERING
    dec.rotate("test")  # RECOVERING -Rotated-> RECOVERING (a fresh Hello)
    assert link().state is PeerLinkState.RECOVERING
    assert isinstance(register(d, tid(), [1], 10, [p]), proto.ReceiveFailed)  # RECOVERING -Forward->
    d.tick(time.monotonic() + 6.0)  # RECOVERING -HandshakeTimeout-> RECOVERING (a fresh Hello)
    net.cut.discard(p.endpoint)
    reply(proto.Error("incompatible", "no"))  # RECOVERING -Refused-> forgotten
    assert link() is None
    register(d, tid(), [1], 10, [p])
    reply(proto.Error("incompatible", "no"))  # HANDSHAKING -Refused-> forgotten
    assert link() is None
    net.cut.add(p.endpoint)
    register(d, tid(), [1], 10, [p])
    dec.rotate("test")  # HANDSHAKING -Rotated-> HANDSHAKING
    d.tick(time.monotonic() + 9.0)  # HANDSHAKING -HandshakeTimeout-> RECOVERING
    assert link().state is PeerLinkState.RECOVERING
    link().node = "gone"
    dec.revoke(set())  # RECOVERING -Revoked-> forgotten
    register(d, tid(), [1], 10, [p])
    link().node = "gone"
    dec.revoke(set())  # HANDSHAKING -Revoked-> forgotten (and our agent rotated)
    net.cut.discard(p.endpoint)
    net.run()  # the Hellos of agents rotated away are refused (a real wire drops a closed link's answers)
    register(d, tid(), [1], 10, [p])
    net.run()
    assert link().state is PeerLinkState.READY
    link().node = "gone"
    dec.revoke(set())  # READY -Revoked-> forgotten
    assert link() is None
    net.cut.add(p.endpoint)
    register(d, tid(), [1], 10, [p])
    d.tick(time.monotonic() + 12.0)  # HANDSHAKING -HandshakeTimeout-> RECOVERING
    d.tick(time.monotonic() + 200.0)  # nobody asked for it since: RECOVERING -Idle-> forgotten
    assert link() is None
    rows = {(r.state, r.event): r for r in LINK_TABLE.rows}
    never = [str(r) for k, r in rows.items() if k not in taken and not r.unreachable]
    assert never == [], "link rows never taken (take them, or document why they cannot be):\n" + "\n".join(never)
    wrong = [str(r) for k, r in rows.items() if k in taken and r.unreachable]
    assert wrong == [], "link rows documented unreachable but taken:\n" + "\n".join(wrong)


def test_a_peer_cannot_register_for_another_rank_or_layout(lab):
    net, fab = lab
    p, d = pair(net, fab)
    register(d, tid(), [1, 2], 20, [p])  # handshakes d with p
    net.run()
    errors = p.ctx.errors
    t = tid()
    d.wire.to_producer(p.endpoint, proto.PeerRegister(t, 0, (1, 2), 20, 1, 2, 1, 20000))  # claims rank 1 of 2
    d.wire.to_producer(p.endpoint, proto.PeerRegister(t, 0, (1, 99), 20, 0, 1, 1, 20000))  # block out of range
    net.run()
    assert p.ctx.errors == errors + 2 and not p.prefill.rdv.live(t)
    prefill_done(p, t, [3, 4], 20)
    net.run()
    assert p.transport.writes == 0


def _per_layer(lay, flat: np.ndarray) -> tuple[object, list[np.ndarray]]:
    from kvpush.proto.layout import per_layer_regions

    ext = lay.max_extent()
    return per_layer_regions(lay), [flat[o:o + ext].copy() for o in lay.layer_offsets]


@pytest.mark.parametrize("split", ["dst", "both"])
def test_one_region_per_layer_lands_byte_exact(lab, split):
    """Multi-region attach: every region mapped and registered, the WRITE's descriptors each
    inside its own region (the fabric checks), bytes equal the reference."""
    net, fab = lab
    lay, meta = cpu()
    p, d = MemNode(net, fab, "p"), MemNode(net, fab, "d")
    pflat, dflat = buf(lay, 3), buf(lay, None)
    p_lay, p_bufs = _per_layer(lay, pflat) if split == "both" else (lay, [pflat])
    d_lay, d_bufs = _per_layer(lay, dflat)
    assert isinstance(p.attach(p_lay, p_bufs, role="prefill"), proto.AttachAck)
    assert isinstance(d.attach(d_lay, d_bufs, role="decode"), proto.AttachAck)
    assert len(d.transport.regions) == 2
    t, n, src, dst = tid(), 40, [5, 1, 9], [2, 7, 3]
    register(d, t, dst, n, [p])
    prefill_done(p, t, src, n)
    net.run()
    assert isinstance(d.answers()[-1], proto.Received), kinds(d)
    want, dont_care = reference_copy(meta, lay, pflat, src, meta, lay, dflat, dst, n, 0)
    got = dflat.copy()
    for o, r in zip(lay.layer_offsets, d_bufs, strict=True):
        got[o:o + r.shape[0]] = r
    assert np.array_equal(got[~dont_care], want[~dont_care])


def test_attach_with_the_wrong_number_of_regions_is_refused(lab):
    from kvpush.proto.layout import per_layer_regions

    net, fab = lab
    lay, _ = cpu()
    d = MemNode(net, fab, "d")
    multi = per_layer_regions(lay)
    reply = d.attach(multi, [np.zeros(multi.regions[0], dtype=np.uint8)], role="decode")
    assert isinstance(reply, proto.Error) and "1 memory handles for a layout of 2 regions" in reply.message
    small = [np.zeros(multi.regions[0], dtype=np.uint8), np.zeros(10, dtype=np.uint8)]
    reply = d.attach(multi, small, role="decode")
    assert isinstance(reply, proto.Error) and "region 1" in reply.message
    assert d.ctx.attached is None and d.transport.regions == []


def test_tp2_to_tp4_each_producer_writes_two_destination_ranks(lab):
    """Prefill rank 1 writes decode ranks 2 and 3 (expected_dests 2, destination ranks not
    below it): both are served, nothing else."""
    net, fab = lab
    ps, pbufs = [], []
    for r in range(2):
        lay, _ = cpu(2, 2 * r, 4)
        node = MemNode(net, fab, f"p{r}")
        pbufs.append(buf(lay, 10 + r))
        node.attach(lay, pbufs[-1], role="prefill", rank=r, tp_size=2, engine_id="P")
        ps.append((node, lay))
    ds = []
    for r in range(4):
        lay, meta = cpu(1, r, 4)
        node = MemNode(net, fab, f"d{r}")
        b = buf(lay, None)
        node.attach(lay, b, role="decode", rank=r, tp_size=4, engine_id="D")
        ds.append((node, lay, meta, b))
    t, n, src, dst = tid(), 24, [3, 4], [1, 2]
    for node, *_ in ds:
        register(node, t, dst, n, [p for p, _ in ps])
    for p, _ in ps:
        prefill_done(p, t, src, n)
    net.run()
    for (node, lay, meta, b) in ds:
        assert kinds(node) == ["Received"], kinds(node)
        p_lay = ps[lay.head_start // 2][1]
        p_buf = pbufs[lay.head_start // 2]
        want, dont_care = reference_copy(cpu(2, p_lay.head_start, 4)[1], p_lay, p_buf, src, meta, lay,
                                         np.zeros_like(b), dst, n, 0)
        assert np.array_equal(b[~dont_care], want[~dont_care])
    assert [kinds(p) for p, _ in ps] == [["Sent"], ["Sent"]]
    assert [p.transport.writes for p, _ in ps] == [2, 2]


def test_a_registration_too_short_to_write_is_refused_with_the_reason(lab):
    """A decode timeout at or below the prefill daemon's write_timeout_s + 1 could never be
    written: the decode engine hears why at once instead of recomputing silently."""
    net, fab = lab
    p, d = pair(net, fab, write_timeout_s=5.0)
    t = tid()
    register(d, t, [1, 2], 20, [p], timeout_ms=5_500)
    net.run()
    assert kinds(d) == ["ReceiveFailed"] and "write_timeout_s" in d.answers()[-1].reason and not d.fenced


def test_a_loop_step_names_the_phase_that_stalled_it():
    """The daemon's stall warning (a step over STALL_WARN_S) says which phase took the time:
    the only way to tell a blocking NIXL call from a slow handler in an operator's log."""
    from kvpush.daemon.device_daemon import _Laps

    lap = _Laps(iter((10.0, 10.1, 14.1, 14.2)).__next__)
    for what in ("engine messages", "peer messages", "NIXL polls"):
        lap(what)
    assert abs(lap.total() - 4.2) < 1e-9
    assert lap.slowest() == "peer messages: 4.00 s"


@pytest.mark.parametrize("large", [False, True])
def test_a_large_write_is_announced_before_it_is_posted_a_small_one_after(lab, monkeypatch, large):
    """The consumer must be polling while a large post fills the socket; a small post is over
    before the hint lands, so its hint follows it (EARLY_HINT_MIN_BYTES)."""
    from kvpush.daemon import prefill_side

    net, fab = lab
    p, d = pair(net, fab)
    t, n, blocks = tid(), 40, [1, 2, 3]
    monkeypatch.setattr(prefill_side, "EARLY_HINT_MIN_BYTES", 1 if large else 1 << 40)
    sent = []  # (message kind, WRITEs posted when it left)
    to_consumer = p.wire.to_consumer

    def spy(routing_id, msg):
        sent.append((type(msg).__name__, getattr(msg, "done", None), p.transport.writes))
        to_consumer(routing_id, msg)

    p.wire.to_consumer = spy
    register(d, t, blocks, n, [p])
    net.run()
    prefill_done(p, t, blocks, n)
    net.run()
    assert kinds(d) == ["Received"] and kinds(p) == ["Sent"]
    hint = [w for kind, done, w in sent if kind == "Writing" and done is False]
    assert hint == [0 if large else 1], sent


def test_attached_has_one_writer_the_engine_session(lab):
    """ctx.attached is a read-only property; only the engine session that owns it sets it
    (the worker's shutdown asks the session to unmap)."""
    net, fab = lab
    p = MemNode(net, fab, "p")
    with pytest.raises(AttributeError):
        p.ctx.attached = None  # type: ignore[misc]
    with pytest.raises(RuntimeError, match="only the owner"):
        p.ctx.set_attached(None, by=p)
    with pytest.raises(RuntimeError, match="already has an owner"):
        p.ctx.own_attached(object())
    p.ctx.set_attached(None, by=p.session)


def test_ops_sees_the_daemon_through_its_view_only(lab):
    """The in-memory node is a DeviceDaemon: ops answers from the same narrow view a real daemon
    gives (handle_ops never gets the worker)."""
    from kvpush.daemon.ops.views import DaemonView, handle_ops

    net, fab = lab
    p, d = pair(net, fab)
    t = tid()
    register(d, t, [1, 2], 20, [p])
    net.run()
    assert isinstance(d.ops, DaemonView)
    reply = handle_ops(d.ops, proto.OpsRequest("pending"))
    assert reply.ok and [r["transfer_id"] for r in reply.data["pending"]] == [t]
    assert handle_ops(d.ops, proto.OpsRequest("status")).data["pending"]["decode"]["waiting"] == 1
    assert handle_ops(d.ops, proto.OpsRequest("cancel", t)).ok
    net.run()
    assert handle_ops(d.ops, proto.OpsRequest("drain")).ok and d.ctx.draining


def _failures(node: MemNode, cause: str) -> float:
    return node.ctx.metrics.registry.get_sample_value(
        "kvpush_failures_total", {"device": node.ctx.metrics.device, "cause": cause}) or 0.0


def test_frames_of_an_evicted_peer_are_handshake_lost_and_it_re_handshakes(lab):
    """A decode daemon frozen past peer_timeout_s is evicted; its queued frames arrive after it
    resumes. They are counted as handshake_lost (not unauthenticated: it is a known peer), what it
    had registered fails at once, and it re-handshakes so the next transfer goes through."""
    net, fab = lab
    p, d = pair(net, fab)
    t = tid()
    register(d, t, [1, 2], 20, [p])
    net.run()
    (c,) = p.prefill.consumers.values()
    p.prefill.evict(c, "silent for 10.0s", time.monotonic())
    d.wire.to_producer(p.endpoint, proto.Heartbeat(1))  # its backlog: a heartbeat and a cancel
    d.wire.to_producer(p.endpoint, proto.Cancel(t, 0, "engine gave up"))
    net.run()
    assert _failures(p, "handshake_lost") == 2 and _failures(p, "unauthenticated") == 0
    assert kinds(d) == ["ReceiveFailed"] and "lost our handshake" in d.answers()[-1].reason
    assert not d.fenced  # nothing was announced as written: the producer evicted us and posts nothing
    assert d.decode.producers[p.endpoint].state is PeerLinkState.READY  # re-handshaken at once
    t2 = tid()
    register(d, t2, [3, 4], 20, [p])
    prefill_done(p, t2, [5, 6], 20)
    net.run()
    assert kinds(d)[-1] == "Received"
    # A stranger without a handshake stays unauthenticated.
    net.post("to_prefill", p.endpoint, "mem://stranger", proto.Heartbeat(1))
    net.run()
    assert _failures(p, "unauthenticated") == 1 and _failures(p, "handshake_lost") == 2


def test_revoking_a_ready_producer_drops_it_and_fences_what_it_may_still_write(lab):
    """A revoked node is no longer trusted, and one that was ready may have posted a WRITE for
    what we registered there: the link is dropped (it used to stay up), and its registrations
    end in a fence, not in blocks handed back."""
    net, fab = lab
    p, d = pair(net, fab)
    register(d, tid(), [1, 2], 20, [p])
    net.run()
    d.decode.producers[p.endpoint].node = "pnode"  # the in-memory net is unauthenticated
    d.decode.revoke({"dnode"})
    assert p.endpoint not in d.decode.producers
    assert len(d.fenced) == 1 and kinds(d) == []


@pytest.mark.parametrize("gap", [1.0, 2.0])
def test_a_prefill_daemon_that_did_not_run_never_writes_blocks_its_engine_may_have_freed(lab, gap):
    """A prefill daemon frozen past the engine's shortest dead_after (proto.ENGINE_DEAD_AFTER_MIN_S)
    may have been given up by its engine, which then freed the blocks of its sends. A prefill it
    holds and has not started writing fails on resume, before any message queued meanwhile (a
    registration) is handled: no WRITE, and the decode side fails at once. A shorter gap changes
    nothing: the transfer goes through."""
    net, fab = lab
    p, d = pair(net, fab)
    t = tid()
    prefill_done(p, t, [1, 2], 20)
    net.run()
    p.resumed(gap, time.monotonic())
    register(d, t, [3, 4], 20, [p])
    net.run()
    if gap < proto.ENGINE_DEAD_AFTER_MIN_S:
        assert kinds(d) == ["Received"] and p.transport.writes == 1
    else:
        assert p.transport.writes == 0
        assert kinds(p) == ["SendFailed"] and "did not run" in p.answers()[-1].reason
        assert kinds(d) == ["ReceiveFailed"]


@pytest.mark.parametrize("rate_bps, streams", [(None, True), (1e3, True), (1e15, False)])
def test_auto_streams_only_to_a_peer_whose_link_makes_it_worth_it(lab, rate_bps, streams):
    """layerwise "auto": the prefill daemon posts group WRITEs only to a decode peer whose
    whole WRITE of the request would take layerwise_min_transfer_ms or more at the rate last
    measured to it (a peer not measured yet is streamed to); "on" streams regardless."""
    net, fab = lab
    p, d = pair(net, fab, layerwise_min_transfer_ms=20.0)
    t0, n, blocks = tid(), 40, [1, 2, 3]
    register(d, t0, blocks, n, [p])  # a first transfer makes the peer known
    net.run()
    prefill_done(p, t0, blocks, n)
    net.run()
    (peer,) = p.prefill.consumers.values()
    peer.rate = pr.LinkRate() if rate_bps is None else pr.LinkRate(rate_bps, 1)
    for auto in (True, False):
        t = tid()
        before = p.transport.writes
        register(d, t, blocks, n, [p])
        net.run()
        p.engine(proto.LayerProgress(0, 1, (proto.LayerChunk(t, 0, 0, tuple(blocks), 0, n, auto=auto),)))
        net.run()
        assert p.transport.writes - before == (1 if streams or not auto else 0), (auto, rate_bps)
        prefill_done(p, t, blocks, n)
        net.run()
        assert [type(m).__name__ for m in d.answers()][-1] == "Received"


def test_link_rate_averages_large_writes_only():
    r = pr.LinkRate()
    assert r.samples == 0
    r.note(1000, 0.001)  # small: latency, not rate
    assert r.samples == 0
    r.note(8 << 20, 0.008)  # 1 GiB/s-ish
    assert r.bps == pytest.approx((8 << 20) / 0.008)
    r.note(8 << 20, 0.080)  # a slower sample pulls the average down, not all the way
    assert (8 << 20) / 0.080 < r.bps < (8 << 20) / 0.008


def test_a_group_write_keeps_the_consumer_polling_only_while_it_is_in_flight(lab):
    """Between a stream's group WRITEs the decode daemon waits at its normal cadence (the next
    layers are still being computed); while one is in flight, or the final WRITE is announced,
    it polls tightly. The producer says both ends of each group WRITE."""
    from kvpush.daemon import decode_side

    net, fab = lab
    p, d = pair(net, fab)
    t, n, blocks = tid(), 40, [1, 2, 3]
    register(d, t, blocks, n, [p])
    net.run()
    now = time.monotonic()
    tight, idle = decode_side.RECV_POLL_MAX_S, min(d.cfg.poll_max_s, decode_side.RECV_FALLBACK_S)
    assert d.decode.poll_cap(now) == idle
    seen = []
    on_writing = d.decode._on_writing

    def spy(msg, now):
        seen.append((msg.group, msg.done))
        on_writing(msg, now)
        seen.append(d.decode.poll_cap(now))

    d.decode._on_writing = spy
    p.engine(proto.LayerProgress(0, 1, (proto.LayerChunk(t, 0, 0, tuple(blocks), 0, n),)))
    net.run()
    assert p.transport.writes == 1
    p.poll()  # the in-memory WRITE completes at its first poll
    net.run()
    (g, _), cap_posted, (g2, _), cap_done = seen
    assert g == g2 > 0 and cap_posted == tight and cap_done == idle, seen
    # announced: it may have landed (fencing keeps counting it)
    assert d.decode.counter.registration(t).announced_until > time.monotonic()
    seen.clear()
    prefill_done(p, t, blocks, n)
    net.run()
    assert seen and seen[0] == (0, False) and seen[1] == tight, seen
    assert [type(m).__name__ for m in d.answers()][-1] == "Received"


def test_heartbeats_advise_the_shortest_prompt_worth_streaming_to_any_peer(lab):
    """The prefill daemon tells its engine (HeartbeatAck) the shortest prompt it would stream
    to any decode peer: 0 while a peer is unmeasured (or none is known), else the fastest
    link's floor."""
    net, fab = lab
    p, d = pair(net, fab, layerwise_min_transfer_ms=20.0)

    def advice() -> int:
        ack = p.engine(proto.Heartbeat(7))
        assert isinstance(ack, proto.HeartbeatAck) and ack.seq == 7
        return ack.stream_min_tokens

    assert advice() == 0  # no peer yet
    t, n, blocks = tid(), 40, [1, 2, 3]
    register(d, t, blocks, n, [p])
    net.run()
    prefill_done(p, t, blocks, n)
    net.run()
    (peer,) = p.prefill.consumers.values()
    assert advice() == 0  # a peer not measured yet (this transfer was too small to measure)
    lay = p.ctx.attached.layout
    per_token = lay.block_bytes / lay.block_size
    peer.rate = pr.LinkRate(1000 * per_token, 1)  # 1000 tokens a second: 20 ms is 20 tokens
    assert advice() == 20
    peer.rate = pr.LinkRate(1e6 * per_token, 1)
    assert advice() == 20_000


def test_the_decode_shell_does_not_ask_its_counter_back(lab, monkeypatch):
    """Register to Received, and to ReceiveFailed: the counter's actions carry what the shell
    needs (whom to cancel, which producer a notification names, the history's numbers), and
    the hints for its poll are the counter's own, so the shell asks it nothing back."""
    import sys

    net, fab = lab
    p, d = pair(net, fab)
    asked: list[str] = []
    cc = d.decode.counter
    def spying(name: str):
        real = getattr(cc, name)

        def spy(*a, **k):
            if sys._getframe(1).f_globals.get("__name__") == "kvpush.daemon.decode_side":
                asked.append(name)
            return real(*a, **k)

        return spy

    for name in ("live", "registration", "producer_index", "rank_index", "current"):
        monkeypatch.setattr(cc, name, spying(name))
    t = tid()
    register(d, t, [1, 2], 20, [p])
    net.run()
    prefill_done(p, t, [3, 4], 20)
    net.run()
    d.decode.poll_cap(time.monotonic())
    t2 = tid()
    register(d, t2, [5, 6], 20, [p])
    net.run()
    fab.fail_writes = True
    prefill_done(p, t2, [7, 8], 20)
    net.run()
    assert kinds(d) == ["Received", "ReceiveFailed"]
    assert [h["result"] for h in d.ctx.history.items][-2:] == ["ok", "failed"]
    assert d.ctx.history.items[-1]["producers"] == 1 and d.ctx.history.items[-1]["latency_ms"] is not None
    assert asked == []
