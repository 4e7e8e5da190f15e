"""The engine side trusts only a daemon of a trusted user (issue 28, item 7).

Findings reproduced, each against the real plugin client (``DaemonClient``) or card reader
(``DaemonCards``) and a hostile listener in a process of another uid (65534, made with
``setuid``; these tests need root and skip without it):

* a socket directory another uid made first (0777, then owned by it), with that uid's listener
  in it: the engine never connects (zero bytes reach the listener), and counts the daemon as
  unavailable;
* a listener of another uid behind a socket file and directory that look right (bound by root,
  listening after setuid): ``SO_PEERCRED`` refuses it, before the Attach goes out;
* a card another uid planted, or a group-writable one: not read;
* a FIFO where the card should be: refused at once instead of blocking vLLM's scheduler.

A real daemon of our own uid is still reached (control), and ``daemon_user`` admits a daemon
of the configured uid.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpush import proto
from kvpush.engine_plugin.config import PluginConfig
from kvpush.engine_plugin.link.client import DaemonClient
from kvpush.engine_plugin.scheduler.cards import DaemonCards
from kvpush.proto.card import DaemonCard, write_card
from kvpush_dev.daemon_harness import Daemon, device_config
from kvpush_dev.kvref import make

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(os.geteuid() != 0, reason="another uid's listener needs root (setuid)")]

OTHER = 65534
SYSTEM_PYTHON = "/usr/bin/python3"  # stdlib only; readable by uid 65534 (the venv may not be)

# A listener that accepts for ``secs`` and prints how many connections and bytes it got.
# ``mode`` "squat": run as OTHER from the start; "setuid": bind as root, then setuid, listen.
_LISTENER = r"""
import os, socket, sys, time
path, mode, secs = sys.argv[1], sys.argv[2], float(sys.argv[3])
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind(path)
os.chmod(path, 0o666)
if mode == "setuid":
    os.setgid(65534); os.setuid(65534)
s.listen(16)
s.settimeout(0.05)
print("ready", flush=True)
conns, got, end = [], 0, time.monotonic() + secs
while time.monotonic() < end:
    try:
        c, _ = s.accept(); c.setblocking(False); conns.append(c)
    except (TimeoutError, BlockingIOError):
        pass
    for c in conns:
        try:
            got += len(c.recv(65536))
        except (BlockingIOError, OSError):
            pass
print(f"connections={len(conns)} bytes={got}", flush=True)
"""


@pytest.fixture
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="kvtrust-", dir="/tmp"))  # ipc paths <= 107 bytes
    path.chmod(0o755)  # uid 65534 must reach the directories inside
    yield path
    shutil.rmtree(path, ignore_errors=True)


def listener(path: Path, mode: str, secs: float) -> subprocess.Popen[str]:
    user = OTHER if mode == "squat" else None
    p = subprocess.Popen([SYSTEM_PYTHON, "-c", _LISTENER, str(path), mode, str(secs)], user=user,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready", p.stderr.read() if p.stderr else ""
    return p


def counts(p: subprocess.Popen[str]) -> tuple[int, int]:
    out, err = p.communicate(timeout=30)
    line = out.strip().splitlines()[-1]
    c, b = (int(kv.split("=")[1]) for kv in line.split())
    return c, b


def layout():
    return make("amx", num_layers=2, num_blocks=8, block_size=16, num_heads=2, head_size=64, dtype="bfloat16")[0]


def try_attach(client: DaemonClient, secs: float) -> None:
    client.attach(proto.Attach("e", 0, 1, "decode", (), layout()))
    end = time.monotonic() + secs
    while time.monotonic() < end:
        client.poll()
        time.sleep(0.02)


def test_squatted_socket_directory_is_never_dialled(base: Path) -> None:
    """Finding: an engine attached to the listener of the uid that created its socket dir."""
    run = base / "run"
    run.mkdir()
    run.chmod(0o777)  # another user created it first...
    os.chown(run, OTHER, OTHER)  # ... and owns it
    sock = run / "engine-0.sock"
    hostile = listener(sock, "squat", 1.5)
    client = DaemonClient(f"ipc://{sock}")
    try:
        try_attach(client, 1.0)
        assert not client.attached and not client.available
        assert client.refusals > 0
    finally:
        client.close()
    assert counts(hostile) == (0, 0), "the engine connected to another uid's listener"


def test_listener_of_another_uid_refused_by_peercred(base: Path) -> None:
    """The socket and its directory look like ours (root's), but the listening process runs as
    another uid: SO_PEERCRED tells, and no frame (no Attach) is sent."""
    run = base / "run"
    run.mkdir(mode=0o755)
    sock = run / "engine-0.sock"
    hostile = listener(sock, "setuid", 1.5)
    assert sock.stat().st_uid == 0
    client = DaemonClient(f"ipc://{sock}")
    try:
        try_attach(client, 1.0)
        assert not client.attached and client.refusals > 0
    finally:
        client.close()
    conns, got = counts(hostile)
    assert got == 0, f"the engine sent {got} bytes to another uid's listener"


def test_daemon_user_admits_the_configured_uid(base: Path) -> None:
    run = base / "run"
    run.mkdir(mode=0o755)
    os.chown(run, OTHER, OTHER)
    sock = run / "engine-0.sock"
    hostile = listener(sock, "squat", 1.5)
    cfg = PluginConfig.from_extra({"daemon": f"ipc://{run}/engine-{{rank}}.sock", "daemon_user": "nobody"})
    assert OTHER in cfg.trusted_uids()
    client = DaemonClient(cfg.socket_for(0), trusted=cfg.trusted_uids())
    try:
        try_attach(client, 1.0)
        assert client.refusals == 0
    finally:
        client.close()
    conns, got = counts(hostile)
    assert conns >= 1 and got > 0  # configured: it is the daemon, the Attach went to it


def test_a_real_daemon_of_our_uid_is_reached(base: Path) -> None:
    home = base / "d"
    home.mkdir(mode=0o700)
    d = Daemon(device_config(home, 0))
    client = DaemonClient(d.cfg.engine_socket)
    try:
        try_attach(client, 2.0)
        assert client.available and client.refusals == 0
    finally:
        client.close()
        d.stop()


def _cards(run: Path) -> DaemonCards:
    return DaemonCards(PluginConfig.from_extra({"daemon": f"ipc://{run}/engine-{{rank}}.sock"}), 1)


def _card(run: Path) -> Path:
    path = run / "engine-0.sock.card"
    write_card(str(path), DaemonCard("tcp://10.9.9.9:7000", "evil"))
    return path


def test_a_card_planted_in_a_squatted_directory_is_not_read(base: Path) -> None:
    """Finding: the plugin took a card another uid planted in such a directory."""
    run = base / "run"
    run.mkdir(mode=0o777)
    run.chmod(0o777)
    os.chown(run, OTHER, OTHER)
    os.chown(_card(run), OTHER, OTHER)
    assert _cards(run).endpoints() is None
    run.chmod(0o755)  # a directory nobody else may write, but the card is another uid's
    assert _cards(run).endpoints() is None
    os.chown(run / "engine-0.sock.card", 0, 0)
    os.chown(run, 0, 0)
    assert _cards(run).endpoints() == ("tcp://10.9.9.9:7000",)  # control: ours is read


def test_a_group_writable_card_is_not_read(base: Path) -> None:
    run = base / "run"
    run.mkdir(mode=0o755)
    _card(run).chmod(0o664)
    assert _cards(run).endpoints() is None


def test_a_fifo_card_does_not_block_the_scheduler(base: Path) -> None:
    """Finding: the card reader opened a FIFO without O_NONBLOCK inside vLLM's scheduler."""
    run = base / "run"
    run.mkdir(mode=0o755)
    os.mkfifo(run / "engine-0.sock.card", 0o600)
    cards = _cards(run)
    t0 = time.monotonic()
    assert cards.endpoints() is None
    assert time.monotonic() - t0 < 0.5
    (run / "engine-0.sock.card").unlink()
    (run / "engine-0.sock.card").write_text(json.dumps({"peer_endpoint": "tcp://10.0.0.1:7000", "daemon_id": "d"}))
    (run / "engine-0.sock.card").chmod(0o600)
    assert cards.endpoints() == ("tcp://10.0.0.1:7000",)
