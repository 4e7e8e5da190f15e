"""Each family's GPU layout with every vLLM release kvpush claims (marker vllm_compat).

``python -m kvpush_dev.gpu_families`` in a child process per release (its Python tree first on
the path, as tests/compat/test_vllm_releases.py does): vLLM's own KV cache config builder,
allocator and ``MambaBase.bind_kv_cache`` of that release lay out each family (sliding window
beside full attention, Mamba2 state, gated delta net state, FlashMLA; with vLLM 0.34 also a
Mamba2 state whose sub-tensors FlashInfer's ReplaySSM aligns to 16 bytes), kvpush derives the
GPU engine's layout and a request moved through the daemon's plan must land where that vLLM
reads it, byte for byte (tests/unit/test_gpu_hybrid_layouts.py runs the same in-process with
the installed vLLM).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvpush.engine_plugin.compat import TESTED_VLLM
from kvpush_dev import vllm_releases

pytestmark = pytest.mark.vllm_compat
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_vllm_releases import _source  # noqa: E402


@pytest.mark.parametrize("release", TESTED_VLLM)
def test_every_family_lands_where_the_release_reads_it(release):
    try:
        tree, how = _source(release)
    except vllm_releases.FetchError as e:
        pytest.fail(f"vLLM {release} could not be had: {e}")
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_LOGGING_LEVEL="WARNING")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (tree, os.environ.get("PYTHONPATH"), str(ROOT / "dev")) if p)
    p = subprocess.run([sys.executable, "-m", "kvpush_dev.gpu_families"], env=env, cwd=str(ROOT),
                       capture_output=True, text=True, timeout=300)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"{how}: no result (rc {p.returncode}): {(p.stdout + p.stderr)[-3000:]}"
    got = json.loads(lines[-1])
    assert {"swa", "mamba", "gdn", "mla"} <= set(got), got
    bad = {k: v for k, v in got.items() if not v.startswith("ok")}
    assert not bad and p.returncode == 0, f"{how}: {bad}"
    if release.startswith("0.34"):
        assert "mamba-aligned" in got  # the release's state_alignment is exercised
