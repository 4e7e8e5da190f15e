"""The router's first token from the prefill leg, when the decode leg disagrees with it.

The prefill engine here serves a checkpoint whose output layer is shifted by one token (its
layers, and so the KV it pushes, are the decode engine's): every token it samples differs from
the one the decode engine computes from the same KV. The client was already sent the prefill
leg's token, so the router must continue from it: the client's answer is that token followed
by what the decode engine generates after it, never the decode leg's own first token.
"""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from kvpush_dev import prom
from kvpush_dev import vllm_env as ve
from kvpush_dev.pd_stack import PDStack, first_token_leg
from kvpush_dev.tiny_model import prompt_ids as ids

pytestmark = pytest.mark.e2e

SHIFT = """
import sys
from safetensors.torch import load_file, save_file
path = sys.argv[1]
t = load_file(path)
t["lm_head.weight"] = t["lm_head.weight"].roll(1, 0).contiguous()
save_file(t, path, metadata={"format": "pt"})
"""


def shifted(model: Path, out: Path) -> Path:
    """``model`` with its output layer's rows rolled by one: same KV, other tokens."""
    shutil.copytree(model, out)
    subprocess.run([ve.vllm_python(), "-c", SHIFT, str(out / "model.safetensors")], check=True, timeout=120)
    return out


def streamed(url: str, b: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """A streamed completion's text and its usage event."""
    req = urllib.request.Request(url, json.dumps({**b, "stream": True,
                                                  "stream_options": {"include_usage": True}}).encode(),
                                 {"content-type": "application/json"})
    text, usage = [], {}
    with urllib.request.urlopen(req, timeout=300) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            obj = json.loads(line[5:])
            assert "error" not in obj, obj
            text += [c["text"] for c in obj["choices"]]
            usage = obj.get("usage") or usage
    return "".join(text), usage


def test_a_decode_leg_that_disagrees_with_the_sent_token_is_continued_from_it(tiny_model: Path,
                                                                               tmp_path: Path) -> None:
    stack = PDStack(tiny_model, tmp_path / "pd", p_model=shifted(tiny_model, tmp_path / "shifted"),
                    keys_dir=tmp_path)
    stack.start()
    try:
        def mismatches() -> float:
            return prom.total(prom.scrape(f"{stack.router_url}/metrics"),
                              "kvpush_router_first_token_mismatches_total") or 0.0

        for n, max_tokens in ((300, 6), (40, 1)):
            prompt = ids(n, 900 + n)
            b = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
            first = ve.post_json(f"{stack.p_url}/v1/completions", {**b, "max_tokens": 1, "return_token_ids": True})
            t1, t1_text = first["choices"][0]["token_ids"], first["choices"][0]["text"]
            own1 = ve.post_json(f"{stack.d_url}/v1/completions", {**b, "max_tokens": 1})["choices"][0]["text"]
            assert own1 != t1_text  # the decode engine would have started otherwise
            own = ve.post_json(f"{stack.d_url}/v1/completions", b)["choices"][0]["text"]  # its whole answer
            rest = "" if max_tokens == 1 else ve.post_json(
                f"{stack.d_url}/v1/completions", {**b, "prompt": prompt + t1, "max_tokens": max_tokens - 1},
            )["choices"][0]["text"]
            # Which leg reaches the router first is a race (first_token_leg): a try where the
            # decode leg was first gets the decode engine's own answer (rightly, no mismatch).
            # Try until the prefill leg's token went out first; every try's answer is checked.
            for _ in range(3):
                before = mismatches()
                leg, (got, usage) = first_token_leg(
                    stack.router_url, functools.partial(streamed, f"{stack.router_url}/v1/completions", b))
                assert usage["prompt_tokens"] == n and usage["completion_tokens"] == max_tokens, usage
                if leg == "decode":
                    assert got == own and mismatches() == before
                    continue
                assert got == t1_text + rest
                deadline = time.monotonic() + 5
                while mismatches() != before + 1 and time.monotonic() < deadline:
                    time.sleep(0.1)
                assert mismatches() == before + 1
                break
            else:
                raise AssertionError("the prefill leg's token never went out first in 3 tries")
    finally:
        stack.stop()
