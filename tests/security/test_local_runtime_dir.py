"""The runtime directory (engine and ops sockets, the shm ledger) is private to the daemon's
user: created 0700 (0750 with group-shared sockets) and refused, with a clear error, when
another user created it first or anyone else may write it. Real kvpushd processes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpush.proto import naming
from kvpush_dev.daemon_harness import Daemon, device_config

pytestmark = pytest.mark.integration

KVPUSHD = Path(sys.executable).with_name("kvpushd")


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="kvsec-", dir="/tmp"))  # ipc paths <= 107 bytes
    yield path
    shutil.rmtree(path, ignore_errors=True)


def kvpushd(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KVPUSH_INSECURE_PEERS": "true"}
    return subprocess.run([str(KVPUSHD), *args, "--metrics-port", "0", "--base-port", "0"],
                          capture_output=True, text=True, timeout=90, env=env)


def squat(path: Path) -> str:
    """What another local user does first: mkdir the well-known directory, mode 0777."""
    path.mkdir()
    path.chmod(0o777)
    if os.geteuid() == 0:
        os.chown(path, 65534, 65534)
        return "owned by uid 65534"
    return "group/world-writable"


@pytest.mark.parametrize("cmd", [["worker", "--device", "cpu0"], ["--devices", "cpu0"]],
                         ids=["worker", "supervisor"])
def test_hostile_runtime_dir_refused(short_tmp: Path, cmd: list[str]) -> None:
    run = short_tmp / "run"
    why = squat(run)
    r = kvpushd(*cmd, "--runtime-dir", str(run))
    assert r.returncode != 0, r.stderr
    assert f"runtime directory {run}" in r.stderr and why in r.stderr, r.stderr
    assert list(run.iterdir()) == []  # no socket, no ledger was made in it


def test_world_readable_dir_refused_even_if_ours(short_tmp: Path) -> None:
    run = short_tmp / "run"
    run.mkdir(mode=0o755)
    run.chmod(0o755)
    r = kvpushd("worker", "--device", "cpu0", "--runtime-dir", str(run))
    assert r.returncode != 0 and "mode 0o755" in r.stderr, r.stderr


@pytest.mark.parametrize("socket_mode, want", [(0o600, 0o700), (0o660, 0o750)])
def test_daemon_creates_private_dir(short_tmp: Path, socket_mode: int, want: int) -> None:
    run = short_tmp / "run"
    cfg = device_config(short_tmp, 0, runtime_dir=str(run), engine_socket=naming.engine_socket(str(run), 0),
                        ops_socket=naming.ops_socket(str(run), 0), socket_mode=socket_mode)
    old = os.umask(0o022)
    try:
        d = Daemon(cfg)
    finally:
        os.umask(old)
    try:
        st = run.stat()
        assert st.st_mode & 0o777 == want and st.st_uid == os.geteuid()
        assert os.stat(naming.engine_socket(str(run), 0).removeprefix("ipc://")).st_mode & 0o777 == socket_mode
    finally:
        d.stop()
