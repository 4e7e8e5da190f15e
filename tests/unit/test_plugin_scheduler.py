"""The plugin's scheduler half with vLLM's real Request objects."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("vllm")

from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from kvpush.engine_plugin.config import PluginConfig  # noqa: E402
from kvpush.engine_plugin.scheduler import KVPushScheduler  # noqa: E402


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
