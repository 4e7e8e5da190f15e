#!/usr/bin/env python3
"""kvpush router: an OpenAI-API front for P/D serving that sends both legs at once.

Push is only faster when the decode engine registers its blocks while the
prefill engine computes, so for every request the router makes a
``transfer_id`` and sends the prefill leg (``max_tokens=1``) and the decode leg
**concurrently**; it streams the decode leg back. If either leg fails, the other
is cancelled and the client gets a clear error.

    python scripts/router.py --port 8000 \\
        --prefill http://127.0.0.1:8100=tcp://127.0.0.1:17500 \\
        --decode http://127.0.0.1:8200

``--prefill URL=ENDPOINT[,ENDPOINT...]`` names the engine and its daemons' peer
endpoints, one per TP rank (rank order). Several ``--prefill`` / ``--decode``
give XpYd with least-loaded (default) or round-robin choice.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from kvpush.proto.trace import TraceRing

log = logging.getLogger("kvpush.router")


@dataclass
class Backend:
    url: str
    kv_endpoints: list[str] = field(default_factory=list)
    in_flight: int = 0
    served: int = 0
    failed: int = 0


@dataclass
class RouterConfig:
    prefill: list[Backend]
    decode: list[Backend]
    policy: str = "least-loaded"
    connect_timeout_s: float = 10.0
    prefill_timeout_s: float = 300.0
    request_timeout_s: float = 600.0
    mode: str = "push"  # push: both legs at once; pull-style sequential P then D is not offered


def parse_prefill(spec: str) -> Backend:
    url, _, eps = spec.partition("=")
    if not url.startswith("http"):
        raise argparse.ArgumentTypeError(f"--prefill wants URL=tcp://host:port[,...], got {spec!r}")
    endpoints = [e for e in eps.split(",") if e]
    if not endpoints:
        raise argparse.ArgumentTypeError(f"--prefill {url}: name its daemon peer endpoint(s) after '='")
    return Backend(url.rstrip("/"), endpoints)


class Router:
    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        self._rr = {"p": itertools.cycle(range(len(cfg.prefill))), "d": itertools.cycle(range(len(cfg.decode)))}
        self.session: aiohttp.ClientSession | None = None
        self.stats = {"requests": 0, "errors": 0}
        # Per-request timeline (kvpushctl trace --router URL) and x-request-id -> transfer_id.
        self.trace = TraceRing()
        self.request_ids: dict[str, str] = {}

    def pick(self, pool: list[Backend], key: str) -> Backend:
        if self.cfg.policy == "round-robin":
            return pool[next(self._rr[key])]
        return min(pool, key=lambda b: b.in_flight)

    async def start(self, _app: web.Application) -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.cfg.connect_timeout_s)
        self.session = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0))

    async def stop(self, _app: web.Application) -> None:
        if self.session is not None:
            await self.session.close()

    # ------------------------------------------------------------------ handlers

    async def health(self, _req: web.Request) -> web.Response:
        assert self.session is not None
        bad = []
        for b in [*self.cfg.prefill, *self.cfg.decode]:
            try:
                async with self.session.get(f"{b.url}/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
                    if r.status != 200:
                        bad.append(b.url)
            except (TimeoutError, aiohttp.ClientError):
                bad.append(b.url)
        if bad:
            return web.json_response({"status": "unhealthy", "down": bad}, status=503)
        return web.json_response({"status": "ok"})

    async def models(self, _req: web.Request) -> web.Response:
        assert self.session is not None
        async with self.session.get(f"{self.cfg.decode[0].url}/v1/models") as r:
            return web.Response(body=await r.read(), status=r.status, content_type="application/json")

    async def status(self, _req: web.Request) -> web.Response:
        def rows(pool: list[Backend]) -> list[dict[str, Any]]:
            return [{"url": b.url, "in_flight": b.in_flight, "served": b.served, "failed": b.failed} for b in pool]

        return web.json_response({**self.stats, "prefill": rows(self.cfg.prefill), "decode": rows(self.cfg.decode)})

    async def trace_view(self, req: web.Request) -> web.Response:
        """``?transfer_id=`` or ``?request_id=``: this router's stamps of one request."""
        import socket

        tid = req.query.get("transfer_id") or self.request_ids.get(req.query.get("request_id", ""), "")
        return web.json_response({"host": socket.gethostname(), **self.trace.view(tid)})

    async def completions(self, req: web.Request) -> web.StreamResponse:
        return await self.forward(req, req.path)

    async def forward(self, req: web.Request, path: str) -> web.StreamResponse:
        assert self.session is not None
        try:
            body = await req.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "request body is not JSON")
        if not isinstance(body, dict):
            return _error(400, "request body must be a JSON object")
        self.stats["requests"] += 1
        transfer_id = f"kvp-{uuid.uuid4().hex}"
        self.trace.stamp(transfer_id, "router.request_in")
        rid = req.headers.get("x-request-id", transfer_id)
        if len(self.request_ids) >= self.trace.max_transfers:
            self.request_ids.pop(next(iter(self.request_ids)))
        self.request_ids[rid] = transfer_id
        log.debug("request %s -> transfer %s", rid, transfer_id)
        p, d = self.pick(self.cfg.prefill, "p"), self.pick(self.cfg.decode, "d")
        p_body = dict(body)
        p_body.update(stream=False, max_tokens=1, kv_transfer_params={"do_remote_decode": True, "transfer_id": transfer_id})
        p_body.pop("stream_options", None)
        if "max_completion_tokens" in p_body:
            p_body["max_completion_tokens"] = 1
        d_body = dict(body)
        d_body["kv_transfer_params"] = {
            "do_remote_prefill": True,
            "transfer_id": transfer_id,
            "prefill_endpoints": p.kv_endpoints,
            "prefill_tp_size": len(p.kv_endpoints),
        }
        headers = {"x-request-id": rid, "content-type": "application/json"}
        if "authorization" in req.headers:
            headers["authorization"] = req.headers["authorization"]
        p.in_flight += 1
        d.in_flight += 1
        prefill = asyncio.create_task(self._prefill(p, path, p_body, headers, transfer_id))
        decode = asyncio.ensure_future(self.session.post(
            f"{d.url}{path}", json=d_body, headers=headers,
            timeout=aiohttp.ClientTimeout(total=self.cfg.request_timeout_s),
        ))
        self.trace.stamp(transfer_id, "router.legs_sent")
        resp: web.StreamResponse | None = None
        try:
            # A non-streaming decode leg answers only when generation is done: race its
            # headers against the prefill leg so a failed prefill cancels it at once.
            await asyncio.wait({decode, prefill}, return_when=asyncio.FIRST_COMPLETED)
            if not decode.done() and prefill.exception() is not None:
                decode.cancel()  # closes the connection: vLLM aborts the request
                raise LegFailed(str(prefill.exception()))
            async with await decode as upstream:
                if upstream.status != 200:
                    text = await upstream.text()
                    prefill.cancel()
                    d.failed += 1
                    return _error(upstream.status, f"decode engine {d.url}: {text[:500]}")
                resp = web.StreamResponse(status=200, headers={
                    "content-type": upstream.headers.get("content-type", "application/json"),
                    "x-request-id": rid, "x-kvpush-transfer-id": transfer_id})
                await resp.prepare(req)
                first = True
                async for chunk in decode_chunks(upstream, prefill):
                    if first:
                        self.trace.stamp(transfer_id, "router.decode_first_byte")
                        first = False
                    await resp.write(chunk)
                # The decode leg finished; the prefill leg must have succeeded too.
                await prefill
                await resp.write_eof()
                d.served += 1
                return resp
        except LegFailed as exc:
            d.failed += 1
            self.stats["errors"] += 1
            if resp is None:
                return _error(502, str(exc))
            return resp  # headers already sent: the stream just ends
        except (TimeoutError, aiohttp.ClientError) as exc:
            prefill.cancel()
            d.failed += 1
            self.stats["errors"] += 1
            if resp is None:
                return _error(502, f"decode engine {d.url}: {type(exc).__name__}: {exc}")
            return resp
        finally:
            for task in (prefill, decode):
                if not task.done():
                    task.cancel()
            p.in_flight -= 1
            d.in_flight -= 1

    async def _prefill(self, p: Backend, path: str, body: dict[str, Any], headers: dict[str, str],
                       transfer_id: str) -> None:
        assert self.session is not None
        t0 = time.monotonic()
        try:
            async with self.session.post(
                f"{p.url}{path}", json=body, headers=headers,
                timeout=aiohttp.ClientTimeout(total=self.cfg.prefill_timeout_s),
            ) as r:
                text = await r.text()
                if r.status != 200:
                    p.failed += 1
                    raise LegFailed(f"prefill engine {p.url} answered {r.status}: {text[:500]}")
        except (TimeoutError, aiohttp.ClientError) as exc:
            p.failed += 1
            raise LegFailed(f"prefill engine {p.url}: {type(exc).__name__}: {exc}") from exc
        p.served += 1
        self.trace.stamp(transfer_id, "router.prefill_answered")
        log.debug("prefill leg done in %.1f ms", (time.monotonic() - t0) * 1e3)


class LegFailed(RuntimeError):
    """One leg of a P/D request failed; the other is cancelled."""


async def decode_chunks(up: aiohttp.ClientResponse, prefill: asyncio.Task[Any] | None) -> AsyncIterator[bytes]:
    """Decode-leg bytes as they arrive; raise LegFailed once a concurrent prefill leg failed."""
    it = up.content.iter_any().__aiter__()
    nxt: asyncio.Future[bytes] | None = None
    try:
        while True:
            if prefill is not None and prefill.done() and not prefill.cancelled():
                exc = prefill.exception()
                if exc is not None:
                    up.close()  # closing the decode leg aborts it in the engine
                    raise LegFailed(str(exc))
            if nxt is None:
                nxt = asyncio.ensure_future(it.__anext__())
            waits: set[asyncio.Future[Any]] = {nxt}
            if prefill is not None and not prefill.done():
                waits.add(prefill)
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            if nxt in done:
                try:
                    chunk = nxt.result()
                except StopAsyncIteration:
                    return
                nxt = None
                yield chunk
    finally:
        if nxt is not None and not nxt.done():
            nxt.cancel()


def error_response(status: int, message: str, kind: str = "kvpush_router_error") -> web.Response:
    """An OpenAI-style error body, so clients show the message."""
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)


def _error(status: int, message: str) -> web.Response:
    return error_response(status, message)


def front_app(front: Any, status_path: str) -> web.Application:
    """The OpenAI-API surface shared by this router and the baselines' proxy: ``front``
    provides start/stop/health/models/status/completions."""
    app = web.Application(client_max_size=64 << 20)
    app.on_startup.append(front.start)
    app.on_cleanup.append(front.stop)
    app.router.add_get("/health", front.health)
    app.router.add_get("/v1/models", front.models)
    app.router.add_get(status_path, front.status)
    app.router.add_post("/v1/completions", front.completions)
    app.router.add_post("/v1/chat/completions", front.completions)
    return app


def build_app(cfg: RouterConfig) -> web.Application:
    r = Router(cfg)
    app = front_app(r, "/router/status")
    app.router.add_get("/router/trace", r.trace_view)
    app["router"] = r
    return app


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="router.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--prefill", type=parse_prefill, action="append", required=True, metavar="URL=ENDPOINTS")
    ap.add_argument("--decode", action="append", required=True, metavar="URL")
    ap.add_argument("--policy", choices=("least-loaded", "round-robin"), default="least-loaded")
    ap.add_argument("--prefill-timeout", type=float, default=300.0, help="seconds for the prefill leg")
    ap.add_argument("--request-timeout", type=float, default=600.0, help="seconds for the decode leg")
    ap.add_argument("--log-level", default="INFO")
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s kvpush-router %(levelname)s %(message)s")
    cfg = RouterConfig(
        prefill=args.prefill,
        decode=[Backend(u.rstrip("/")) for u in args.decode],
        policy=args.policy,
        prefill_timeout_s=args.prefill_timeout,
        request_timeout_s=args.request_timeout,
    )
    web.run_app(build_app(cfg), host=args.host, port=args.port, print=None, access_log=None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
