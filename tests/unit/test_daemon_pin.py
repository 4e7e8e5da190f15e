"""A device daemon with ``cpus`` set runs on those cores only (checked in a child process:
affinity is per process, and the test runner's own must not change)."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest

from kvpush.daemon.config import DeviceConfig
from kvpush.daemon.device_daemon import pin


def _affinity_after_pin(cpus: str, q: mp.Queue) -> None:
    pin(DeviceConfig(index=0, name="cpu0", cpus=cpus))
    q.put(sorted(os.sched_getaffinity(0)))


def _run(cpus: str) -> list[int]:
    ctx = mp.get_context("spawn")
    q: mp.Queue = ctx.Queue()
    p = ctx.Process(target=_affinity_after_pin, args=(cpus, q))
    p.start()
    try:
        return q.get(timeout=60)
    finally:
        p.join(10)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")
def test_pin_confines_the_daemon_to_its_cpus() -> None:
    mine = sorted(os.sched_getaffinity(0))
    one = mine[-1]
    assert _run(str(one)) == [one]
    assert _run("") == mine  # unset: inherited
