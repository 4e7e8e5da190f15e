"""scripts/gpu_check.sh's ``families`` step with shm regions: for each family (sliding window
beside full attention, Mamba2 state, gated delta net state, FlashMLA), two real kvpushd move
one request between two engines whose KV is laid out as vLLM lays it out on GPU; the decode
allocation must be what vLLM's own views say, byte for byte. On a GPU the same step runs over
CUDA IPC regions."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from kvpush_dev.gpu_check import step_families  # noqa: E402
from kvpush_dev.gpu_families import cases  # noqa: E402


def test_gpu_check_families_step_passes_on_cpu_regions():
    line = step_families("cpu")
    assert all(f"{f}:" in line for f in cases()) and line.count("bytes equal") == len(cases())
