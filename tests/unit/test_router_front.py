"""The router's shared HTTP front against real aiohttp engines stand-ins on loopback."""

from __future__ import annotations

import asyncio
import socket

import aiohttp
from aiohttp import web

from kvpush.router.app import Backend, RouterConfig, build_app


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _engine(healthy: bool) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_get("/health", lambda _r: web.Response(status=200 if healthy else 503))
    app.router.add_get("/v1/models", lambda _r: web.json_response({"data": [{"id": "tiny"}]}))
    runner = web.AppRunner(app)
    await runner.setup()
    port = _port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


DOWN: list[str] = []
BAD: list[tuple[int, str]] = []


async def _scenario() -> tuple[int, dict, int, dict]:
    (pr, p_url), (dr, d_url) = await _engine(True), await _engine(False)
    DOWN[:] = [d_url]
    cfg = RouterConfig(prefill=[Backend(p_url, ["tcp://127.0.0.1:1"])], decode=[Backend(d_url, [])])
    runner = web.AppRunner(build_app(cfg))
    await runner.setup()
    port = _port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        async with aiohttp.ClientSession() as s:
            async with s.get(f"http://127.0.0.1:{port}/health") as r:
                health = (r.status, await r.json())
            async with s.get(f"http://127.0.0.1:{port}/v1/models") as r:
                models = (r.status, await r.json())
            for data in (b"{not json", b"[1, 2]"):
                async with s.post(f"http://127.0.0.1:{port}/v1/completions", data=data) as r:
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
