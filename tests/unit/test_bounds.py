"""Bounds from configuration, never from the wire: per-peer quotas (rendezvous holdings and
the pure quota rule), the generic Hello refusal, message-size limits, clipped quotes.

The prefill side is driven over the in-memory ports (real parts, real codec: a reply the
codec could not decode fails the test where it is delivered)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush import proto
from kvpush.common.machine.core import Held
from kvpush.daemon import handshake
from kvpush.daemon.config import DEFAULT_MAX_MESSAGE, ConfigError, DeviceConfig
from kvpush.daemon.core import quotas
from kvpush.daemon.core import rendezvous as rz
from kvpush.proto import codec
from kvpush_dev.inmemory import Fabric, MemNode, Net
from kvpush_dev.kvref import make

_ids = itertools.count()


def tid() -> str:
    return f"b-{next(_ids)}"


# ------------------------------------------------------- rendezvous holdings (property)

TIDS, PEERS = ("a", "b", "c"), ("p0", "p1")

event = st.one_of(
    st.tuples(st.just("reg"), st.sampled_from(TIDS), st.integers(0, 2), st.sampled_from(PEERS),
              st.integers(0, 1), st.integers(1, 2), st.integers(1, 4)),
    st.tuples(st.just("prefill"), st.sampled_from(TIDS)),
    st.tuples(st.just("write"), st.integers(0, 5), st.booleans()),
    st.tuples(st.just("cancel"), st.sampled_from(TIDS), st.sampled_from(PEERS)),
    st.tuples(st.just("abort"), st.sampled_from(TIDS)),
    st.tuples(st.just("lost"), st.sampled_from(PEERS)),
    st.tuples(st.just("tick"), st.floats(0.1, 20)),
)


def _recount(rv: rz.Rendezvous) -> dict[str, Held]:
    """What every peer holds, recomputed from scratch from the records' facts."""
    out: dict[str, Held] = {}
    for rec in rv._recs.values():
        if rec.state in rz.TOMBSTONES:
            continue
        mine: dict[str, int] = {}
        for dest, reg in rec.regs.items():
            if rec.live or (rec.attempt, dest) in rec.writes.inflight:
                mine[reg.peer] = mine.get(reg.peer, 0) + len(reg.block_ids)
        for f in rec.writes.inflight.values():
            mine.setdefault(f.peer, 0)
        for peer, n in mine.items():
            h = out.get(peer, Held())
            out[peer] = Held(h.records + 1, h.units + n)
    return out


@settings(max_examples=300, deadline=None)
@given(st.lists(event, max_size=60), st.sampled_from([5.0, 1e9]))
def test_peer_holdings_are_kept_exactly_and_drop_to_zero(events, tombstone_s):
    rv = rz.Rendezvous(tombstone_s=tombstone_s, max_transfers=4)
    now, flights = 0.0, []

    def handle(ev: object) -> None:
        for act in rv.handle(ev):  # type: ignore[arg-type]
            if isinstance(act, rz.StartWrite):
                flights.append(act)
        want = _recount(rv)
        for p in PEERS:
            assert rv.peer_held(p) == want.get(p, Held()), (p, ev)
        for t in TIDS:  # the per-transfer stake agrees with the totals
            for p in PEERS:
                stake = rv.peer_stake(t, p)
                assert stake is None or 0 <= stake <= rv.peer_held(p).units

    for e in events:
        now += 0.01
        kind = e[0]
        if kind == "reg":
            _, t, attempt, peer, dest, expected, n = e
            handle(rz.Registered(t, attempt, peer, min(dest, expected - 1), expected, tuple(range(n)), 16,
                               now, now + 5.0))
        elif kind == "prefill":
            handle(rz.Prefilled(e[1], (1, 2), 16, now, now + 5.0))
        elif kind == "write" and flights:
            w = flights.pop(e[1] % len(flights))
            cls = rz.WriteDone if e[2] else rz.WriteFailed
            args = (w.transfer_id, w.attempt, w.dest_rank) + (() if e[2] else ("boom",))
            handle(cls(*args, now))  # type: ignore[arg-type]
        elif kind == "cancel":
            handle(rz.Aborted(e[1], None, "c", "peer", now, e[2]))
        elif kind == "abort":
            handle(rz.Aborted(e[1], None, "a", "local", now))
        elif kind == "lost":
            handle(rz.PeerLost(e[1], now))
        elif kind == "tick":
            now += e[1]
            handle(rz.Tick(now))
    while flights:  # the transport answers every write; then every deadline passes
        w = flights.pop()
        handle(rz.WriteDone(w.transfer_id, w.attempt, w.dest_rank, now))
    handle(rz.Tick(now + 1e10))
    assert all(rv.peer_held(p) == Held() for p in PEERS)


@given(st.integers(0, 50), st.integers(0, 5000), st.none() | st.integers(0, 100), st.integers(0, 3000),
       st.integers(0, 50), st.integers(0, 5000))
def test_quota_refuses_exactly_what_goes_over(records, units, stake, blocks, max_t, max_b):
    q = quotas.Quota(max_t, max_b)
    units = max(units, stake or 0)
    why = quotas.refusal(q, Held(records, units), stake, blocks)
    over = records + (stake is None) > max_t or units - (stake or 0) + blocks > max_b
    assert bool(why) == over
    assert not why or why.startswith("quota: ")


# ------------------------------------------------------------- the prefill side's quota


def cpu(num_blocks: int = 64):
    return make("row", num_layers=2, num_blocks=num_blocks, block_size=16, num_heads=2, head_size=8,
                dtype="bfloat16")


def _node(net, fab, name, role, **cfg) -> MemNode:
    import numpy as np

    lay, _ = cpu()
    n = MemNode(net, fab, name, **cfg)
    buf = np.zeros(lay.region_size, dtype=np.uint8)
    n.attach(lay, buf, role=role, engine_id=name)
    return n


def _register(d: MemNode, p: MemNode, t: str, blocks, n: int = 20):
    return d.engine(proto.Register(t, 0, tuple(blocks), n, (p.endpoint,), 1, 20_000))


def _failures(d: MemNode) -> dict[str, str]:
    return {m.transfer_id: m.reason for m in d.answers() if isinstance(m, proto.ReceiveFailed)}


@pytest.mark.parametrize("limit", ["transfers", "blocks"])
def test_a_peer_over_its_quota_is_refused_and_others_are_not(limit):
    net, fab = Net(), Fabric()
    cfg = {"max_transfers_per_peer": 2} if limit == "transfers" else {"max_blocks_per_peer": 4}
    p = _node(net, fab, "p", "prefill", **cfg)
    d1, d2 = _node(net, fab, "d1", "decode"), _node(net, fab, "d2", "decode")
    t1, t2, t3 = tid(), tid(), tid()
    _register(d1, p, t1, [1, 2])
    _register(d1, p, t2, [3, 4])
    net.run()
    _register(d1, p, t3, [5, 6])  # a third transfer / block IDs 5 and 6: over the quota
    net.run()
    why = _failures(d1).get(t3, "")
    assert why.startswith("producer 0: quota: "), why
    assert not p.prefill.rdv.live(t3), "nothing of a refused registration is stored"
    assert p.prefill.rdv.peer_held(p.prefill.consumers[b"mem://d1"].key) == Held(2, 4)
    # another peer is not affected
    t4 = tid()
    _register(d2, p, t4, [7, 8, 9, 10])
    net.run()
    p.engine(proto.PrefillDone(t4, (1, 2), 20, 5000))
    net.run()
    assert any(isinstance(m, proto.Received) and m.transfer_id == t4 for m in d2.answers())
    # the count drops when a transfer ends: d1 may register again
    p.engine(proto.PrefillDone(t1, (3, 4), 20, 5000))
    net.run()
    t5 = tid()
    _register(d1, p, t5, [11, 12])
    net.run()
    assert t5 not in _failures(d1) and p.prefill.rdv.live(t5)


def test_a_repeat_of_a_held_registration_is_never_refused_by_the_quota():
    """A repeat may have a WRITE in flight into its blocks: only the rendezvous answers it."""
    net, fab = Net(), Fabric()
    p = _node(net, fab, "p", "prefill", max_transfers_per_peer=1, max_blocks_per_peer=2)
    d = _node(net, fab, "d", "decode")
    t = tid()
    _register(d, p, t, [1, 2])
    net.run()
    d.wire.to_producer(p.endpoint, proto.PeerRegister(t, 0, (1, 2), 20, 0, 1, 1, 20_000, key=bytes(32)))  # the same again
    net.run()
    assert t not in _failures(d) and p.prefill.rdv.live(t)


# ------------------------------------------------------------------- handshake refusals


def test_refusal_text_is_generic_unless_authenticated():
    why = "dtype bfloat16 there, float16 here"
    assert handshake.refusal(why, authenticated=False) == "handshake refused"
    assert handshake.refusal(why, authenticated=True) == why
    assert len(handshake.refusal("x" * 10_000, authenticated=True)) <= codec.QUOTE_MAX


def test_an_incompatible_hello_hears_only_handshake_refused_and_is_counted():
    net, fab = Net(), Fabric()
    p = _node(net, fab, "p", "prefill")
    d = MemNode(net, fab, "d")
    import numpy as np

    other, _ = make("row", num_layers=3, num_blocks=64, block_size=16, num_heads=2, head_size=8,
                    dtype="float16")
    d.attach(other, np.zeros(other.region_size, dtype=np.uint8), role="decode")
    heard: list[proto.Error] = []
    orig = d.decode.on_producer

    def spy(endpoint, msg, now):
        if isinstance(msg, proto.Error):
            heard.append(msg)
        orig(endpoint, msg, now)

    d.decode.on_producer = spy  # type: ignore[method-assign]
    errors = p.ctx.errors
    t = tid()
    _register(d, p, t, [1, 2])
    net.run()
    assert [e.message for e in heard] == ["handshake refused"]
    assert p.ctx.errors == errors + 1 and "handshake" in p.ctx.metrics.render()
    assert t in _failures(d)  # the decode side still fails its transfer (its own words)


# ----------------------------------------------------------- sizes and clipped quotes


def test_default_message_size_fits_the_largest_legitimate_message():
    assert DEFAULT_MAX_MESSAGE >= codec.largest_inbound() > codec.MAX_METADATA
    assert DEFAULT_MAX_MESSAGE <= codec.DEFAULT_LIMITS.max_message
    ids = tuple(range(2**32 - codec.MAX_BLOCK_IDS, 2**32))
    assert len(proto.encode(proto.PeerRegister("t" * 64, 0, ids, 1, 0, 1, 1, 1))) < DEFAULT_MAX_MESSAGE
    ops = proto.encode(proto.OpsRequest("cancel", "\U0001f600" * codec.DEFAULT_LIMITS.max_str))
    assert len(ops) <= codec.largest_ops_request()


@pytest.mark.parametrize("value", [1000, codec.DEFAULT_LIMITS.max_message + 1])
def test_message_size_outside_its_bounds_is_a_config_error(value):
    cfg = DeviceConfig(index=0, name="cpu0", runtime_dir="/run/x", insecure_peers=True,
                       max_message_bytes=value)
    with pytest.raises(ConfigError, match="max_message_bytes"):
        cfg.validate()


@given(st.text(max_size=6000), st.integers(30, 5000))
def test_clip_bounds_any_text(text, n):
    out = codec.clip(text, n)
    assert len(out) <= n and (out == text) == (len(text) <= n)


def test_long_reasons_from_the_wire_still_give_decodable_replies():
    """A 4096-char abort / cancel reason is quoted in replies to the engine and to other
    peers: the in-memory net decodes every message with the real codec."""
    net, fab = Net(), Fabric()
    p = _node(net, fab, "p", "prefill")
    d = _node(net, fab, "d", "decode")
    long = "r" * codec.DEFAULT_LIMITS.max_str
    t1 = tid()
    _register(d, p, t1, [1, 2])
    net.run()
    p.engine(proto.Abort(t1, 0, long))  # prefill engine aborts: WriteFailedNotice to d
    net.run()
    assert t1 in _failures(d)
    t2 = tid()
    p.engine(proto.PrefillDone(t2, (1, 2), 20, 5000))
    _register(d, p, t2, [3, 4])
    d.engine(proto.Abort(t2, 0, long))  # decode engine aborts: Cancel with the long reason
    net.run()
    t3 = tid()
    x = "x" * codec.DEFAULT_LIMITS.max_str  # and a 4096-char transfer ID, end to end
    p.engine(proto.PrefillDone(x, (1, 2), 20, 5000))
    p.engine(proto.Abort(x, 0, long))
    sent = [m for m in p.answers() if isinstance(m, proto.SendFailed) and m.transfer_id in (t1, t2, x)]
    assert sent and all(len(m.reason) <= codec.REASON_MAX for m in sent)
    assert t3 not in _failures(d)
