"""OpenTelemetry export of the per-request timeline (kvpush.common.otel).

The SDK's in-memory exporter checks what spans a timeline becomes (the daemons' sink on the
trace ring, the trace context carried in the transfer ID); one real OTLP/HTTP receive checks
the router end to end: a local HTTP server accepts the exporter's protobuf POST and decodes
it with opentelemetry-proto, while engine stand-ins record what the router forwarded.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import pytest
from aiohttp import web

pytest.importorskip("opentelemetry.sdk")

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

from kvpush.common import otel
from kvpush.proto.trace import ClockPair, TraceRing  # noqa: E402
from kvpush.router.app import Backend, RouterConfig, build_app  # noqa: E402
from kvpush_dev.aioserve import serve
from kvpush_dev.otlp import OtlpReceiver  # noqa: E402

TP = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_traceparent_parsing_is_strict() -> None:
    ctx = otel.parse_traceparent(TP)
    assert ctx is not None and ctx.traceparent == TP and ctx.sampled
    for bad in (None, "", "01-" + TP[3:], TP.upper(), TP[:-1], "00-" + "0" * 32 + TP[35:],
                TP.replace("00f067aa0ba902b7", "0" * 16), TP + "-x"):
        assert otel.parse_traceparent(bad) is None, bad
    child = ctx.child()
    assert child.trace_id == ctx.trace_id and child.span_id != ctx.span_id
    assert otel.context_of(otel.transfer_id_for(child)) == child
    assert otel.context_of("kvps-" + "a" * 32) is None and otel.context_of("kvp-" + "a" * 32) is None


def _sink() -> tuple[otel.SpanSink, InMemorySpanExporter]:
    mem = InMemorySpanExporter()
    return otel.SpanSink("kvpushd cpu0", exporter=mem), mem


def test_a_daemon_timeline_becomes_one_span_under_the_routers_span() -> None:
    sink, mem = _sink()
    router_span = otel.parse_traceparent(TP).child()
    tid = otel.transfer_id_for(router_span)
    ring = TraceRing()
    ring.sink = sink.on_end("kvpushd cpu0")
    clock = ClockPair.read()
    t0 = clock.monotonic_ns
    for i, hop in enumerate(("p.daemon.register_in", "p.daemon.prefill_done_in", "p.daemon.write_posted",
                             "p.daemon.write_done")):
        ring.stamp(tid, hop, t0 + i * 1_000_000)
    assert sink.flush() and not mem.get_finished_spans()  # not ended yet: nothing exported
    ring.stamp(tid, "p.daemon.sent", t0 + 9_000_000)
    assert sink.flush()
    (span,) = mem.get_finished_spans()
    assert span.name == "kvpushd cpu0" and span.attributes["kvpush.transfer_id"] == tid
    assert span.context.trace_id == router_span.trace_id and span.parent.span_id == router_span.span_id
    assert [e.name for e in span.events][-1] == "p.daemon.sent" and len(span.events) == 5
    assert span.end_time - span.start_time == 9_000_000
    assert abs(span.start_time - clock.wall_ns) < 5_000_000_000  # monotonic stamps -> wall time
    assert span.status.status_code.name == "UNSET"


def test_a_serial_proxys_transfer_shares_one_derived_trace_across_daemons() -> None:
    sink, mem = _sink()
    tid = "kvps-0123456789abcdef0123456789abcdef"  # named by the prefill engine: no context
    t = time.monotonic_ns()
    sink.export("kvpushd cpu0", tid, [("p.daemon.register_in", t), ("p.daemon.send_failed", t + 5)], failed=True)
    sink.export("kvpushd cpu1", tid, [("d.daemon.register_in", t), ("d.daemon.receive_failed", t + 7)])
    assert sink.flush()
    p, d = mem.get_finished_spans()
    assert p.context.trace_id == d.context.trace_id == otel.derived_trace_id(tid)
    assert p.context.span_id != d.context.span_id and p.parent is None
    assert p.status.status_code.name == "ERROR"


# ---------------------------------------------------------------- a real OTLP/HTTP receive


def _engine(seen: list[dict[str, Any]]) -> web.Application:
    async def completions(req: web.Request) -> web.Response:
        body = await req.json()
        seen.append({"traceparent": req.headers.get("traceparent"), "params": body.get("kv_transfer_params")})
        return web.json_response({"id": "x", "object": "text_completion", "model": "tiny",
                                  "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}]})
    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    return app


def test_the_router_exports_over_otlp_http_and_forwards_the_trace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # the batch processor's period, ms
    collector = OtlpReceiver()
    endpoint = collector.endpoint
    p_seen: list[dict[str, Any]] = []
    d_seen: list[dict[str, Any]] = []

    async def go() -> int:
        (pr, p_url), (dr, d_url) = await serve(_engine(p_seen)), await serve(_engine(d_seen))
        cfg = RouterConfig(prefill=[Backend(p_url, ["tcp://127.0.0.1:1"])], decode=[Backend(d_url, [])],
                           otlp_traces_endpoint=endpoint)
        runner, url = await serve(build_app(cfg))
        try:
            async with aiohttp.ClientSession() as s:
                async with s.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2},
                                  headers={"traceparent": TP}) as r:
                    await r.read()
                    return r.status
        finally:
            await runner.cleanup()
            await pr.cleanup()
            await dr.cleanup()

    try:
        assert asyncio.run(go()) == 200
        deadline = time.monotonic() + 15
        while not collector.spans() and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        collector.close()
    assert collector.posts and collector.posts[0] == ("/v1/traces", "application/x-protobuf")
    (span,) = collector.spans()
    assert span["service"] == "kvpush-router" and span["name"] == "kvpush router"
    client = otel.parse_traceparent(TP)
    assert span["trace_id"] == client.trace_id and span["parent_span_id"] == client.span_id  # the client's trace
    mine = otel.TraceContext(client.trace_id, span["span_id"])
    assert span["events"][:2] == ["router.request_in", "router.legs_sent"]
    # Both engines got the router's span as their parent (vLLM's spans nest under it) ...
    assert p_seen[0]["traceparent"] == d_seen[0]["traceparent"] == mine.traceparent
    # ... and both legs' transfer ID carries it to the daemons.
    assert p_seen[0]["params"]["transfer_id"] == d_seen[0]["params"]["transfer_id"] == otel.transfer_id_for(mine)
