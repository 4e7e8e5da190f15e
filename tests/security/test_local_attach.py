"""One engine per rank, and only its own memory: real daemons, real ZeroMQ and NIXL, and
local clients in processes of their own (``EngineProcess``), some of them hostile.

What is asserted: a second local client cannot replace the attached engine (and the real one
keeps transferring); a restarted engine re-attaches at once; an Attach naming another
process's shm file, a symlink, a hard link, or a file of the right size owned by someone
else is refused and nothing of it is mapped; a killed engine's shm file is unlinked within
seconds; after a daemon restart the live engine re-attaches with the same file, which
survives, and nobody else can take its rank meanwhile.
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from kvpush import proto
from kvpush.engine_plugin.worker.export import export_cpu_tensor, unlink_export
from kvpush.proto.handles import shm_info
from kvpush_dev.daemon_harness import Daemon, Engine, EngineProcess, device_config
from kvpush_dev.kvref import make, reference_copy

pytestmark = pytest.mark.integration

_ids = itertools.count()


def layout():
    return make("amx", num_layers=2, num_blocks=32, block_size=16, num_heads=2, head_size=64,
                dtype="bfloat16")


@pytest.fixture(scope="module")
def tmp() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="kvsec-", dir="/tmp"))  # ipc paths <= 107 bytes
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def pd(tmp: Path) -> Iterator[list[Daemon]]:
    daemons = [Daemon(device_config(tmp, 0)), Daemon(device_config(tmp, 1))]
    yield daemons  # a test may replace daemons[1] (restart); stop whichever is current
    for d in daemons:
        d.stop()


@pytest.fixture
def lone(tmp: Path) -> Iterator[Daemon]:
    """A daemon nobody holds yet."""
    d = Daemon(device_config(tmp, 2 + next(_ids) % 50))
    yield d
    d.stop()


def attached_id(d: Daemon) -> str | None:
    return (d.ops("status").get("engine") or {}).get("engine_id")


def maps_of(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


def transfer(pe: Engine, de: Engine, p: Daemon) -> None:
    _, meta = layout()
    t, n = f"sec{os.getpid()}-{next(_ids)}", 2 * 16 + 7
    src, dst = [5, 9, 1], [20, 3, 30]
    before = de.bytes.copy()
    de.send(proto.Register(t, 0, tuple(dst), n, (p.peer_endpoint,), 1, 10_000))
    pe.send(proto.PrefillDone(t, tuple(src), n, 10_000))
    assert isinstance(de.result(t), proto.Received)
    assert isinstance(pe.result(t), proto.Sent)
    want, dont_care = reference_copy(meta, pe.layout, pe.bytes, src, meta, de.layout, before, dst, n, 0)
    assert np.array_equal(de.bytes[~dont_care], want[~dont_care])


def wait_until(pred, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, what
        time.sleep(0.05)


def test_second_client_cannot_take_the_rank(pd: list[Daemon]) -> None:
    p, d = pd
    lay, _ = layout()
    pe = Engine(p, lay, "prefill", seed=3)
    de = Engine(d, lay, "decode", fill="zeros", engine_id="real-D")
    intruder = EngineProcess(d, lay, engine_id="intruder")
    try:
        assert isinstance(intruder.reply, proto.Error) and intruder.reply.code == "attach_refused", intruder.reply
        assert "one engine per rank" in intruder.reply.message
        assert attached_id(d) == "real-D"
        assert shm_info(intruder.handle).path not in maps_of(d.proc.pid)
        transfer(pe, de, p)  # the real engine still works, and gets no not_attached
        assert not any(isinstance(m, proto.Error) for m in de.inbox)
    finally:
        intruder.stop()
        pe.close()
        de.close()


def test_restarted_engine_reattaches_promptly(lone: Daemon) -> None:
    lay, _ = layout()
    first = EngineProcess(lone, lay, engine_id="run-1")
    assert isinstance(first.reply, proto.AttachAck), first.reply
    first.kill()  # the old process is gone: its rank is free at once
    t0 = time.monotonic()
    second = EngineProcess(lone, lay, engine_id="run-2")
    try:
        assert isinstance(second.reply, proto.AttachAck), second.reply
        assert time.monotonic() - t0 < 30 and attached_id(lone) == "run-2"
    finally:
        second.stop()


@pytest.mark.parametrize("how", ["foreign", "foreign_renamed", "symlink", "hardlink", "not_owned"])
def test_memory_not_its_own_is_refused(lone: Daemon, how: str) -> None:
    if how == "not_owned" and os.geteuid() != 0:
        pytest.skip("planting a file owned by another user needs root")
    lay, _ = layout()
    victim_kv = torch.zeros(lay.region_size, dtype=torch.uint8)  # another process's KV (ours)
    victim = export_cpu_tensor(victim_kv)
    hostile = EngineProcess(lone, lay, engine_id=f"forger-{how}", how=how, victim=victim)
    try:
        assert isinstance(hostile.reply, proto.Error), hostile.reply
        assert hostile.reply.code in ("attach_refused", "attach"), hostile.reply
        assert attached_id(lone) is None
        maps = maps_of(lone.proc.pid)
        assert shm_info(victim).path not in maps
        assert not any(path in maps for path in hostile.planted)
        assert os.path.exists(shm_info(victim).path)  # and nothing of the victim was touched
    finally:
        hostile.stop()
        unlink_export(victim)


def test_killed_engine_shm_file_removed(lone: Daemon) -> None:
    lay, _ = layout()
    eng = EngineProcess(lone, lay, engine_id="doomed")
    path = shm_info(eng.handle).path
    assert isinstance(eng.reply, proto.AttachAck) and os.path.exists(path)
    eng.kill()
    wait_until(lambda: not os.path.exists(path), 5, f"{path} left behind by a killed engine")
    wait_until(lambda: attached_id(lone) is None, 5, "dead engine still attached")
    assert path not in maps_of(lone.proc.pid)  # unmapped too: the pages are free


def test_daemon_restart_engine_reattaches_with_same_file(pd: list[Daemon]) -> None:
    p, d = pd
    lay, _ = layout()
    pe = Engine(p, lay, "prefill", seed=6)
    de = Engine(d, lay, "decode", fill="zeros", engine_id="D-live")
    path = shm_info(de.handle).path
    try:
        d.kill()
        pd[1] = d = Daemon(d.cfg)  # reads the ledger: D-live's file is alive, keep it
        intruder = EngineProcess(d, lay, engine_id="squatter")
        try:
            assert isinstance(intruder.reply, proto.Error) and intruder.reply.code == "attach_refused"
        finally:
            intruder.stop()

        def back() -> bool:
            de.pump()
            return attached_id(d) == "D-live"
        wait_until(back, 20, "engine did not re-attach after the daemon restart")
        assert os.path.exists(path)
        transfer(pe, de, p)
    finally:
        pe.close()
        de.close()
