"""A CUDA IPC handle gets the owner check a shm handle gets (issue 28, item 5): a real daemon,
an engine client in this process sending an Attach with a ``cuda_ipc`` handle.

No CUDA here, so the test shows the check runs first, before CUDA is touched: a handle whose
torch reference-counter file is another process's export, or a file of another uid, is
refused for that reason; a handle whose counter is our own file passes it and only then fails
for want of CUDA. What the check cannot prove (the cudaIpcMemHandle bytes name no process) is
in docs/security.md. On a GPU the same Attach path runs; this task had no GPU to run it on.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpush import proto
from kvpush.engine_plugin.link.client import DaemonClient
from kvpush.proto.handles import CudaIpcInfo, cuda_handle
from kvpush_dev.daemon_harness import Daemon, device_config
from kvpush_dev.kvref import make

pytestmark = pytest.mark.integration


def layout():
    return make("amx", num_layers=2, num_blocks=8, block_size=16, num_heads=2, head_size=64, dtype="bfloat16")[0]


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    base = Path(tempfile.mkdtemp(prefix="kvcuda-", dir="/tmp"))
    d = Daemon(device_config(base, 0))
    yield d
    d.stop()
    shutil.rmtree(base, ignore_errors=True)


def attach_error(d: Daemon, counter: str) -> str:
    lay = layout()
    info = CudaIpcInfo(0, b"\x01" * 64, lay.region_size, 0, counter.encode(), 0, b"\x00" * 64, False)
    client = DaemonClient(d.cfg.engine_socket)
    try:
        client.attach(proto.Attach("forger", 0, 1, "decode", (cuda_handle(info, 0),), lay))
        end = time.monotonic() + 10
        while time.monotonic() < end:
            for m in client.poll():
                if isinstance(m, proto.Error):
                    return m.message
                if isinstance(m, proto.AttachAck):
                    return "ATTACHED"
            client.wait(0.02)
        return "NO ANSWER"
    finally:
        client.close()


@pytest.fixture
def counter_file() -> Iterator[str]:
    name = f"/torch_{os.getpid()}_4242_{time.monotonic_ns() % 10**6}"
    path = "/dev/shm" + name
    with open(path, "wb") as f:
        f.write(b"\0" * 64)
    yield name
    os.unlink(path)


def test_a_cuda_handle_naming_another_process_is_refused(daemon: Daemon) -> None:
    why = attach_error(daemon, f"/torch_{os.getppid()}_1_0")
    assert "not a torch export of process" in why, why


@pytest.mark.skipif(os.geteuid() != 0, reason="a file of another uid needs root")
def test_a_cuda_handle_whose_counter_belongs_to_another_uid_is_refused(daemon: Daemon, counter_file: str) -> None:
    os.chown("/dev/shm" + counter_file, 65534, 65534)
    why = attach_error(daemon, counter_file)
    assert "owned by uid 65534" in why, why


def test_a_symlinked_counter_is_refused(daemon: Daemon, counter_file: str) -> None:
    link = f"/torch_{os.getpid()}_4343_0"
    os.symlink("/dev/shm" + counter_file, "/dev/shm" + link)
    try:
        why = attach_error(daemon, link)
    finally:
        os.unlink("/dev/shm" + link)
    assert "reference counter" in why and "CUDA in the daemon" not in why, why


def test_our_own_counter_passes_the_owner_check(daemon: Daemon, counter_file: str) -> None:
    why = attach_error(daemon, counter_file)
    assert "needs CUDA in the daemon" in why or "cudaIpcOpenMemHandle" in why, why
