"""scripts/gpu_check.sh on a machine without a GPU: it says so and exits with its own code;
its options parse (the ``legacy``, ``vmm`` and ``families`` steps among them, the family presets
of the 1P1D runs); the ``events`` step's daemon-side process speaks its protocol (over a fake
event port: the real one needs the GPU). The ``vmm`` step's two sides run here over a fake
libcuda in tests/unit/test_cuda_vmm.py; the ``families`` step, with shm regions instead of
CUDA ones, in tests/integration/test_gpu_families_daemon.py (its layouts and plans in
tests/unit/test_gpu_hybrid_layouts.py).

(On a machine with a GPU the script is the check itself; run it there.)
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from kvpush.daemon.io.layer_gate import EventError
from kvpush_dev.gpu_check import (
    DEFAULT_PRESETS,
    EXIT_NO_GPU,
    STEPS,
    _events_child,
    main,
    parse_presets,
    parse_steps,
)

ROOT = Path(__file__).resolve().parents[2]
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: run scripts/gpu_check.sh")


@no_gpu
def test_script_without_gpu_exits_77_with_one_verdict_line():
    r = subprocess.run([str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True, text=True, timeout=120)
    assert r.returncode == EXIT_NO_GPU == 77, r.stdout + r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[-1].startswith("gpu_check: NO GPU") and "nothing was run" in lines[-1]


@no_gpu
def test_module_without_cuda_exits_77(capsys):
    """The Python half decides by torch, not by device files (a container may hide them)."""
    assert main(["--skip-vllm"]) == EXIT_NO_GPU
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].startswith("gpu_check: NO GPU") and "torch" in out[-1]


@no_gpu
def test_module_usage_error_is_distinct():
    assert main(["--no-such-flag"]) == 2
    assert subprocess.run([sys.executable, "-m", "kvpush_dev.gpu_check", "--help"],
                          capture_output=True, timeout=60).returncode == 0


def test_steps_parse_to_a_subset_in_run_order():
    """Both allocations have a step: ``legacy`` (CUDA IPC of cudaMalloc memory, what runs) and
    ``vmm`` (the POSIX-fd export of VMM memory, built and not switched on)."""
    assert tuple(STEPS) == ("legacy", "vmm", "daemon", "events", "families")
    assert parse_steps("events") == ("events",)
    assert parse_steps(" events, vmm ,legacy") == ("legacy", "vmm", "events")
    assert parse_steps("families,daemon") == ("daemon", "families")
    assert parse_steps(",".join(STEPS)) == tuple(STEPS)
    for bad in ("", ",", "event", "ipc", "legacy,nope"):
        with pytest.raises(argparse.ArgumentTypeError, match="subset of legacy,vmm,daemon,events,families"):
            parse_steps(bad)


def test_presets_are_the_tiny_model_families():
    """The 1P1D runs after the tiny model's: swa, mla and mamba by default, each a preset
    kvpush_dev.tiny_model builds; '' runs none."""
    from kvpush_dev.tiny_model import FAMILIES

    assert DEFAULT_PRESETS == ("swa", "mla", "mamba") and set(DEFAULT_PRESETS) <= set(FAMILIES)
    assert parse_presets("mamba, swa,mamba") == ("mamba", "swa") and parse_presets("") == ()
    with pytest.raises(argparse.ArgumentTypeError, match="subset of"):
        parse_presets("tiny")


@no_gpu
def test_steps_option_is_checked_before_the_gpu(capsys):
    assert main(["--steps", "nope"]) == 2
    assert "subset of legacy,vmm,daemon,events,families" in capsys.readouterr().err
    assert main(["--presets", "swa,nope"]) == 2
    assert "subset of" in capsys.readouterr().err
    assert main(["--steps", "families", "--presets", "", "--skip-vllm"]) == EXIT_NO_GPU
    assert main(["--steps", "events", "--skip-vllm"]) == EXIT_NO_GPU
    assert main(["--steps", "vmm,legacy", "--skip-vllm"]) == EXIT_NO_GPU


class _Port:
    """Events a test fires by hand (``fired``: event objects whose newest record completed)."""

    def __init__(self) -> None:
        self.fired: set[int] = set()
        self.lock = threading.Lock()

    def open(self, handle: bytes, device: int) -> int:
        if handle == b"bad":
            raise EventError("cannot open")
        return int(handle)

    def done(self, ev: int) -> bool:
        with self.lock:
            return ev in self.fired

    def close(self, ev: int) -> None:
        pass


def _child(port: _Port):
    parent, child = mp.Pipe()
    t = threading.Thread(target=_events_child, args=(child, port), daemon=True)
    t.start()
    return parent, t


def _ask(conn, cmd):
    conn.send(cmd)
    assert conn.poll(30), f"no answer to {cmd!r}"
    return conn.recv()


def test_events_child_holds_pending_items_and_lets_fired_ones_through():
    port = _Port()
    port.fired = {1, 2, 3}  # slot 0 pending, as behind the step's long kernel
    conn, t = _child(port)
    try:
        conn.send(([b"0", b"1", b"2", b"3"], 0))
        assert conn.recv() == "opened"
        assert _ask(conn, "admit") == ([2, 3, 4], 1)
        threading.Timer(0.05, lambda: port.fired.add(0)).start()
        assert _ask(conn, "wait") == ([1], 0, 0)
        port.fired = set()  # the pool re-recorded behind another kernel
        assert _ask(conn, "admit") == ([], 4)
        threading.Timer(0.05, lambda: port.fired.update(range(4))).start()
        got, waiting, dropped = _ask(conn, "wait")
        assert sorted(got) == [1, 2, 3, 4] and waiting == dropped == 0
    finally:
        conn.send("done")
        t.join(10)
    assert not t.is_alive()


def test_events_child_says_why_the_pool_did_not_open():
    conn, t = _child(_Port())
    conn.send(([b"0", b"bad"], 0))
    assert conn.poll(30)
    assert conn.recv() == "EventError: event 2 of 2: cannot open"
    t.join(10)
    assert not t.is_alive()
