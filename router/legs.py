"""Sending one leg to its engine: over a pooled connection, and once more over a fresh one
where the pooled connection turns out dead before the engine answered anything.

Why. An engine's HTTP server (vLLM's uvicorn, 5 s keep-alive) closes a kept-alive connection
it holds idle when its keep-alive timer fires. A leg written into such a connection as the
server closes it is never read: the server closed it with the request still unread in its
socket (the kernel then answers with a reset: ``ClientOSError`` "Connection reset by peer"),
or before it arrived (``ServerDisconnectedError``). In steady state the window is narrow; after
the engine did not run for a moment (SIGSTOP, swapping, a stalled host) it is certain: on
resume uvloop runs its due timers before it reads its sockets, so every idle connection whose
keep-alive ran out meanwhile is closed with whatever the router wrote into it meanwhile. The
client was answered 502 for a request no engine ever saw (issue 43).

When a leg is sent again (RFC 9112 §9.3.1: a client retries a non-idempotent request only
where it knows the first was not acted on), all three hold:

1. it went over a connection taken from the pool (a fresh connection that fails is the
   engine's failure, reported as it is);
2. it failed by a disconnect or a reset: never a timeout, never a failed connect;
3. before the response's headers.

A server closes a connection it is handling a request on only by dying, and its engine goes
with it (vLLM's engine core exits with its API server); a connection it closes alive is one it
held idle, whose bytes it never read. So the first copy did not reach vLLM: sending it again
makes one prefill, not two (this matters: the prefill engine's plugin takes one prefill per
transfer ID, and the prefill daemon one ``PrefillDone``). The copy is the same request, with the
same transfer ID and secret: the decode side meets it as it would have met the first. (A
decode leg would be safe to repeat even if it had been read: its registration would be a
reissue, a newer attempt that supersedes the first, and vLLM aborts the first copy when its
connection closes.)

Once only, and over a connection opened for it: the pool's other idle connections to that
engine may be just as dead.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import aiohttp

__all__ = ["Legs"]

log = logging.getLogger("kvpush.router")


@dataclass
class _Attempt:
    """What the session's trace tells of one send: whether its connection came from the pool."""

    reused: bool = False


async def _note_reuse(_session: aiohttp.ClientSession, ctx: SimpleNamespace,
                      _params: aiohttp.TraceConnectionReuseconnParams) -> None:
    if isinstance(ctx.trace_request_ctx, _Attempt):
        ctx.trace_request_ctx.reused = True


def _dead_pooled(exc: BaseException, attempt: _Attempt) -> bool:
    """A pooled connection the engine had closed (see the module's docstring)."""
    if not attempt.reused or isinstance(exc, aiohttp.ClientConnectorError):
        return False
    return isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientOSError)


class Legs:
    """The trace that tells pooled connections from fresh ones (``trace_config``: the front's
    pooled session must carry it) and the session that opens a fresh connection for each
    request it sends (``start``/``stop`` with the front)."""

    def __init__(self) -> None:
        self.trace_config = aiohttp.TraceConfig()
        self.trace_config.on_connection_reuseconn.append(_note_reuse)
        self.fresh: aiohttp.ClientSession | None = None

    def start(self, timeout: aiohttp.ClientTimeout) -> None:
        self.fresh = aiohttp.ClientSession(timeout=timeout,
                                           connector=aiohttp.TCPConnector(limit=0, force_close=True))

    async def stop(self) -> None:
        if self.fresh is not None:
            await self.fresh.close()

    async def post(self, session: aiohttp.ClientSession, url: str, *, leg: str, on_resend: Any = None,
                   **kw: Any) -> aiohttp.ClientResponse:
        """POST a leg over ``session``'s pool; its response once its headers are in (the
        caller closes it). Sent again once, over a fresh connection, where the pooled one was
        dead (``on_resend(exc)`` is called first)."""
        assert self.fresh is not None
        attempt = _Attempt()
        try:
            return await session.post(url, trace_request_ctx=attempt, **kw)
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            if not _dead_pooled(exc, attempt):
                raise
            log.info("%s leg to %s: its pooled connection was closed by the engine before it answered "
                     "(%s: %s); sending it again over a fresh connection", leg, url, type(exc).__name__, exc)
            if on_resend is not None:
                on_resend(exc)
        return await self.fresh.post(url, **kw)
