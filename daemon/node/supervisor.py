"""kvpushd supervisor: one spawned process per accelerator daemon, restarted one at a time.

Why a supervisor: one process per accelerator keeps a crash (NIXL, CUDA, a bad handle) to
one device; its engines re-attach after the restart while the other devices keep serving.
systemd sees one ``Type=notify`` service and gets ``READY=1`` only once every child is up.

Child contract (``target(cfg, ready_event) -> int``, the default being
``kvpush.daemon.device_daemon.run_device_daemon(cfg, ready_event=...)``):

* called in a fresh spawned interpreter, in its own process group (a terminal's Ctrl-C
  reaches only the supervisor), with logging configured at ``cfg.log_level``, NOTIFY_SOCKET
  removed, and SIGTERM/SIGINT at their defaults; it dies with the supervisor (PDEATHSIG);
* sets ``ready_event`` once its sockets are bound and engines can attach;
* on SIGTERM stops within ``NodeConfig.stop_timeout_s`` and returns 0 (else SIGKILL);
* any exit the supervisor did not ask for (return value, exception, signal) is a crash and
  the child is restarted after a backoff (doubling, capped), at most
  ``max_restarts_per_minute`` times in any 60 s; beyond that it is held down
  ("crash-loop") until the window has room again. Other children are never touched.

Every state of a child and every change of it, the restart policy included, is a row of the
pure table in :mod:`kvpush.daemon.node.children`; this module only turns what it sees of the
processes into its events and carries out the actions it returns.

The HTTP thread (stdlib, not the data path) serves ``/health`` (200 when every child is
up, else 503; JSON per device) and ``/metrics`` (supervisor metrics + each child's own,
fetched over the ops sockets with ``OpsRequest(cmd="metrics")`` through
:mod:`kvpush.daemon.ops.client`, every up child at once).
"""

from __future__ import annotations

import ctypes
import json
import logging
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from multiprocessing.connection import wait as mp_wait
from typing import Any

import psutil
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from kvpush.common import logfmt
from kvpush.common.machine import Single, drive
from kvpush.daemon.config import DeviceConfig, NodeConfig
from kvpush.daemon.context import FENCE_EXIT_CODE
from kvpush.daemon.node import children as cm
from kvpush.daemon.node import sdnotify
from kvpush.daemon.node.children import ChildFacts, ChildState
from kvpush.daemon.ops import client as opsclient
from kvpush.proto.buildinfo import build_info
from kvpush.proto.messages import OpsRequest
from kvpush.proto.ops import MetricsReply

log = logging.getLogger(__name__)

LOG_FORMAT = "%(asctime)s %(levelname)-7s %(processName)s[%(process)d] %(name)s: %(message)s"
SCRAPE_TIMEOUT_S = 0.5

WorkerTarget = Callable[[DeviceConfig, Any], int]


def configure_logging(level: str, fmt: str = "text") -> None:
    """Lines on stderr (journald adds its own metadata): text, or JSON for a log pipeline."""
    logfmt.configure(level, fmt, LOG_FORMAT)


def ensure_runtime_dir(path: str, *socket_modes: int) -> None:
    """Create the socket directory if systemd's RuntimeDirectory did not (0700; 0750 when
    a socket is group-shared), or refuse one another user could tamper with (wrong owner,
    group/world-writable, more open than that): RuntimeDirError."""
    from kvpush.daemon.io.endpoints import ensure_private_dir, runtime_dir_mode

    ensure_private_dir(path, runtime_dir_mode(socket_modes))


def run_worker_entry(cfg: DeviceConfig, ready_event: Any) -> int:
    """Default child target; imports the worker only inside the child."""
    from kvpush.daemon.device_daemon import run_device_daemon

    return run_device_daemon(cfg, ready_event=ready_event)


def _die_with_parent(parent_pid: int) -> None:
    """PR_SET_PDEATHSIG: an orphaned worker would hold its sockets and GPU memory."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def _child_main(target: WorkerTarget, cfg: DeviceConfig, ready: Any, parent_pid: int) -> None:
    try:
        os.setpgid(0, 0)
    except OSError:
        pass
    _die_with_parent(parent_pid)
    for var in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
        os.environ.pop(var, None)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    configure_logging(cfg.log_level, cfg.log_format)
    try:
        code = target(cfg, ready)
    except Exception:
        logging.getLogger("kvpush.daemon.device_daemon").exception("worker %s crashed", cfg.name)
        code = 1
    sys.exit(code if isinstance(code, int) else 0)


@dataclass(eq=False, kw_only=True)
class Child(ChildFacts):
    """One device daemon: the table's facts (:class:`ChildFacts`) and the shell's handles."""

    cfg: DeviceConfig
    process: Any = None
    ready: Any = None
    ps: psutil.Process | None = None
    rss_bytes: int = 0
    cpu_seconds: float = 0.0
    cpu_percent: float = 0.0

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None


class Supervisor:
    """Runs and watches every device daemon of a node; see the module docstring."""

    def __init__(self, node: NodeConfig, target: WorkerTarget = run_worker_entry,
                 notify: Callable[[str], bool] = sdnotify.notify) -> None:
        self.node = node
        self.target = target
        self._notify = notify
        self._ctx = mp.get_context("spawn")
        self._children = {d.name: Child(cfg=d) for d in node.devices}
        self._policy = cm.Policy(node.max_restarts_per_minute, node.restart_backoff_s,
                                 node.restart_backoff_max_s, node.ready_timeout_s)
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._ready_sent = False
        self._last_status = ""
        self._watchdog_s = sdnotify.watchdog_interval_s()
        self._last_watchdog = 0.0
        self._started = time.monotonic()
        self._http: ThreadingHTTPServer | None = None
        self.http_port: int | None = None

    # ---------------------------------------------------------------- lifecycle

    def run(self) -> int:
        """Start everything, supervise until SIGTERM/SIGINT or request_stop(); returns 0."""
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_signal)
            signal.signal(signal.SIGINT, self._on_signal)
        try:
            self.start()
            while not self._stop.is_set():
                self.step()
                self._sleep()
        finally:
            self.shutdown()
        return 0

    def start(self) -> None:
        ensure_runtime_dir(self.node.runtime_dir, *(d.socket_mode for d in self.node.devices))
        self._start_http()
        with self._lock:
            now = time.monotonic()
            for child in self._children.values():
                self._feed(child, cm.Start(now))
        log.info("supervising %d device daemon(s): %s", len(self._children),
                 ", ".join(self._children))
        self._publish_status()

    def request_stop(self) -> None:
        self._stop.set()
        self._wake()

    def _on_signal(self, signum: int, _frame: Any) -> None:
        log.info("received %s, stopping", signal.Signals(signum).name)
        self.request_stop()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except (BlockingIOError, OSError):
            pass

    def shutdown(self) -> None:
        """STOPPING=1, SIGTERM every child, SIGKILL what is left after stop_timeout_s."""
        self._notify("STOPPING=1")
        with self._lock:
            live = [c for c in self._children.values() if c.process is not None]
            for c in self._children.values():
                self._feed(c, cm.Stop())
        deadline = time.monotonic() + self.node.stop_timeout_s
        while any(c.process.is_alive() for c in live) and time.monotonic() < deadline:
            mp_wait([c.process.sentinel for c in live if c.process.is_alive()],
                    timeout=max(deadline - time.monotonic(), 0.0))
        with self._lock:
            for c in live:
                if c.process.is_alive():
                    log.warning("%s did not stop in %.1fs, killing", c.cfg.name,
                                self.node.stop_timeout_s)
                    c.process.kill()
                self._feed(c, cm.Stopped(self._reap(c)))
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        log.info("all device daemons stopped")

    # ---------------------------------------------------------------- supervision

    def _feed(self, c: Child, ev: object) -> None:
        """One event into the child's table; carry out its actions, in order."""
        drive(Single(cm.TABLE, self._policy, c), ev, lambda a: self._carry_out(c, a))

    def _carry_out(self, c: Child, a: cm.Act) -> None:
        if a is cm.Act.SPAWN:
            self._spawn(c)
        elif a is cm.Act.KILL:
            c.process.kill()
        elif a is cm.Act.TERMINATE:
            if c.process.is_alive():
                c.process.terminate()
        elif a is cm.Act.LOG_UP:
            log.info("%s is up (pid %d, %.2fs)", c.cfg.name, c.pid, c.up_since - c.started_at)
        elif a is cm.Act.LOG_NOT_READY:
            log.error("%s not ready after %.1fs, killing it", c.cfg.name,
                      self.node.ready_timeout_s)
        elif a is cm.Act.LOG_FAILED:
            log.error("%s exited (%s); restarts are disabled", c.cfg.name, c.last_exit)
        elif a is cm.Act.LOG_CRASH_LOOP:
            log.error("%s exited (%s) after %d restarts in %.0fs; holding it down for %.1fs",
                      c.cfg.name, c.last_exit, len(c.restart_times), cm.WINDOW_S,
                      c.next_start - c.started_at - c.ran_s)
        elif a is cm.Act.LOG_BACKOFF:
            why = " (it fenced: a WRITE could still arrive)" if c.last_exit == FENCE_EXIT_CODE else ""
            log.warning("%s exited (%s)%s after %.1fs; restarting in %.2fs", c.cfg.name,
                        c.last_exit, why, c.ran_s, c.delay_s)

    def _spawn(self, c: Child) -> None:
        c.ready = self._ctx.Event()
        c.process = self._ctx.Process(target=_child_main, name=f"kvpushd-{c.cfg.name}",
                                      args=(self.target, c.cfg, c.ready, os.getpid()))
        c.process.start()
        c.ps = _psutil_process(c.process.pid)
        c.rss_bytes, c.cpu_seconds, c.cpu_percent = 0, 0.0, 0.0
        log.info("%s %s (pid %d)", "restarted" if c.restarts else "started", c.cfg.name,
                 c.process.pid)

    def _reap(self, c: Child) -> int | None:
        """Join an ended process and drop its handles; its exit code."""
        c.process.join()
        code = c.process.exitcode
        c.process, c.ps, c.ready = None, None, None
        return code

    def step(self) -> None:
        """One supervision pass: reap, promote ready children, restart due ones, sample."""
        now = time.monotonic()
        with self._lock:
            for c in self._children.values():
                if c.process is not None and not c.process.is_alive():
                    self._feed(c, cm.Exited(now, self._reap(c)))
                elif c.ready is not None and c.ready.is_set():
                    self._feed(c, cm.Ready(now))
                self._feed(c, cm.Tick(now))
                self._sample(c)
        self._publish_status()
        if self._watchdog_s and now - self._last_watchdog >= self._watchdog_s:
            self._notify("WATCHDOG=1")
            self._last_watchdog = now

    def _sample(self, c: Child) -> None:
        if c.ps is None:
            return
        try:
            with c.ps.oneshot():
                c.rss_bytes = c.ps.memory_info().rss
                t = c.ps.cpu_times()
                c.cpu_seconds = t.user + t.system
                c.cpu_percent = c.ps.cpu_percent(interval=None)
        except psutil.Error:
            pass  # exited between checks: reaped on the next step

    def _sleep(self) -> None:
        now = time.monotonic()
        with self._lock:
            timeout = 1.0
            for c in self._children.values():
                if c.state is ChildState.STARTING:
                    timeout = min(timeout, 0.05)
                elif c.state in (ChildState.BACKOFF, ChildState.CRASH_LOOP):
                    timeout = min(timeout, max(c.next_start - now, 0.0))
            sentinels = [c.process.sentinel for c in self._children.values()
                         if c.process is not None]
        if self._watchdog_s:
            timeout = min(timeout, self._watchdog_s)
        ready = mp_wait([*sentinels, self._wake_r], timeout=timeout)
        if self._wake_r in ready:
            try:
                os.read(self._wake_r, 4096)
            except OSError:
                pass

    def _publish_status(self) -> None:
        with self._lock:
            children = list(self._children.values())
            up = sum(c.state is ChildState.UP for c in children)
            not_up = [f"{c.cfg.name} {c.state}" for c in children if c.state is not ChildState.UP]
        text = f"{up}/{len(children)} devices up" + (f" ({', '.join(not_up)})" if not_up else "")
        if up == len(children) and not self._ready_sent:
            self._ready_sent = True
            self._last_status = text
            self._notify(f"READY=1\nSTATUS={text}")
            log.info("ready: %s", text)
        elif text != self._last_status:
            self._last_status = text
            self._notify(f"STATUS={text}")

    # ---------------------------------------------------------------- introspection

    def status(self) -> dict[str, Any]:
        """JSON-like snapshot for /health and the ops 'status' command."""
        now = time.monotonic()
        with self._lock:
            devices = {name: {
                "state": str(c.state),
                "up": c.state is ChildState.UP,
                "pid": c.pid,
                "restarts": c.restarts,
                "last_exit": c.last_exit,
                "uptime_s": round(now - c.up_since, 3) if c.up_since is not None else None,
                "rss_bytes": c.rss_bytes,
                "cpu_seconds": round(c.cpu_seconds, 3),
                "cpu_percent": c.cpu_percent,
                "engine_socket": c.cfg.engine_socket,
                "ops_socket": c.cfg.ops_socket,
                "peer_endpoint": c.cfg.peer_endpoint,
            } for name, c in self._children.items()}
        ready = all(d["up"] for d in devices.values())
        return {"ready": ready, "pid": os.getpid(),
                "uptime_s": round(now - self._started, 3), "devices": devices}

    def render_metrics(self) -> str:
        """Supervisor metrics plus every up child's metrics, merged into one exposition."""
        snap = self.status()
        up = [name for name, dev in snap["devices"].items() if dev["up"]]
        texts = fetch_child_metrics([snap["devices"][name]["ops_socket"] for name in up])
        scraped = {name: False for name in snap["devices"]}
        for name, text in zip(up, texts, strict=True):
            scraped[name] = text is not None
        return merge_metrics([_supervisor_families(snap, scraped)], [t for t in texts if t])

    # ---------------------------------------------------------------- HTTP

    def _start_http(self) -> None:
        if not self.node.metrics_port:
            return
        try:
            server = ThreadingHTTPServer((self.node.metrics_host, self.node.metrics_port),
                                         _Handler)
        except OSError as e:
            raise RuntimeError(f"cannot serve /metrics on {self.node.metrics_host}:"
                               f"{self.node.metrics_port}: {e.strerror}") from e
        server.daemon_threads = True
        server.supervisor = self  # type: ignore[attr-defined]
        self._http = server
        self.http_port = server.server_address[1]
        threading.Thread(target=server.serve_forever, name="kvpushd-http", daemon=True).start()
        log.info("serving /health and /metrics on http://%s:%d", self.node.metrics_host,
                 self.http_port)


def _psutil_process(pid: int) -> psutil.Process | None:
    try:
        p = psutil.Process(pid)
        p.cpu_percent(interval=None)  # prime: the first call always returns 0.0
        return p
    except psutil.Error:
        return None


class _Handler(BaseHTTPRequestHandler):
    server_version = "kvpushd"

    def do_GET(self) -> None:  # noqa: N802 (http.server API)
        sup: Supervisor = self.server.supervisor  # type: ignore[attr-defined]
        path = self.path.split("?", 1)[0]
        if path == "/health":
            snap = sup.status()
            body, ctype = json.dumps(snap).encode(), "application/json"
            code = 200 if snap["ready"] else 503
        elif path == "/metrics":
            body, ctype, code = sup.render_metrics().encode(), CONTENT_TYPE_LATEST, 200
        else:
            body, ctype, code = b"not found\n", "text/plain", 404
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        log.debug("http: " + format, *args)


# -------------------------------------------------------------------- metrics helpers

def fetch_child_metrics(endpoints: list[str], timeout_s: float = SCRAPE_TIMEOUT_S) -> list[str | None]:
    """Each child's Prometheus text over its ops socket (all asked at once), None for one
    that does not answer within ``timeout_s``. The children are up: no socket probe."""
    answers = opsclient.ask(endpoints, OpsRequest(cmd="metrics"), timeout_s, check=False)
    return [a.reply.text if isinstance(a.reply, MetricsReply) else None for a in answers]


def _supervisor_families(snap: dict[str, Any], scraped: dict[str, bool]) -> list[Metric]:
    devices = snap["devices"]
    fams = {
        "kvpush_ready": Metric("kvpush_ready", "1 when every device daemon is up", "gauge"),
        "up": Metric("kvpush_child_up", "1 when the device daemon is up", "gauge"),
        "restarts": Metric("kvpush_child_restarts", "Restarts of the device daemon", "counter"),
        "rss": Metric("kvpush_child_rss_bytes", "Resident memory of the device daemon", "gauge"),
        "cpu": Metric("kvpush_child_cpu_seconds", "CPU time of the current daemon process",
                      "counter"),
        "scrape": Metric("kvpush_child_metrics_ok",
                         "1 when the daemon's own metrics were fetched for this scrape", "gauge"),
    }
    fams["kvpush_ready"].add_sample("kvpush_ready", {}, 1.0 if snap["ready"] else 0.0)
    fams["build"] = Metric("kvpush_build", "What is installed: kvpush version, wire protocol, "
                           "python, nixl (value 1)", "info")
    fams["build"].add_sample("kvpush_build_info", build_info(), 1.0)
    for name, d in devices.items():
        lab = {"device": name}
        fams["up"].add_sample("kvpush_child_up", lab, 1.0 if d["up"] else 0.0)
        fams["restarts"].add_sample("kvpush_child_restarts_total", lab, float(d["restarts"]))
        fams["rss"].add_sample("kvpush_child_rss_bytes", lab, float(d["rss_bytes"]))
        fams["cpu"].add_sample("kvpush_child_cpu_seconds_total", lab, float(d["cpu_seconds"]))
        fams["scrape"].add_sample("kvpush_child_metrics_ok", lab, 1.0 if scraped[name] else 0.0)
    return list(fams.values())


class _Families:
    """A collector yielding fixed metric families (for generate_latest)."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterable[Metric]:
        return self._families


def merge_metrics(families: list[list[Metric]], texts: list[str]) -> str:
    """One exposition from several: a family seen in several children (one per device)
    must appear once, with all samples, or Prometheus rejects the whole scrape."""
    merged: dict[str, Metric] = {}
    parsed = [list(text_string_to_metric_families(t)) for t in texts]
    for fam in [f for group in families for f in group] + [f for p in parsed for f in p]:
        into = merged.get(fam.name)
        if into is None:
            into = merged[fam.name] = Metric(fam.name, fam.documentation, fam.type)
        if into.type == fam.type:
            into.samples.extend(fam.samples)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(merged.values()))  # type: ignore[arg-type]
    return generate_latest(registry).decode()
