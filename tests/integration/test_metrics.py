"""The supervisor's /metrics with real device daemons: every documented kvpush_* family is
exposed once, per device, and a transfer between the two daemons shows up in the counters.
The live daemon's and a live router's series match docs/metrics.md both ways (names, types,
labels).

``kvpushd --devices cpu0,cpu1`` runs as a subprocess (its own supervisor and children);
the engines are harness Engines (DaemonClients) pointed at its engine sockets.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpush import proto
from kvpush.daemon.config import DeviceConfig
from kvpush.daemon.ops.ctl import main as ctl_main
from kvpush_dev.daemon_harness import Engine, ops_request
from kvpush_dev.keys import lab_keys
from kvpush_dev.kvref import make

pytestmark = pytest.mark.integration

BIN = Path(sys.executable).parent
DEVICES = ("cpu0", "cpu1")


METRICS_DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def documented(section: str) -> dict[str, tuple[str, frozenset[str]]]:
    """series -> (type, labels) from the table under the docs/metrics.md heading that starts
    with ``section``."""
    text = METRICS_DOC.read_text()
    body = text.split(f"\n## {section}", 1)[1].split("\n## ", 1)[0]
    out: dict[str, tuple[str, frozenset[str]]] = {}
    for name, kind, labels in re.findall(r"^\| `([\w:]+)` \| (\w+) \| ([^|]+) \|", body, re.M):
        assert name not in out, f"{name} documented twice"
        out[name] = (kind, frozenset() if labels.strip() == "-" else
                     frozenset(x.strip() for x in labels.split(",")))
    assert out, f"no table under '## {section}' in {METRICS_DOC}"
    return out


def live(fams: dict[str, Any]) -> dict[str, tuple[str, frozenset[str]]]:
    """The scrape as series -> (type, labels): counters by their _total name, info families
    by their _info name; labels seen on any sample (le of histograms left out)."""
    out: dict[str, tuple[str, frozenset[str]]] = {}
    for name, fam in fams.items():
        series = name + {"counter": "_total", "info": "_info"}.get(fam.type, "")
        kind = "gauge" if fam.type == "info" else fam.type
        labels = frozenset(k for s in fam.samples for k in s.labels if k != "le")
        out[series] = (kind, labels)
    return out


def assert_documented_both_ways(fams: dict[str, Any], section: str) -> None:
    docs, got = documented(section), live(fams)
    assert set(got) - set(docs) == set(), f"exposed but not in docs/metrics.md ({section})"
    assert set(docs) - set(got) == set(), f"in docs/metrics.md ({section}) but not exposed"
    for name, (kind, labels) in got.items():
        assert docs[name][0] == kind, (name, kind, docs[name][0])
        # a family without samples yet shows no labels; those it shows must be documented
        assert labels <= docs[name][1], (name, labels, docs[name][1])


def documented_families() -> set[str]:
    """The daemon's documented series as the parser's family names (counters without _total)."""
    return {n.removesuffix("_total") for n in documented("kvpushd")}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Remote:
    """What harness Engines need of a daemon the supervisor started."""

    cfg: DeviceConfig
    peer_endpoint: str


class Node:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.port = free_port()
        self.log = open(tmp / "kvpushd.log", "w+")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [str(BIN / "kvpushd"), "--devices", ",".join(DEVICES), "--runtime-dir", str(tmp),
             "--base-port", "0", "--metrics-port", str(self.port)],
            stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **lab_keys(tmp).env()})

    def get(self, path: str) -> tuple[int, str]:
        assert self.proc.poll() is None, f"kvpushd exited with {self.proc.returncode}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()
        except (urllib.error.URLError, ConnectionError):
            return 0, ""

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.get("/health")[0] != 200:
            assert time.monotonic() < deadline, "kvpushd never became healthy"
            time.sleep(0.1)

    def scrape(self) -> dict[str, Any]:
        code, text = self.get("/metrics")
        assert code == 200
        fams = list(text_string_to_metric_families(text))
        names = [f.name for f in fams]
        assert len(names) == len(set(names)), "a family appears twice: Prometheus rejects that"
        return {f.name: f for f in fams}

    def remote(self, index: int) -> Remote:
        cfg = DeviceConfig(index=index, name=f"cpu{index}", runtime_dir=str(self.tmp))
        status = ops_request(cfg.ops_socket, "status").data
        return Remote(cfg, status["peer_endpoint"])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.seek(0)
        sys.stderr.write(self.log.read()[-3000:])
        self.log.close()


@pytest.fixture
def node() -> Iterator[Node]:
    tmp = Path(tempfile.mkdtemp(prefix="kvmet-", dir="/tmp"))  # ipc paths <= 107 bytes
    n = Node(tmp)
    try:
        n.wait_healthy(90)
        yield n
    finally:
        n.close()
        shutil.rmtree(tmp, ignore_errors=True)


def sample(fams: dict[str, Any], family: str, name: str, **labels: str) -> float:
    got = [s.value for s in fams[family].samples
           if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(got) == 1, (name, labels, fams[family].samples)
    return got[0]


def test_metrics_families_and_a_transfer(node: Node) -> None:
    # gauges set by the worker's periodic tick appear within its first loop pass
    deadline = time.monotonic() + 10
    while True:
        fams = node.scrape()
        devs = {s.labels.get("device") for s in fams["kvpush_pending_rendezvous"].samples}
        if devs == set(DEVICES) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert documented_families() <= set(fams), documented_families() - set(fams)
    # families with samples before any traffic carry both devices
    for fam in ("kvpush_pending_rendezvous", "kvpush_transfers_in_flight",
                "kvpush_written_bytes", "kvpush_write_latency_seconds", "kvpush_notifications"):
        assert {s.labels.get("device") for s in fams[fam].samples} == set(DEVICES), fam
    for dev in DEVICES:
        assert sample(fams, "kvpush_child_metrics_ok", "kvpush_child_metrics_ok", device=dev) == 1
        assert sample(fams, "kvpush_written_bytes", "kvpush_written_bytes_total", device=dev) == 0
    assert not [s for s in fams["kvpush_transfers"].samples if s.value]
    (build,) = fams["kvpush_build_info"].samples
    assert build.value == 1 and set(build.labels) == {"version", "protocol", "python", "nixl"}
    assert build.labels["protocol"] == str(proto.PROTOCOL_VERSION)

    lay, _ = make("amx", num_layers=2, num_blocks=32, block_size=16, num_heads=2, head_size=64,
                  dtype="bfloat16")
    p, d = node.remote(0), node.remote(1)
    pe = Engine(p, lay, "prefill", seed=7)  # type: ignore[arg-type]
    de = Engine(d, lay, "decode", fill="zeros")  # type: ignore[arg-type]
    try:
        t, n = "metrics-t1", 3 * 16
        de.send(proto.Register(t, 0, (1, 2, 3), n, (p.peer_endpoint,), 1, 10_000))
        pe.send(proto.PrefillDone(t, (9, 8, 7), n, 10_000))
        assert isinstance(de.result(t), proto.Received)
        assert isinstance(pe.result(t), proto.Sent)
        recent = ops_request(p.cfg.ops_socket, "transfers").data["recent"]
        nbytes = sum(r["bytes"] for r in recent if r["transfer_id"] == t)
        assert nbytes > 0
    finally:
        pe.close()
        de.close()

    fams = node.scrape()
    assert sample(fams, "kvpush_written_bytes", "kvpush_written_bytes_total", device="cpu0") == nbytes
    assert sample(fams, "kvpush_written_bytes", "kvpush_written_bytes_total", device="cpu1") == 0
    assert sample(fams, "kvpush_transfers", "kvpush_transfers_total", device="cpu0",
                  side="prefill", result="ok") == 1
    assert sample(fams, "kvpush_transfers", "kvpush_transfers_total", device="cpu1",
                  side="decode", result="ok") == 1
    assert sample(fams, "kvpush_write_latency_seconds", "kvpush_write_latency_seconds_count",
                  device="cpu0") == 1
    assert sample(fams, "kvpush_notifications", "kvpush_notifications_total", device="cpu1") == 1
    assert sample(fams, "kvpush_child_restarts", "kvpush_child_restarts_total", device="cpu1") == 0
    # after a transfer every family with labels has samples: the docs match names and labels
    assert_documented_both_ways(fams, "kvpushd")
    assert {s.labels["state"] for s in fams["kvpush_pending_rendezvous"].samples} == {
        "wait_prefill", "wait_register", "writing", "draining", "streamed",
        "waiting", "failing", "aborting", "superseded"}, "finished states are not pending"

    # kvpushctl metrics: the same counters, straight from each daemon (found by glob)
    out, err = io.StringIO(), io.StringIO()
    conf = node.tmp / "kvpushd.toml"
    conf.write_text(f'devices = ["cpu0"]\nruntime_dir = "{node.tmp}"\nmetrics_port = 0\n')
    assert ctl_main(["--config", str(conf), "metrics"], out=out, err=err) == 0, err.getvalue()
    text = out.getvalue()
    assert "# kvpushctl: cpu0" in text and "# kvpushctl: cpu1" in text
    assert f'kvpush_written_bytes_total{{device="cpu0"}} {float(nbytes)}' in text

    # a crashed child: kvpushctl status says so, then shows the supervisor's restart count
    conf.write_text(f'devices = ["cpu0", "cpu1"]\nruntime_dir = "{node.tmp}"\n'
                    f'metrics_port = {node.port}\n')
    os.kill(ops_request(d.cfg.ops_socket, "status").data["pid"], signal.SIGKILL)
    out, err = io.StringIO(), io.StringIO()
    assert ctl_main(["--config", str(conf), "status"], out=out, err=err) == 1
    assert [ln.split()[1] for ln in out.getvalue().splitlines() if ln.startswith("cpu1 ")][0] \
        .startswith("no"), out.getvalue()
    deadline = time.monotonic() + 60
    while True:
        out, err = io.StringIO(), io.StringIO()
        if ctl_main(["--config", str(conf), "status", "--json"], out=out, err=err) == 0:
            break
        assert time.monotonic() < deadline, err.getvalue()
        time.sleep(0.2)
    by = {x["device"]: x["data"]["supervisor"] for x in json.loads(out.getvalue())["daemons"]}
    assert by["cpu1"]["restarts"] == 1 and by["cpu1"]["last_exit"] == -signal.SIGKILL
    assert by["cpu0"] == {"state": "up", "up": True, "restarts": 0, "last_exit": None}


def test_blocks_held_for_nobody_are_visible_counted_and_said_once(node: Node) -> None:
    """A prefill whose decode side never registers: its blocks show as held (and how long), the
    lease releases them, the expiry is counted by cause, and the daemon says so once."""
    lay, _ = make("amx", num_layers=2, num_blocks=32, block_size=16, num_heads=2, head_size=64,
                  dtype="bfloat16")
    p = node.remote(0)
    pe = Engine(p, lay, "prefill", seed=7)  # type: ignore[arg-type]
    try:
        pe.send(proto.PrefillDone("nobody-1", (4, 5, 6), 48, 1500))
        time.sleep(0.5)
        fams = node.scrape()
        assert sample(fams, "kvpush_held_blocks", "kvpush_held_blocks", device="cpu0", state="wait_register") == 3
        assert 0.3 < sample(fams, "kvpush_unclaimed_oldest_seconds", "kvpush_unclaimed_oldest_seconds",
                            device="cpu0") < 1.5
        rows = ops_request(p.cfg.ops_socket, "pending").data["pending"]
        assert [(r["transfer_id"], r["state"], r["blocks"], r["attempt"]) for r in rows] == \
            [("nobody-1", "wait_register", 3, -1)] and rows[0]["age"] > 0.3
        assert isinstance(pe.result("nobody-1"), proto.SendFailed)
        pe.send(proto.PrefillDone("nobody-2", (7, 8), 32, 200))
        assert isinstance(pe.result("nobody-2"), proto.SendFailed)
    finally:
        pe.close()
    fams = node.scrape()
    assert sample(fams, "kvpush_lease_expired", "kvpush_lease_expired_total", device="cpu0", registered="none") == 2
    assert sample(fams, "kvpush_lease_expired_blocks", "kvpush_lease_expired_blocks_total", device="cpu0") == 5
    assert sample(fams, "kvpush_held_blocks", "kvpush_held_blocks", device="cpu0", state="wait_register") == 0
    assert sample(fams, "kvpush_unclaimed_oldest_seconds", "kvpush_unclaimed_oldest_seconds", device="cpu0") == 0
    node.log.flush()
    said = Path(node.log.name).read_text().count("no decode side registered: is the decode engine using kvpush")
    assert said == 1


def test_router_metrics_match_the_docs(tmp_path: Path) -> None:
    """A live kvpush-router (its engines need not exist for /metrics): after one request that
    fails its legs, every family has samples; names, types and labels match docs/metrics.md."""
    port = free_port()
    dead = free_port()  # nothing listens here: both legs fail with a connect error
    log = open(tmp_path / "router.log", "w+")  # noqa: SIM115
    proc = subprocess.Popen(
        [str(BIN / "kvpush-router"), "--listen", f"127.0.0.1:{port}",
         "--prefill", f"http://127.0.0.1:{dead}=127.0.0.1:{free_port()}",
         "--decode", f"http://127.0.0.1:{dead}", "--prefill-timeout", "2", "--request-timeout", "2"],
        stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=2):
                    break
            except urllib.error.HTTPError:
                break  # answering at all is enough: it is up
            except (urllib.error.URLError, ConnectionError):
                assert proc.poll() is None and time.monotonic() < deadline, "router never came up"
                time.sleep(0.1)
        req = urllib.request.Request(f"{base}/v1/completions", method="POST",
                                     data=json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 1,
                                                      "stream": False}).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            urllib.request.urlopen(req, timeout=30).read()
        except urllib.error.HTTPError:
            pass  # the legs fail: the router answers an error, and counts it
        with urllib.request.urlopen(f"{base}/metrics", timeout=5) as r:
            fams = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
        assert_documented_both_ways(fams, "kvpush-router")
        (build,) = fams["kvpush_build_info"].samples
        assert build.labels["protocol"] == str(proto.PROTOCOL_VERSION)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
