"""The plugin's scheduler half with vLLM's real Request objects."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("vllm")

from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from kvpush.engine_plugin.config import PluginConfig  # noqa: E402
from kvpush.engine_plugin.metadata import Send  # noqa: E402
from kvpush.engine_plugin.scheduler.half import KVPushScheduler  # noqa: E402
from kvpush.engine_plugin.scheduler.lifecycle import State  # noqa: E402


def req(rid: str, params: dict, n: int = 64) -> Request:
    return Request(rid, list(range(n)), SamplingParams(max_tokens=8, extra_args={"kv_transfer_params": params}), None)


def test_decode_legs_in_both_spellings_claim_the_prompt():
    s = KVPushScheduler(PluginConfig(daemon="ipc:///x"), block_size=16)
    ours = {"do_remote_prefill": True, "transfer_id": "t1", "prefill_endpoints": ["tcp://h:1"], "prefill_tp_size": 1}
    vllm_push = {"do_remote_prefill": True, "transfer_id": "t2", "remote_host": "h", "remote_port": 17500,
                 "tp_size": 1, "pp_size": 1, "remote_engine_id": "p", "remote_request_id": "cmpl-t2-0"}
    assert s.get_num_new_matched_tokens(req("a", ours), 0) == (64, True)
    assert s.get_num_new_matched_tokens(req("b", vllm_push), 0) == (64, True)


def test_an_unusable_remote_prefill_leg_is_computed_locally_and_said_once(caplog):
    s = KVPushScheduler(PluginConfig(daemon="ipc:///x"), block_size=16)
    bad = {"do_remote_prefill": True, "remote_engine_id": "p"}  # no transfer, no prefill daemon
    with caplog.at_level(logging.WARNING, logger="kvpush.plugin"):
        for i in range(5):
            assert s.get_num_new_matched_tokens(req(f"r{i}", bad), 0) == (0, False)
        assert s.get_num_new_matched_tokens(req("x", {"do_remote_prefill": True, "pp_size": 2}), 0) == (0, False)
        assert s.get_num_new_matched_tokens(req("y", {}), 0) == (0, False)  # not a remote leg: nothing to say
    said = [r for r in caplog.records if "remote prefill" in r.getMessage()]
    assert len(said) == 2 and "remote_engine_id" in said[0].getMessage()


# ---- serial proxies: the prefill engine names the transfer and answers with the decode leg ----

SERIAL_P = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None}  # vLLM's toy proxy


def finished(r: Request) -> Request:
    from vllm.v1.request import RequestStatus

    r.status = RequestStatus.FINISHED_LENGTH_CAPPED
    return r


def serial_sched(tmp_path, tp: int = 2, cards: bool = True) -> KVPushScheduler:
    from kvpush.proto.card import DaemonCard, card_path, write_card

    cfg = PluginConfig(daemon=f"ipc://{tmp_path}/engine-{{rank}}.sock")
    if cards:
        for r in range(tp):
            write_card(card_path(cfg.socket_for(r)), DaemonCard(f"tcp://10.1.0.7:{17500 + r}", f"d{r}", "nodeP"))
    return KVPushScheduler(cfg, block_size=16, tp_size=tp)


def test_a_serial_prefill_leg_answers_a_decode_leg_the_decode_engine_claims(tmp_path):
    from kvpush.proto.params import decode_leg

    s = serial_sched(tmp_path)
    r = req("p1", SERIAL_P)
    s.get_num_new_matched_tokens(r, 0)
    hold, answer = s.request_finished(finished(r), [3, 4, 5, 6])
    assert hold is True and answer is not None
    (send,) = s._meta.events
    assert isinstance(send, Send) and send.transfer_id == answer["transfer_id"] and send.block_ids == (3, 4, 5, 6)
    assert answer["do_remote_prefill"] is True and answer["do_remote_decode"] is False
    leg = decode_leg(answer)  # what the decode engine makes of it, forwarded verbatim
    assert leg is not None and leg.prefill_endpoints == ("tcp://10.1.0.7:17500", "tcp://10.1.0.7:17501")
    d = KVPushScheduler(PluginConfig(daemon="ipc:///x"), block_size=16)
    assert d.get_num_new_matched_tokens(req("d1", answer), 0) == (64, True)
    # Another serial request gets another transfer.
    r2 = req("p2", SERIAL_P)
    assert s.request_finished(finished(r2), [7])[1]["transfer_id"] != answer["transfer_id"]
    # Each named transfer lives in its request's record only, held until the daemon is done.
    assert s.lifecycle.live_count() == s.lifecycle.count(State.HELD) == 2


def test_a_serial_leg_without_a_daemon_card_does_not_hold_its_blocks(tmp_path, caplog):
    s = serial_sched(tmp_path, cards=False)
    with caplog.at_level(logging.WARNING, logger="kvpush.plugin"):
        for i in range(3):
            r = req(f"p{i}", SERIAL_P)
            s.get_num_new_matched_tokens(r, 0)
            assert s.request_finished(finished(r), [1, 2]) == (False, None)
    assert not s._meta.events and not s.lifecycle.live_count() and not s.has_pending_push_work()
    assert len([m for m in caplog.messages if "no daemon card" in m]) == 1  # said once per card


def test_a_restarted_daemon_s_new_card_is_read(tmp_path):
    import os

    from kvpush.proto.card import DaemonCard, card_path, write_card

    s = serial_sched(tmp_path, tp=1)
    r = req("p1", SERIAL_P)
    assert s.request_finished(finished(r), [1])[1]["prefill_endpoints"] == ["tcp://10.1.0.7:17500"]
    path = card_path(s.cfg.socket_for(0))
    write_card(path, DaemonCard("tcp://10.1.0.8:18000", "d9"))
    os.utime(path, ns=(1, 1))  # a different mtime, as a later write has
    assert s.request_finished(finished(req("p2", SERIAL_P)), [1])[1]["prefill_endpoints"] == ["tcp://10.1.0.8:18000"]


@pytest.mark.parametrize("raw", [b"{", b'{"peer_endpoint": "tcp://h:1", "daemon_id": "x", "evil": 1}',
                                 b'{"peer_endpoint": "ipc:///etc/passwd", "daemon_id": "x"}',
                                 b'{"peer_endpoint": "tcp://h:99999", "daemon_id": "x"}', b"x" * 5000])
def test_a_malformed_card_is_refused(tmp_path, raw):
    from kvpush.proto.card import read_card

    p = tmp_path / "c.card"
    p.write_bytes(raw)
    with pytest.raises(ValueError):
        read_card(str(p))


def test_a_router_leg_answers_too_and_still_pushes_without_a_card(tmp_path):
    s = serial_sched(tmp_path, cards=False)
    r = req("p1", {"do_remote_decode": True, "transfer_id": "t-router"})
    assert s.request_finished(finished(r), [1, 2]) == (True, None)  # the decode leg is on its way
    assert [(type(e), e.transfer_id) for e in s._meta.events] == [(Send, "t-router")]


# ---- one shape per hop: the scheduler half's decision is the worker lifecycle's own event ----


def test_a_registration_crosses_to_the_worker_as_its_lifecycle_s_event_and_to_the_wire_once():
    """What the scheduler half decides is the worker lifecycle's Register itself (no request
    shape copied field by field into it); it crosses to a worker process as it is (vLLM may
    pickle the metadata), and the worker lifecycle builds the daemon's message from it."""
    import pickle
    from types import SimpleNamespace

    from kvpush import proto
    from kvpush.engine_plugin.worker import lifecycle as wl

    s = KVPushScheduler(PluginConfig(daemon="ipc:///x"), block_size=16)
    params = {"do_remote_prefill": True, "transfer_id": "t1", "prefill_endpoints": ["tcp://h:1"],
              "prefill_tp_size": 1, "kvpush_secret": "s1"}
    r = req("a", params, n=40)
    assert s.get_num_new_matched_tokens(r, 0) == (40, True)
    s.update_state_after_alloc(r, SimpleNamespace(get_block_ids=lambda: [[5, 6, 7]]), 40)
    meta = s.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=0))  # type: ignore[arg-type]
    assert meta and meta.idle and [type(e) for e in meta.events] == [wl.Register]
    back = pickle.loads(pickle.dumps(meta))
    assert back.events == meta.events and type(back.events[0]) is wl.Register
    ev = back.events[0]
    ev.now = 2.0  # the worker half stamps its own facts (now, down) and applies the event as it is
    w = wl.WorkerLifecycle(timeout_ms=1000, lease_ms=500)
    pubs = [a.msg for a in w.handle(ev) if isinstance(a, wl.Publish)]
    assert pubs == [proto.Register("t1", 0, (5, 6, 7), 40, ("tcp://h:1",), 1, 1000, 0, "s1")]
    assert w.state(("recv", "t1", 0)) is wl.State.LOADING
