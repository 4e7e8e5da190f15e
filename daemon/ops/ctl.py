"""``kvpushctl``: operator commands against the ops sockets of a node's device daemons.

    kvpushctl [--config FILE | --runtime-dir DIR] [--socket ipc://PATH | --device NAME]
              [--json] [--timeout S] [--watch S]
              {status,pending,peers,transfers,cancel TRANSFER_ID,drain,metrics,
               trace [TRANSFER_ID] [--router URL], doctor [--peer tcp://HOST:PORT]}

``doctor`` checks the whole node and names a fix for each failure (:mod:`kvpush.daemon.ops.doctor`;
exit 1 on any failure; ``--json``: ``{"command": "doctor", "ok", "findings": [{"check", "ok",
"detail", "fix"}]}``).

Which daemons: by default every daemon of the node, i.e. the ops sockets of the devices in
the config (``--config``, else /etc/kvpush/kvpushd.toml if it exists, else ``KVPUSH_*`` env
and defaults, exactly as kvpushd reads them) plus any ``{runtime_dir}/ops-*.sock`` not named
there (daemons started by hand with ``kvpushd worker``; names from :mod:`kvpush.proto.naming`). ``--socket`` or ``--device`` picks
one. All daemons are asked at once; each one that does not answer within ``--timeout`` is
reported down.

Wire: :mod:`kvpush.daemon.ops.client` (one ``OpsRequest`` frame per daemon, one
``OpsReply`` back); each reply is checked against its command's schema in
:mod:`kvpush.proto.ops`, and one that does not match counts as undecodable.

Exit codes (worst daemon wins, in this order): 3 permission denied on a socket or the
config file, 1 a daemon is down (no socket file, stale socket, no reply, undecodable or
malformed reply), 4 a daemon refused the command (e.g. cancel of a transfer it does not
hold), 2 usage or configuration error, 0 otherwise. ``cancel`` succeeds (0) if any daemon cancelled the
transfer: a transfer lives on one daemon, the others answer "not pending here".
Every error is one line on stderr, never a traceback.

``--json`` prints one object::

    {
      "command": "pending",              # the command that was run
      "daemons": [                       # one entry per daemon asked, in discovery order
        {
          "device": "cuda0" | null,      # from the config, else the daemon's own answer
          "socket": "ipc:///run/kvpush/ops-0.sock",
          "ok": true,                    # the daemon answered and accepted the command
          "error": null | "one line",    # why not ok (down, permission, refusal text)
          "data": {...} | null           # the daemon's OpsReply.data (see proto/ops.py);
        }                                #   null when it did not answer
      ]
    }

``data`` is the daemon's reply unchanged except for two additions made here:
``status`` gets ``"supervisor": {"state", "up", "restarts", "last_exit"} | null`` from the
supervisor's ``/health`` when that answers; every ``pending`` row gets ``"deadline_in_s"``
(seconds until its deadline, negative when overdue, null without one); the daemon's
``deadline`` is a CLOCK_MONOTONIC time, shared by all processes of the host.
``metrics`` data is ``{"text": "<Prometheus exposition>"}``.
``trace`` data is ``{"device", "clock": {"monotonic_ns", "wall_ns"}, "transfer_id",
"events": [[hop, monotonic_ns], ...]}`` (without an ID: ``"recent": [ids]``); the JSON adds
``"timeline": [{"t_ms", "delta_ms", "source", "hop"}]``, merged over every daemon and, with
``--router``, the router's own stamps (its ``/router/trace``). Same-host stamps share
CLOCK_MONOTONIC; a router on another host is aligned through both sides' wall clocks, so its
rows carry that clock's offset between the hosts as their uncertainty.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import socket
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO, TypeVar

import zmq

from kvpush import proto
from kvpush.daemon.config import (
    DEFAULT_CONFIG,
    ConfigError,
    NodeConfig,
    load_config,
    parse_device_name,
)
from kvpush.daemon.ops import client as opsclient
from kvpush.proto import naming
from kvpush.proto.buildinfo import version_line
from kvpush.proto.ops import (
    CancelReply,
    DecodePending,
    MetricsReply,
    OpsData,
    PeersReply,
    PendingReply,
    PrefillPending,
    StatusReply,
    TraceReply,
    TransfersReply,
)
from kvpush.proto.trace import ClockPair, Row, merge

DEFAULT_TIMEOUT_S = 2.0
HEALTH_TIMEOUT_S = 1.0

EXIT_OK = 0
EXIT_DOWN = 1
EXIT_USAGE = 2
EXIT_DENIED = 3
EXIT_REFUSED = 4

COMMANDS = {
    "status": "daemon and device status",
    "pending": "rendezvous waiting for register or prefill, with ages",
    "peers": "peer daemons and their state",
    "transfers": "transfers in flight and recently finished",
    "cancel": "cancel a pending transfer by ID",
    "drain": "refuse new transfers, finish the current ones",
    "metrics": "raw Prometheus text of each daemon",
    "trace": "one transfer's timeline across router, engines and daemons (no ID: recent IDs)",
    "doctor": "check this node (config, keys, daemons, engines, peers, transport); name fixes",
}
WATCHABLE = ("status", "pending", "peers", "transfers", "metrics")


class UsageError(Exception):
    """Bad flags or configuration: exit 2 (or 3 when ``code`` says permission)."""

    def __init__(self, message: str, code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.code = code


# --------------------------------------------------------------------------- targets

@dataclass
class Target:
    """One daemon to ask, and what came of it."""

    socket: str
    device: str | None = None
    outcome: str = "ok"  # ok | down | denied | refused (see opsclient.Answer)
    error: str | None = None
    reply: OpsData | None = None  # the typed data of an accepted reply
    answered_at: float = 0.0  # CLOCK_MONOTONIC when the reply came (pending: deadline-in)
    supervisor: dict[str, Any] | None = None  # its entry in the supervisor's /health
    timeline: list[dict[str, Any]] | None = None  # trace: the merged node timeline

    def label(self) -> str:
        return self.device or naming.ipc_path(self.socket) or self.socket

    @property
    def data(self) -> dict[str, Any] | None:
        """The daemon's reply data plus this tool's additions (module docstring)."""
        if self.reply is None:
            return {} if self.outcome == "refused" else None
        d = self.reply.to_data()
        if isinstance(self.reply, StatusReply):
            d["supervisor"] = self.supervisor
        elif isinstance(self.reply, PendingReply):
            for row, r in zip(d["pending"], self.reply.pending, strict=True):
                row["deadline_in_s"] = _deadline_in(r, self.answered_at)
        if self.timeline is not None:
            d["timeline"] = self.timeline
        return d

    def as_json(self) -> dict[str, Any]:
        return {"device": self.device, "socket": self.socket, "ok": self.outcome == "ok",
                "error": self.error, "data": self.data}


def _deadline_in(row: PrefillPending | DecodePending, now: float) -> float | None:
    return None if row.deadline is None else round(row.deadline - now, 3)


@dataclass
class Node:
    """What the config says about the node (None where kvpushctl could not tell)."""

    runtime_dir: str
    devices: dict[str, str] = field(default_factory=dict)  # name -> ops socket
    health_url: str | None = None


def _cuda_count_from_dev() -> int:
    """/dev/nvidiaN count: devices = "all" without importing torch (seconds, maybe CUDA)."""
    return len(glob.glob("/dev/nvidia[0-9]*"))


def load_node(config: str | None, runtime_dir: str | None) -> Node:
    """The node's runtime dir, device ops sockets and /health URL, from the same sources
    (file, env, defaults) that kvpushd uses."""
    path = config
    if path is None and "KVPUSH_CONFIG" not in os.environ and os.path.exists(DEFAULT_CONFIG):
        path = DEFAULT_CONFIG
    if path is not None and os.path.exists(path) and not os.access(path, os.R_OK):
        raise UsageError(f"permission denied reading config file {path}", EXIT_DENIED)
    try:
        node: NodeConfig = load_config(path, {"runtime_dir": runtime_dir},
                                       cuda_count=_cuda_count_from_dev)
    except ConfigError as e:
        raise UsageError(f"configuration error: {e}") from None
    url = None
    if node.metrics_port:
        host = node.metrics_host
        host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
        host = f"[{host}]" if ":" in host else host
        url = f"http://{host}:{node.metrics_port}/health"
    return Node(node.runtime_dir, {d.name: d.ops_socket for d in node.devices}, url)


def _norm(endpoint: str) -> str:
    path = naming.ipc_path(endpoint)
    return "ipc://" + os.path.realpath(path) if path else endpoint


def discover(node: Node, sock: str | None, device: str | None) -> list[Target]:
    """The daemons to ask: --socket, --device, or every configured + found one."""
    if sock:
        if "://" not in sock:
            sock = "ipc://" + os.path.abspath(sock)
        names = [n for n, ep in node.devices.items() if _norm(ep) == _norm(sock)]
        return [Target(sock, names[0] if names else None)]
    if device:
        if device in node.devices:
            return [Target(node.devices[device], device)]
        try:
            _, index = parse_device_name(device)
        except ConfigError as e:
            raise UsageError(str(e)) from None
        return [Target(naming.ops_socket(node.runtime_dir, index), device)]
    targets = [Target(ep, name) for name, ep in node.devices.items()]
    seen = {_norm(t.socket) for t in targets}
    for path in sorted(glob.glob(os.path.join(glob.escape(node.runtime_dir), naming.OPS_SOCKET_GLOB))):
        ep = "ipc://" + path
        if _norm(ep) not in seen:
            seen.add(_norm(ep))
            targets.append(Target(ep))
    return targets


# --------------------------------------------------------------------------- asking

def ask(targets: list[Target], req: proto.OpsRequest, timeout_s: float,
        ctx: zmq.Context | None = None) -> None:
    """Send ``req`` to every target not already known to be unreachable, at once (see
    :mod:`kvpush.daemon.ops.client`), and fill in each outcome."""
    live = [t for t in targets if t.outcome == "ok"]
    answers = opsclient.ask([t.socket for t in live], req, timeout_s, ctx)
    now = time.monotonic()
    for t, a in zip(live, answers, strict=True):
        t.outcome, t.error, t.reply, t.answered_at = a.outcome, a.error, a.reply, now
        device = getattr(a.reply, "device", None)
        if t.device is None and isinstance(device, str):
            t.device = device


def name_unknown(cmd: str, targets: list[Target], timeout_s: float) -> None:
    """Sockets found by globbing have no device name, and only some replies carry one:
    ask those daemons for their status first (cheap, local) to label their rows."""
    unnamed = [t for t in targets if t.device is None]
    if cmd == "status" or not unnamed:
        return
    probes = [Target(t.socket) for t in unnamed]
    ask(probes, proto.OpsRequest("status"), timeout_s)
    for t, probe in zip(unnamed, probes, strict=True):
        t.device = probe.device
        if probe.outcome in ("down", "denied"):  # do not wait for it a second time
            t.outcome, t.error = probe.outcome, probe.error


def fetch_health(url: str | None) -> dict[str, Any] | None:
    """The supervisor's /health JSON (also on 503), or None when it does not answer."""
    if url is None:
        return None
    try:
        with urllib.request.urlopen(url, timeout=HEALTH_TIMEOUT_S) as r:
            body = r.read()
    except urllib.error.HTTPError as e:
        body = e.read()
    except (urllib.error.URLError, OSError, ValueError):
        return None
    try:
        health = json.loads(body)
    except ValueError:
        return None
    return health if isinstance(health, dict) else None


def augment(cmd: str, targets: list[Target], health: dict[str, Any] | None) -> None:
    """Each target's entry in the supervisor's /health (``status`` shows it)."""
    devices = (health or {}).get("devices") or {}
    for t in targets:
        d = devices.get(t.device or "")
        if isinstance(d, dict):
            t.supervisor = {k: d.get(k) for k in ("state", "up", "restarts", "last_exit")}


def exit_code(cmd: str, targets: list[Target]) -> int:
    outcomes = {t.outcome for t in targets}
    if cmd == "cancel" and "ok" in outcomes:
        return EXIT_OK
    for outcome, code in (("denied", EXIT_DENIED), ("down", EXIT_DOWN), ("refused", EXIT_REFUSED)):
        if outcome in outcomes:
            return code
    return EXIT_OK


# --------------------------------------------------------------------------- rendering

def _size(n: Any) -> str:
    if not isinstance(n, (int, float)):
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return "-"  # unreachable


def _mode(r: Any) -> str:
    """A WRITE's part in its transfer: ``group 3`` (a layer group's), ``layerwise 6g`` (a final
    WRITE after 6 streamed parts), ``whole``; the decode side's rows have none."""
    group, mode = getattr(r, "group", 0), getattr(r, "mode", "")
    if group:
        return f"group {group}"
    if mode == "layerwise":
        return f"layerwise {r.groups}g"
    return mode or ("final" if r.side == "prefill" else "-")


def _ms(v: float | None) -> str:
    return f"{v:.1f} ms" if isinstance(v, (int, float)) else "-"


def _dur(s: Any) -> str:
    if not isinstance(s, (int, float)):
        return "-"
    sign, s = ("-" if s < 0 else ""), abs(s)
    if s < 60:
        return f"{sign}{s:.1f}s"
    m, sec = divmod(int(s), 60)
    if m < 60:
        return f"{sign}{m}m{sec:02d}s"
    h, m = divmod(m, 60)
    if h < 24:
        return f"{sign}{h}h{m:02d}m"
    d, h = divmod(h, 24)
    return f"{sign}{d}d{h:02d}h"


def _v(x: Any) -> str:
    return "-" if x is None or x == "" else str(x)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Left-aligned columns, two spaces apart, headers first."""
    cells = [list(headers)] + [[_v(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                     for r in cells)


_R = TypeVar("_R", bound=OpsData)


def _replies(targets: list[Target], cls: type[_R]) -> list[tuple[Target, _R]]:
    """The targets that answered with ``cls``, each with its reply."""
    return [(t, t.reply) for t in targets if t.outcome == "ok" and isinstance(t.reply, cls)]


def _status_rows(targets: list[Target]) -> list[list[Any]]:
    rows = []
    for t in targets:
        d = t.reply if t.outcome == "ok" and isinstance(t.reply, StatusReply) else None
        sup = t.supervisor or {}
        if d is None:  # the supervisor may still know why (backoff, crash-loop, ...)
            up = "denied" if t.outcome == "denied" else "no"
            if sup.get("state") not in (None, "up"):
                up = f"{up}({sup['state']})"
            rows.append([t.label(), up, None, None, None, None, None, None, None, None, None,
                         sup.get("restarts"), None])
            continue
        eng = d.engine
        rows.append([
            t.label(), "draining" if d.draining else "yes", d.pid,
            eng.role if eng else None,
            f"{eng.rank}/{eng.tp_size}" if eng else None,
            d.backend,
            (eng.engine_id if eng else "") or "(none)",
            _size(eng.memory_bytes) if eng else None,
            f"{d.peers.producers}/{d.peers.consumers}",
            "INSECURE" if d.peer_auth == "insecure" else f"curve:{d.node}",
            _dur(d.uptime_s),
            sup.get("restarts"),
            d.version,
        ])
    return rows


def _pending_rows(targets: list[Target]) -> list[list[Any]]:
    rows = []
    for t, rep in _replies(targets, PendingReply):
        for r in rep.pending:
            if isinstance(r, PrefillPending):
                blocks: int | None = r.blocks
                detail = (f"registered {r.registered}/{r.expected}" if r.attempt >= 0 or not r.blocks
                          else "held, no decode side registered yet (released at the lease)")
            else:
                blocks = None
                detail = f"notified {r.notified}/{r.producers}"
            rows.append([t.label(), r.transfer_id, None if r.attempt < 0 else r.attempt, r.side,
                         r.state, blocks, _dur(r.age), _dur(_deadline_in(r, t.answered_at)),
                         detail])
    return rows


def render(cmd: str, targets: list[Target]) -> str:
    """The human view of one command's answers."""
    if cmd == "status":
        return table(["DEVICE", "UP", "PID", "ROLE", "RANK", "BACKEND", "ENGINE", "MEMORY",
                      "PEERS P/C", "AUTH", "UPTIME", "RESTARTS", "PROTO"], _status_rows(targets))
    if cmd == "pending":
        rows = _pending_rows(targets)
        if not rows:
            return "no pending transfers"
        return table(["DEVICE", "TRANSFER", "ATTEMPT", "SIDE", "STATE", "BLOCKS", "AGE",
                      "DEADLINE-IN", "PROGRESS"], rows)
    if cmd == "peers":
        rows = [[t.label(), p.role, p.endpoint, p.state, p.engine_id, f"{p.rank}/{p.tp_size}",
                 _dur(p.last_seen_s), p.transfers, p.queued,
                 f"{p.write_mb_s:g} MB/s" if p.write_mb_s is not None else None, p.error]
                for t, rep in _replies(targets, PeersReply) for p in rep.peers]
        if not rows:
            return "no peers"
        return table(["DEVICE", "ROLE", "ENDPOINT", "STATE", "ENGINE", "RANK", "LAST-SEEN",
                      "TRANSFERS", "QUEUED", "WRITE-RATE", "ERROR"], rows)
    if cmd == "transfers":
        rows = []
        for t, rep in _replies(targets, TransfersReply):
            for r in [*rep.in_flight, *rep.recent]:
                lat = getattr(r, "latency_ms", None)  # absent while in flight
                rows.append([t.label(), r.transfer_id, r.attempt, r.side, r.result, _mode(r),
                             getattr(r, "bytes", None),  # the decode side counts no bytes
                             f"{lat:.3f} ms" if lat is not None else None,
                             _ms(getattr(r, "first_group_lag_ms", None)), _ms(getattr(r, "tail_ms", None)),
                             _dur(r.age_s), getattr(r, "error", None)])
        if not rows:
            return "no transfers"
        return table(["DEVICE", "TRANSFER", "ATTEMPT", "SIDE", "RESULT", "MODE", "BYTES", "LATENCY",
                      "1ST-GROUP-LAG", "TAIL", "AGE", "ERROR"], rows)
    if cmd == "cancel":
        return "\n".join(f"{t.label()}: cancelled {r.cancelled}" for t, r in _replies(targets, CancelReply))
    if cmd == "drain":
        return "\n".join(f"{t.label()}: draining" for t in targets if t.outcome == "ok" and t.reply)
    if cmd == "trace":
        return render_trace(targets)
    if cmd == "metrics":
        texts = _replies(targets, MetricsReply)
        return "".join(r.text if len(texts) == 1 else f"# kvpushctl: {t.label()}\n{r.text}"
                       for t, r in texts).rstrip("\n")
    raise ValueError(cmd)


def fetch_router_trace(url: str, tid: str) -> dict[str, Any] | None:
    """The router's stamps of ``tid`` (``/router/trace`` on its admin address; the token, if
    it wants one, from ``KVPUSH_ROUTER_ADMIN_TOKEN``), or None when it does not answer."""
    q = urllib.parse.urlencode({"transfer_id": tid})
    req = urllib.request.Request(f"{url.rstrip('/')}/router/trace?{q}")
    if os.environ.get("KVPUSH_ROUTER_ADMIN_TOKEN"):
        req.add_header("Authorization", f"Bearer {os.environ['KVPUSH_ROUTER_ADMIN_TOKEN']}")
    try:
        with urllib.request.urlopen(req, timeout=HEALTH_TIMEOUT_S) as r:
            data = json.loads(r.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def merge_trace(targets: list[Target], router: dict[str, Any] | None) -> list[dict[str, Any]]:
    """One timeline from every daemon's (and the router's) stamps, in this host's monotonic clock.

    Daemons of this node share CLOCK_MONOTONIC with us. The router may run elsewhere: its
    stamps go through its wall clock and ours (its monotonic->wall offset, then ours back).
    """
    rows: list[Row] = []
    for t, rep in _replies(targets, TraceReply):
        for hop, ns in rep.events or ():
            who = "engine" if ".plugin." in hop else "daemon"
            rows.append(Row(ns, f"{who} {t.label()}", hop))
    if router and router.get("events"):
        clk = router.get("clock") or {}
        here = ClockPair.read()
        shift = 0
        if router.get("host") != socket.gethostname() and "wall_ns" in clk:
            shift = (clk["wall_ns"] - clk["monotonic_ns"]) - (here.wall_ns - here.monotonic_ns)
        for hop, ns in router["events"]:
            rows.append(Row(int(ns) + shift, "router", hop))
    return [{"t_ms": round(t_ms, 3), "delta_ms": round(d_ms, 3), "source": r.source, "hop": r.hop}
            for r, t_ms, d_ms in merge(rows)]


def render_trace(targets: list[Target]) -> str:
    answered = _replies(targets, TraceReply)
    timeline = next((t.timeline for t, _ in answered if t.timeline is not None), None)
    if timeline is None:  # no ID given: the recent IDs each daemon knows
        ids: list[str] = []
        for _, rep in answered:
            for tid in rep.recent or ():
                if tid not in ids:
                    ids.append(tid)
        return "\n".join(ids) if ids else "no traced transfers"
    if not timeline:
        return "no stamps for this transfer on this node"
    return table(["T(ms)", "DELTA(ms)", "SOURCE", "HOP"],
                 [[f"{r['t_ms']:.3f}", f"+{r['delta_ms']:.3f}", r["source"], r["hop"]] for r in timeline])


# --------------------------------------------------------------------------- CLI

def _add_common(p: argparse.ArgumentParser) -> None:
    # SUPPRESS: options are accepted before and after the command without resetting.
    s = argparse.SUPPRESS
    p.add_argument("--config", metavar="FILE", default=s,
                   help=f"kvpushd config (default: {DEFAULT_CONFIG} if present)")
    p.add_argument("--runtime-dir", metavar="DIR", default=s, help="socket directory of kvpushd")
    who = p.add_mutually_exclusive_group()
    who.add_argument("--socket", metavar="ENDPOINT", default=s,
                     help="one daemon's ops socket (ipc://PATH or PATH)")
    who.add_argument("--device", metavar="NAME", default=s, help="one device, e.g. cuda0")
    p.add_argument("--json", action="store_true", default=s, help="machine-readable output")
    p.add_argument("--timeout", type=float, metavar="S", default=s,
                   help=f"seconds to wait for replies (default {DEFAULT_TIMEOUT_S:g})")
    p.add_argument("--watch", type=float, metavar="S", default=s,
                   help="refresh every S seconds until Ctrl-C")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvpushctl", description="inspect and steer the kvpushd daemons of this node",
        epilog="exit codes: 0 ok, 1 a daemon is down, 2 usage, 3 permission denied, "
               "4 command refused", allow_abbrev=False)
    parser.add_argument("--version", action="version", version=version_line("kvpushctl"))
    _add_common(parser)
    sub = parser.add_subparsers(dest="cmd", metavar="{" + ",".join(COMMANDS) + "}")
    for name, text in COMMANDS.items():
        p = sub.add_parser(name, help=text, description=text, allow_abbrev=False)
        _add_common(p)
        if name == "cancel":
            p.add_argument("transfer_id")
        if name == "trace":
            p.add_argument("transfer_id", nargs="?", default="")
            p.add_argument("--router", metavar="URL", default=None,
                           help="also merge this router's stamps: its admin address (e.g. http://127.0.0.1:8001; "
                                "a token from KVPUSH_ROUTER_ADMIN_TOKEN)")
        if name == "doctor":
            p.add_argument("--peer", metavar="ENDPOINT", action="append", default=[],
                           help="probe this peer daemon (tcp://HOST:PORT) instead of every "
                                "allowlisted node at this node's base_port (repeat for several)")
    return parser


def _node_for(ns: argparse.Namespace) -> Node:
    """The config; with --socket it only names devices, so an implicit one that fails to
    load (someone else's broken /etc file) does not stop a query of one socket."""
    config, runtime_dir = getattr(ns, "config", None), getattr(ns, "runtime_dir", None)
    try:
        return load_node(config, runtime_dir)
    except UsageError:
        if config is None and getattr(ns, "socket", None):
            return Node(runtime_dir or "/nonexistent")
        raise


def run_once(ns: argparse.Namespace, node: Node, out: TextIO, err: TextIO) -> int:
    cmd: str = ns.cmd
    targets = discover(node, getattr(ns, "socket", None), getattr(ns, "device", None))
    if not targets:
        print(f"kvpushctl: no daemons configured or found in {node.runtime_dir}", file=err)
        return EXIT_DOWN
    timeout = getattr(ns, "timeout", DEFAULT_TIMEOUT_S)
    name_unknown(cmd, targets, timeout)
    ask(targets, proto.OpsRequest(cmd, getattr(ns, "transfer_id", "")), timeout)
    health = fetch_health(node.health_url) if cmd == "status" else None
    augment(cmd, targets, health)
    code = exit_code(cmd, targets)
    if cmd == "trace" and ns.transfer_id:
        router_url = getattr(ns, "router", None)
        router = fetch_router_trace(router_url, ns.transfer_id) if router_url else None
        if router_url and router is None:
            print(f"kvpushctl: router {router_url} did not answer /router/trace", file=err)
        timeline = merge_trace(targets, router)
        for t in targets:
            if t.outcome == "ok" and t.reply is not None:
                t.timeline = timeline
                break
        if not timeline and code == EXIT_OK:
            code = EXIT_REFUSED
    if getattr(ns, "json", False):
        out.write(json.dumps({"command": cmd, "daemons": [t.as_json() for t in targets]},
                             indent=2) + "\n")
    else:
        text = render(cmd, targets)
        if text:
            out.write(text + "\n")
    quiet_refusals = cmd == "cancel" and code == EXIT_OK
    for t in targets:
        if t.outcome != "ok" and not (quiet_refusals and t.outcome == "refused"):
            print(f"kvpushctl: {t.label()}: {t.error}", file=err)
    out.flush()
    return code


def main(argv: Sequence[str] | None = None, out: TextIO | None = None,
         err: TextIO | None = None, sleep: Callable[[float], None] = time.sleep) -> int:
    out = out or sys.stdout
    err = err or sys.stderr
    parser = build_parser()
    try:
        ns = parser.parse_args(argv)
    except SystemExit as e:  # argparse printed the usage; keep its code (2, or 0 for -h)
        return int(e.code or 0)
    if ns.cmd is None:
        parser.print_usage(err)
        print("kvpushctl: a command is required", file=err)
        return EXIT_USAGE
    if getattr(ns, "socket", None) and getattr(ns, "device", None):
        print("kvpushctl: give --socket or --device, not both", file=err)
        return EXIT_USAGE
    watch = getattr(ns, "watch", None)
    if watch is not None and (watch <= 0 or ns.cmd not in WATCHABLE):
        print(f"kvpushctl: --watch needs a positive interval and one of {', '.join(WATCHABLE)}",
              file=err)
        return EXIT_USAGE
    if getattr(ns, "timeout", DEFAULT_TIMEOUT_S) <= 0:
        print("kvpushctl: --timeout must be positive", file=err)
        return EXIT_USAGE
    if ns.cmd == "doctor":
        from kvpush.daemon.ops import doctor

        config = getattr(ns, "config", None)
        if config is None and "KVPUSH_CONFIG" not in os.environ and os.path.exists(DEFAULT_CONFIG):
            config = DEFAULT_CONFIG
        return doctor.run(config, getattr(ns, "runtime_dir", None), getattr(ns, "socket", None),
                          ns.peer, getattr(ns, "timeout", DEFAULT_TIMEOUT_S), out,
                          as_json=getattr(ns, "json", False))
    longest = proto.Limits().max_str  # the daemon could not even decode a longer request
    if len(getattr(ns, "transfer_id", "")) > longest:
        print(f"kvpushctl: a transfer ID has at most {longest} characters", file=err)
        return EXIT_USAGE
    try:
        node = _node_for(ns)
        if watch is None:
            return run_once(ns, node, out, err)
        code = EXIT_OK
        with contextlib.suppress(KeyboardInterrupt):
            while True:
                out.write("\033[H\033[2J")  # home + clear, as watch(1) does
                out.write(f"kvpushctl {ns.cmd}  (every {watch:g}s, Ctrl-C to stop)  "
                          f"{time.strftime('%H:%M:%S')}\n\n")
                code = run_once(ns, node, out, err)
                sleep(watch)
        return code
    except UsageError as e:
        print(f"kvpushctl: {e}", file=err)
        return e.code
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # an operator tool prints one line, never a traceback
        print(f"kvpushctl: internal error: {type(e).__name__}: {e}", file=err)
        return EXIT_DOWN


if __name__ == "__main__":
    sys.exit(main())
