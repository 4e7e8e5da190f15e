"""No peer can exhaust or disturb a daemon: floods against real daemons (real ZeroMQ, NIXL).

The prefill daemon runs with ``insecure_peers`` (the worst case: anyone who reaches the port
can speak ZMTP to it; with CURVE a stranger cannot even finish the handshake), a small quota
and a short handshake interval so the properties show quickly. After each flood a real decode
daemon still transfers, and the prefill daemon's RSS grew by less than ``RSS_BOUND``.
"""

from __future__ import annotations

import io
import itertools
import os
import socket

import pytest
import zmq

from kvpush import proto
from kvpush.daemon.ops.ctl import main as ctl_main
from kvpush.proto import codec
from kvpush_dev.bench import flood
from kvpush_dev.daemon_harness import Daemon, Engine, device_config
from kvpush_dev.engine_peer import raw_request

pytestmark = pytest.mark.integration

RSS_BOUND = 100 << 20
QUOTA = 32
_ids = itertools.count()


def tid() -> str:
    return f"s{os.getpid()}-{next(_ids)}"


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bounds")
    kw = dict(insecure_peers=True, max_transfers_per_peer=QUOTA, peer_handshake_s=1.0, register_timeout_s=30.0)
    p, d = Daemon(device_config(tmp, 0, **kw)), Daemon(device_config(tmp, 1, **kw))
    lay = flood.layout()
    pe, de = Engine(p, lay, "prefill", seed=3), Engine(d, lay, "decode", fill="zeros")
    yield p, d, pe, de, lay
    pe.close()
    de.close()
    p.stop()
    d.stop()


def transfers_still(p: Daemon, pe: Engine, de: Engine, blocks=(5, 6)) -> None:
    """A real decode daemon's transfer through the flooded prefill daemon succeeds."""
    t = tid()
    de.send(proto.Register(t, 0, tuple(blocks), 20, (p.peer_endpoint,), 1, 20_000))
    pe.send(proto.PrefillDone(t, (1, 2), 20, 20_000))
    assert isinstance(de.result(t), proto.Received)
    assert isinstance(pe.result(t), proto.Sent)


def test_a_peer_over_its_quota_is_refused_and_others_still_transfer(lab):
    p, d, pe, de, lay = lab
    r = flood.flood_quota(p, lay, n=1000)
    assert r.detail["held"] == QUOTA and r.detail["refused_quota"] == 1000 - QUOTA, r.line()
    assert r.grew < RSS_BOUND, r.line()
    assert all(p.ops("pending")["pending"][i]["transfer_id"].startswith("flood-")
               for i in range(QUOTA)), "what was refused is not stored"
    assert len(p.ops("pending")["pending"]) == QUOTA
    transfers_still(p, pe, de)


def test_partial_max_size_frames_are_bounded_and_an_oversize_one_closes(lab):
    p, d, pe, de, lay = lab
    r = flood.flood_partial(p, conns=16)
    assert r.detail["oversize_closed_s"] is not None and r.detail["oversize_closed_s"] < 2, r.line()
    assert r.grew < RSS_BOUND, r.line()
    transfers_still(p, pe, de, (7, 8))


def test_half_open_connections_are_closed_after_the_handshake_interval(lab):
    p, d, pe, de, lay = lab
    r = flood.flood_half_open(p, conns=32)
    t = r.detail["closed_after_s"]
    assert t is not None and 0.5 < t < p.cfg.peer_handshake_s + 2, r.line()
    assert r.detail["still_open"] == 0 and r.grew < RSS_BOUND, r.line()


def test_silent_engine_socket_connections_are_closed_and_engines_keep_working(lab):
    """A local process that opens engine connections and never says anything holds them for
    the handshake interval at most (ZeroMQ did the same for this socket before the link left
    it); beyond the per-user share they are closed at once. The attached engines keep
    transferring, and a new engine connection is answered afterwards."""
    p, d, pe, de, lay = lab
    path = p.cfg.engine_socket.removeprefix("ipc://")
    socks = []
    for _ in range(100):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        socks.append(s)
    try:
        times = [flood.closed_within(s, p.cfg.peer_handshake_s + 3) for s in socks]
        assert all(t is not None for t in times), f"{times.count(None)} silent connections stayed open"
        assert max(times) < p.cfg.peer_handshake_s + 2, max(times)
    finally:
        for s in socks:
            s.close()
    transfers_still(p, pe, de, (9, 10))
    reply = raw_request(p.cfg.engine_socket, proto.encode(proto.Heartbeat(7)))
    assert reply is not None and isinstance(proto.decode(reply), proto.HeartbeatAck)


def test_half_open_connections_time_out_with_curve_too(tmp_path):
    p = Daemon(device_config(tmp_path, 0, peer_handshake_s=1.0))  # CURVE (the harness's lab keys)
    try:
        s = socket.create_connection(flood._host_port(p.peer_endpoint), timeout=5)
        t = flood.closed_within(s, 6.0)
        s.close()
        assert t is not None and t < 3.0
    finally:
        p.stop()


def test_hello_refusals_say_only_handshake_refused_and_are_counted(lab):
    p, d, pe, de, lay = lab
    before = p.ops("status")["rejected_inputs"]
    r = flood.flood_junk_hello(p, lay, n=300)
    assert r.detail["replies"] == 300 and r.detail["texts"] == ["handshake refused"], r.line()
    assert p.ops("status")["rejected_inputs"] >= before + 300
    assert 'cause="handshake"' in p.ops("metrics")["text"]
    assert r.grew < RSS_BOUND, r.line()
    transfers_still(p, pe, de, (9, 10))


# --------------------------------------------------------- every reply decodable


LONG = "x" * codec.DEFAULT_LIMITS.max_str


def ctl(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    return ctl_main(list(args), out=out, err=err), out.getvalue(), err.getvalue()


def test_kvpushctl_cancel_of_a_4096_char_id_gets_a_decodable_refusal(lab):
    p, *_ = lab
    code, out, err = ctl("--socket", p.cfg.ops_socket, "cancel", LONG)
    assert code == 4 and "is not pending here" in err and len(err.strip().splitlines()) == 1, err
    code, out, err = ctl("--socket", p.cfg.ops_socket, "cancel", LONG + "y")
    assert code == 2 and "at most 4096" in err


def test_engine_and_peer_replies_quoting_4096_chars_decode(lab):
    p, d, pe, de, lay = lab
    # engine: a Register with a 4096-char ID and endpoint (its ReceiveFailed quotes both)
    de.send(proto.Register(LONG, 0, (1, 2), 20, ("tcp://" + "h" * 4000 + ":1",), 1, 5_000))
    assert isinstance(de.result(LONG, timeout=15), proto.ReceiveFailed)
    # engine: an Abort with a 4096-char reason of a transfer a peer registered for
    t = tid()
    de.send(proto.Register(t, 0, (3, 4), 20, (p.peer_endpoint,), 1, 20_000))
    pe.send(proto.PrefillDone(LONG, (1, 2), 20, 20_000))
    pe.send(proto.Abort(LONG, 0, LONG))
    failed = pe.result(LONG)
    assert isinstance(failed, proto.SendFailed) and len(failed.reason) <= codec.REASON_MAX
    de.send(proto.Abort(t, 0, LONG))  # Cancel with a long reason to the producer
    de.wait_for(lambda m: isinstance(m, proto.Released) and m.transfer_id == t, 15)
    # peer: a stranger's PeerRegister / Cancel with 4096-char fields: every answer decodes
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(p.peer_endpoint)
    try:
        for msg in (proto.PeerRegister(LONG, 0, (1,), 16, 0, 1, 1, 1000), proto.Cancel(LONG, 0, LONG)):
            s.send(proto.encode(msg))
            assert s.poll(5000), "no answer"
            assert isinstance(proto.decode(s.recv()), proto.Error)
    finally:
        s.close(0)
    transfers_still(p, pe, de, (11, 12))
