"""kvpushd supervisor with real processes: readiness, sd_notify, /health, /metrics, restart
of one crashed child, crash-loop hold-down, SIGTERM shutdown (with a SIGKILL fallback).

The children run :func:`kvpush_dev.fake_worker.target` (a stand-in for run_device_daemon with the
same contract; in the package because spawned children import it by name);
what each one does is read from ``modes.json`` / ``<name>.hold`` files in the runtime dir.

Load-proof by construction (CI is a small, often loaded machine): every condition is waited
for with a generous bound (:data:`SLOW`) that only limits how long success may take, and no
assertion depends on how fast a child starts (spawn + imports take anything from 0.5 s to
several seconds under load).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpush.daemon.metrics import DaemonMetrics
from kvpush.daemon.node import sdnotify
from kvpush.daemon.node.supervisor import merge_metrics
from kvpush_dev.keys import lab_keys

pytestmark = pytest.mark.integration
SLOW = 60.0  # bound on waiting for a condition that needs children to start (spawn + imports)
QUICK = 20.0  # bound on waiting for what needs no new process (a signal, a notification)


# ----------------------------------------------------------------------------- harness

SUPERVISOR_MAIN = """
import json, sys
from kvpush.daemon.config import load_config
from kvpush.daemon.node.supervisor import Supervisor, configure_logging
from kvpush_dev.fake_worker import target
configure_logging("INFO")
node = load_config(None, json.loads(sys.argv[1]), {})
sys.exit(Supervisor(node, target=target).run())
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(cond: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll ``cond`` until it returns something truthy (returned); fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {value!r})")
        time.sleep(0.05)


class Node:
    """A supervisor subprocess plus the test's end of its NOTIFY_SOCKET and HTTP port."""

    def __init__(self, runtime: Path, devices: list[str], modes: dict[str, str],
                 notify_addr: str, **overrides: Any) -> None:
        self.runtime = runtime
        (runtime / "modes.json").write_text(json.dumps(modes))
        self.port = free_port()
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.notify.bind("\0" + notify_addr[1:] if notify_addr.startswith("@") else notify_addr)
        self.messages: list[str] = []
        self.pids: set[int] = set()  # every child pid seen, killed in close() if still there
        cfg = {"devices": devices, "runtime_dir": str(runtime), "metrics_port": self.port,
               "base_port": 21000, "restart_backoff_s": 0.2,
               "stop_timeout_s": 5.0, **overrides}
        self.log = open(runtime / "supervisor.log", "w+")  # noqa: SIM115
        env = {**os.environ, "NOTIFY_SOCKET": notify_addr}
        self.proc = subprocess.Popen([sys.executable, "-c", SUPERVISOR_MAIN, json.dumps(cfg)],
                                     env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()
        except (urllib.error.URLError, ConnectionError):
            return 0, ""

    def health(self) -> tuple[int, dict]:
        if self.proc.poll() is not None:
            raise AssertionError(f"supervisor exited with {self.proc.returncode}")
        code, body = self.get("/health")
        h = json.loads(body) if code else {}
        self.pids.update(d["pid"] for d in h.get("devices", {}).values() if d["pid"])
        return code, h

    def drain_notify(self, timeout: float = 0.0) -> list[str]:
        self.notify.settimeout(timeout if timeout > 0 else None)
        self.notify.setblocking(timeout > 0)
        try:
            while True:
                self.messages.append(self.notify.recv(4096).decode())
                self.notify.setblocking(False)
        except (BlockingIOError, TimeoutError):
            pass
        return self.messages

    def wait_notify(self, line: str, timeout: float) -> None:
        wait_for(lambda: any(line in m.splitlines() for m in self.drain_notify(0.1)), timeout,
                 f"{line!r} on NOTIFY_SOCKET (got {self.messages})")

    def stop(self, timeout: float) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def close(self) -> None:
        """Leave nothing behind, even after a failed test (a stubborn child ignores the
        SIGTERM its parent's death sends it)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pid in self.pids:
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)
        self.notify.close()
        self.log.seek(0)
        sys.stderr.write(self.log.read()[-4000:])
        self.log.close()


@pytest.fixture
def runtime() -> Iterator[Path]:
    # short path: ipc socket paths must fit in 107 bytes
    path = Path(tempfile.mkdtemp(prefix="kvp-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


# ----------------------------------------------------------------------------- tests

def test_ready_health_restart_one_child_and_sigterm(runtime: Path) -> None:
    (runtime / "cpu1.hold").touch()
    node = Node(runtime, ["cpu0", "cpu1"], {}, f"@kvpush-test-{uuid.uuid4().hex}")
    try:
        # cpu0 up, cpu1 held: 503, and no READY=1 yet
        code, h = wait_for(lambda: (r := node.health())[0] == 503
                           and r[1]["devices"]["cpu0"]["up"] and r, SLOW, "cpu0 up")
        assert h["devices"]["cpu1"]["state"] == "starting" and not h["ready"]
        time.sleep(0.3)
        assert not any("READY=1" in m for m in node.drain_notify())
        # release cpu1: 200 and READY=1
        (runtime / "cpu1.hold").unlink()
        code, h = wait_for(lambda: (r := node.health())[0] == 200 and r, SLOW, "health 200")
        assert h["ready"] and all(d["up"] for d in h["devices"].values())
        node.wait_notify("READY=1", QUICK)
        pids = {n: d["pid"] for n, d in h["devices"].items()}
        # SIGKILL cpu1: it alone comes back with a new pid
        os.kill(pids["cpu1"], signal.SIGKILL)
        code, h = wait_for(lambda: (r := node.health())[0] == 200
                           and r[1]["devices"]["cpu1"]["restarts"] == 1 and r, SLOW, "cpu1 restart")
        assert h["devices"]["cpu1"]["pid"] not in (None, pids["cpu1"])
        assert h["devices"]["cpu1"]["last_exit"] == -signal.SIGKILL
        assert h["devices"]["cpu0"]["pid"] == pids["cpu0"]
        assert h["devices"]["cpu0"]["restarts"] == 0
        assert gone(pids["cpu1"]) and not gone(pids["cpu0"])
        code, text = node.get("/metrics")
        assert code == 200
        assert 'kvpush_child_restarts_total{device="cpu1"} 1.0' in text
        assert 'kvpush_child_restarts_total{device="cpu0"} 0.0' in text
        assert 'kvpush_child_up{device="cpu0"} 1.0' in text
        assert "kvpush_ready 1.0" in text
        assert {f.name for f in text_string_to_metric_families(text)} >= {
            "kvpush_child_up", "kvpush_child_restarts", "kvpush_child_rss_bytes"}
        assert node.get("/nope")[0] == 404
        # SIGTERM: STOPPING=1, children gone, exit 0
        live = [d["pid"] for d in h["devices"].values()]
        assert node.stop(timeout=SLOW) == 0
        node.wait_notify("STOPPING=1", QUICK)
        assert all(gone(pid) for pid in live)
    finally:
        node.close()


def test_crash_loop_is_held_down_and_stubborn_child_is_killed(runtime: Path) -> None:
    notify_path = str(runtime / "notify.sock")
    node = Node(runtime, ["cpu0", "cpu1"], {"cpu0": "crash", "cpu1": "stubborn"}, notify_path,
                restart_backoff_s=0.1, max_restarts_per_minute=2, stop_timeout_s=1.0)
    try:
        code, h = wait_for(lambda: (r := node.health())[1].get("devices", {}).get("cpu1", {})
                           .get("up") and r, SLOW, "cpu1 up")
        stubborn = h["devices"]["cpu1"]["pid"]
        code, h = wait_for(lambda: (r := node.health())[1]["devices"]["cpu0"]["state"]
                           == "crash-loop" and r, SLOW, "cpu0 crash-loop")
        assert code == 503 and not h["ready"]
        assert h["devices"]["cpu0"]["restarts"] == 2 and h["devices"]["cpu0"]["last_exit"] == 3
        time.sleep(0.5)  # held down: no third restart within the minute
        code, h = node.health()
        assert h["devices"]["cpu0"]["restarts"] == 2
        assert h["devices"]["cpu1"]["pid"] == stubborn and h["devices"]["cpu1"]["restarts"] == 0
        node.wait_notify("STATUS=1/2 devices up (cpu0 crash-loop)", QUICK)
        assert not any("READY=1" in m for m in node.messages)
        t0 = time.monotonic()
        assert node.stop(timeout=SLOW) == 0
        assert time.monotonic() - t0 >= 0.9  # waited stop_timeout_s, then SIGKILL
        assert gone(stubborn)
    finally:
        node.close()


def test_child_never_ready_is_killed_and_children_die_with_supervisor(runtime: Path) -> None:
    """cpu0 never gets ready: killed after ready_timeout_s, again and again. cpu1 gets ready
    and, once up, is never touched by its sibling's kills. Killing the supervisor outright
    takes every child with it (PR_SET_PDEATHSIG).

    Nothing here races the clock: how long cpu1 takes to start does not matter (should a
    start under heavy load exceed the timeout, that attempt is killed and the next one gets
    the full timeout again); what is checked about cpu1 is measured from when it is up."""
    node = Node(runtime, ["cpu0", "cpu1"], {"cpu0": "hang"}, str(runtime / "notify.sock"),
                restart_backoff_s=0.1, ready_timeout_s=3.0, max_restarts_per_minute=60)
    try:
        code, h = wait_for(lambda: (r := node.health())[1].get("devices", {}).get("cpu0", {})
                           .get("restarts", 0) >= 1 and r, SLOW, "cpu0 killed for not getting ready")
        assert code == 503 and h["devices"]["cpu0"]["last_exit"] == -signal.SIGKILL
        # cpu1 up; then cpu0 killed once more while cpu1 is up: cpu1 is left alone
        h = wait_for(lambda: (r := node.health()[1])["devices"]["cpu1"]["up"] and r, SLOW,
                     "cpu1 up")
        cpu1, kills = h["devices"]["cpu1"], h["devices"]["cpu0"]["restarts"]
        code, h = wait_for(lambda: (r := node.health())[1]["devices"]["cpu0"]["restarts"]
                           > kills and r, SLOW, "cpu0 killed again")
        assert code == 503 and h["devices"]["cpu0"]["last_exit"] == -signal.SIGKILL
        now1 = h["devices"]["cpu1"]
        assert now1["up"] and (now1["pid"], now1["restarts"]) == (cpu1["pid"], cpu1["restarts"])
        assert not any("READY=1" in m for m in node.drain_notify())
        # a supervisor killed outright takes its children with it (PR_SET_PDEATHSIG)
        children = [d["pid"] for d in node.health()[1]["devices"].values() if d["pid"]]
        assert cpu1["pid"] in children
        node.proc.kill()
        node.proc.wait(QUICK)
        wait_for(lambda: all(gone(pid) for pid in children), QUICK,
                 f"orphaned children {children} to exit")
    finally:
        node.close()


def test_metrics_merges_children_over_ops(runtime: Path) -> None:
    pytest.importorskip("kvpush.proto.codec")
    node = Node(runtime, ["cpu0", "cpu1"], {"cpu0": "ops", "cpu1": "ops"},
                str(runtime / "notify.sock"))
    try:
        wait_for(lambda: node.health()[0] == 200, SLOW, "health 200")
        # One scrape gives each child SCRAPE_TIMEOUT_S; a loaded child may miss one: wait for
        # a scrape that got both (a child that never answers still fails the test).
        text = wait_for(lambda: scraped(node.get("/metrics")[1], ["cpu0", "cpu1"]), SLOW,
                        "a /metrics scrape that reached both children")
        assert 'kvpush_written_bytes_total{device="cpu0"} 4096.0' in text
        assert 'kvpush_written_bytes_total{device="cpu1"} 8192.0' in text
        assert 'kvpush_child_metrics_ok{device="cpu1"} 1.0' in text
        assert text.count("# TYPE kvpush_written_bytes_total counter") == 1
        assert node.stop(timeout=SLOW) == 0
    finally:
        node.close()


def scraped(text: str, devices: list[str]) -> str:
    """``text`` if this /metrics scrape got every device's own metrics, else ""."""
    ok = all(f'kvpush_child_metrics_ok{{device="{d}"}} 1.0' in text for d in devices)
    return text if ok else ""


def test_merge_metrics_groups_families_by_name() -> None:
    texts = []
    for i, dev in enumerate(["cuda0", "cuda1"]):
        m = DaemonMetrics(dev)
        m.write_done(100 * (i + 1), 0.002)
        m.timeout("register")
        m.set_pending("prefill", "waiting_register", i)
        texts.append(m.render())
    merged = merge_metrics([], texts)
    fams = {f.name: f for f in text_string_to_metric_families(merged)}
    assert merged.count("# TYPE kvpush_write_latency_seconds histogram") == 1
    assert {s.labels["device"] for s in fams["kvpush_written_bytes"].samples} == {"cuda0", "cuda1"}
    buckets = [s for s in fams["kvpush_write_latency_seconds"].samples
               if s.name.endswith("_bucket") and s.labels["device"] == "cuda1"]
    assert buckets[0].labels["le"] == "0.0001" and buckets[-1].labels["le"] == "+Inf"
    assert len(buckets) == 17 and buckets[-1].value == 1.0
    assert {(s.labels["device"], s.value) for s in fams["kvpush_timeouts"].samples} == {
        ("cuda0", 1.0), ("cuda1", 1.0)}


@pytest.mark.parametrize("abstract", [True, False])
def test_sdnotify_sends_one_datagram(tmp_path: Path, abstract: bool) -> None:
    addr = f"@kvpush-sd-{uuid.uuid4().hex}" if abstract else str(tmp_path / "n.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + addr[1:] if abstract else addr)
        sock.settimeout(2)
        assert sdnotify.notify("READY=1\nSTATUS=ok", {"NOTIFY_SOCKET": addr})
        assert sock.recv(4096) == b"READY=1\nSTATUS=ok"
    assert not sdnotify.notify("READY=1", {})
    assert not sdnotify.notify("READY=1", {"NOTIFY_SOCKET": str(tmp_path / "absent.sock")})
    assert sdnotify.watchdog_interval_s({"WATCHDOG_USEC": "2000000"}) == 1.0
    assert sdnotify.watchdog_interval_s({"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": "1"}) is None


# ----------------------------------------------------------------------------- real workers

def _run_kvpushd(args: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "kvpush.daemon.node.cli", *args],
                            env={**os.environ, **env}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)


def test_kvpushd_runs_real_workers(runtime: Path) -> None:
    """`kvpushd` end to end with the default target (kvpush.daemon.device_daemon.run_device_daemon)."""
    port = free_port()
    proc = _run_kvpushd(["--devices", "cpu0", "--runtime-dir", str(runtime), "--base-port",
                         str(free_port()), "--metrics-port", str(port)], lab_keys(runtime).env())
    try:
        def health() -> int:
            assert proc.poll() is None, f"kvpushd exited with {proc.returncode}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    return r.status
            except (urllib.error.URLError, ConnectionError):
                return 0
        wait_for(lambda: health() == 200, SLOW, "kvpushd /health 200")

        def metrics() -> str:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                return r.read().decode()
        # one scrape gives the child 0.5 s; wait for one that reached it
        text = wait_for(lambda: scraped(metrics(), ["cpu0"]), SLOW,
                        "a /metrics scrape that reached cpu0")
        assert 'kvpush_transfers_in_flight{device="cpu0"} 0.0' in text
        assert (runtime / "ops-0.sock").exists()
        assert oct((runtime / "engine-0.sock").stat().st_mode & 0o777) == oct(0o600)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(SLOW) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        sys.stderr.write(proc.stderr.read().decode()[-3000:] if proc.stderr else "")


def test_kvpushd_worker_foreground_notifies_ready(runtime: Path) -> None:
    addr = f"@kvpush-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + addr[1:])
        sock.settimeout(0.2)
        proc = _run_kvpushd(["worker", "--device", "cpu1", "--runtime-dir", str(runtime),
                             "--base-port", str(free_port())], {"NOTIFY_SOCKET": addr, **lab_keys(runtime).env()})

        def recv() -> str:
            assert proc.poll() is None, f"kvpushd worker exited with {proc.returncode}"
            try:
                return sock.recv(4096).decode()
            except TimeoutError:
                return ""
        try:
            assert wait_for(recv, SLOW, "READY=1 from kvpushd worker").splitlines()[0] == "READY=1"
            assert (runtime / "engine-1.sock").exists()
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(SLOW) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
            sys.stderr.write(proc.stderr.read().decode()[-3000:] if proc.stderr else "")
