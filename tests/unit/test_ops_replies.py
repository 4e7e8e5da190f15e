"""Typed ops replies (kvpush.proto.ops): round trips, through the real codec too, clear errors
for malformed data, and the one ops client reading a real ZeroMQ ROUTER's replies."""

from __future__ import annotations

import dataclasses
import threading
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush import proto
from kvpush.daemon.ops import client as opsclient
from kvpush.proto import ops
from kvpush.proto.ops import REPLY_TYPES, OpsDataError, parse_reply
from kvpush.proto.trace import ClockPair

INTS = st.integers(-(2**62), 2**62)
FLOATS = st.floats(allow_nan=False, allow_infinity=False, width=64)
TEXT = st.text(max_size=20)


def strategy(hint: Any) -> st.SearchStrategy[Any]:
    """Values of a reply field's type hint (tags keep their one value)."""
    if hint is bool:
        return st.booleans()
    if hint is int:
        return INTS
    if hint is float:
        return FLOATS
    if hint is str:
        return TEXT
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        hints = typing.get_type_hints(hint)
        kw = {f.name: strategy(hints[f.name]) for f in dataclasses.fields(hint)
              if not f.metadata.get("tag")}
        return st.builds(hint, **kw)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        return st.one_of(*[st.none() if a is type(None) else strategy(a) for a in args])
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return st.lists(strategy(args[0]), max_size=3).map(tuple)
    if origin is tuple:
        return st.tuples(*[strategy(a) for a in args])
    if origin is dict:
        return st.dictionaries(TEXT, strategy(args[1]), max_size=3)
    raise TypeError(hint)


ANY_REPLY = st.sampled_from(sorted(REPLY_TYPES)).flatmap(
    lambda cmd: st.tuples(st.just(cmd), strategy(REPLY_TYPES[cmd])))


@settings(max_examples=300, deadline=None)
@given(ANY_REPLY)
def test_every_reply_round_trips_through_the_codec(case: tuple[str, ops.OpsData]) -> None:
    cmd, reply = case
    data = reply.to_data()
    assert type(reply).from_data(data) == reply
    wire = proto.decode(proto.encode(proto.OpsReply(True, data)))
    assert isinstance(wire, proto.OpsReply) and wire.data == data
    assert parse_reply(cmd, wire.data) == reply
    assert parse_reply(cmd, wire.data).to_data() == data  # kvpushctl --json shows it unchanged


def status_data() -> dict[str, Any]:
    return ops.StatusReply(
        device="cpu0", pid=7, daemon_id="abc", version=1, backend="UCX", agent="a",
        uptime_s=1.5, draining=False, peer_endpoint="tcp://127.0.0.1:1", peer_auth="curve", node="n1",
        engine_socket="ipc:///e",
        rss_bytes=10, cpu_s=0.1,
        engine=ops.EngineInfo(engine_id="e", rank=0, tp_size=1, role="prefill", memory_bytes=1,
                              blocks=2, block_size=16, attached_s=0.5),
        peers=ops.PeerCounts(producers=0, consumers=1),
        pending=ops.PendingCounts(prefill={"wait_register": 1}, decode={}),
        in_flight=0, rejected_inputs=0,
    ).to_data()


def pending_data() -> dict[str, Any]:
    return ops.PendingReply(device="cpu0", pending=(
        ops.PrefillPending(transfer_id="t", attempt=-1, state="wait_register", blocks=3,
                           registered=0, expected=0, writes_in_flight=0, age=0.1, deadline=None),
        ops.DecodePending(transfer_id="u", attempt=0, state="waiting", notified=0, resolved=0,
                          producers=1, age=0.2, deadline=12.0),
    )).to_data()


def test_wire_shape_is_the_documented_one() -> None:
    """What kvpushctl --json prints: the keys daemon/ops/views.py always sent."""
    d = pending_data()
    assert list(d["pending"][0]) == ["side", "transfer_id", "attempt", "state", "blocks",
                                     "registered", "expected", "writes_in_flight", "age", "deadline"]
    assert d["pending"][1]["side"] == "decode"
    clock = ClockPair(1, 2)
    assert ops.TraceReply(device="cpu0", clock=clock, recent=("a",)).to_data() == {
        "device": "cpu0", "clock": {"monotonic_ns": 1, "wall_ns": 2}, "recent": ["a"]}
    assert ops.TraceReply(device="cpu0", clock=clock, transfer_id="t",
                          events=(("p.daemon.sent", 5),)).to_data() == {
        "device": "cpu0", "clock": {"monotonic_ns": 1, "wall_ns": 2}, "transfer_id": "t",
        "events": [["p.daemon.sent", 5]]}
    assert ops.LiveWrite(transfer_id="t", attempt=0, dest_rank=0, bytes=1, descriptors=1,
                         age_s=0.0).to_data()["result"] == "in_flight"


def _set(d: dict[str, Any], path: list[Any], value: Any) -> dict[str, Any]:
    node: Any = d
    for p in path[:-1]:
        node = node[p]
    if value is _DELETE:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return d


_DELETE = object()


@pytest.mark.parametrize(("make", "cmd", "path", "value", "message"), [
    (status_data, "status", ["pid"], "7", r"status\.pid: expected int, got str"),
    (status_data, "status", ["pid"], True, r"status\.pid: expected int, got bool"),
    (status_data, "status", ["draining"], 0, r"status\.draining: expected bool, got int"),
    (status_data, "status", ["uptime_s"], None, r"status\.uptime_s: expected a number, got null"),
    (status_data, "status", ["engine", "rank"], 1.0, r"status\.engine\.rank: expected int, got float"),
    (status_data, "status", ["engine", "role"], _DELETE, r"status\.engine\.role: missing"),
    (status_data, "status", ["peers"], [], r"status\.peers: expected a map, got list"),
    (status_data, "status", ["pending", "prefill", "x"], "1", r"status\.pending\.prefill\['x'\]: expected int"),
    (status_data, "status", ["surprise"], 1, r"status: unexpected field\(s\) surprise"),
    (pending_data, "pending", ["pending", 0, "side"], "both", r"pending\.pending\[0\]\.side: 'both' is not one of decode, prefill"),
    (pending_data, "pending", ["pending", 1, "blocks"], 3, r"pending\.pending\[1\]: unexpected field\(s\) blocks"),
    (pending_data, "pending", ["pending", 1, "deadline"], None, r"pending\.pending\[1\]\.deadline: expected"),
    (pending_data, "pending", ["pending"], {}, r"pending\.pending: expected an array, got dict"),
])
def test_malformed_reply_names_the_field(make: Any, cmd: str, path: list[Any], value: Any,
                                         message: str) -> None:
    data = _set(make(), path, value)
    with pytest.raises(OpsDataError, match=message):
        parse_reply(cmd, data)


def test_trace_fields_may_be_omitted_but_not_the_rest() -> None:
    base = {"device": "cpu0", "clock": {"monotonic_ns": 1, "wall_ns": 2}}
    assert parse_reply("trace", base) == ops.TraceReply(device="cpu0", clock=ClockPair(1, 2))
    with pytest.raises(OpsDataError, match=r"trace\.events\[0\]: expected 2 elements, got 1"):
        parse_reply("trace", {**base, "events": [["hop"]]})
    with pytest.raises(OpsDataError, match=r"trace\.clock\.wall_ns: missing"):
        parse_reply("trace", {"device": "cpu0", "clock": {"monotonic_ns": 1}})
    with pytest.raises(OpsDataError, match="no reply schema for ops command 'reboot'"):
        parse_reply("reboot", {})


# ----------------------------------------------------------------------------- the client


@pytest.fixture
def router(tmp_path: Path) -> Iterator[tuple[str, list[Any]]]:
    """A ROUTER that answers each request with the next queued reply (bytes) or not at all."""
    ep = f"ipc://{tmp_path}/ops-0.sock"
    replies: list[Any] = []
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(ep)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            if sock.poll(50):
                ident, _ = sock.recv_multipart()
                frame = replies.pop(0) if replies else None
                if frame is not None:
                    sock.send_multipart([ident, frame])

    th = threading.Thread(target=serve, daemon=True)
    th.start()
    yield ep, replies
    stop.set()
    th.join(5)
    sock.close(0)


def test_client_types_replies_and_reports_each_failure(router: tuple[str, list[Any]],
                                                       tmp_path: Path) -> None:
    ep, replies = router
    replies.append(proto.encode(proto.OpsReply(True, status_data())))
    [a] = opsclient.ask([ep], proto.OpsRequest("status"), 5.0)
    assert a.ok and isinstance(a.reply, ops.StatusReply) and a.reply.engine is not None
    assert a.data == status_data()

    replies.append(proto.encode(proto.OpsReply(True, {**status_data(), "pid": "x"})))
    a = opsclient.request(ep, proto.OpsRequest("status"))
    assert (a.outcome, a.reply, a.data) == ("down", None, None)
    assert a.error == f"malformed status reply from {ep}: status.pid: expected int, got str"

    replies.append(proto.encode(proto.OpsReply(False, {}, "transfer 't' is not pending here")))
    a = opsclient.request(ep, proto.OpsRequest("cancel", "t"))
    assert (a.outcome, a.error, a.data) == ("refused", "transfer 't' is not pending here", {})

    replies.append(b"\x01garbage")
    assert "unreadable reply" in (opsclient.request(ep, proto.OpsRequest("peers")).error or "")

    missing = f"ipc://{tmp_path}/ops-9.sock"
    replies.append(None)  # the live one stays silent: the timeout is the whole call's
    a, b = opsclient.ask([ep, missing], proto.OpsRequest("metrics"), 0.3)
    assert a.outcome == "down" and a.error == f"no reply within 0.3s from {ep}"
    assert b.outcome == "down" and "no socket" in (b.error or "")
