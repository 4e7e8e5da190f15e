"""A request vLLM refuses on its own is refused the same through kvpush's router.

The reference is the prefill engine asked directly (colocated): the router's client must get
that engine's status and body, on both OpenAI APIs, streamed or not; a 502 around the
engine's message would tell the client the server failed when its request was at fault.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest

from kvpush_dev.pd_stack import PDStack

pytestmark = pytest.mark.e2e

# Each refusal vLLM makes before it schedules anything (its front end's checks).
REFUSALS: dict[str, dict[str, Any]] = {
    "greedy_n": {"n": 2, "temperature": 0.0},
    "unknown_model": {"model": "no-such-model"},
    "max_tokens_too_large": {"max_tokens": 1 << 20},
    "bad_logprobs": {"logprobs": 1000},
}


def _body(case: str, chat: bool, stream: bool) -> dict[str, Any]:
    b: dict[str, Any] = {"model": "tiny", "max_tokens": 4, "stream": stream, **REFUSALS[case]}
    if chat:
        b["messages"] = [{"role": "user", "content": "push the blocks"}]
        if "logprobs" in b:  # the chat API's spelling of too many logprobs
            b.update(logprobs=True, top_logprobs=b.pop("logprobs"))
    else:
        b["prompt"] = "push the blocks"
    return b


async def _ask(url: str, body: dict[str, Any]) -> tuple[int, Any]:
    """Status and body; a stream's body as its events (vLLM refuses some streamed requests with
    a 200 whose one event is the error)."""
    async with aiohttp.ClientSession() as s, s.post(url, json=body, timeout=aiohttp.ClientTimeout(total=120)) as r:
        raw = (await r.read()).decode()
        if "event-stream" in r.headers.get("content-type", ""):
            return r.status, [json.loads(x[5:]) if x[5:].strip() != "[DONE]" else "[DONE]"
                              for x in raw.splitlines() if x.startswith("data:")]
        return r.status, json.loads(raw)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_a_request_vllm_refuses_is_refused_as_a_colocated_engine_refuses_it(pd: PDStack, case: str, chat: bool,
                                                                            stream: bool) -> None:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    b = _body(case, chat, stream)
    want = asyncio.run(_ask(f"{pd.p_url}{path}", b))
    got = asyncio.run(_ask(f"{pd.router_url}{path}", b))
    refused = 400 <= want[0] < 500 or (want[0] == 200 and "error" in want[1][0])
    assert refused, want  # vLLM itself refuses it as the client's fault
    assert got == want
