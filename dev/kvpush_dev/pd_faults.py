"""Fault drills and serving fronts on a running :class:`~kvpush_dev.pd_stack.PDStack`, shared by
the end-to-end suites (the dense tiny model's test_pd*.py and test_llmd_shape.py, and each model
family's test_models_faults.py), so that every family goes through the very same drill.

- what an engine or a daemon still holds: :func:`running`, :func:`prefill_holds`;
- a daemon's pid, and waiting for its supervisor to restart it: :func:`daemon_pid`,
  :func:`wait_daemon`;
- an outage (a daemon frozen or killed) with requests in flight and sent during it:
  :func:`outage`, then :func:`check` that each finished soon after, with the colocated tokens;
- the decode leg registered, then its client gone: :func:`abort_after_register`;
- a serial front (the prefill leg first, then the decode leg with the prefill answer's
  ``kv_transfer_params`` verbatim), as llm-d's routing sidecar and Ray Serve LLM send it:
  :func:`serial_front`, :data:`SERIAL_PREFILL_PARAMS`.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from typing import Any

import aiohttp

from kvpush import proto
from kvpush.daemon.ops import client as opsclient
from kvpush_dev import prom
from kvpush_dev.pd_stack import PDStack

__all__ = ["SERIAL_PREFILL_PARAMS", "abort_after_register", "check", "daemon_pid", "ops", "outage",
           "prefill_holds", "running", "serial_front", "timed_post", "wait_daemon"]

# What a serial front puts on the prefill leg: the shape vLLM's NixlConnector expects (llm-d's
# sidecar, vLLM's toy serial proxy). No transfer ID, no daemon endpoint: the prefill engine's
# plugin names the transfer and answers with the decode leg's params.
SERIAL_PREFILL_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def running(url: str) -> float:
    """Requests the engine at ``url`` still runs or queues (its own /metrics)."""
    snap = prom.parse(prom.fetch_text(f"{url}/metrics", timeout=10))
    return sum(prom.total(snap, n) or 0.0 for n in ("vllm:num_requests_running", "vllm:num_requests_waiting"))


def ops(stack: PDStack, idx: int, cmd: str) -> Any:
    """Daemon ``idx``'s answer to the ops command ``cmd``."""
    reply = opsclient.request(stack.ops_socket(idx), proto.OpsRequest(cmd, ""), 5.0)
    assert reply.ok, reply.error
    return reply.data


def prefill_holds(stack: PDStack, wait_s: float = 5.0) -> list[Any]:
    """The prefill daemon's pending rendezvous (with held blocks) once ``wait_s`` passed or none is left."""
    deadline = time.monotonic() + wait_s
    while True:
        rows = [r for r in ops(stack, 0, "pending")["pending"]
                if r["side"] == "prefill" and r["state"] not in ("done", "failed", "expired")]
        if not rows or time.monotonic() > deadline:
            return rows
        time.sleep(0.1)


def daemon_pid(stack: PDStack, idx: int) -> int:
    return int(ops(stack, idx, "status")["pid"])


def wait_daemon(stack: PDStack, idx: int, not_pid: int, limit_s: float) -> float:
    """Until daemon ``idx`` answers with another pid than ``not_pid`` (its supervisor restarted
    it); when it first did."""
    end = time.monotonic() + limit_s
    while True:
        try:
            if daemon_pid(stack, idx) != not_pid:
                return time.monotonic()
        except (AssertionError, OSError, TimeoutError, RuntimeError):
            pass
        assert time.monotonic() < end, f"daemon cpu{idx} not restarted within {limit_s:g} s"
        time.sleep(0.1)


async def timed_post(s: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """One completion: when it was sent and done, its status, and its text (or its error)."""
    sent = time.monotonic()
    async with s.post(url, json=body, timeout=aiohttp.ClientTimeout(total=300)) as r:
        data = await r.json(content_type=None)
    out = {"sent": sent, "done": time.monotonic(), "status": r.status}
    if r.status == 200:
        out["text"] = data["choices"][0]["text"]
    else:
        out["error"] = data
    return out


def outage(stack: PDStack, bodies: list[dict[str, Any]], *, stop: Callable[[], Any], resume: Callable[[], float],
           hold_s: float, during_before_resume: float = 1.5,
           ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], float]:
    """The first body in flight through the router at ``stop()``, the rest sent
    ``during_before_resume`` seconds before ``resume()`` (``hold_s`` after the stop), which
    returns when the peer is back. Returns (in flight, sent during, back)."""
    url = f"{stack.router_url}/v1/completions"

    async def go() -> tuple[list[dict[str, Any]], list[dict[str, Any]], float]:
        async with aiohttp.ClientSession() as s:
            first = asyncio.create_task(timed_post(s, url, bodies[0]))
            await asyncio.sleep(0.05)
            stop()
            during: list[asyncio.Task[dict[str, Any]]] = []
            try:
                await asyncio.sleep(hold_s - during_before_resume)
                during = [asyncio.create_task(timed_post(s, url, b)) for b in bodies[1:]]
                await asyncio.sleep(during_before_resume)
            finally:
                back = await asyncio.to_thread(resume)
            return [await first], list(await asyncio.gather(*during)), back

    return asyncio.run(go())


def check(got: list[dict[str, Any]], want: list[str], back: float, soon_s: float) -> None:
    """Each answer equals colocated and finished within ``soon_s`` of the peer being back (or of
    being sent, if later): no request waited for a deadline where the outcome was known."""
    for g, w in zip(got, want, strict=True):
        assert g.get("text") == w, g
        late = g["done"] - max(g["sent"], back)
        assert late < soon_s, (f"finished {late:.1f} s after the peer was back: it waited for a deadline "
                               "where the outcome was already known")


def abort_after_register(stack: PDStack, d_body: dict[str, Any], limit_s: float = 60.0) -> None:
    """Send the decode leg ``d_body`` to the decode engine and, once it is in the engine's
    scheduler (registered, waiting for its KV), go away; return when the engine runs nothing."""

    async def register_then_leave() -> None:
        async with aiohttp.ClientSession() as s:
            task = asyncio.create_task(s.post(f"{stack.d_url}/v1/completions", json=d_body))
            deadline = time.monotonic() + limit_s
            while running(stack.d_url) < 1:  # the leg is in D's scheduler, waiting for KV
                assert time.monotonic() < deadline, "the decode leg never reached the engine"
                await asyncio.sleep(0.2)
            task.cancel()

    asyncio.run(register_then_leave())
    deadline = time.monotonic() + limit_s
    while running(stack.d_url) > 0:
        assert time.monotonic() < deadline, "the aborted decode leg still runs"
        time.sleep(0.5)


async def serial_front(stack: PDStack, body: dict[str, Any], request_id: str | None = None,
                       ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The serial front: the prefill leg (``stream: false``, ``max_tokens: 1``,
    :data:`SERIAL_PREFILL_PARAMS`, an ``x-request-id``), then the decode leg with the prefill
    answer's ``kv_transfer_params`` verbatim. Both answers; either leg's failure fails here."""
    rid = request_id or f"serial-{uuid.uuid4().hex}"
    async with aiohttp.ClientSession() as s:
        async def post(url: str, b: dict[str, Any]) -> dict[str, Any]:
            async with s.post(url, json=b, headers={"x-request-id": rid},
                              timeout=aiohttp.ClientTimeout(total=300)) as r:
                data = await r.json(content_type=None)
                assert r.status == 200, data
                return dict(data)

        p = await post(f"{stack.p_url}/v1/completions",
                       {**body, "stream": False, "max_tokens": 1, "kv_transfer_params": dict(SERIAL_PREFILL_PARAMS)})
        d = await post(f"{stack.d_url}/v1/completions", {**body, "kv_transfer_params": p["kv_transfer_params"]})
    return p, d
