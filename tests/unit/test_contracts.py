"""The small cross-process contracts in kvpush.proto: notification format, leg params, names."""

from hypothesis import given
from hypothesis import strategies as st

from kvpush.proto import naming, params
from kvpush.proto.notif import Notification


@given(st.text(min_size=1, max_size=40), st.integers(0, 2**31), st.integers(0, 1024))
def test_notification_round_trips_any_transfer_id(tid, attempt, rank):
    n = Notification(tid, attempt, rank)
    assert Notification.decode(n.encode()) == n


@given(st.binary(max_size=64))
def test_notification_decode_is_total(data):
    got = Notification.decode(data)
    assert got is None or Notification.decode(got.encode()) == got


def test_notification_rejects_other_prefixes_and_negatives():
    assert Notification.decode(b"kvp0|t|1|0") is None
    assert Notification.decode(b"kvp1|t|-1|0") is None
    assert Notification.decode(b"kvp1|t|1") is None


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
