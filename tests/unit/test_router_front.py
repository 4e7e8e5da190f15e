"""The router's shared HTTP front against real aiohttp engines stand-ins on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kvpush.router.app import Backend, RouterConfig, build_app
from kvpush_dev.aioserve import serve


async def _router(p_url: str, d_url: str) -> tuple[web.AppRunner, str]:
    """The router in front of one prefill and one decode engine stand-in."""
    cfg = RouterConfig(prefill=[Backend(p_url, ["tcp://127.0.0.1:1"])], decode=[Backend(d_url, [])])
    return await serve(build_app(cfg))


@contextlib.asynccontextmanager
async def _pd(prefill: Any, decode: Any) -> AsyncIterator[str]:
    """The router in front of two ``/v1/completions`` stand-ins (handlers); yields its URL."""
    servers = []
    for handler in (prefill, decode):
        app = web.Application()
        app.router.add_post("/v1/completions", handler)
        servers.append(await serve(app))
    (_, p_url), (_, d_url) = servers
    router, url = await _router(p_url, d_url)
    try:
        yield url
    finally:
        for x in (router, *(runner for runner, _ in servers)):
            await x.cleanup()


async def _engine(healthy: bool) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_get("/health", lambda _r: web.Response(status=200 if healthy else 503))
    app.router.add_get("/v1/models", lambda _r: web.json_response({"data": [{"id": "tiny"}]}))
    return await serve(app)


DOWN: list[str] = []
BAD: list[tuple[int, str]] = []


async def _scenario() -> tuple[int, dict, int, dict]:
    (pr, p_url), (dr, d_url) = await _engine(True), await _engine(False)
    DOWN[:] = [d_url]
    runner, url = await _router(p_url, d_url)
    try:
        async with aiohttp.ClientSession() as s:
            async with s.get(f"{url}/health") as r:
                health = (r.status, await r.json())
            async with s.get(f"{url}/v1/models") as r:
                models = (r.status, await r.json())
            for data in (b"{not json", b"[1, 2]"):
                async with s.post(f"{url}/v1/completions", data=data) as r:
                    BAD.append((r.status, (await r.json())["error"]["message"]))
        return (*health, *models)
    finally:
        await runner.cleanup()
        await pr.cleanup()
        await dr.cleanup()


def test_health_names_the_engine_that_is_down_and_models_come_from_decode():
    hs, health, ms, models = asyncio.run(_scenario())
    assert hs == 503 and health["status"] == "unhealthy"
    assert health["down"] == [DOWN[0]]  # the decode stand-in answers 503; prefill is fine
    assert ms == 200 and models["data"][0]["id"] == "tiny"
    assert BAD == [(400, "request body is not JSON"), (400, "request body must be a JSON object")]


async def _streaming_decode_then_failing_prefill() -> list[str]:
    """The decode engine's stream is open (200 and a first event sent) when the prefill leg
    fails: the client must be told, not handed a stream that just ends."""
    async def decode(req: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(status=200, headers={"content-type": "text/event-stream"})
        await resp.prepare(req)
        await resp.write(b'data: {"choices": [{"text": ""}]}\n\n')
        await asyncio.sleep(3)  # waits for the KV, which never comes
        return resp

    async def prefill(_req: web.Request) -> web.Response:
        await asyncio.sleep(0.3)
        return web.json_response({"error": {"message": "boom"}}, status=500)

    async with _pd(prefill, decode) as url, aiohttp.ClientSession() as s:
        body = {"model": "tiny", "prompt": "x", "max_tokens": 4, "stream": True}
        async with s.post(f"{url}/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=20)) as r:
            assert r.status == 200
            return [line.decode().strip() async for line in r.content if line.strip()]


def test_a_prefill_leg_failing_after_the_stream_started_ends_it_with_an_error_event():
    lines = asyncio.run(_streaming_decode_then_failing_prefill())
    assert lines[0] == 'data: {"choices": [{"text": ""}]}'
    err, last = lines[-2:]  # the error, then [DONE], as vLLM ends a stream that failed
    assert err.startswith("data: {\"error\"") and "prefill engine" in err and "500" in err, lines
    assert last == "data: [DONE]", lines


async def _prefill_first_decode_late(decode_status: int) -> tuple[bool, list[str]]:
    """The prefill leg answers at once; the decode engine holds its headers until the client has
    seen a first event (or 5 s pass). Returns whether that first event came before the decode
    engine answered at all, and every line the client got."""
    released, answered = asyncio.Event(), asyncio.Event()

    async def prefill(_req: web.Request) -> web.Response:
        return web.json_response({"id": "cmpl-1", "created": 1, "model": "tiny", "choices": [
            {"index": 0, "text": " a", "token_ids": [5], "prompt_token_ids": [1, 2], "logprobs": None,
             "finish_reason": "length"}], "usage": {"prompt_tokens": 2, "completion_tokens": 1}})

    async def decode(req: web.Request) -> web.StreamResponse:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(released.wait(), 5)
        answered.set()
        if decode_status != 200:
            return web.json_response({"error": {"message": "no room"}}, status=decode_status)
        resp = web.StreamResponse(status=200, headers={"content-type": "text/event-stream"})
        await resp.prepare(req)
        for text, fin in ((" a", None), (" b", "length")):
            await resp.write(b"data: " + json.dumps({"id": "cmpl-d", "object": "text_completion", "choices": [
                {"index": 0, "text": text, "logprobs": None, "finish_reason": fin}]}).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async with _pd(prefill, decode) as url, aiohttp.ClientSession() as s:
        body = {"model": "tiny", "prompt": "x", "max_tokens": 2, "stream": True, "temperature": 0}
        async with s.post(f"{url}/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=20)) as r:
            assert r.status == 200
            lines, before = [], None
            async for line in r.content:
                if line.strip():
                    lines.append(line.decode().strip())
                    if before is None:
                        before = not answered.is_set()
                        released.set()
            return bool(before), lines


def test_the_prefill_legs_first_token_does_not_wait_for_the_decode_engines_headers():
    before, lines = asyncio.run(_prefill_first_decode_late(200))
    assert before, "the first token waited for the decode engine to answer"
    texts = [json.loads(x[5:])["choices"][0]["text"] for x in lines if x != "data: [DONE]"]
    assert texts == [" a", " b"] and lines[-1] == "data: [DONE]"


def test_a_decode_leg_refused_after_the_first_token_went_out_ends_the_stream_with_its_error():
    before, lines = asyncio.run(_prefill_first_decode_late(503))
    assert before and json.loads(lines[0][5:])["choices"][0]["text"] == " a"
    assert lines[-2].startswith('data: {"error"') and "no room" in lines[-2], lines
    assert lines[-1] == "data: [DONE]", lines


# ---- an engine's refusal is the client's answer, not a 502 around it ----

VLLM_400 = {"error": {"message": "n must be 1 when using greedy sampling, got 2.", "type": "BadRequestError",
                      "param": None, "code": 400}}


@contextlib.asynccontextmanager
async def _pd_both(prefill: Any, decode: Any) -> AsyncIterator[str]:
    """Like ``_pd`` with both OpenAI APIs routed to the stand-ins."""
    servers = []
    for handler in (prefill, decode):
        app = web.Application()
        app.router.add_post("/v1/completions", handler)
        app.router.add_post("/v1/chat/completions", handler)
        servers.append(await serve(app))
    (_, p_url), (_, d_url) = servers
    router, url = await _router(p_url, d_url)
    try:
        yield url
    finally:
        for x in (router, *(runner for runner, _ in servers)):
            await x.cleanup()


async def _refused_by(side: str, status: int, path: str, stream: bool,
                      **extra: Any) -> tuple[int, bytes, list[dict]]:
    """One engine (``side``) answers ``status`` with vLLM's body; the other waits for KV (decode)
    or answers a token (prefill). Returns the client's status, body and the legs' bodies."""
    seen: list[dict] = []
    answered = asyncio.Event()
    refusal = json.dumps({**VLLM_400, "error": {**VLLM_400["error"], "code": status}}).encode()

    def engine(me: str) -> Any:
        async def handler(req: web.Request) -> web.StreamResponse:
            seen.append({"leg": me, **await req.json()})
            if me == side:
                return web.Response(body=refusal, status=status, content_type="application/json")
            if me == "decode":  # waits for KV that never comes: the refusal must not wait for it
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(answered.wait(), 5)
            return web.json_response({"choices": [{"index": 0, "text": " a", "finish_reason": "length"}]})
        return handler

    async with _pd_both(engine("prefill"), engine("decode")) as url, aiohttp.ClientSession() as s:
        body: dict[str, Any] = {"model": "tiny", "max_tokens": 4, "n": 2, "temperature": 0, "stream": stream,
                                **extra}
        body.update({"messages": [{"role": "user", "content": "x"}]} if "chat" in path else {"prompt": "x"})
        async with s.post(f"{url}{path}", json=body, timeout=aiohttp.ClientTimeout(total=20)) as r:
            out = r.status, await r.read(), seen
        answered.set()
        return out


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("side", "status"), [("prefill", 400), ("decode", 400), ("prefill", 404),
                                              ("decode", 404)])
def test_an_engines_refusal_reaches_the_client_as_its_4xx_with_the_engines_body(side, status, path, stream):
    got, raw, _ = asyncio.run(_refused_by(side, status, path, stream))
    assert got == status, raw
    assert json.loads(raw) == {**VLLM_400, "error": {**VLLM_400["error"], "code": status}}


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_an_engine_failing_is_still_a_5xx(side):
    got, raw, _ = asyncio.run(_refused_by(side, 500, "/v1/completions", False))
    assert 500 <= got < 600 and f"{side} engine" in json.loads(raw)["error"]["message"], raw


def test_the_prefill_leg_asks_for_one_choice_and_one_token_the_decode_leg_for_what_the_client_asked():
    _, _, seen = asyncio.run(_refused_by("neither", 400, "/v1/completions", False, min_tokens=3))
    by_leg = {b["leg"]: b for b in seen}
    assert (by_leg["prefill"]["n"], by_leg["prefill"]["min_tokens"]) == (1, 1)
    assert (by_leg["decode"]["n"], by_leg["decode"]["min_tokens"]) == (2, 3)
