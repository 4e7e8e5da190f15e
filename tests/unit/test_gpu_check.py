"""scripts/gpu_check.sh on a machine without a GPU: it says so and exits with its own code.

(On a machine with a GPU the script is the check itself; run it there.)
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvpush.testing.gpu_check import EXIT_NO_GPU, main

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: run scripts/gpu_check.sh")


def test_script_without_gpu_exits_77_with_one_verdict_line():
    r = subprocess.run([str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True, text=True, timeout=120)
    assert r.returncode == EXIT_NO_GPU == 77, r.stdout + r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[-1].startswith("gpu_check: NO GPU") and "nothing was run" in lines[-1]


def test_module_without_cuda_exits_77(capsys):
    """The Python half decides by torch, not by device files (a container may hide them)."""
    assert main(["--skip-vllm"]) == EXIT_NO_GPU
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].startswith("gpu_check: NO GPU") and "torch" in out[-1]


def test_module_usage_error_is_distinct():
    assert main(["--no-such-flag"]) == 2
    assert subprocess.run([sys.executable, "-m", "kvpush.testing.gpu_check", "--help"],
                          capture_output=True, timeout=60).returncode == 0
