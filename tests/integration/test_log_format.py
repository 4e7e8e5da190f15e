"""``--log-format json``: kvpushd (supervisor and a real device daemon) and the router write one
JSON object per line, and text stays the default."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvpush.common import logfmt
from kvpush_dev.keys import lab_keys
from kvpush_dev.procs import free_port

pytestmark = pytest.mark.integration


def test_json_formatter_one_object_per_record_even_with_newlines_and_exceptions() -> None:
    rec = logging.LogRecord("kvpush.daemon.x", logging.WARNING, __file__, 1, "two\nlines %s", ("é",), None)
    try:
        raise ValueError("boom")
    except ValueError:
        rec.exc_info = sys.exc_info()
    line = logfmt.JsonFormatter().format(rec)
    assert "\n" not in line
    obj = json.loads(line)
    assert obj["level"] == "WARNING" and obj["logger"] == "kvpush.daemon.x" and obj["msg"] == "two\nlines é"
    assert "ValueError: boom" in obj["exc"] and obj["ts"].endswith("+00:00")
    with pytest.raises(ValueError, match="text, json"):
        logfmt.formatter("xml")


@pytest.fixture
def runtime() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="kvp-", dir="/tmp"))  # short: socket paths
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _health(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:  # the router's 503 while no engine is up: it serves
        return e.code
    except OSError:
        return 0


def _run_until(cmd: list[str], port: int, done: Callable[[list[str]], bool],
               env: dict[str, str] | None = None) -> list[str]:
    """Start ``cmd``, wait for /health and for its stderr lines to satisfy ``done``, SIGTERM
    it; its stderr lines."""
    proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr or ()), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 60
        while _health(port) == 0 or not done([ln for ln in lines if ln.strip()]):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(10)
    return [ln for ln in lines if ln.strip()]


def _device_line(lines: list[str]) -> bool:
    return any('"process": "MainProcess"' not in ln and '"logger": "kvpush.daemon.' in ln for ln in lines)


@pytest.mark.parametrize("how", ["flag", "config"])
def test_kvpushd_json_lines_from_supervisor_and_device_daemon(runtime: Path, how: str) -> None:
    port = free_port()
    args = ["--devices", "cpu0", "--runtime-dir", str(runtime), "--base-port", str(free_port()),
            "--metrics-port", str(port)]
    if how == "flag":
        args += ["--log-format", "json"]
    else:
        (runtime / "kvpushd.toml").write_text('log_format = "json"\n')
        args += ["--config", str(runtime / "kvpushd.toml")]
    lines = _run_until([sys.executable, "-m", "kvpush.daemon.node.cli", *args], port, _device_line,
                       lab_keys(runtime).env())
    objs = [json.loads(ln) for ln in lines]  # every line is one JSON object
    loggers = {o["logger"] for o in objs}
    assert any(n.startswith("kvpush.daemon.") and n != "kvpush.daemon.node.supervisor" for n in loggers), loggers
    assert "kvpush.daemon.node.supervisor" in loggers, loggers
    assert {o["process"] for o in objs} >= {"MainProcess"} and len({o["pid"] for o in objs}) >= 2, objs


def test_kvpushd_text_is_the_default(runtime: Path) -> None:
    port = free_port()
    lines = _run_until([sys.executable, "-m", "kvpush.daemon.node.cli", "--devices", "cpu0", "--runtime-dir",
                        str(runtime), "--base-port", str(free_port()), "--metrics-port", str(port)],
                       port, lambda ls: any(" is up" in ln for ln in ls), lab_keys(runtime).env())
    assert lines and not any(ln.startswith("{") for ln in lines), lines


def test_router_json_lines(tmp_path: Path) -> None:
    port = free_port()
    cmd = [sys.executable, "-m", "kvpush.router.cli", "--listen", f"127.0.0.1:{port}", "--log-format", "json",
           "--prefill", f"http://127.0.0.1:{free_port()}=127.0.0.1:{free_port()}", "--decode",
           f"http://127.0.0.1:{free_port()}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while _health(port) == 0 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)  # /health answers 503 (no engine up) once the router serves
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines = [ln for ln in (proc.stderr.read() if proc.stderr else "").splitlines() if ln.strip()]
    objs = [json.loads(ln) for ln in lines]
    assert any(o["logger"] == "kvpush.router" and "listening on" in o["msg"] for o in objs), objs
    bad = subprocess.run([*cmd[:5], "--log-format", "xml"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "invalid choice" in bad.stderr
