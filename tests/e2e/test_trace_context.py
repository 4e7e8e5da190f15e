"""A client's W3C trace context through kvpush's router on real engines: the transfer ID
carries it to both daemons, and the push still happens (tokens equal colocated, the prompt
comes through kvpush). The router's engine legs carry the same ``traceparent`` vLLM reads."""

from __future__ import annotations

import json
import random
import urllib.request

import pytest

from kvpush.daemon import otel
from kvpush.testing import vllm_env as ve
from kvpush.testing.pd_stack import PDStack, prompt_tokens_by_source

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
