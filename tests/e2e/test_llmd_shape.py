"""kvpush behind llm-d's routing sidecar: the exact request shape it sends, on real engines.

llm-d's sidecar (its NIXL v2 connector path) is a serial proxy, not our router: it sends the
prefill leg first, with NIXL-shaped null params, ``stream: false``, ``max_tokens: 1`` and an
``x-request-id``; then it sends the decode leg with the prefill response's
``kv_transfer_params`` copied verbatim (``kvpush_dev.pd_faults.serial_front`` sends exactly
that; every model family's suite goes through it too). No transfer ID or daemon endpoint is in the prefill
leg, so the prefill engine's plugin names the transfer and answers with the decode leg's
params (its daemons' endpoints). Greedy tokens must equal the colocated run, and the decode
engine's own counter must show the prompt came through kvpush, not a local recompute.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import aiohttp
import pytest

from kvpush_dev.pd_faults import serial_front
from kvpush_dev.pd_stack import PDStack, prompt_tokens_by_source
from kvpush_dev.tiny_model import prompt_ids as ids

pytestmark = pytest.mark.e2e


async def post(s: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict[str, Any]:
    async with s.post(url, json=body, timeout=aiohttp.ClientTimeout(total=300)) as r:
        data = await r.json(content_type=None)
        assert r.status == 200, data
        return data


async def colocated(pd: PDStack, body: dict[str, Any]) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s:
        return await post(s, f"{pd.p_url}/v1/completions", body)


@pytest.mark.parametrize("n", [200, 1000])
def test_llmd_sidecar_request_shape_equals_colocated(pd: PDStack, n: int) -> None:
    body = {"model": "tiny", "prompt": ids(n, seed=2700 + n), "max_tokens": 12, "temperature": 0.0,
            "ignore_eos": True}
    want = asyncio.run(colocated(pd, body))["choices"][0]["text"]
    ext0 = prompt_tokens_by_source(pd.d_url).get("external_kv_transfer", 0.0)
    p, d = asyncio.run(serial_front(pd, body, request_id=f"llmd-{uuid.uuid4().hex}"))
    ext1 = prompt_tokens_by_source(pd.d_url).get("external_kv_transfer", 0.0)
    # The prefill engine answered with a kvpush decode leg naming its daemon.
    params = p["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["prefill_endpoints"] == [pd.prefill_endpoint], params
    assert d["choices"][0]["text"] == want
    assert n - 1 <= ext1 - ext0 <= n, f"decode engine loaded {ext1 - ext0} of {n} prompt tokens through kvpush"
