"""A client's W3C trace context through kvpush's router on real engines: the transfer ID
carries it to both daemons, and the push still happens (tokens equal colocated, the prompt
comes through kvpush). The router's engine legs carry the same ``traceparent`` vLLM reads."""

from __future__ import annotations

import json
import os
import random
import time
import urllib.request
from pathlib import Path

import pytest

from kvpush.common import otel
from kvpush_dev import vllm_env as ve
from kvpush_dev.otlp import OtlpReceiver
from kvpush_dev.pd_stack import PDStack, prompt_tokens_by_source
from kvpush_dev.procs import free_port, popen

pytestmark = pytest.mark.e2e

TP = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_a_traced_request_is_pushed_under_its_trace(pd: PDStack) -> None:
    rng = random.Random(31)
    prompt = [rng.randrange(10, 2990) for _ in range(300)]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    want = ve.post_json(f"{pd.p_url}/v1/completions", body)["choices"][0]["text"]
    ext0 = prompt_tokens_by_source(pd.d_url).get("external_kv_transfer", 0.0)
    req = urllib.request.Request(f"{pd.router_url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json", "traceparent": TP})
    with urllib.request.urlopen(req, timeout=120) as r:
        got = json.loads(r.read())
        tid = r.headers["x-kvpush-transfer-id"]
    ext1 = prompt_tokens_by_source(pd.d_url).get("external_kv_transfer", 0.0)
    assert got["choices"][0]["text"] == want
    assert 299 <= ext1 - ext0 <= 300, ext1 - ext0
    ctx = otel.context_of(tid)
    assert ctx is not None and ctx.trace_id == otel.parse_traceparent(TP).trace_id, tid


def test_the_transfer_shows_up_in_the_same_trace_as_vllms_spans(tiny_model: Path, tmp_path: Path) -> None:
    """Engines with vLLM's own tracing (``--otlp-traces-endpoint``), both daemons and the router
    exporting to one OTLP/HTTP receiver: one request gives one trace holding the router's span,
    both engines' ``llm_request`` spans and both daemons' spans, each under the router's span."""
    collector = OtlpReceiver()
    stack = PDStack(tiny_model, tmp_path / "pd", with_router=False, keys_dir=tmp_path,
                    engine_args=["--otlp-traces-endpoint", collector.endpoint],
                    engine_env={"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", "OTEL_BSP_SCHEDULE_DELAY": "200"},
                    daemon_toml=f'otlp_traces_endpoint = "{collector.endpoint}"\n')
    router = None
    try:
        stack.start()
        port = free_port()
        conf = tmp_path / "router.toml"
        conf.write_text(f'listen = "127.0.0.1:{port}"\notlp_traces_endpoint = "{collector.endpoint}"\n'
                        'expose_transfer_id = true\n'
                        f'[[prefill]]\nurl = "{stack.p_url}"\nhost = "127.0.0.1"\nbase_port = {stack.base_port}\n'
                        f'[[decode]]\nurl = "{stack.d_url}"\n')
        router = popen([ve.vllm_python(), "-m", "kvpush.router.cli", "--config", str(conf)], tmp_path / "router.log",
                       env={**os.environ, "OTEL_BSP_SCHEDULE_DELAY": "200"})
        ve.wait_healthy(f"http://127.0.0.1:{port}/health", 60, router)
        body = {"model": "tiny", "prompt": list(range(20, 220)), "max_tokens": 4, "temperature": 0.0}
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json", "traceparent": TP})
        with urllib.request.urlopen(req, timeout=120) as r:
            assert r.status == 200
            tid = r.headers["x-kvpush-transfer-id"]
        trace = otel.parse_traceparent(TP).trace_id
        deadline, spans = time.monotonic() + 30, []
        while time.monotonic() < deadline:
            spans = [s for s in collector.spans() if s["trace_id"] == trace]
            if len(spans) >= 5:
                break
            time.sleep(0.5)
        names = sorted((s["service"], s["name"]) for s in spans)
        router_span = next(s for s in spans if s["service"] == "kvpush-router")
        assert otel.transfer_id_for(otel.TraceContext(trace, router_span["span_id"])) == tid
        under_router = [s for s in spans if s["parent_span_id"] == router_span["span_id"]]
        assert sum(s["name"] == "llm_request" for s in under_router) == 2, names  # vLLM's, P and D
        assert {s["service"] for s in under_router if s["name"].startswith("kvpushd")} == \
            {"kvpushd cpu0", "kvpushd cpu1"}, names
    finally:
        if router is not None:
            ve.stop_group(router)
        stack.stop()
        collector.close()
