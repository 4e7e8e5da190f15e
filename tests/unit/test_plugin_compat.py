"""The connector's answers to vLLM's engine-level hooks and the release-dependent facts
(engine_plugin.compat), with the installed vLLM's real classes. The same hooks driven by
vLLM's own Scheduler of every tested release: tests/compat (marker vllm_compat)."""

from __future__ import annotations

import enum
import logging
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402

from kvpush.engine_plugin import compat  # noqa: E402
from kvpush.engine_plugin.config import PluginConfig  # noqa: E402
from kvpush.engine_plugin.connector import KVPushConnector  # noqa: E402
from kvpush.engine_plugin.metadata import Send, StreamAbort  # noqa: E402
from kvpush.engine_plugin.scheduler.half import KVPushScheduler  # noqa: E402
from kvpush.engine_plugin.scheduler.lifecycle import State  # noqa: E402


def req(rid: str, params: dict, n: int = 40, **kw) -> Request:
    return Request(rid, list(range(n)), SamplingParams(max_tokens=8, extra_args={"kv_transfer_params": params}),
                   None, **kw)


def sched() -> KVPushScheduler:
    return KVPushScheduler(PluginConfig(daemon="ipc:///x"), block_size=16)


P_LEG = {"do_remote_decode": True, "transfer_id": "t-p"}
D_LEG = {"do_remote_prefill": True, "transfer_id": "t-d", "prefill_endpoints": ["tcp://h:1"], "prefill_tp_size": 1}


# ------------------------------------------------------------------ classmethods


def test_sleep_mode_is_refused_by_the_class_and_at_start_up():
    assert KVPushConnector.supports_sleep_mode(None) is False  # vLLM 0.33+ asks at config time
    with pytest.raises(compat.UnsupportedEngineSetting, match="sleep mode"):  # 0.32 does not ask
        compat.refuse_sleep_mode(SimpleNamespace(model_config=SimpleNamespace(enable_sleep_mode=True)))
    compat.refuse_sleep_mode(SimpleNamespace(model_config=SimpleNamespace(enable_sleep_mode=False)))


@pytest.mark.parametrize("extra, piecewise", [
    ({"daemon": "x", "layerwise": "on"}, True),  # streams on a GPU: save_kv_layer must run
    ({"daemon": "x"}, False),  # auto: streams on CPU engines only, where there are no CUDA graphs
    ({"daemon": "x", "layerwise": "auto"}, False),
    ({"daemon": "x", "layerwise": "off"}, False),
    ({"layerwise": "on"}, True),  # does not parse (no daemon): the safe answer
    ({"daemon": "x", "layerwise": "on", "layer_group": "two"}, True),
])
def test_piecewise_cuda_graphs_whenever_layerwise_can_stream(extra, piecewise):
    assert KVPushConnector.requires_piecewise_for_cudagraph(extra) is piecewise


class FakeAccess(enum.IntFlag):
    IN_PROCESS = 0
    REGISTERS = enum.auto()
    LEGACY_IPC = enum.auto()


class NoLegacy(enum.IntFlag):
    IN_PROCESS = 0
    REGISTERS = enum.auto()


def test_kv_cache_access_asks_for_the_legacy_allocation(monkeypatch):
    import vllm.config.kv_transfer as kt

    monkeypatch.setattr(kt, "KVCacheAccess", FakeAccess, raising=False)  # 0.34's enum, on any release
    assert KVPushConnector.kv_cache_access(None) is FakeAccess.LEGACY_IPC
    monkeypatch.setattr(kt, "KVCacheAccess", NoLegacy)
    with pytest.raises(RuntimeError, match="no LEGACY_IPC"):
        KVPushConnector.kv_cache_access(None)
    monkeypatch.delattr(kt, "KVCacheAccess")  # 0.32 / 0.33: never asked; a clear error if it is
    with pytest.raises(RuntimeError, match="has no KVCacheAccess"):
        KVPushConnector.kv_cache_access(None)


def test_a_vmm_backed_kv_cache_is_refused_with_the_fix():
    with pytest.raises(compat.UnsupportedEngineSetting, match="--no-enable-extensible-kv-cache"):
        compat.check_kv_allocation(SimpleNamespace(cache_config=SimpleNamespace(enable_extensible_kv_cache=True)))
    for v in (None, False):  # 0.34 with LEGACY_IPC honoured, or off
        compat.check_kv_allocation(SimpleNamespace(cache_config=SimpleNamespace(enable_extensible_kv_cache=v)))
    compat.check_kv_allocation(SimpleNamespace(cache_config=SimpleNamespace()))  # 0.32 / 0.33: no such setting


def test_draft_layers_are_left_out():
    ctx = {"model.layers.0.attn": SimpleNamespace(is_draft_layer=False),
           "model.layers.1.attn": SimpleNamespace(),  # 0.32: no such attribute
           "draft.layers.0.attn": SimpleNamespace(is_draft_layer=True)}
    cfg = SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context=ctx))
    kv = {n: object() for n in ctx}
    assert set(compat.target_layers(kv, cfg)) == {"model.layers.0.attn", "model.layers.1.attn"}
    assert compat.target_layers(kv, SimpleNamespace()) is kv  # nothing known: all of it
    with pytest.raises(compat.UnsupportedEngineSetting):
        compat.target_layers({"draft.layers.0.attn": object()}, cfg)


def test_tokens_kvpush_loads_are_counted_as_peer_transfers():
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    c = KVPushConnector.__new__(KVPushConnector)  # the answer is the class's: no engine needed
    assert c.get_external_cache_hit_sources(req("d", D_LEG), 39) == {CacheHitSource.P2P: 39}
    assert c.get_external_cache_hit_sources(req("d", D_LEG), 0) == {}


# ------------------------------------------------------------------ versions


@pytest.mark.parametrize("version, newer", [
    ("0.32.0", False), ("0.32.0+cpu", False), ("0.33.0", False), ("0.34.0", False), ("0.31.2", False),
    ("0.34.1", True), ("0.34.1.dev12+gabcdef", True), ("0.35.0rc1", True), ("1.0.0", True), ("weird", False),
])
def test_newer_than_tested_is_named(version, newer):
    why = compat.untested_reason(version)
    assert (why is not None) is newer
    if newer:
        assert version in why and "0.32.0, 0.33.0, 0.34.0" in why


def test_the_warning_is_logged_once_per_version(caplog, monkeypatch):
    monkeypatch.setattr(compat, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="vllm.kvpush"):
        for _ in range(3):
            assert compat.warn_if_untested("0.99.0") is not None
        assert compat.warn_if_untested("0.34.0") is None
    assert len([r for r in caplog.records if "newer than the newest" in r.getMessage()]) == 1


# ------------------------------------------------------------------ scheduler half


@pytest.mark.parametrize("status, held", [
    (RequestStatus.FINISHED_STOPPED, True), (RequestStatus.FINISHED_LENGTH_CAPPED, True),
    (RequestStatus.FINISHED_REPETITION, True),  # a normal finish: its KV is whole
    (RequestStatus.FINISHED_ABORTED, False), (RequestStatus.FINISHED_ERROR, False),
    (RequestStatus.FINISHED_IGNORED, False),
])
def test_every_normal_finish_holds_and_pushes(status, held):
    s = sched()
    r = req("p", P_LEG)
    s.get_num_new_matched_tokens(r, 0)
    r.status = status
    assert s.request_finished(r, [1, 2, 3])[0] is held
    m = s.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=0, num_scheduled_tokens={},
                                               scheduled_new_reqs=[]))
    assert [x.transfer_id for x in m.events if type(x) is Send] == (["t-p"] if held else [])
    assert [x.transfer_id for x in m.events if type(x) is StreamAbort] == ([] if held else ["t-p"])  # withdrawn


def test_abort_immediately_withdraws_the_transfer_at_once():
    """vLLM 0.33+ adds a request rejected while the engine is paused with abort_immediately
    and aborts it before any hook but request_finished: its prefill leg is withdrawn from the
    daemon in that step, so a decode side registered for it fails now (not at its timeout)."""
    s = sched()
    r = req("p", P_LEG, abort_immediately=True)
    r.status = RequestStatus.FINISHED_ABORTED
    assert s.request_finished(r, []) == (False, None)
    m = s.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=0, num_scheduled_tokens={},
                                               scheduled_new_reqs=[]))
    assert [(type(a), a.transfer_id) for a in m.events] == [(StreamAbort, "t-p")] and m
    assert not s.lifecycle.live_count()
    # a serial leg (no transfer ID yet) has nothing anyone waits for
    r = req("q", {"do_remote_decode": True}, abort_immediately=True)
    r.status = RequestStatus.FINISHED_ABORTED
    assert s.request_finished(r, []) == (False, None) and not s._meta.events


def test_pending_block_frees_while_blocks_wait_for_the_daemon():
    s = sched()
    assert not s.has_pending_block_frees()
    r = req("p", P_LEG)
    s.get_num_new_matched_tokens(r, 0)
    assert not s.has_pending_block_frees()  # prefilling: nothing to free yet
    r.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert s.request_finished(r, [1, 2])[0]
    assert s.lifecycle.state("p") is State.HELD and s.has_pending_block_frees()
    s.update_connector_output(SimpleNamespace(finished_sending={"p"}, finished_recving=None))
    assert not s.has_pending_block_frees()
    # decode side: an aborted load keeps its blocks until the daemon released them
    d = req("d", D_LEG)
    assert s.get_num_new_matched_tokens(d, 0) == (40, True)
    s.update_state_after_alloc(d, SimpleNamespace(get_block_ids=lambda: ([4, 5, 6],)), 40)
    d.status = RequestStatus.FINISHED_ABORTED
    assert s.request_finished(d, [4, 5, 6])[0]
    assert s.has_pending_block_frees()
    s.update_connector_output(SimpleNamespace(finished_sending={"d"}, finished_recving=None))
    assert not s.has_pending_block_frees()
    c = KVPushConnector.__new__(KVPushConnector)  # the facade asks its scheduler half
    c.scheduler = s
    assert not c.has_pending_block_frees()
    c.scheduler = None  # a worker-side connector holds no blocks
    assert not c.has_pending_block_frees()
