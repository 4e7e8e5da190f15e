"""The shipped systemd unit and example config, checked against the real kvpushd.

* ``systemd-analyze verify`` on the unit file exactly as shipped. verify insists that
  ExecStart's binary exists, and /opt/kvpush/venv/bin/kvpushd exists only on an installed
  node, so the check runs in a private mount namespace (``unshare --mount``, root) with a
  tmpfs on /opt holding a link to this venv's kvpushd: the unit text is untouched. Without
  that privilege it verifies a copy that differs in the ExecStart binary path alone (the
  test asserts that the copy differs in nothing else).
* ExecStart run as written (its argv, its Environment=), with only the binary mapped to this
  venv's kvpushd and the config path to a copy of the shipped example config (temp runtime
  dir, ephemeral ports), under what systemd would provide: RUNTIME_DIRECTORY, a
  NOTIFY_SOCKET the test listens on, WATCHDOG_USEC. READY=1 must arrive, WATCHDOG=1 must
  follow, kvpushctl must find the daemon through that config, and SIGTERM must end it with
  exit 0 and no socket left behind.

CI needs systemd-analyze: ``apt-get install -y --no-install-recommends systemd``.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpush.daemon.config import load_config
from kvpush_dev.keys import lab_keys

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "scripts" / "systemd" / "kvpushd.service"
EXAMPLE = ROOT / "scripts" / "systemd" / "kvpushd.toml"
BIN = Path(sys.executable).parent
KVPUSHD = BIN / "kvpushd"
INSTALLED_BIN = "/opt/kvpush/venv/bin/kvpushd"
INSTALLED_CONFIG = "/etc/kvpush/kvpushd.toml"


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """section -> key -> values, in order (systemd syntax: comments, continuations)."""
    out: dict[str, dict[str, list[str]]] = {}
    section = ""
    pending = ""
    for raw in text.splitlines():
        line = pending + raw.strip()
        pending = ""
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            out.setdefault(section, {})
            continue
        key, _, value = line.partition("=")
        out[section].setdefault(key.strip(), []).append(value.strip())
    return out


def unit() -> dict[str, dict[str, list[str]]]:
    return parse_unit(UNIT.read_text())


def one(section: str, key: str) -> str:
    values = unit()[section].get(key, [])
    assert len(values) == 1, f"{key}= in [{section}]: {values}"
    return values[0]


def exec_start() -> list[str]:
    value = one("Service", "ExecStart")
    return shlex.split(value.lstrip("-@:+!"))


def unit_environment() -> dict[str, str]:
    env: dict[str, str] = {}
    for value in unit()["Service"].get("Environment", []):
        for item in shlex.split(value):
            key, _, val = item.partition("=")
            env[key] = val
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="kvsd-", dir="/tmp"))  # ipc paths <= 107 bytes
    yield path
    shutil.rmtree(path, ignore_errors=True)


# ----------------------------------------------------------------------------- static

def test_unit_settings_and_example_config_agree() -> None:
    s = unit()["Service"]
    assert one("Service", "Type") == "notify" and one("Service", "NotifyAccess") == "main"
    assert exec_start() == [INSTALLED_BIN, "--config", INSTALLED_CONFIG]
    assert one("Service", "RuntimeDirectory") == "kvpush"
    assert one("Service", "RuntimeDirectoryMode") == "0750"
    # a restart (manual or on failure) keeps /run/kvpush: the shm ledger survives it
    assert one("Service", "RuntimeDirectoryPreserve") == "restart"
    assert one("Service", "Restart") == "on-failure"
    assert one("Service", "KillMode") == "mixed"
    assert (one("Service", "User"), one("Service", "Group")) == ("kvpush", "kvpush")
    assert one("Service", "LimitMEMLOCK") == "infinity"
    assert one("Service", "ProtectSystem") == "strict"
    assert "/run/kvpush" in one("Service", "ReadWritePaths").split()
    # options that would hide GPUs, RDMA devices or the shared /dev/shm must stay off
    for key in ("PrivateDevices", "DevicePolicy", "DeviceAllow", "PrivateIPC", "ProtectProc",
                "MemoryDenyWriteExecute", "RestrictAddressFamilies", "SystemCallFilter"):
        assert key not in s, key
    # the supervisor's SIGTERM -> SIGKILL grace must fit in systemd's stop timeout
    stop_s = int(one("Service", "TimeoutStopSec").removesuffix("s"))
    node = load_config(str(EXAMPLE), {}, {}, cuda_count=lambda: 0)
    assert node.stop_timeout_s + 5 <= stop_s
    assert int(one("Service", "TimeoutStartSec").removesuffix("s")) > node.ready_timeout_s
    # the example config is valid, and kvpushctl finds sockets where systemd puts them
    assert node.runtime_dir == "/run/" + one("Service", "RuntimeDirectory")
    assert [d.name for d in node.devices] == ["cpu0"]
    assert node.devices[0].socket_mode == 0o660  # group kvpush: engines and operators
    assert node.devices[0].ops_socket == "ipc:///run/kvpush/ops-0.sock"
    assert [d.name for d in load_config(str(EXAMPLE), {}, {}, cuda_count=lambda: 2).devices] \
        == ["cuda0", "cuda1"]


def test_example_config_names_only_schema_keys(tmp_path: Path) -> None:
    """Every key the example shows, commented out or not, is one kvpushd reads: uncommented
    (CURVE paths pointed at real files), the example still loads."""
    from kvpush.daemon.config import TABLE_KEYS, TOP_KEYS

    (tmp_path / "keys").mkdir()
    (tmp_path / "node.key_secret").write_text("secret")
    lines = []
    for line in EXAMPLE.read_text().splitlines():
        m = re.match(r"^#\s?((\[device\.\w+\])|([a-z_]+) = .*)$", line)
        if m:
            line = m.group(1)
            name = m.group(3)
            assert name is None or name in TOP_KEYS or name in TABLE_KEYS, name
        lines.append(line.replace("/etc/kvpush/authorized_keys", str(tmp_path / "keys"))
                     .replace("/etc/kvpush/node.key_secret", str(tmp_path / "node.key_secret")))
    text = "\n".join(lines) + "\n"
    assert "advertise_host" in text and "lease_s = 30.0" in text and "[device.cuda1]" in text
    conf = tmp_path / "all.toml"
    conf.write_text(text)
    node = load_config(str(conf), {}, {}, cuda_count=lambda: 2)
    assert node.devices[1].peer_port == 17601 and node.devices[0].authorized_keys_dir


def _analyze() -> str:
    exe = shutil.which("systemd-analyze")
    if exe is None:
        pytest.skip("systemd-analyze is not installed (CI: apt-get install -y "
                    "--no-install-recommends systemd)")
    return exe


def _verify(exe: str, path: Path, setup: str = "") -> subprocess.CompletedProcess[str]:
    """``systemd-analyze verify``; with ``setup``, inside a private mount namespace after
    running that shell snippet there."""
    cmd = [exe, "verify", "--man=no", str(path)]
    if setup:
        cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
               f'{setup} && exec "$@"', "sh", *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def _complaints(r: subprocess.CompletedProcess[str], name: str) -> list[str]:
    """Lines about this unit (verify may also grumble about unrelated units of the host)."""
    return [ln for ln in (r.stdout + r.stderr).splitlines() if name in ln]


def _can_unshare() -> bool:
    if shutil.which("unshare") is None:
        return False
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"],
                       capture_output=True, timeout=30)
    return r.returncode == 0


def test_systemd_analyze_verify(short_tmp: Path) -> None:
    exe = _analyze()
    if os.path.exists(INSTALLED_BIN):  # an installed node: verify in place
        r = _verify(exe, UNIT)
    elif _can_unshare():  # the unit as shipped, with /opt/kvpush provided in a namespace
        r = _verify(exe, UNIT, setup=(
            f"mount -t tmpfs -o mode=0755 kvpush-test /opt && "
            f"mkdir -p {os.path.dirname(INSTALLED_BIN)} && "
            f"ln -s {shlex.quote(str(KVPUSHD))} {INSTALLED_BIN}"))
    else:  # no mount namespace: a copy that differs in the binary path alone
        copy = short_tmp / UNIT.name
        copy.write_text(UNIT.read_text().replace(f"ExecStart={INSTALLED_BIN} ",
                                                 f"ExecStart={KVPUSHD} "))
        diff = [(a, b) for a, b in zip(UNIT.read_text().splitlines(),
                                       copy.read_text().splitlines(), strict=True) if a != b]
        assert diff == [(f"ExecStart={INSTALLED_BIN} --config {INSTALLED_CONFIG}",
                         f"ExecStart={KVPUSHD} --config {INSTALLED_CONFIG}")]
        r = _verify(exe, copy)
    assert r.returncode == 0 and not _complaints(r, "kvpushd"), r.stdout + r.stderr
    # the check can fail: a misspelt option or a missing binary is reported for this unit
    bad = short_tmp / "kvpushd-bad.service"
    bad.write_text(UNIT.read_text().replace("KillMode=mixed", "KillMode=mixxed"))
    r = _verify(exe, bad)
    assert _complaints(r, "kvpushd-bad"), r.stdout + r.stderr


def test_install_script_is_valid_shell() -> None:
    script = ROOT / "scripts" / "install_systemd.sh"
    assert os.access(script, os.X_OK)
    subprocess.run(["bash", "-n", str(script)], check=True, timeout=30)
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (apt-get install -y shellcheck)")
    r = subprocess.run(["shellcheck", str(script)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout


# ----------------------------------------------------------------------------- ExecStart

def _example_config(tmp: Path, run_dir: Path, metrics_port: int) -> Path:
    """The shipped example with only devices, runtime_dir and ports changed."""
    text = EXAMPLE.read_text()
    for key, value in (("devices", '["cpu0"]'), ("runtime_dir", json.dumps(str(run_dir))),
                       ("base_port", "0"), ("metrics_port", str(metrics_port))):
        text, n = re.subn(rf"^{key} = .*$", f"{key} = {value}", text, flags=re.M)
        assert n == 1, f"{key} not set exactly once in {EXAMPLE}"
    path = tmp / "kvpushd.toml"
    path.write_text(text)
    return path


def test_execstart_as_written_notifies_ready_and_stops_clean(short_tmp: Path) -> None:
    argv = exec_start()
    assert argv[0] == INSTALLED_BIN and argv.count(INSTALLED_CONFIG) == 1
    run_dir = short_tmp / "run"
    run_dir.mkdir(mode=0o750)  # what RuntimeDirectory=kvpush + RuntimeDirectoryMode=0750 do
    port = free_port()
    config = _example_config(short_tmp, run_dir, port)
    argv = [str(KVPUSHD) if a == INSTALLED_BIN else str(config) if a == INSTALLED_CONFIG else a
            for a in argv]
    notify_addr = f"@kvpush-sd-{uuid.uuid4().hex}"
    # systemd's environment: a clean one, the unit's Environment=, and what it adds itself
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": str(short_tmp),
           **unit_environment(), "RUNTIME_DIRECTORY": str(run_dir),
           "NOTIFY_SOCKET": notify_addr, "WATCHDOG_USEC": "2000000",
           **lab_keys(short_tmp).env()}  # what the install script's keygen provides
    log = open(short_tmp / "kvpushd.log", "w+")  # noqa: SIM115
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as nsock:
        nsock.bind("\0" + notify_addr[1:])
        nsock.settimeout(0.5)
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        messages: list[str] = []

        def wait_line(line: str, timeout: float) -> None:
            deadline = time.monotonic() + timeout
            while not any(line in m.splitlines() for m in messages):
                assert proc.poll() is None, f"kvpushd exited with {proc.returncode}"
                assert time.monotonic() < deadline, f"no {line!r} in {messages}"
                try:
                    messages.append(nsock.recv(4096).decode())
                except TimeoutError:
                    pass

        try:
            wait_line("READY=1", 90)
            ready = next(m for m in messages if "READY=1" in m.splitlines())
            assert "STATUS=1/1 devices up" in ready
            sockets = {p.name for p in run_dir.glob("*.sock")}
            assert sockets == {"engine-0.sock", "ops-0.sock"}
            assert (run_dir / "engine-0.sock").stat().st_mode & 0o777 == 0o660
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                assert r.status == 200 and json.loads(r.read())["ready"]
            wait_line("WATCHDOG=1", 5)  # WatchdogSec= is honoured
            # kvpushctl finds the daemon through the same config, restarts via /health
            r = subprocess.run([str(BIN / "kvpushctl"), "--config", str(config), "status",
                                "--json"], capture_output=True, text=True, timeout=30)
            assert r.returncode == 0, r.stderr
            [d] = json.loads(r.stdout)["daemons"]
            assert d["device"] == "cpu0" and d["ok"]
            assert d["data"]["supervisor"] == {"state": "up", "up": True, "restarts": 0,
                                               "last_exit": None}
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(30) == 0
            messages += _drain(nsock)
            assert any("STOPPING=1" in m.splitlines() for m in messages)
            assert not list(run_dir.glob("*.sock")), "sockets left behind after SIGTERM"
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.seek(0)
            sys.stderr.write(log.read()[-4000:])
            log.close()


def _drain(sock: socket.socket) -> list[str]:
    out = []
    sock.settimeout(0.2)
    try:
        while True:
            out.append(sock.recv(4096).decode())
    except TimeoutError:
        pass
    return out


def test_example_config_is_what_kvpushd_runs() -> None:
    """print-config of the example (no GPU): the values the comments promise."""
    r = subprocess.run([str(KVPUSHD), "--config", str(EXAMPLE), "print-config", "--format", "json"], capture_output=True, text=True,
                       timeout=60, env={**os.environ, "KVPUSH_DEVICES": "cpu0"})
    assert r.returncode == 0, r.stderr
    node = json.loads(r.stdout)
    assert node["runtime_dir"] == "/run/kvpush" and node["metrics_port"] == 9470
    [dev] = node["devices"]
    assert dev["peer_port"] == 17500 and dev["socket_mode"] == 0o660


ROUTER_UNIT = ROOT / "scripts" / "systemd" / "kvpush-router.service"
ROUTER_BIN = "/opt/kvpush/venv/bin/kvpush-router"


def test_router_unit_verifies_and_its_example_config_loads(short_tmp: Path) -> None:
    from kvpush.router.router_config import load as load_router

    cfg = load_router(str(ROOT / "scripts" / "systemd" / "router.toml"))
    assert cfg.prefill[0].kv_endpoints == ["tcp://10.0.0.5:17500"] and cfg.shutdown_grace_s == 30
    text = ROUTER_UNIT.read_text()
    assert f"ExecStart={ROUTER_BIN} --config /etc/kvpush/router.toml" in text
    # its own user: none of the daemons' group (sockets, keys, shared memory)
    users = dict(re.findall(r"^(User|Group|DynamicUser)=(\S+)$", text, re.M))
    assert users == {"User": "kvpush-router", "Group": "kvpush-router", "DynamicUser": "yes"}
    assert "kvpush" not in re.findall(r"^SupplementaryGroups=(.*)$", text, re.M)
    # systemd waits longer than the router's own grace before SIGKILL
    stop = int(re.search(r"^TimeoutStopSec=(\d+)s$", text, re.M).group(1))  # type: ignore[union-attr]
    assert stop > cfg.shutdown_grace_s
    exe = _analyze()
    if not _can_unshare():
        pytest.skip("no mount namespace to provide /opt/kvpush for verify")
    r = _verify(exe, ROUTER_UNIT, setup=(
        f"mount -t tmpfs -o mode=0755 kvpush-test /opt && mkdir -p {os.path.dirname(ROUTER_BIN)} && "
        f"ln -s {shlex.quote(str(BIN / 'kvpush-router'))} {ROUTER_BIN}"))
    assert r.returncode == 0 and not _complaints(r, "kvpush-router"), r.stdout + r.stderr
