"""kvpushctl against real daemons: pending, cancel, peers, transfers, status, drain, errors,
and an engine that re-attaches by itself after its daemon was killed and started again.

Most commands run in-process (``ctl.main`` with captured streams: the same code path, a
fraction of the start-up cost); exit codes, stderr and Ctrl-C are also checked on the real
``kvpushctl`` console script.
"""

from __future__ import annotations

import io
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvpush import proto
from kvpush.daemon.ops.ctl import main as ctl_main
from kvpush_dev.daemon_harness import Daemon, Engine, device_config
from kvpush_dev.kvref import make, reference_copy

pytestmark = pytest.mark.integration

_ids = itertools.count()
BIN = Path(sys.executable).parent


def tid() -> str:
    return f"ctl{os.getpid()}-{next(_ids)}"


def layout() -> tuple[Any, dict]:
    return make("amx", num_layers=2, num_blocks=32, block_size=16, num_heads=2, head_size=64,
                dtype="bfloat16")


def ctl(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = ctl_main(list(args), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def ctl_json(*args: str) -> dict[str, Any]:
    code, out, err = ctl(*args, "--json")
    assert code == 0, err
    return json.loads(out)


def kvpushctl_cmd() -> list[str]:
    exe = shutil.which("kvpushctl", path=str(BIN))
    return [exe] if exe else [sys.executable, "-m", "kvpush.daemon.ops.ctl"]


def ctl_proc(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*kvpushctl_cmd(), *args], capture_output=True, text=True,
                          timeout=timeout)


def row_with(text: str, needle: str) -> list[str]:
    rows = [line.split() for line in text.splitlines() if needle in line.split()]
    assert len(rows) == 1, f"{needle!r} in {text!r}"
    return rows[0]


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


class Pair:
    """A prefill daemon (cpu0) and a decode daemon (cpu1) plus a config naming both."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.p = Daemon(device_config(tmp, 0))
        self.d = Daemon(device_config(tmp, 1))
        self.config = tmp / "kvpushd.toml"
        self.config.write_text(f'devices = ["cpu0", "cpu1"]\nruntime_dir = "{tmp}"\n'
                               "metrics_port = 0\nbase_port = 0\n")

    def stop(self) -> None:
        for x in (self.p, self.d):
            x.stop()


@pytest.fixture(scope="module")
def short_tmp() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="kvctl-", dir="/tmp"))  # ipc paths <= 107 bytes
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def pair(short_tmp: Path) -> Iterator[Pair]:
    pr = Pair(short_tmp)
    yield pr
    pr.stop()


def register(de: Engine, p: Daemon, t: str, blocks: list[int], n: int) -> None:
    de.send(proto.Register(t, 0, tuple(blocks), n, (p.peer_endpoint,), 1, 10_000))


def transfer(pe: Engine, pmeta: dict, de: Engine, dmeta: dict, p: Daemon) -> str:
    t, n = tid(), 2 * 16 + 7
    src, dst = [5, 9, 1], [20, 3, 30]
    before = de.bytes.copy()
    register(de, p, t, dst, n)
    pe.send(proto.PrefillDone(t, tuple(src), n, 10_000))
    assert isinstance(de.result(t), proto.Received)
    assert isinstance(pe.result(t), proto.Sent)
    want, dont_care = reference_copy(pmeta, pe.layout, pe.bytes, src, dmeta, de.layout, before,
                                     dst, n, 0)
    assert np.array_equal(de.bytes[~dont_care], want[~dont_care])
    return t


# ----------------------------------------------------------------------------- commands

def test_pending_then_cancel_sends_sendfailed(pair: Pair) -> None:
    lay, _ = layout()
    pe = Engine(pair.p, lay, "prefill", seed=1)
    try:
        t = tid()
        pe.send(proto.PrefillDone(t, (4, 5, 6), 40, 10_000))  # no registration: it waits
        sock = pair.p.cfg.ops_socket
        deadline = time.monotonic() + 10
        while True:
            code, out, err = ctl("pending", "--socket", sock)
            assert code == 0, err
            if t in out:
                break
            assert time.monotonic() < deadline, out
            time.sleep(0.05)
        header = out.splitlines()[0].split()
        assert header == ["DEVICE", "TRANSFER", "ATTEMPT", "SIDE", "STATE", "BLOCKS", "AGE",
                          "DEADLINE-IN", "PROGRESS"]
        row = row_with(out, t)
        assert row[:6] == ["cpu0", t, "-", "prefill", "wait_register", "3"]
        assert row[6].endswith("s") and row[7].endswith("s")

        doc = ctl_json("pending", "--socket", sock)
        [daemon] = doc["daemons"]
        assert doc["command"] == "pending"
        assert daemon["ok"] and daemon["error"] is None and daemon["device"] == "cpu0"
        assert daemon["socket"] == sock
        [r] = [r for r in daemon["data"]["pending"] if r["transfer_id"] == t]
        assert (r["side"], r["state"], r["attempt"], r["blocks"]) == ("prefill", "wait_register", -1, 3)
        assert 0 < r["deadline_in_s"] <= 10.0 and r["age"] >= 0

        # cancel walks both daemons (from the config): cpu0 holds it, cpu1 refuses -> exit 0
        code, out, err = ctl("--config", str(pair.config), "cancel", t)
        assert code == 0, err
        assert out.strip() == f"cpu0: cancelled {t}" and err == ""
        msg = pe.result(t)
        assert isinstance(msg, proto.SendFailed) and "cancelled by operator" in msg.reason
        assert t not in ctl("pending", "--socket", sock)[1]

        # again: nobody holds it -> refused, exit 4, one line per daemon
        r2 = ctl_proc("cancel", t, "--socket", sock)
        assert r2.returncode == 4, r2.stderr
        assert "not pending here" in one_line(r2.stderr)
    finally:
        pe.close()


def test_transfer_shows_in_peers_and_transfers(pair: Pair) -> None:
    lay, meta = layout()
    pe = Engine(pair.p, lay, "prefill", seed=2)
    de = Engine(pair.d, lay, "decode", fill="zeros")
    try:
        t = transfer(pe, meta, de, meta, pair.p)
        code, out, err = ctl("peers", "--socket", pair.d.cfg.ops_socket)
        assert code == 0, err
        row = row_with(out, pair.p.peer_endpoint)
        assert row[:5] == ["cpu1", "producer", pair.p.peer_endpoint, "ready", "prefill-0"]
        peers = ctl_json("peers", "--socket", pair.p.cfg.ops_socket)["daemons"][0]["data"]["peers"]
        assert [p["role"] for p in peers if p["state"] == "ready"] == ["consumer"]
        assert any(p["transfers"] >= 1 for p in peers)

        code, out, err = ctl("transfers", "--socket", pair.p.cfg.ops_socket)
        assert code == 0, err
        row = row_with(out, t)
        recent = ctl_json("transfers", "--socket", pair.p.cfg.ops_socket)["daemons"][0]["data"]["recent"]
        [rec] = [r for r in recent if r["transfer_id"] == t]
        assert rec["result"] == "ok" and rec["bytes"] > 0 and rec["latency_ms"] > 0
        assert rec["mode"] == "whole" and rec["group"] == 0 and rec["tail_ms"] is not None
        assert row[:7] == ["cpu0", t, "0", "prefill", "ok", "whole", str(rec["bytes"])]
        assert row[7:9] == [f"{rec['latency_ms']:.3f}", "ms"]
        assert row[9] == "-" and row[10:12] == [f"{rec['tail_ms']:.1f}", "ms"]  # no group, so no lag
        # the decode side lists it too (no bytes there: it only counts notifications)
        code, out, _ = ctl("transfers", "--socket", pair.d.cfg.ops_socket)
        assert row_with(out, t)[3:5] == ["decode", "ok"]

        # trace: both daemons' stamps of it in one timeline; without an ID, the recent IDs
        code, out, err = ctl("--config", str(pair.config), "trace", t)
        assert code == 0, err
        assert "p.daemon.write_posted" in out and "d.daemon.register_in" in out
        [first, *_] = ctl_json("--config", str(pair.config), "trace", t)["daemons"]
        assert {r["source"] for r in first["data"]["timeline"]} >= {"daemon cpu0", "daemon cpu1"}
        assert t in ctl("trace", "--socket", pair.p.cfg.ops_socket)[1].split()
        # metrics: each daemon's exposition, labelled when there are several
        code, out, err = ctl("--config", str(pair.config), "metrics")
        assert code == 0, err
        assert "# kvpushctl: cpu0" in out and 'kvpush_written_bytes_total{device="cpu0"}' in out
    finally:
        pe.close()
        de.close()


def test_status_all_daemons_from_config(pair: Pair) -> None:
    lay, _ = layout()
    pe = Engine(pair.p, lay, "prefill", seed=3)
    try:
        code, out, err = ctl("--config", str(pair.config), "status")
        assert code == 0, err
        lines = out.splitlines()
        assert lines[0].split() == ["DEVICE", "UP", "PID", "ROLE", "RANK", "BACKEND", "ENGINE",
                                    "MEMORY", "PEERS", "P/C", "AUTH", "UPTIME", "RESTARTS", "PROTO"]
        row = row_with(out, "cpu0")
        assert row[1] == "yes" and row[2] == str(pair.p.proc.pid)
        assert row[3:7] == ["prefill", "0/1", "UCX", "prefill-0"]
        assert row_with(out, "cpu1")[1] == "yes"
        doc = ctl_json("--config", str(pair.config), "status")
        by = {d["device"]: d for d in doc["daemons"]}
        assert set(by) == {"cpu0", "cpu1"}
        eng = by["cpu0"]["data"]["engine"]
        assert eng["memory_bytes"] >= lay.region_size and eng["role"] == "prefill"
        assert by["cpu0"]["data"]["supervisor"] is None  # metrics_port = 0: no /health
        # found by globbing the runtime dir, without a config naming them
        other = pair.tmp / "empty.toml"
        other.write_text(f'devices = ["cpu7"]\nruntime_dir = "{pair.tmp}"\nmetrics_port = 0\n')
        code, out, err = ctl("--config", str(other), "status", "--json")
        assert code == 1 and "cpu7" in one_line(err)  # configured but not running
        found = {d["device"]: d["ok"] for d in json.loads(out)["daemons"]}
        assert found == {"cpu7": False, "cpu0": True, "cpu1": True}
    finally:
        pe.close()


def test_watch_refreshes_until_ctrl_c(pair: Pair) -> None:
    # SIGINT at its default in the child: a suite started in the background by a
    # non-interactive shell inherits it ignored, and a process that starts with SIGINT
    # ignored never sees a Ctrl-C (that is the caller's choice, not kvpushctl's to undo).
    proc = subprocess.Popen([*kvpushctl_cmd(), "--watch", "0.2", "status", "--socket",
                             pair.p.cfg.ops_socket], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stdout is not None
        seen = 0
        deadline = time.monotonic() + 20
        while seen < 2 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            seen += line.startswith("cpu0 ")
        assert seen == 2
        proc.send_signal(signal.SIGINT)
        assert proc.wait(10) == 0
        assert "Traceback" not in proc.stderr.read()  # type: ignore[union-attr]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_drain_refuses_new_prefill(short_tmp: Path) -> None:
    lay, _ = layout()
    dm = Daemon(device_config(short_tmp, 3))
    pe = None
    try:
        pe = Engine(dm, lay, "prefill", seed=4)
        # --device outside the config: its socket follows the default template
        code, out, err = ctl("drain", "--device", "cpu3", "--runtime-dir", str(short_tmp))
        assert (code, out.strip(), err) == (0, "cpu3: draining", "")
        assert row_with(ctl("status", "--socket", dm.cfg.ops_socket)[1], "cpu3")[1] == "draining"
        t = tid()
        pe.send(proto.PrefillDone(t, (1, 2), 20, 10_000))
        msg = pe.result(t)
        assert isinstance(msg, proto.SendFailed) and "draining" in msg.reason
    finally:
        if pe is not None:
            pe.close()
        dm.stop()


# ----------------------------------------------------------------------------- errors

def test_down_daemons_exit_1_with_one_line(tmp_path: Path) -> None:
    # no socket file at all (the real console script: exit code and stderr as shipped)
    r = ctl_proc("status", "--socket", f"ipc://{tmp_path}/ops-9.sock")
    assert r.returncode == 1
    assert "not running" in one_line(r.stderr)
    assert row_with(r.stdout, f"{tmp_path}/ops-9.sock")[1] == "no"
    # a stale socket file left by a killed daemon: refused at once, no timeout wait
    stale = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(stale))
    t0 = time.monotonic()
    code, _, err = ctl("pending", "--socket", str(stale))
    assert code == 1 and "stale socket" in one_line(err)
    assert time.monotonic() - t0 < 1.5
    # something listening that never answers: the --timeout applies
    hung = tmp_path / "hung.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(hung))
        s.listen()
        code, out, err = ctl("peers", "--socket", str(hung), "--timeout", "0.3", "--json")
    assert code == 1 and "no reply within 0.3s" in one_line(err)
    [d] = json.loads(out)["daemons"]
    assert d["ok"] is False and d["data"] is None and "no reply" in d["error"]
    # not a socket at all
    plain = tmp_path / "plain"
    plain.write_text("")
    assert ctl("status", "--socket", str(plain))[0] == 1


def test_malformed_reply_is_one_line_exit_1(tmp_path: Path) -> None:
    """A daemon whose reply does not match its command's schema (proto/ops.py) is reported
    like an undecodable one: down, exit 1, the field named, no traceback."""
    import threading

    import zmq

    ep = f"ipc://{tmp_path}/ops-0.sock"
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.bind(ep)
    done = threading.Event()

    def serve() -> None:
        while not done.is_set():
            if sock.poll(50):
                ident, _ = sock.recv_multipart()
                bad = {"device": "cpu0", "pid": "7"}
                sock.send_multipart([ident, proto.encode(proto.OpsReply(True, bad))])

    th = threading.Thread(target=serve, daemon=True)
    th.start()
    try:
        code, out, err = ctl("status", "--socket", ep, "--json")
        assert code == 1
        assert one_line(err).endswith(f"malformed status reply from {ep}: status.pid: expected int, got str")
        [d] = json.loads(out)["daemons"]
        assert d["ok"] is False and d["data"] is None
    finally:
        done.set()
        th.join(5)
        sock.close(0)


def test_usage_errors_exit_2(tmp_path: Path) -> None:
    sock = f"ipc://{tmp_path}/ops-0.sock"
    assert ctl()[0] == 2
    assert ctl("cancel", "--socket", sock)[0] == 2  # no transfer ID
    assert ctl("frobnicate")[0] == 2
    assert ctl("--watch", "1", "cancel", "x", "--socket", sock)[0] == 2
    assert ctl("status", "--device", "gpu0", "--runtime-dir", str(tmp_path))[0] == 2
    assert ctl("status", "--socket", sock, "--device", "cpu0")[0] == 2
    code, _, err = ctl("status", "--config", str(tmp_path / "missing.toml"))
    assert code == 2 and "configuration error" in one_line(err)
    bad = tmp_path / "bad.toml"
    bad.write_text("devics = 3\n")
    code, _, err = ctl("status", "--config", str(bad))
    assert code == 2 and "devices" in one_line(err)  # names the nearest key


def unprivileged() -> dict[str, Any]:
    """Popen arguments that run kvpushctl without root, whom file modes never stop: as
    nobody when the tests run as root (skipped where nobody cannot run this Python)."""
    if os.geteuid() != 0:
        return {}
    kw: dict[str, Any] = {"user": 65534, "group": 65534, "extra_groups": [], "cwd": "/"}
    try:
        r = subprocess.run([sys.executable, "-c", "import kvpush.daemon.ops.ctl"],
                           capture_output=True, text=True, timeout=60, **kw)
    except OSError as e:
        pytest.skip(f"running as root and user nobody cannot start {sys.executable} ({e}); "
                    "root itself is never denied by file modes")
    if r.returncode:
        pytest.skip("running as root and user nobody cannot import kvpush "
                    f"({r.stderr.strip().splitlines()[-1:]}); root is never denied by file modes")
    return kw


def test_permission_denied_exit_3() -> None:
    kw = unprivileged()
    base = Path(tempfile.mkdtemp(prefix="kvperm-", dir="/tmp"))
    try:
        base.chmod(0o755)
        sock = base / "ops-0.sock"
        conf = base / "kvpushd.toml"
        conf.write_text("metrics_port = 0\n")
        conf.chmod(0)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.bind(str(sock))
            s.listen()
            sock.chmod(0)
            r = subprocess.run([*kvpushctl_cmd(), "status", "--socket", str(sock)],
                               capture_output=True, text=True, timeout=60, **kw)
            assert r.returncode == 3, r.stderr
            assert "permission denied" in one_line(r.stderr)
            r = subprocess.run([*kvpushctl_cmd(), "status", "--config", str(conf)],
                               capture_output=True, text=True, timeout=60, **kw)
            assert r.returncode == 3 and "permission denied" in one_line(r.stderr)
            if kw:  # a directory nobody may traverse (0700, owned by root)
                base.chmod(0o700)
                sock.chmod(0o666)
                r = subprocess.run([*kvpushctl_cmd(), "status", "--socket", str(sock)],
                                   capture_output=True, text=True, timeout=60, **kw)
                assert r.returncode == 3 and "permission denied" in one_line(r.stderr)
    finally:
        shutil.rmtree(base, ignore_errors=True)


# ----------------------------------------------------------------------------- restart

def test_engine_reattaches_after_daemon_restart(pair: Pair) -> None:
    """The decode daemon is SIGKILLed and a new one binds the same sockets; the engine's
    client, only being pumped, re-attaches (same memory, no engine restart) and the next
    transfer lands."""
    lay, meta = layout()
    pe = Engine(pair.p, lay, "prefill", seed=5)
    de = Engine(pair.d, lay, "decode", fill="zeros", engine_id="D-restart")
    try:
        sock = pair.d.cfg.ops_socket
        old_pid = pair.d.proc.pid
        pair.d.kill()
        assert ctl("status", "--socket", sock, "--timeout", "0.5")[0] == 1
        pair.d = Daemon(pair.d.cfg)  # the fixture stops whichever daemon is current
        deadline = time.monotonic() + 20
        while True:
            de.pump()
            doc = ctl_json("status", "--socket", sock)
            data = doc["daemons"][0]["data"]
            if (data.get("engine") or {}).get("engine_id") == "D-restart":
                break
            assert time.monotonic() < deadline, data
            time.sleep(0.05)
        assert data["pid"] == pair.d.proc.pid != old_pid
        ack = de.wait_for(lambda m: isinstance(m, proto.AttachAck), 5)
        assert ack.daemon_id == data["daemon_id"] == de.client.daemon_id
        transfer(pe, meta, de, meta, pair.p)
    finally:
        pe.close()
        de.close()
