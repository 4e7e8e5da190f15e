"""Ports and process groups of the stacks the demo, the e2e tests and the benchmarks start.

Why one module: every launcher needs a port nobody else will take, a child in its own
process group (so a stop reaches all it forks), and the benchmarks need the CPU seconds of
such a group and the /dev/shm files it maps (killed engines leave them behind).
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
from pathlib import Path

import psutil

from kvpush_dev.vllm_env import child_setup

_given: set[int] = set()


def free_port(lo: int = 20000, hi: int = 32000) -> int:
    """A free port below the kernel's ephemeral range (32768+), never handed out twice.

    Engines bind their ports tens of seconds after we pick them; a port from the ephemeral
    range is by then often the source port of some other connection.
    """
    rng = random.Random()
    for _ in range(2000):
        port = rng.randrange(lo, hi)
        if port in _given:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _given.add(port)
        return port
    raise RuntimeError(f"no free port in [{lo}, {hi})")


def popen(cmd: list[str], log: Path, env: dict[str, str] | None = None,
          cpus: set[int] | None = None, nice: int = 0) -> subprocess.Popen[bytes]:
    """``cmd`` in its own process group, output to ``log``, optionally pinned to ``cpus``;
    ``nice`` is added to its niceness (inherited by its children and threads)."""
    return subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True,
                            env=env or dict(os.environ), preexec_fn=child_setup(cpus, nice))


def group_cpu_seconds(proc: subprocess.Popen[bytes] | None) -> float:
    """CPU seconds of a process and all its live descendants, plus what reaped children used."""
    if proc is None:
        return 0.0
    try:
        root = psutil.Process(proc.pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
        except psutil.NoSuchProcess:
            pass
    return total


def cpu_snapshot(groups: dict[str, subprocess.Popen[bytes]]) -> dict[str, float]:
    """Group name -> its CPU seconds so far (two snapshots make a delta)."""
    return {name: group_cpu_seconds(p) for name, p in groups.items()}


def shm_files(groups: dict[str, subprocess.Popen[bytes]]) -> set[str]:
    """/dev/shm files mapped by the groups' processes (vLLM's queues, torch's KV segments).

    Why: engines that are SIGKILLed leave them behind (hundreds of MiB each); these are
    ours to remove once the mode is stopped.
    """
    out: set[str] = set()
    for proc in groups.values():
        try:
            root = psutil.Process(proc.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        for p in procs:
            try:
                with open(f"/proc/{p.pid}/maps") as f:
                    for line in f:
                        if " /dev/shm/" in line and not line.rstrip().endswith("(deleted)"):
                            out.add(line.split(" /dev/shm/", 1)[1].strip())
            except OSError:
                pass
    return {f"/dev/shm/{name}" for name in out if "/" not in name}
