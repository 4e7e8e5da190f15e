"""OpenAI-API proxies for vLLM's own P/D connectors, the baselines kvpush is measured against.

Two flows, each the one its connector is built for:

- ``--mode pull`` (``NixlConnector``): vLLM's usual sequential flow. Send the prefill
  engine ``max_tokens=1`` with ``kv_transfer_params={"do_remote_decode": true}``, take the
  ``kv_transfer_params`` it answers with (its block ids, engine id, side channel) and only
  then send the decode engine the original request with them; the decode engine READs.
- ``--mode push`` (``NixlPushConnector``): both legs at once, like the kvpush router. The
  decode leg names the prefill engine up front (``remote_engine_id`` — the prefill engine's
  fixed ``engine_id`` — ``remote_host``, ``remote_port`` = its NIXL side-channel port,
  ``tp_size``, ``remote_request_id``), registers its blocks with it, and the prefill
  engine WRITEs when done. The two legs are matched by request id (vLLM strips its random
  suffix), so both get the same, freshly made ``x-request-id``.

Every request gets a unique id here (never the client's), so that a leg left behind by an
earlier timed-out request can never be matched with a new one. A client that disconnects
cancels both legs (the engines abort them).

    python -m kvpush_dev.baseline_proxy --mode pull --port 8000 --prefill http://127.0.0.1:8100 \\
        --decode http://127.0.0.1:8200
    python -m kvpush_dev.baseline_proxy --mode push --port 8000 --prefill http://127.0.0.1:8100 \\
        --decode http://127.0.0.1:8200 --prefill-engine-id prefill --prefill-side-port 5601
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import uuid
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from kvpush.proto.params import (
    DO_REMOTE_DECODE,
    DO_REMOTE_PREFILL,
    REMOTE_HOST,
    REMOTE_PORT,
    TP_SIZE,
)
from kvpush.router.front import (  # one front end, two policies
    BadRequest,
    LegFailed,
    LegRefused,
    Upstreams,
    decode_chunks,
    error_response,
    front_app,
    json_body,
    leg_error,
    refused_response,
)

log = logging.getLogger("baseline-proxy")
MODES = ("pull", "push")
# vLLM's NixlConnector / NixlPushConnector keys that only vLLM reads (the do_remote_* flags and
# the push proxy's remote_host / remote_port / tp_size, which kvpush reads too, are in
# kvpush.proto.params).
REMOTE_ENGINE_ID = "remote_engine_id"
REMOTE_BLOCK_IDS = "remote_block_ids"
REMOTE_REQUEST_ID = "remote_request_id"


@dataclass
class ProxyConfig:
    """Where the two engines are; for push also the prefill engine's NIXL coordinates."""

    mode: str
    prefill_url: str
    decode_url: str
    prefill_engine_id: str = "prefill"
    prefill_host: str = "127.0.0.1"
    prefill_side_port: int = 0
    prefill_tp_size: int = 1
    prefill_timeout_s: float = 600.0
    request_timeout_s: float = 600.0


def prefill_body(body: dict[str, Any], kv_params: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg: one token, no streaming, the connector's producer parameters."""
    out = dict(body)
    out.update(stream=False, max_tokens=1, kv_transfer_params=kv_params)
    out.pop("stream_options", None)
    out.pop("min_tokens", None)
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    if "n" in out:  # one prompt, one prefill; the decode leg keeps n
        out["n"] = 1
    return out


def pull_prefill_params() -> dict[str, Any]:
    """What vLLM's own toy proxy sends the prefill engine for NixlConnector."""
    return {DO_REMOTE_DECODE: True, DO_REMOTE_PREFILL: False, REMOTE_ENGINE_ID: None,
            REMOTE_BLOCK_IDS: None, REMOTE_HOST: None, REMOTE_PORT: None}


def push_decode_params(cfg: ProxyConfig, request_id: str) -> dict[str, Any]:
    """The decode leg's parameters for NixlPushConnector (push_scheduler.update_state_after_alloc).

    ``remote_request_id`` is the prefill engine's request id without vLLM's random suffix
    (``cmpl-<x-request-id>-<prompt index>``): heartbeats name it, the push itself matches
    on the shared base id.
    """
    return {
        DO_REMOTE_PREFILL: True,
        DO_REMOTE_DECODE: False,
        REMOTE_ENGINE_ID: cfg.prefill_engine_id,
        REMOTE_HOST: cfg.prefill_host,
        REMOTE_PORT: cfg.prefill_side_port,
        TP_SIZE: cfg.prefill_tp_size,
        REMOTE_REQUEST_ID: f"cmpl-{request_id}-0",
        REMOTE_BLOCK_IDS: [],
    }


class Proxy(Upstreams):
    def __init__(self, cfg: ProxyConfig) -> None:
        if cfg.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {cfg.mode!r}")
        if cfg.mode == "push" and not cfg.prefill_side_port:
            raise ValueError("push mode needs the prefill engine's NIXL side-channel port")
        self.cfg = cfg
        self.stats = {"requests": 0, "errors": 0, "in_flight": 0}

    def engine_urls(self) -> list[str]:
        return [self.cfg.prefill_url, self.cfg.decode_url]

    def models_url(self) -> str:
        return self.cfg.decode_url

    async def status(self, _req: web.Request) -> web.Response:
        return web.json_response({"mode": self.cfg.mode, **self.stats})

    async def completions(self, req: web.Request) -> web.StreamResponse:
        try:
            body = await json_body(req)
        except BadRequest as exc:
            return _error(400, str(exc))
        self.stats["requests"] += 1
        self.stats["in_flight"] += 1
        rid = f"px{uuid.uuid4().hex}"
        headers = {"x-request-id": rid, "content-type": "application/json"}
        try:
            if self.cfg.mode == "pull":
                return await self._pull(req, body, headers)
            return await self._push(req, body, headers, rid)
        except LegRefused as exc:  # the client's fault: its 4xx, the engine's body
            self.stats["errors"] += 1
            return refused_response(exc)
        except LegFailed as exc:
            self.stats["errors"] += 1
            return _error(502, str(exc))
        finally:
            self.stats["in_flight"] -= 1

    async def _prefill(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
        assert self.session is not None
        url = f"{self.cfg.prefill_url}{path}"
        try:
            async with self.session.post(url, json=body, headers=headers,
                                         timeout=aiohttp.ClientTimeout(total=self.cfg.prefill_timeout_s)) as r:
                raw = await r.read()
                text = raw.decode(errors="replace")
                if r.status != 200:
                    raise leg_error(r.status, raw, f"prefill engine answered {r.status}: {text[:500]}")
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise LegFailed(f"prefill engine: {type(exc).__name__}: {exc}") from exc
        try:
            out = json.loads(text)
        except json.JSONDecodeError as exc:
            raise LegFailed(f"prefill engine answered non-JSON: {text[:200]}") from exc
        return out if isinstance(out, dict) else {}

    async def _pull(self, req: web.Request, body: dict[str, Any], headers: dict[str, str]) -> web.StreamResponse:
        out = await self._prefill(req.path, prefill_body(body, pull_prefill_params()), headers)
        kv = out.get("kv_transfer_params")
        if not isinstance(kv, dict):
            raise LegFailed(f"prefill engine returned no kv_transfer_params: {json.dumps(out)[:300]}")
        d_body = dict(body)
        d_body["kv_transfer_params"] = kv
        return await self._stream_decode(req, d_body, headers, prefill=None)

    async def _push(self, req: web.Request, body: dict[str, Any], headers: dict[str, str],
                    rid: str) -> web.StreamResponse:
        p_body = prefill_body(body, {DO_REMOTE_DECODE: True})
        d_body = dict(body)
        d_body["kv_transfer_params"] = push_decode_params(self.cfg, rid)
        prefill = asyncio.create_task(self._prefill(req.path, p_body, headers))
        try:
            return await self._stream_decode(req, d_body, headers, prefill=prefill)
        finally:
            if not prefill.done():
                prefill.cancel()

    async def _stream_decode(self, req: web.Request, d_body: dict[str, Any], headers: dict[str, str],
                             prefill: asyncio.Task[dict[str, Any]] | None) -> web.StreamResponse:
        """Stream the decode leg back; with a concurrent prefill leg, fail as soon as it fails."""
        assert self.session is not None
        resp: web.StreamResponse | None = None
        try:
            async with self.session.post(f"{self.cfg.decode_url}{req.path}", json=d_body, headers=headers,
                                         timeout=aiohttp.ClientTimeout(total=self.cfg.request_timeout_s)) as up:
                if up.status != 200:
                    raw = await up.read()
                    raise leg_error(up.status, raw, f"decode engine answered {up.status}: "
                                                    f"{raw[:500].decode(errors='replace')}")
                resp = web.StreamResponse(status=200, headers={
                    "content-type": up.headers.get("content-type", "application/json")})
                await resp.prepare(req)
                async for chunk in decode_chunks(up, prefill):
                    await resp.write(chunk)
                if prefill is not None:
                    await prefill  # the decode leg ended; the prefill leg must have succeeded
                await resp.write_eof()
                return resp
        except (TimeoutError, aiohttp.ClientError) as exc:
            if resp is None:
                raise LegFailed(f"decode engine: {type(exc).__name__}: {exc}") from exc
            self.stats["errors"] += 1
            return resp  # headers are out: the stream just ends, the client sees it short
        except LegFailed:
            if resp is None:
                raise
            self.stats["errors"] += 1
            return resp


def _error(status: int, message: str) -> web.Response:
    return error_response(status, message, "baseline_proxy_error")


def build_app(cfg: ProxyConfig) -> web.Application:
    p = Proxy(cfg)
    app = front_app(p, "/proxy/status")
    app["proxy"] = p
    return app


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=MODES, required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--prefill", required=True, metavar="URL")
    ap.add_argument("--decode", required=True, metavar="URL")
    ap.add_argument("--prefill-engine-id", default="prefill", help="push: the P engine's fixed engine_id")
    ap.add_argument("--prefill-host", default="127.0.0.1", help="push: the P engine's NIXL side-channel host")
    ap.add_argument("--prefill-side-port", type=int, default=0, help="push: VLLM_NIXL_SIDE_CHANNEL_PORT of P")
    ap.add_argument("--prefill-tp-size", type=int, default=1)
    ap.add_argument("--prefill-timeout", type=float, default=600.0)
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--log-level", default="INFO")
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s baseline-proxy %(levelname)s %(message)s")
    cfg = ProxyConfig(mode=args.mode, prefill_url=args.prefill.rstrip("/"), decode_url=args.decode.rstrip("/"),
                      prefill_engine_id=args.prefill_engine_id, prefill_host=args.prefill_host,
                      prefill_side_port=args.prefill_side_port, prefill_tp_size=args.prefill_tp_size,
                      prefill_timeout_s=args.prefill_timeout, request_timeout_s=args.request_timeout)
    # handler_cancellation: a client that gives up (the benchmark's per-request cap) closes
    # both legs, so the engines abort them instead of holding blocks for the full timeout.
    web.run_app(build_app(cfg), host=args.host, port=args.port, print=None, access_log=None,
                handler_cancellation=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
