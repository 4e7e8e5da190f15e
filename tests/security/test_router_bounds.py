"""The router bounds what a client can make it do (issue 28, items 5 and 6): the real router
app on loopback in front of recording engine stand-ins.

Findings: a 60 MiB body took the router from 115 to 784 MiB and went on to both engines; a
deeply nested JSON body was answered 500. Asserted: a body over ``max_body_bytes`` (default
8 MiB) is answered 413 and reaches no engine; a deeply nested one is answered 400; a client's
own ``kv_transfer_params`` never reach an engine (both legs carry the router's).
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kvpush.router.app import Backend, RouterConfig, build_app
from kvpush.router.router_config import RouterConfigError
from kvpush_dev.aioserve import serve


async def _engine(seen: list[dict[str, Any]]) -> tuple[web.AppRunner, str]:
    """An engine stand-in that records every completion body it gets."""
    async def completions(req: web.Request) -> web.Response:
        seen.append(await req.json())
        return web.json_response({"choices": [{"text": "ok"}]})

    app = web.Application(client_max_size=256 << 20)
    app.router.add_post("/v1/completions", completions)
    return await serve(app)


async def _scenario(max_body: int | None, posts: list[bytes]) -> tuple[list[tuple[int, str]], list, list]:
    p_seen: list[dict[str, Any]] = []
    d_seen: list[dict[str, Any]] = []
    (pr, p_url), (dr, d_url) = await _engine(p_seen), await _engine(d_seen)
    kw = {} if max_body is None else {"max_body_bytes": max_body}
    cfg = RouterConfig(prefill=[Backend(p_url, ["tcp://127.0.0.1:1"])], decode=[Backend(d_url, [])], **kw)
    runner, url = await serve(build_app(cfg))
    out: list[tuple[int, str]] = []
    try:
        async with aiohttp.ClientSession() as s:
            for data in posts:
                async with s.post(f"{url}/v1/completions", data=data,
                                  headers={"content-type": "application/json"}) as r:
                    out.append((r.status, await r.text()))
    finally:
        for x in (runner, pr, dr):
            await x.cleanup()
    return out, p_seen, d_seen


def test_a_body_over_the_bound_is_refused_and_forwarded_nowhere() -> None:
    big = b'{"prompt": "' + b"x" * (60 << 20) + b'", "max_tokens": 1}'
    small = b'{"prompt": "hi", "max_tokens": 1}'
    out, p_seen, d_seen = asyncio.run(_scenario(None, [big, small]))
    assert out[0][0] == 413, out[0]
    assert out[1][0] == 200
    assert len(p_seen) == len(d_seen) == 1 and p_seen[0]["prompt"] == "hi"


def test_the_bound_is_configurable() -> None:
    body = b'{"prompt": "' + b"x" * (2 << 20) + b'"}'
    out, _, _ = asyncio.run(_scenario(1 << 20, [body]))
    assert out[0][0] == 413
    with pytest.raises(RouterConfigError, match="max_body_bytes"):
        RouterConfig(prefill=[Backend("http://a", ["tcp://h:1"])], decode=[Backend("http://b", [])],
                     max_body_bytes=0).validate()


def test_a_deeply_nested_body_is_a_400() -> None:
    nested = b'{"prompt": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"
    out, p_seen, d_seen = asyncio.run(_scenario(None, [nested]))
    assert out[0][0] == 400 and "nested" in out[0][1], out[0]
    assert not p_seen and not d_seen


def test_client_kv_transfer_params_never_reach_an_engine() -> None:
    """What a client names (another prefill node's daemons, a transfer ID it learnt) is
    replaced on both legs by the router's own."""
    evil = {"kvpush": {"transfer_id": "stolen", "endpoints": ["tcp://10.6.6.6:7000"], "role": "consumer"}}
    import json

    body = json.dumps({"prompt": "hi", "max_tokens": 1, "kv_transfer_params": evil}).encode()
    out, p_seen, d_seen = asyncio.run(_scenario(None, [body]))
    assert out[0][0] == 200
    for seen in (p_seen, d_seen):
        params = json.dumps(seen[0]["kv_transfer_params"])
        assert "stolen" not in params and "10.6.6.6" not in params
