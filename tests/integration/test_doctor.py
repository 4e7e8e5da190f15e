"""``kvpushctl doctor`` against real daemons: each of five planted faults is found and its fix
named; a healthy node passes.

Three "nodes" on loopback addresses, each with its own key pair: A (127.0.0.1, where doctor
runs), B (127.0.0.2, allowlists A) and C (127.0.0.3, in A's allowlist but not allowing A). All
peer ports are A's base_port, as on a fleet with one config (each node its own address).
"""

from __future__ import annotations

import io
import json
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpush.daemon.ops.ctl import main as ctl_main
from kvpush.daemon.trust.peerauth import keygen
from kvpush_dev.daemon_harness import Daemon, Engine, device_config
from kvpush_dev.kvref import make

pytestmark = pytest.mark.integration

HOSTS = {"a": "127.0.0.1", "b": "127.0.0.2", "c": "127.0.0.3"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Fleet:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = _free_port()
        self.keys: dict[str, tuple[Path, Path]] = {}  # node -> (secret, authorized dir)
        for n, host in HOSTS.items():
            pub, sec = keygen(root / n / "keys", f"node{n}", [host])
            (root / n / "authorized").mkdir(mode=0o700)
            self.keys[n] = (sec, root / n / "authorized")
        self.allow("a", "a", "b", "c")
        self.allow("b", "b", "a")
        self.allow("c", "c")  # C does not allowlist A
        self.daemons: dict[str, Daemon] = {}

    def allow(self, node: str, *others: str) -> None:
        for o in others:
            pub = self.keys[o][0].with_suffix(".key")
            (self.keys[node][1] / pub.name).write_bytes(pub.read_bytes())

    def run(self, node: str) -> Daemon:
        sec, auth = self.keys[node]
        rt = self.root / node / "run"
        rt.mkdir(mode=0o700, exist_ok=True)
        d = Daemon(device_config(rt, 0, peer_host=HOSTS[node], peer_port=self.port,
                                 curve_secret_key_file=str(sec), authorized_keys_dir=str(auth)))
        self.daemons[node] = d
        return d

    def config(self, **over: str) -> Path:
        sec, auth = self.keys["a"]
        keys = {"curve_secret_key_file": str(sec), "authorized_keys_dir": str(auth), **over}
        path = self.root / "a.toml"
        path.write_text(f'devices = ["cpu0"]\nruntime_dir = "{self.root / "a" / "run"}"\n'
                        f"base_port = {self.port}\nmetrics_port = 0\n"
                        + "".join(f'{k} = "{v}"\n' for k, v in keys.items()))
        return path

    def doctor(self, *args: str, config: Path | None = None) -> tuple[int, str]:
        out, err = io.StringIO(), io.StringIO()
        code = ctl_main(["--config", str(config or self.config()), "doctor", *args], out=out, err=err)
        return code, out.getvalue() + err.getvalue()

    def stop(self) -> None:
        for d in self.daemons.values():
            d.stop()


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    root = Path(tempfile.mkdtemp(prefix="kvdoc-", dir="/tmp"))  # ipc paths <= 107 bytes
    f = Fleet(root)
    try:
        f.run("b")
        f.run("c")
        yield f
    finally:
        f.stop()
        shutil.rmtree(root, ignore_errors=True)


def lines(text: str, check: str) -> list[str]:
    """The finding line of ``check`` and its fix line, if any."""
    rows = text.splitlines()
    for i, row in enumerate(rows):
        if row[6:].startswith(check):
            return rows[i:i + 2] if i + 1 < len(rows) and "fix:" in rows[i + 1] else rows[i:i + 1]
    raise AssertionError(f"no {check!r} finding in:\n{text}")


def test_fault_daemon_down(fleet: Fleet) -> None:
    code, text = fleet.doctor("--peer", f"tcp://{HOSTS['b']}:{fleet.port}")
    assert code == 1
    row, fix = lines(text, "daemon cpu0")
    assert row.startswith("FAIL") and "down: nothing answers at" in row, text
    assert "systemctl start kvpushd" in fix


def test_fault_no_keys(fleet: Fleet) -> None:
    code, text = fleet.doctor(config=fleet.config(curve_secret_key_file=str(fleet.root / "none.key_secret")))
    assert code == 1
    row, fix = lines(text, "keys")
    assert row.startswith("FAIL") and "has no key at" in row, text
    assert "kvpushd keygen --dir" in fix


@pytest.fixture(scope="module")
def a(fleet: Fleet) -> Daemon:
    return fleet.run("a")


def test_fault_no_engine_attached(fleet: Fleet, a: Daemon) -> None:
    code, text = fleet.doctor("--peer", f"tcp://{HOSTS['b']}:{fleet.port}")
    assert code == 1
    assert lines(text, "daemon cpu0")[0].startswith("ok"), text
    row, fix = lines(text, "engine cpu0")
    assert row.startswith("FAIL") and "no engine attached" in row
    assert f'"daemon": "{a.cfg.engine_socket}"' in fix


def test_fault_wrong_socket_path(fleet: Fleet, a: Daemon) -> None:
    wrong = fleet.root / "elsewhere"
    wrong.mkdir(exist_ok=True)
    for args in (["--runtime-dir", str(wrong)], ["--socket", str(wrong / "ops-0.sock")]):
        code, text = fleet.doctor(*args, "--peer", f"tcp://{HOSTS['b']}:{fleet.port}")
        assert code == 1
        row, fix = lines(text, "daemon")
        assert row.startswith("FAIL") and "wrong socket path" in row and "down" not in row, text
        assert str(fleet.root / "a" / "run") in fix


def test_fault_peer_does_not_allowlist_this_node(fleet: Fleet, a: Daemon) -> None:
    """No --peer: every allowlisted node is probed at the base port; C refuses A's key."""
    code, text = fleet.doctor()
    assert code == 1
    assert lines(text, "peer nodeb")[0].startswith("ok"), text
    row, fix = lines(text, "peer nodec")
    assert row.startswith("FAIL") and "refused this node's key" in row, text
    assert f"copy {fleet.keys['a'][0].with_suffix('.key')} into nodec's authorized_keys_dir" in fix


def test_a_peer_this_node_does_not_allowlist(fleet: Fleet, a: Daemon) -> None:
    code, text = fleet.doctor("--peer", f"tcp://127.0.0.4:{fleet.port}")
    assert code == 1
    row, fix = lines(text, "peer tcp://127.0.0.4")
    assert "no allowlisted certificate lists host" in row and str(fleet.keys["a"][1]) in fix


def test_healthy_node_passes(fleet: Fleet, a: Daemon) -> None:
    lay, _ = make("amx", num_layers=2, num_blocks=32, block_size=16, num_heads=2, head_size=64,
                  dtype="bfloat16")
    e = Engine(a, lay, "prefill", seed=7)  # type: ignore[arg-type]
    try:
        code, text = fleet.doctor("--peer", f"tcp://{HOSTS['b']}:{fleet.port}")
        jcode, jtext = fleet.doctor("--json", "--peer", f"tcp://{HOSTS['b']}:{fleet.port}")
    finally:
        e.close()
    assert code == 0, text
    assert "doctor: all checks passed" in text
    assert lines(text, "engine cpu0")[0].startswith("ok")
    transport = lines(text, "transport cpu0")[0]
    assert "NIXL does not report which transport carried a WRITE" in transport and "backend UCX" in transport
    got = json.loads(jtext)
    assert jcode == 0 and got["ok"] is True and got["command"] == "doctor"
    assert {x["check"] for x in got["findings"]} >= {"config", "keys", "daemon cpu0", "engine cpu0",
                                                     "peer nodeb", "transport cpu0"}
