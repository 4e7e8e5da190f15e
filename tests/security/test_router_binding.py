"""The router binds each transfer to its decode side and tells clients nothing of it (issue 28,
item 3): the real router app on loopback in front of engine stand-ins that answer as vLLM does,
echoing their leg's ``kv_transfer_params`` in a non-streamed answer.

Findings: the router returned the transfer ID to every client in ``x-kvpush-transfer-id``; the
transfer ID was a bearer credential. Asserted: by default no client-facing answer (headers or
body, streamed or not) holds the transfer ID or the secret; ``expose_transfer_id`` shows the ID
only; the prefill leg names the configured decode node and a fresh secret, which only the decode
leg carries.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
from aiohttp import web

from kvpush.router.app import Backend, RouterConfig, build_app
from kvpush_dev.aioserve import serve


async def _engine(seen: list[dict[str, Any]]) -> tuple[web.AppRunner, str]:
    """An engine stand-in answering as vLLM does: the request's kv_transfer_params come back in
    a non-streamed body; a streamed one is two SSE chunks."""
    async def completions(req: web.Request) -> web.StreamResponse:
        body = await req.json()
        seen.append(body)
        if body.get("stream"):
            resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await resp.prepare(req)
            await resp.write(b'data: {"choices": [{"text": "o"}]}\n\n')
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        return web.json_response({"choices": [{"text": "ok"}], "kv_transfer_params": body.get("kv_transfer_params")})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    return await serve(app)


async def _run(stream: bool, **cfg_kw: Any) -> tuple[dict[str, str], str, list, list]:
    p_seen: list[dict[str, Any]] = []
    d_seen: list[dict[str, Any]] = []
    (pr, p_url), (dr, d_url) = await _engine(p_seen), await _engine(d_seen)
    cfg = RouterConfig(prefill=[Backend(p_url, ["tcp://127.0.0.1:1"])], decode=[Backend(d_url, [], node="dnode")],
                       **cfg_kw)
    runner, url = await serve(build_app(cfg))
    try:
        async with aiohttp.ClientSession() as s, s.post(
                f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stream": stream}) as r:
            assert r.status == 200
            return dict(r.headers), await r.text(), p_seen, d_seen
    finally:
        for x in (runner, pr, dr):
            await x.cleanup()


def test_the_prefill_leg_is_bound_to_the_decode_node_and_a_secret_only_the_decode_leg_has() -> None:
    _, _, p_seen, d_seen = asyncio.run(_run(False))
    p, d = p_seen[0]["kv_transfer_params"], d_seen[0]["kv_transfer_params"]
    assert p["kvpush_decode_node"] == "dnode"
    assert len(p["kvpush_secret"]) >= 22 and p["kvpush_secret"] == d["kvpush_secret"]
    assert p["transfer_id"] == d["transfer_id"]
    _, _, p2, _ = asyncio.run(_run(False))
    assert p2[0]["kv_transfer_params"]["kvpush_secret"] != p["kvpush_secret"]  # fresh per request


def test_no_transfer_id_or_secret_reaches_a_client_by_default() -> None:
    for stream in (False, True):
        headers, text, p_seen, _ = asyncio.run(_run(stream))
        kv = p_seen[0]["kv_transfer_params"]
        everything = json.dumps(headers) + text
        assert kv["transfer_id"] not in everything, (stream, everything)
        assert kv["kvpush_secret"] not in everything, (stream, everything)
        assert not any(h.lower() == "x-kvpush-transfer-id" for h in headers)
        if not stream:
            assert "kv_transfer_params" not in json.loads(text) and json.loads(text)["choices"]


def test_expose_transfer_id_shows_the_id_for_debugging_never_the_secret() -> None:
    headers, text, p_seen, _ = asyncio.run(_run(False, expose_transfer_id=True))
    kv = p_seen[0]["kv_transfer_params"]
    assert headers["x-kvpush-transfer-id"] == kv["transfer_id"]
    assert kv["kvpush_secret"] not in json.dumps(headers) + text
