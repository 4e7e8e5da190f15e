"""The small cross-process contracts in kvpush.proto: notification format, leg params, names."""

from hypothesis import given
from hypothesis import strategies as st

from kvpush.proto import naming, params
from kvpush.proto.notif import Notification, authentic


@given(st.text(min_size=1, max_size=40), st.integers(0, 2**31), st.integers(0, 1024), st.binary(min_size=1))
def test_notification_round_trips_any_transfer_id(tid, attempt, rank, key):
    n = Notification.signed(key, tid, attempt, rank)
    assert Notification.decode(n.encode()) == n and authentic(key, n)


def test_a_notification_verifies_only_under_its_key_for_what_it_says():
    """The tag binds the key (the registration's producer), the transfer, the attempt and the
    producer rank: change any of them and it no longer verifies; no key verifies nothing."""
    k = b"k" * 32
    n = Notification.signed(k, "t|1", 2, 3)
    assert authentic(k, n)
    assert not authentic(b"j" * 32, n) and not authentic(b"", Notification.signed(b"", "t|1", 2, 3))
    for other in (Notification("t|2", 2, 3, n.tag), Notification("t|1", 1, 3, n.tag),
                  Notification("t|1", 2, 0, n.tag), Notification("t|1", 2, 3, "")):
        assert not authentic(k, other), other


@given(st.binary(max_size=64))
def test_notification_decode_is_total(data):
    got = Notification.decode(data)
    assert got is None or Notification.decode(got.encode()) == got


def test_notification_rejects_other_prefixes_and_negatives():
    tag = b"0" * 64
    assert Notification.decode(b"kvp2|t|1|0|" + tag) == Notification("t", 1, 0, tag.decode())
    assert Notification.decode(b"kvp1|t|1|0") is None  # version 4's untagged notification
    assert Notification.decode(b"kvp1|t|1|0|" + tag) is None
    assert Notification.decode(b"kvp2|t|-1|0|" + tag) is None
    assert Notification.decode(b"kvp2|t|1|" + tag) is None
    assert Notification.decode(b"kvp2|t|1|0|" + tag[:-1]) is None
    assert Notification.decode(b"kvp2|t|1|0|" + b"G" * 64) is None


def test_legs_round_trip_and_reject_malformed():
    d = params.DecodeLeg("t1", ("tcp://a:1", "tcp://a:2"), 2)
    assert params.decode_leg(d.to_params()) == d
    assert params.prefill_leg(params.PrefillLeg("t1").to_params()) == params.PrefillLeg("t1")
    assert params.decode_leg({"do_remote_prefill": True, "transfer_id": "t"}) is None
    assert params.decode_leg({**d.to_params(), "prefill_tp_size": 0}) is None
    assert params.decode_leg({**d.to_params(), "prefill_tp_size": True}) is None
    assert params.decode_leg(None) is None and params.prefill_leg({"transfer_id": "t"}) is None
    # Without prefill_tp_size the endpoint count is the TP size.
    assert params.decode_leg({"do_remote_prefill": True, "transfer_id": "t",
                              "prefill_endpoints": ["e"]}) == params.DecodeLeg("t", ("e",), 1)


def test_socket_names():
    assert naming.engine_socket("/run/kvpush", 3) == "ipc:///run/kvpush/engine-3.sock"
    assert naming.ops_socket("/r", 0) == "ipc:///r/ops-0.sock"


def test_vllm_push_proxy_fields_name_the_prefill_daemons():
    """NixlPushConnector's decode leg: host + the node's kvpushd base peer port + TP size."""
    leg = {"do_remote_prefill": True, "remote_engine_id": "p", "remote_host": "10.0.0.5", "remote_port": 17500,
           "tp_size": 2, "pp_size": 1, "remote_request_id": "cmpl-x-0", "transfer_id": "t9"}
    assert params.decode_leg(leg) == params.DecodeLeg("t9", ("tcp://10.0.0.5:17500", "tcp://10.0.0.5:17501"), 2)
    assert params.decode_leg({**leg, "remote_host": "fd00::5", "tp_size": 1}).prefill_endpoints == (
        "tcp://[fd00::5]:17500",)
    assert params.decode_leg({k: v for k, v in leg.items() if k != "tp_size"}).prefill_tp_size == 1
    for bad in ({"pp_size": 2}, {"tp_size": 0}, {"tp_size": "2"}, {"remote_port": 65535}, {"remote_port": True},
                {"remote_host": ""}, {"remote_host": "a/b"}, {"transfer_id": ""}):
        assert params.decode_leg({**leg, **bad}) is None, bad
    # Our own router's spelling wins when both are there.
    both = {**leg, "prefill_endpoints": ["tcp://h:1"], "prefill_tp_size": 1}
    assert params.decode_leg(both).prefill_endpoints == ("tcp://h:1",)


@given(st.integers(1, 65535), st.integers(1, 64))
def test_push_proxy_ports_never_leave_the_port_range(port, tp):
    eps = params.push_proxy_endpoints({"remote_host": "h", "remote_port": port, "tp_size": tp})
    if port + tp - 1 <= 65535:
        assert eps is not None and len(eps) == tp and all(0 < int(e.rsplit(":", 1)[1]) <= 65535 for e in eps)
    else:
        assert eps is None
