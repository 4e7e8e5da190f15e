"""The OpenAI-API surface a P/D front end serves, and streaming the decode leg back.

Shared by the kvpush router and the baselines' proxy so that both are measured behind the
same HTTP handling: one error shape, one way to stream the decode leg while a concurrent
prefill leg may still fail.
"""

from __future__ import annotations

import asyncio
import json
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from aiohttp import web


class Upstreams(ABC):
    """The client side both fronts share: one pooled session to the engines, and the
    ``/health`` and ``/v1/models`` answers derived from them."""

    connect_timeout_s: float = 10.0
    session: aiohttp.ClientSession | None = None

    @abstractmethod
    def engine_urls(self) -> list[str]:
        """Every engine behind this front (health checks each)."""

    @abstractmethod
    def models_url(self) -> str:
        """The engine whose ``/v1/models`` this front serves."""

    def trace_configs(self) -> list[aiohttp.TraceConfig]:
        """What the pooled session reports its connections to (none here)."""
        return []

    async def start(self, _app: web.Application) -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout_s)
        self.session = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0),
                                             trace_configs=self.trace_configs())

    async def stop(self, _app: web.Application) -> None:
        if self.session is not None:
            await self.session.close()

    async def health(self, _req: web.Request) -> web.Response:
        assert self.session is not None
        down = []
        for url in self.engine_urls():
            try:
                async with self.session.get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
                    if r.status != 200:
                        down.append(url)
            except (TimeoutError, aiohttp.ClientError):
                down.append(url)
        if down:
            return web.json_response({"status": "unhealthy", "down": down}, status=503)
        return web.json_response({"status": "ok"})

    async def models(self, _req: web.Request) -> web.Response:
        assert self.session is not None
        async with self.session.get(f"{self.models_url()}/v1/models") as r:
            return web.Response(body=await r.read(), status=r.status, content_type="application/json")


class LegFailed(RuntimeError):
    """One leg of a P/D request failed; the other is cancelled."""


class LegRefused(LegFailed):
    """An engine refused a leg as the client's fault (4xx): the client gets that status and
    the engine's own body, as a colocated engine would answer, not a 502 around it."""

    def __init__(self, status: int, body: bytes, message: str) -> None:
        super().__init__(message)
        self.status, self.body = status, body


def leg_error(status: int, body: bytes, message: str) -> LegFailed:
    """What a leg's non-200 answer raises: a refusal for 4xx, a failure for anything else."""
    return LegRefused(status, body, message) if 400 <= status < 500 else LegFailed(message)


def refused_response(exc: LegRefused) -> web.Response:
    """The engine's refusal, status and body, passed through."""
    return web.Response(body=exc.body, status=exc.status, content_type="application/json")


def refused_event(exc: LegRefused) -> bytes:
    """The engine's refusal as a stream's last event (its 200 went out already): the body as
    vLLM puts an error in a stream, on one ``data:`` line."""
    try:
        doc = json.loads(exc.body)
    except (ValueError, RecursionError):
        return sse_error(exc.status, str(exc))
    return b"data: " + json.dumps(doc).encode() + b"\n\n"


class _Marker(bytes):
    """A bytes object no stream can yield: told apart by identity."""


PREFILL_ANSWERED = _Marker()  # decode_chunks(announce=True): the prefill leg answered


async def decode_chunks(up: aiohttp.ClientResponse, prefill: asyncio.Task[Any] | None,
                        announce: bool = False) -> AsyncIterator[bytes]:
    """Decode-leg bytes as they arrive; raise LegFailed once a concurrent prefill leg failed.
    ``announce``: also yield PREFILL_ANSWERED (the very object) once the prefill leg succeeded."""
    it = up.content.iter_any().__aiter__()
    nxt: asyncio.Future[bytes] | None = None
    try:
        while True:
            if prefill is not None and prefill.done() and not prefill.cancelled():
                exc = prefill.exception()
                if exc is not None:
                    up.close()  # closing the decode leg aborts it in the engine
                    raise exc if isinstance(exc, LegFailed) else LegFailed(str(exc))
                if announce:
                    announce = False
                    yield PREFILL_ANSWERED
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


def _error_body(status: int, message: str, kind: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "code": status}}


def error_response(status: int, message: str, kind: str = "kvpush_router_error") -> web.Response:
    """An OpenAI-style error body, so clients show the message."""
    return web.json_response(_error_body(status, message, kind), status=status)


def sse_error(status: int, message: str, kind: str = "kvpush_router_error") -> bytes:
    """The same error as a server-sent event, for a stream whose 200 is already out (as vLLM
    reports an error in the middle of a stream): ending the stream silently would hand the
    client an empty or cut answer that looks complete."""
    return b"data: " + json.dumps(_error_body(status, message, kind)).encode() + b"\n\n"


class BadRequest(ValueError):
    """A client's body is not a JSON object: answered 400 with this message."""


async def json_body(req: web.Request) -> dict[str, Any]:
    """The request's JSON object (raises BadRequest otherwise)."""
    try:
        body = await req.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise BadRequest("request body is not JSON") from None
    except RecursionError:  # nesting deeper than the parser's stack: the client's fault, not ours
        raise BadRequest("request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body


MAX_BODY_BYTES = 8 << 20  # a request body larger is answered 413 before it is read whole


def front_app(front: Any, status_path: str | None, max_body_bytes: int = MAX_BODY_BYTES) -> web.Application:
    """The OpenAI-API surface shared by the router and the baselines' proxy: ``front``
    provides start/stop/health/models/status/completions (``status_path`` None: no status
    here; the router serves it to operators apart). A body over ``max_body_bytes`` is
    refused with 413 (aiohttp stops reading it), so no client makes us buffer more."""
    app = web.Application(client_max_size=max_body_bytes)
    app.on_startup.append(front.start)
    app.on_cleanup.append(front.stop)
    app.router.add_get("/health", front.health)
    app.router.add_get("/v1/models", front.models)
    if status_path is not None:
        app.router.add_get(status_path, front.status)
    app.router.add_post("/v1/completions", front.completions)
    app.router.add_post("/v1/chat/completions", front.completions)
    return app
