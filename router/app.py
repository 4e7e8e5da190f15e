"""The kvpush router's policy: for every request, both legs at once.

Push is only faster when the decode engine registers its blocks while the
prefill engine computes, so for every request the router makes a
``transfer_id`` and sends the prefill leg (``max_tokens=1``) and the decode leg
**concurrently**; it streams the decode leg back. If either leg fails, the other
is cancelled and the client gets a clear error. Both legs' ``kv_transfer_params``
are built with :mod:`kvpush.proto.params`, the contract the engine plugin parses.

Each transfer is bound to its decode side: the prefill leg names the decode engine's node
(when configured) and a fresh secret that only the decode leg carries, so a node that
learns the transfer ID cannot take the KV. Neither the ID nor the secret goes back to the
client (``expose_transfer_id`` shows the ID, for debugging); a non-streamed answer loses
any ``kv_transfer_params`` an engine put in it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import json
import logging
import socket
import time
import uuid
from typing import Any

import aiohttp
from aiohttp import web

from kvpush.common import otel
from kvpush.proto.params import DecodeLeg, PrefillLeg, new_secret
from kvpush.proto.trace import TraceRing
from kvpush.router import first_token
from kvpush.router.front import (
    PREFILL_ANSWERED,
    BadRequest,
    LegFailed,
    LegRefused,
    Upstreams,
    decode_chunks,
    error_response,
    front_app,
    json_body,
    leg_error,
    refused_event,
    refused_response,
    sse_error,
)
from kvpush.router.legs import Legs
from kvpush.router.metrics import RouterMetrics
from kvpush.router.router_config import Backend, RouterConfig

SSE = "text/event-stream; charset=utf-8"  # what vLLM streams as
log = logging.getLogger("kvpush.router")


class Router(Upstreams):
    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        self.connect_timeout_s = cfg.connect_timeout_s
        self._rr = {"p": itertools.cycle(range(len(cfg.prefill))), "d": itertools.cycle(range(len(cfg.decode)))}
        self.stats = {"requests": 0, "errors": 0}
        self.metrics = RouterMetrics()
        self.draining = False
        # Per-request timeline (kvpushctl trace --router URL) and x-request-id -> transfer_id.
        self.trace = TraceRing()
        self.request_ids: dict[str, str] = {}
        # Optional OpenTelemetry export of each request's timeline (kvpush.common.otel).
        self.spans = otel.SpanSink("kvpush-router", cfg.otlp_traces_endpoint) if cfg.otlp_traces_endpoint else None
        self.legs = Legs()  # a leg whose pooled connection was dead goes again on a fresh one

    def trace_configs(self) -> list[aiohttp.TraceConfig]:
        return [self.legs.trace_config]

    async def start(self, app: web.Application) -> None:
        await super().start(app)
        self.legs.start(aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout_s))

    async def stop(self, app: web.Application) -> None:
        await self.legs.stop()
        await super().stop(app)

    def _post_leg(self, leg: str, url: str, transfer_id: str, **kw: Any) -> Any:
        """One leg's POST (router.legs: sent again once where its pooled connection was dead)."""
        assert self.session is not None

        def resent(_exc: BaseException) -> None:
            self.metrics.legs_resent.labels(leg).inc()
            self.trace.stamp(transfer_id, f"router.{leg}_resent")

        return self.legs.post(self.session, url, leg=leg, on_resend=resent, **kw)

    def pick(self, pool: list[Backend], key: str) -> Backend:
        if self.cfg.policy == "round-robin":
            return pool[next(self._rr[key])]
        return min(pool, key=lambda b: b.in_flight)

    def engine_urls(self) -> list[str]:
        return [b.url for b in [*self.cfg.prefill, *self.cfg.decode]]

    def models_url(self) -> str:
        return self.cfg.decode[0].url

    # ------------------------------------------------------------------ handlers

    async def status(self, _req: web.Request) -> web.Response:
        def rows(pool: list[Backend]) -> list[dict[str, Any]]:
            return [{"url": b.url, "in_flight": b.in_flight, "served": b.served, "failed": b.failed,
                     **({"kv_endpoints": b.kv_endpoints} if b.kv_endpoints else {})} for b in pool]

        return web.json_response({**self.stats, "draining": self.draining,
                                  "prefill": rows(self.cfg.prefill), "decode": rows(self.cfg.decode)})

    async def health(self, req: web.Request) -> web.Response:
        if self.draining:  # load balancers take us out while in-flight requests finish
            return web.json_response({"status": "draining"}, status=503)
        return await super().health(req)

    async def metrics_view(self, _req: web.Request) -> web.Response:
        for pool, backends in (("prefill", self.cfg.prefill), ("decode", self.cfg.decode)):
            for b in backends:
                self.metrics.in_flight.labels(pool, b.url).set(b.in_flight)
        return web.Response(body=self.metrics.render(), content_type="text/plain", charset="utf-8")

    async def begin_shutdown(self, _app: web.Application) -> None:
        """SIGTERM: the listening socket is closed already; refuse what still arrives on open
        connections and let requests in flight finish (up to ``shutdown_grace_s``)."""
        self.draining = True
        self.metrics.draining.set(1)
        busy = sum(b.in_flight for b in self.cfg.decode)
        log.info("shutting down: %d request(s) in flight get up to %.0f s to finish", busy, self.cfg.shutdown_grace_s)

    async def trace_view(self, req: web.Request) -> web.Response:
        """``?transfer_id=`` or, with ``expose_transfer_id``, ``?request_id=``: this router's
        stamps of that request; none given: the recent transfer IDs. An ID this router has no
        stamps of (or a request ID while they are not exposed) is 404, never the recent list.
        Operators only (the admin listener)."""
        q = req.query
        if "request_id" in q:
            tid = self.request_ids.get(q["request_id"], "") if self.cfg.expose_transfer_id else ""
        else:
            tid = q.get("transfer_id", "")
        if ("request_id" in q or "transfer_id" in q) and tid not in self.trace:
            return _error(404, "no such request in this router's trace")
        return web.json_response({"host": socket.gethostname(), **self.trace.view(tid)})

    async def drain(self, _req: web.Request) -> web.Response:
        """Stop taking requests (health answers 503) and let those in flight finish."""
        self.draining = True
        self.metrics.draining.set(1)
        return web.json_response({"draining": True})

    async def completions(self, req: web.Request) -> web.StreamResponse:
        t0 = time.monotonic()
        resp = await self.forward(req, req.path, t0)
        self.metrics.requests.labels(req.path, str(resp.status)).inc()
        if resp.status == 200:
            self.metrics.latency.labels(str(self._streamed(resp)).lower()).observe(time.monotonic() - t0)
        return resp

    @staticmethod
    def _streamed(resp: web.StreamResponse) -> bool:
        return "event-stream" in resp.headers.get("content-type", "")

    async def _fail_stream(self, resp: web.StreamResponse, message: str,
                           refused: LegRefused | None = None) -> web.StreamResponse:
        """A leg failed after the 200 went out: a streaming client gets the error as an event,
        then ``[DONE]``, as vLLM ends a stream that failed (a non-streaming body is cut short,
        which its JSON parser reports); an engine's refusal goes out as the engine wrote it."""
        if self._streamed(resp):
            with contextlib.suppress(ConnectionError, RuntimeError):  # the client may be gone
                await resp.write(refused_event(refused) if refused is not None else sse_error(502, message))
                await resp.write(b"data: [DONE]\n\n")
        return resp

    async def forward(self, req: web.Request, path: str, t0: float) -> web.StreamResponse:
        assert self.session is not None
        if self.draining:
            return _error(503, "kvpush-router is shutting down")
        try:
            body = await json_body(req)
        except BadRequest as exc:
            return _error(400, str(exc))
        self.stats["requests"] += 1
        # One trace per request: the client's (or, when exporting, a new one) goes on to both
        # engines (vLLM's spans) and, inside the transfer ID, to both daemons (kvpush.common.otel).
        parent = otel.parse_traceparent(req.headers.get("traceparent"))
        span = parent.child() if parent else otel.TraceContext.new() if self.spans else None
        transfer_id = otel.transfer_id_for(span) if span else f"kvp-{uuid.uuid4().hex}"
        self.trace.stamp(transfer_id, "router.request_in")
        rid = req.headers.get("x-request-id") or f"req-{uuid.uuid4().hex}"  # never the transfer ID
        if len(self.request_ids) >= self.trace.max_transfers:
            self.request_ids.pop(next(iter(self.request_ids)))
        self.request_ids[rid] = transfer_id
        log.debug("request %s -> transfer %s", rid, transfer_id)
        p, d = self.pick(self.cfg.prefill, "p"), self.pick(self.cfg.decode, "d")
        p_body = dict(body)
        secret = new_secret()  # the decode leg presents it; the prefill daemon admits only it (and d.node)
        p_body.update(stream=False, max_tokens=1,
                      kv_transfer_params=PrefillLeg(transfer_id, d.node, secret).to_params())
        p_body.pop("stream_options", None)
        if "max_completion_tokens" in p_body:
            p_body["max_completion_tokens"] = 1
        # One prompt, one prefill: vLLM would split an n > 1 leg into n children of one token
        # each. The decode leg keeps n (and refuses what n does not allow, e.g. greedy n > 1);
        # min_tokens above the leg's one token would be refused by the prefill engine alone.
        if "n" in p_body:
            p_body["n"] = 1
        if isinstance(p_body.get("min_tokens"), int) and p_body["min_tokens"] > 1:
            p_body["min_tokens"] = 1
        d_body = dict(body)
        d_body["kv_transfer_params"] = DecodeLeg(
            transfer_id, tuple(p.kv_endpoints), len(p.kv_endpoints), secret).to_params()
        early = self.cfg.first_token == "prefill" and first_token.eligible(path, body)
        if early:
            first_token.leg_bodies(body, p_body, d_body)
        headers = {"x-request-id": rid, "content-type": "application/json"}
        if "authorization" in req.headers:
            headers["authorization"] = req.headers["authorization"]
        if span is not None:
            headers["traceparent"] = span.traceparent
        p.in_flight += 1
        d.in_flight += 1
        ok = False
        prefill = asyncio.create_task(self._prefill(p, path, p_body, headers, transfer_id))
        decode = asyncio.ensure_future(self._post_leg(
            "decode", f"{d.url}{path}", transfer_id, json=d_body, headers=headers,
            timeout=aiohttp.ClientTimeout(total=self.cfg.request_timeout_s),
        ))
        self.trace.stamp(transfer_id, "router.legs_sent")
        resp: web.StreamResponse | None = None
        try:
            # A non-streaming decode leg answers only when generation is done: race its
            # headers against the prefill leg so a failed prefill cancels it at once.
            await asyncio.wait({decode, prefill}, return_when=asyncio.FIRST_COMPLETED)
            if not decode.done() and (exc := prefill.exception()) is not None:
                if isinstance(exc, LegRefused) and (verdict := await self._decode_verdict(decode)) is not None:
                    return verdict
                decode.cancel()  # closes the connection: vLLM aborts the request
                raise exc if isinstance(exc, LegFailed) else LegFailed(str(exc))
            first = decode_first = True
            splice = first_token.Splice(first_token.PATHS[path]) if early else None
            if splice is not None and not decode.done():
                # The prefill leg answered before the decode engine sent its headers: the
                # client's stream opens now, its first token need not wait for the decode engine.
                resp = await self._open(req, rid, transfer_id, SSE)
                out = splice.prefill(_json(prefill.result()))
                if out:
                    self._first_out(transfer_id, t0, streamed=True, prefill_token=True)
                    first = False
                    for piece in out:
                        await resp.write(piece)
            async with await decode as upstream:
                if upstream.status != 200:
                    raw = await upstream.read()
                    prefill.cancel()
                    d.failed += 1
                    self.metrics.leg_failed("decode", None)
                    message = f"decode engine {d.url}: {raw[:500].decode(errors='replace')}"
                    refused = leg_error(upstream.status, raw, message)
                    if isinstance(refused, LegRefused):
                        return refused_response(refused) if resp is None else await self._fail_stream(
                            resp, message, refused)
                    return _error(upstream.status, message) if resp is None else await self._fail_stream(resp, message)
                if resp is None:
                    resp = await self._open(req, rid, transfer_id, upstream.headers.get("content-type", "application/json"))
                streamed = self._streamed(resp)
                whole: list[bytes] | None = None if streamed else []
                if not streamed:
                    splice = None
                announce = splice is not None and splice.state is first_token.State.WAITING
                async for chunk in decode_chunks(upstream, prefill, announce=announce):
                    if decode_first and chunk is not PREFILL_ANSWERED:
                        self.trace.stamp(transfer_id, "router.decode_first_byte")
                        decode_first = False
                    if splice is not None:
                        out = (splice.prefill(_json(prefill.result())) if chunk is PREFILL_ANSWERED
                               else splice.decode(chunk))
                        if splice.state is first_token.State.MISMATCH:
                            break
                    else:
                        out = [chunk]
                    if first and out:
                        self._first_out(transfer_id, t0, streamed, prefill_token=chunk is PREFILL_ANSWERED)
                        first = False
                    for piece in out:
                        if whole is None:
                            await resp.write(piece)
                        else:
                            whole.append(piece)
                if streamed:
                    self.metrics.first_tokens.labels("prefill" if splice is not None and splice.early
                                                     else "decode").inc()
                if splice is not None:
                    # the decode leg left the text sent
                    if splice.state in (first_token.State.MISMATCH, first_token.State.SPLICING):
                        upstream.close()
                        self.metrics.first_token_mismatches.inc()
                        await prefill
                        await self._recover(d, path, body, headers, splice, resp, transfer_id)
                        await resp.write_eof()
                        d.served += 1
                        ok = True
                        return resp
                # The decode leg finished; the prefill leg must have succeeded too.
                await prefill
                if whole is not None:
                    await resp.write(_without_params(b"".join(whole)))
                await resp.write_eof()
                d.served += 1
                ok = True
                return resp
        except LegRefused as exc:  # the client's fault: its 4xx, the engine's body
            self.stats["errors"] += 1
            if resp is None:
                return refused_response(exc)
            return await self._fail_stream(resp, str(exc), exc)
        except LegFailed as exc:
            d.failed += 1
            self.stats["errors"] += 1
            if resp is None:
                return _error(502, str(exc))
            return await self._fail_stream(resp, str(exc))
        except (TimeoutError, aiohttp.ClientError) as exc:
            prefill.cancel()
            d.failed += 1
            self.stats["errors"] += 1
            self.metrics.leg_failed("decode", exc)
            message = f"decode engine {d.url}: {type(exc).__name__}: {exc}"
            if resp is None:
                return _error(502, message)
            return await self._fail_stream(resp, message)
        finally:
            for task in (prefill, decode):
                if not task.done():
                    task.cancel()
            p.in_flight -= 1
            d.in_flight -= 1
            if self.spans is not None and span is not None:
                self.spans.export("kvpush router", transfer_id, self.trace.get(transfer_id), ctx=span,
                                  parent=parent, failed=not ok)

    async def _decode_verdict(self, decode: asyncio.Future[aiohttp.ClientResponse]) -> web.Response | None:
        """The prefill leg was refused. The decode leg carries the request as the client sent it,
        so its own answer is what a colocated engine would say (a refused streamed request is a
        200 whose one event is the error): it gets ``refusal_grace_s`` to give it whole. None
        where it does not (it accepted the request and waits for KV that will not come)."""
        try:
            async with asyncio.timeout(self.cfg.refusal_grace_s):
                async with await decode as up:
                    raw = await up.read()
                    ctype = up.headers.get("content-type", "application/json")
        except (TimeoutError, aiohttp.ClientError):
            return None
        if up.status >= 500:
            return None
        out = web.Response(body=raw if "event-stream" in ctype else _without_params(raw), status=up.status)
        out.headers["content-type"] = ctype
        return out

    def _first_out(self, transfer_id: str, t0: float, streamed: bool, prefill_token: bool) -> None:
        """The client's first token is out: its time, and whose token it was."""
        if prefill_token:
            self.trace.stamp(transfer_id, "router.prefill_first_token")
        self.metrics.ttft.labels(str(streamed).lower()).observe(time.monotonic() - t0)

    async def _open(self, req: web.Request, rid: str, transfer_id: str, ctype: str) -> web.StreamResponse:
        """The client's response, 200 and headers sent."""
        out_headers = {"content-type": ctype, "x-request-id": rid}
        if self.cfg.expose_transfer_id:
            out_headers["x-kvpush-transfer-id"] = transfer_id
        resp = web.StreamResponse(status=200, headers=out_headers)
        await resp.prepare(req)
        return resp

    async def _recover(self, d: Backend, path: str, body: dict[str, Any], headers: dict[str, str],
                       splice: first_token.Splice, resp: web.StreamResponse, transfer_id: str) -> None:
        """The decode leg did not start with the first token the client was sent: the decode
        engine continues from that token alone (prompt and token by ID, no transfer)."""
        assert self.session is not None
        log.warning("transfer %s: the decode leg's first token differs from the prefill leg's; "
                    "continuing from the token sent", transfer_id)
        self.trace.stamp(transfer_id, "router.first_token_recovery")
        rb = splice.recovery(body)
        want_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        if rb.get("max_tokens") == 0:  # the first token was the whole answer
            await resp.write(splice.finished(want_usage))
            return
        async with self.session.post(
            f"{d.url}/v1/completions", json=rb, headers={**headers, "x-request-id": headers["x-request-id"] + "-r"},
            timeout=aiohttp.ClientTimeout(total=self.cfg.request_timeout_s),
        ) as up:
            if up.status != 200:
                await self._fail_stream(resp, f"decode engine {d.url}: {(await up.text())[:500]}")
                return
            events = first_token.Events()
            async for chunk in up.content.iter_any():
                for ev in events.feed(chunk):
                    data = first_token.event_data(ev)
                    if data == b"[DONE]":
                        await resp.write(b"data: [DONE]\n\n")
                        continue
                    try:
                        obj = json.loads(data)
                    except ValueError:
                        continue
                    out = splice.recovered(obj, want_usage) if isinstance(obj, dict) else None
                    if out is not None:
                        await resp.write(out)

    async def _prefill(self, p: Backend, path: str, body: dict[str, Any], headers: dict[str, str],
                       transfer_id: str) -> str:
        assert self.session is not None
        t0 = time.monotonic()
        try:
            async with await self._post_leg(
                "prefill", f"{p.url}{path}", transfer_id, json=body, headers=headers,
                timeout=aiohttp.ClientTimeout(total=self.cfg.prefill_timeout_s),
            ) as r:
                raw = await r.read()
                text = raw.decode(errors="replace")
                if r.status != 200:
                    p.failed += 1
                    self.metrics.leg_failed("prefill", None)
                    raise leg_error(r.status, raw, f"prefill engine {p.url} answered {r.status}: {text[:500]}")
        except (TimeoutError, aiohttp.ClientError) as exc:
            p.failed += 1
            self.metrics.leg_failed("prefill", exc)
            raise LegFailed(f"prefill engine {p.url}: {type(exc).__name__}: {exc}") from exc
        p.served += 1
        self.trace.stamp(transfer_id, "router.prefill_answered")
        log.debug("prefill leg done in %.1f ms", (time.monotonic() - t0) * 1e3)
        return text


def _json(text: str) -> Any:
    """A leg's JSON answer (None where it is not JSON: the splice then leaves the first token
    to the decode leg)."""
    try:
        return json.loads(text)
    except ValueError:
        return None


def _without_params(body: bytes) -> bytes:
    """A non-streamed answer without the ``kv_transfer_params`` vLLM puts in it (a decode
    engine echoes its leg's, which hold the transfer's secret): clients never see them."""
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):
        return body  # not JSON: nothing of ours can be in it as a key
    if isinstance(doc, dict) and "kv_transfer_params" in doc:
        doc.pop("kv_transfer_params")
        return json.dumps(doc).encode()
    return body


def _error(status: int, message: str) -> web.Response:
    return error_response(status, message)


def build_app(cfg: RouterConfig) -> web.Application:
    """The client app: the OpenAI API, /health and /metrics. It starts (and stops) the admin
    app on ``cfg.admin_host:admin_port`` with itself; its URL is ``app["admin_url"]``."""
    r = Router(cfg)
    app = front_app(r, None, cfg.max_body_bytes)
    app.router.add_get("/metrics", r.metrics_view)
    app.on_shutdown.append(r.begin_shutdown)
    app["router"] = r
    admin = build_admin_app(r)

    async def start_admin(app: web.Application) -> None:
        runner = web.AppRunner(admin, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, cfg.admin_host, cfg.admin_port or 0)  # unvalidated (None): any
        await site.start()
        host, port = runner.addresses[0][:2]
        app["admin_runner"], app["admin_url"] = runner, f"http://{host}:{port}"
        log.info("operator endpoints on %s%s", app["admin_url"], " (token required)" if cfg.admin_token else "")

    async def stop_admin(app: web.Application) -> None:
        if "admin_runner" in app:
            await app["admin_runner"].cleanup()

    app.on_startup.append(start_admin)
    app.on_cleanup.append(stop_admin)
    return app


def build_admin_app(r: Router) -> web.Application:
    """The operators' endpoints: /router/status, /router/trace, /router/drain (and /metrics),
    behind ``admin_token`` when one is set."""
    token = r.cfg.admin_token

    @web.middleware
    async def bearer(req: web.Request, handler: Any) -> web.StreamResponse:
        got = req.headers.get("Authorization", "")
        if token and not hmac.compare_digest(got.encode(), f"Bearer {token}".encode()):
            return _error(401, "operator endpoint: Authorization: Bearer <admin_token> required")
        return await handler(req)

    app = web.Application(middlewares=[bearer])
    app.router.add_get("/router/status", r.status)
    app.router.add_get("/router/trace", r.trace_view)
    app.router.add_post("/router/drain", r.drain)
    app.router.add_get("/metrics", r.metrics_view)
    return app
