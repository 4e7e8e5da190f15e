"""The router's operator endpoints (issue 44, item 6): the real router app on loopback in front
of engine stand-ins.

Finding: with ``expose_transfer_id`` off, ``/router/trace?request_id=<unknown>`` fell through
to the ring's view of the last 50 transfers (every client's IDs), on the client port.
Asserted: an unknown request or transfer ID is 404; the client port serves the OpenAI API,
``/health`` and ``/metrics`` only (``/router/*`` is 404 there); the operator endpoints answer
on the admin listener (loopback by default) and, with ``admin_token``, only with the token; a
non-loopback admin address without a token is a configuration error.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kvpush.router.app import Backend, RouterConfig, build_app
from kvpush.router.router_config import RouterConfigError, load
from kvpush_dev.aioserve import serve

TOKEN = "s3cret-operator-token"


async def _engine() -> tuple[web.AppRunner, str]:
    async def completions(req: web.Request) -> web.Response:
        await req.json()
        return web.json_response({"choices": [{"text": "ok"}]})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    return await serve(app)


async def _scenario(gets: list[tuple[str, str, dict[str, str]]], **kw: Any) -> list[tuple[int, Any]]:
    """One completion (so the trace ring holds a transfer), then ``gets``: (which listener,
    path, headers) -> (status, body)."""
    (pr, p_url), (dr, d_url) = await _engine(), await _engine()
    cfg = RouterConfig(prefill=[Backend(p_url, ["tcp://127.0.0.1:1"])], decode=[Backend(d_url, [])], **kw)
    app = build_app(cfg)
    runner, url = await serve(app)
    out: list[tuple[int, Any]] = []
    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 1}) as r:
                assert r.status == 200
            base = {"client": url, "admin": app.get("admin_url", url)}  # (one port before the split)
            for where, path, headers in gets:
                method = s.post if path == "/router/drain" else s.get
                async with method(f"{base[where]}{path}", headers=headers) as r:
                    out.append((r.status, await r.text()))
    finally:
        for x in (runner, pr, dr):
            await x.cleanup()
    return out


def test_an_unknown_request_id_is_404_not_the_recent_transfers() -> None:
    out = asyncio.run(_scenario([
        ("admin", "/router/trace?request_id=nobody", {}),
        ("admin", "/router/trace?transfer_id=nothing-like-it", {}),
        ("admin", "/router/trace", {}),
    ]))
    assert out[0][0] == 404 and "recent" not in out[0][1], out[0]
    assert out[1][0] == 404, out[1]
    assert out[2][0] == 200 and "recent" in out[2][1]  # an operator's listing, on the admin port


def test_the_client_port_serves_the_openai_api_health_and_metrics_only() -> None:
    out = asyncio.run(_scenario([
        ("client", "/router/trace", {}),
        ("client", "/router/status", {}),
        ("client", "/router/drain", {}),
        ("client", "/health", {}),
        ("client", "/metrics", {}),
        ("admin", "/router/status", {}),
    ]))
    assert [s for s, _ in out[:3]] == [404, 404, 404], out[:3]
    assert out[3][0] in (200, 503), out[3]  # served (the stand-ins have no /health: 503)
    assert [s for s, _ in out[4:]] == [200, 200], out[4:]


def test_with_a_token_the_operator_endpoints_want_it() -> None:
    out = asyncio.run(_scenario([
        ("admin", "/router/status", {}),
        ("admin", "/router/trace", {"Authorization": "Bearer wrong-token-wrong-token"}),
        ("admin", "/router/status", {"Authorization": f"Bearer {TOKEN}"}),
        ("admin", "/router/drain", {"Authorization": f"Bearer {TOKEN}"}),
        ("client", "/health", {}),
    ], admin_token=TOKEN))
    assert [s for s, _ in out] == [401, 401, 200, 200, 503], out


def test_an_admin_address_off_loopback_needs_a_token(tmp_path) -> None:
    f = tmp_path / "router.toml"
    f.write_text('admin_listen = "0.0.0.0:9001"\n[[prefill]]\nurl = "http://p:1"\nendpoints = ["tcp://p:2"]\n'
                 '[[decode]]\nurl = "http://d:1"\n')
    with pytest.raises(RouterConfigError, match="admin_token"):
        load(str(f))
    f.write_text(f'admin_listen = "0.0.0.0:9001"\nadmin_token = "{TOKEN}"\n' + f.read_text().split("\n", 1)[1])
    cfg = load(str(f))
    assert (cfg.admin_host, cfg.admin_port, cfg.port) == ("0.0.0.0", 9001, 8000)
    assert load(str(f), {"listen": "127.0.0.1:8000"}).admin_port == 9001
