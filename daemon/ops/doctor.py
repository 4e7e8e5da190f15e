"""``kvpushctl doctor``: one screen that says whether this node can serve, and what to fix.

Checks, in order (a failed one names its fix; any failure exits 1):

1. config      the kvpushd config loads (the same sources kvpushd reads);
2. keys        this node's key pair and allowlist load (or insecure_peers is set, said);
3. daemon      each configured daemon answers on its ops socket. A socket that is missing
               where this command looked while the config's own runtime_dir has live
               daemons is a wrong socket path (--socket / --runtime-dir / KVPUSH_RUNTIME_DIR),
               not a daemon that is down;
4. engine      an engine rank is attached to each daemon;
5. peers       every allowlisted node (each host its certificate lists, at this node's
               base_port; or each ``--peer`` endpoint) is reachable and accepts this node's
               key: a real CURVE handshake, as the daemons do it; plus the peer links the
               daemons report in error;
6. transport   what can be told about the UCX transport of a WRITE (NIXL does not report it).

Facts are gathered by the shell functions here; each check is a plain function of facts to
:class:`Finding` rows, and :func:`render` draws them.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TextIO

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvpush import proto
from kvpush.daemon.config import ConfigError, DeviceConfig, NodeConfig, load_config
from kvpush.daemon.ops import client as opsclient
from kvpush.daemon.trust.peerauth import NodeCert, PeerAuth, PeerAuthError, endpoint_host
from kvpush.proto import naming
from kvpush.proto.ops import PeersReply, StatusReply

PROBE_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class Finding:
    check: str
    ok: bool
    detail: str
    fix: str = ""


@dataclass
class Facts:
    """What the shell found out (inputs of the checks)."""

    config_path: str | None
    node: NodeConfig | None = None
    config_error: str = ""
    looked_in: str = ""  # the runtime dir (or socket) this command asked
    sockets: dict[str, str] = field(default_factory=dict)  # device -> ops endpoint asked
    status: dict[str, StatusReply] = field(default_factory=dict)
    down: dict[str, str] = field(default_factory=dict)  # device -> why it did not answer
    configured_live: list[str] = field(default_factory=list)  # live ops sockets in the config's dir
    peers: dict[str, PeersReply] = field(default_factory=dict)
    daemon_env: dict[str, dict[str, str]] = field(default_factory=dict)


# --------------------------------------------------------------------------- checks (pure)

def check_config(f: Facts) -> list[Finding]:
    where = f.config_path or "defaults (no config file)"
    if f.node is None:
        return [Finding("config", False, f"{where}: {f.config_error}",
                        f"fix the file ({where}); `kvpushd print-config` shows what loads")]
    devs = ", ".join(d.name for d in f.node.devices)
    return [Finding("config", True, f"{where}: devices {devs}, runtime_dir {f.node.runtime_dir}")]


def check_keys(dev: DeviceConfig) -> tuple[list[Finding], PeerAuth | None]:
    if dev.insecure_peers:
        return [Finding("keys", True, "insecure_peers = true: peers are NOT authenticated "
                        "(anyone reaching the peer port gets NIXL access to the KV memory)")], None
    try:
        auth = PeerAuth.load(dev.curve_secret_key_file, dev.authorized_keys_dir)
    except PeerAuthError as e:
        key_dir = os.path.dirname(dev.curve_secret_key_file) or "."
        return [Finding("keys", False, str(e),
                        f"kvpushd keygen --dir {key_dir} --host <this node's address>, then put "
                        f"the public .key files of this node and its peers in "
                        f"{dev.authorized_keys_dir}")], None
    names = sorted(auth.allow.names())
    if auth.me.name not in names:
        return [Finding("keys", False, f"this node ({auth.me.name}) is not in its own allowlist "
                        f"{dev.authorized_keys_dir}",
                        f"copy {_public_of(dev)} into {dev.authorized_keys_dir}")], auth
    return [Finding("keys", True, f"node {auth.me.name} (hosts {', '.join(auth.me.hosts)}); "
                    f"allowlist: {', '.join(names)}")], auth


def check_daemons(f: Facts) -> list[Finding]:
    out = []
    for dev, ep in f.sockets.items():
        st = f.status.get(dev)
        if st is not None:
            out.append(Finding(f"daemon {dev}", True, f"pid {st.pid}, up {st.uptime_s:.0f} s, "
                               f"protocol {st.version}, peer {st.peer_endpoint} ({st.peer_auth})"))
            continue
        why = f.down.get(dev, "no answer")
        if f.configured_live and f.node is not None and \
                os.path.realpath(f.looked_in) != os.path.realpath(f.node.runtime_dir):
            out.append(Finding(f"daemon {dev}", False,
                               f"wrong socket path: nothing answers at {naming.ipc_path(ep) or ep} "
                               f"({why}), but kvpushd serves {', '.join(f.configured_live)}",
                               f"drop --socket/--runtime-dir (or KVPUSH_RUNTIME_DIR), or point "
                               f"them at {f.node.runtime_dir}; engines need the matching "
                               f"engine socket in their kv_connector_extra_config"))
        else:
            out.append(Finding(f"daemon {dev}", False, f"down: nothing answers at "
                               f"{naming.ipc_path(ep) or ep} ({why})",
                               "start it: systemctl start kvpushd (why it stopped: journalctl "
                               "-u kvpushd), or kvpushd --config FILE in a shell"))
    return out


def check_engines(f: Facts) -> list[Finding]:
    out = []
    for dev, st in f.status.items():
        if st.engine is None:
            out.append(Finding(f"engine {dev}", False, "no engine attached",
                               f'start the vLLM engine with "daemon": '
                               f'"{st.engine_socket}" in kv_connector_extra_config (the rank '
                               "attaches at start); its user needs the group of the socket "
                               f"directory ({os.path.dirname(naming.ipc_path(st.engine_socket) or '')})"))
        else:
            e = st.engine
            out.append(Finding(f"engine {dev}", True, f"{e.engine_id} rank {e.rank}/{e.tp_size} "
                               f"{e.role}, {e.blocks} blocks of {e.block_size} tokens, "
                               f"{e.memory_bytes / 2**20:.0f} MiB"))
    return out


def check_peer_links(f: Facts) -> list[Finding]:
    out = []
    for dev, reply in f.peers.items():
        bad = [r for r in reply.peers if r.error]
        for r in bad:
            fix = ("put that node's public .key into authorized_keys_dir (this node dials only "
                   "hosts an allowlisted certificate lists)" if "no authorized node" in r.error
                   else "check that the peer's kvpushd runs and this node is in its allowlist")
            out.append(Finding(f"link {dev}", False, f"{r.role} {r.endpoint}: {r.state}: {r.error}", fix))
        ready = [r for r in reply.peers if not r.error]
        if ready:
            out.append(Finding(f"links {dev}", True, ", ".join(
                f"{r.role} {r.node or r.endpoint} {r.state}" for r in ready)))
    return out


def check_transport(f: Facts) -> list[Finding]:
    out = []
    for dev, st in f.status.items():
        env = f.daemon_env.get(dev)
        tls = (env or {}).get("UCX_TLS")
        if env is None:
            tls_text = "UCX_TLS: unknown (cannot read the daemon's environment as this user)"
        elif tls:
            tls_text = f"UCX_TLS={tls}"
        else:
            tls_text = ("UCX_TLS unset: UCX picks per peer, shared memory (posix/sysv/cma) on "
                        "this host, else tcp or RDMA (rc/ud/dc) when a device is present")
        links = f.peers.get(dev)
        local = remote = 0
        if links is not None:
            here = endpoint_host(st.peer_endpoint)
            for r in links.peers:
                if endpoint_host(r.endpoint) in (here, "127.0.0.1", "localhost", "::1"):
                    local += 1
                else:
                    remote += 1
        out.append(Finding(f"transport {dev}", st.backend in ("UCX", "LIBFABRIC"),
                           f"NIXL does not report which transport carried a WRITE (per WRITE it "
                           f"tells only its backend and telemetry: times, bytes). Known: "
                           f"backend {st.backend}; {tls_text}; peers on this host {local}, "
                           f"remote {remote}. UCX_PROTO_INFO=y in kvpushd's environment makes "
                           f"UCX log the protocol and transport it selects"))
    return out


def render(findings: Sequence[Finding]) -> str:
    width = max((len(x.check) for x in findings), default=0)
    lines = []
    for x in findings:
        lines.append(f"{'ok  ' if x.ok else 'FAIL'}  {x.check:<{width}}  {x.detail}")
        if not x.ok and x.fix:
            lines.append(f"      {'':<{width}}  fix: {x.fix}")
    failed = sum(not x.ok for x in findings)
    lines.append(f"doctor: {'all checks passed' if not failed else f'{failed} check(s) failed'}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- the shell

def _public_of(dev: DeviceConfig) -> str:
    return os.path.splitext(dev.curve_secret_key_file)[0] + ".key"


def _environ(pid: int) -> dict[str, str] | None:
    try:
        raw = open(f"/proc/{pid}/environ", "rb").read()  # noqa: SIM115
    except OSError:
        return None
    return dict(x.decode(errors="replace").partition("=")[::2] for x in raw.split(b"\0") if b"=" in x)


def probe_peers(auth: PeerAuth, endpoints: Sequence[str], timeout_s: float) -> dict[str, str]:
    """CURVE-handshake each endpoint as this node (as the daemons dial): endpoint -> "" when
    the peer accepted this node's key, else what went wrong. All at once, bounded."""
    events = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
              | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
              | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
    ctx = zmq.Context()
    result: dict[str, str] = {}
    mons: dict[zmq.Socket, str] = {}
    socks: list[zmq.Socket] = []  # referenced until the end: a collected socket is closed
    seen: dict[str, str] = {}
    try:
        for ep in endpoints:
            cert = auth.allow.server_for(endpoint_host(ep))
            if cert is None:
                result[ep] = (f"no allowlisted certificate lists host {endpoint_host(ep)!r} (or "
                              "several do): the daemons will not dial it")
                continue
            s = ctx.socket(zmq.DEALER)
            socks.append(s)
            s.linger = 0
            s.curve_secretkey, s.curve_publickey, s.curve_serverkey = auth.secret, auth.me.public, cert.public
            mons[s.get_monitor_socket(events)] = ep
            s.connect(ep)
            seen[ep] = "not reachable (nothing accepted the connection)"
        poller = zmq.Poller()
        for m in mons:
            poller.register(m, zmq.POLLIN)
        deadline = time.monotonic() + timeout_s
        pending = set(mons.values())
        while pending and (left := deadline - time.monotonic()) > 0:
            for m, _ in poller.poll(int(left * 1000) + 1):
                ep = mons[m]
                ev = recv_monitor_message(m)["event"]
                if ev == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    result[ep] = ""
                elif ev == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                    result[ep] = "refused this node's key (this node is not in its allowlist)"
                elif ev in (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL):
                    result[ep] = ("handshake failed: the key this node has for it is not the "
                                  "one it serves with, or it is not a kvpushd peer port")
                elif ev == zmq.EVENT_CONNECTED:
                    seen[ep] = "connected, but no CURVE handshake completed in time"
                elif ev == zmq.EVENT_DISCONNECTED and ep not in result:
                    seen[ep] = "connected, then the peer closed the connection during the handshake"
                if ep in result:
                    pending.discard(ep)
        for ep in pending:
            result[ep] = f"{seen[ep]} within {timeout_s:g} s"
    finally:
        ctx.destroy(linger=0)
    return result


def check_peers(auth: PeerAuth, dev: DeviceConfig, base_port: int, explicit: Sequence[str],
                timeout_s: float) -> list[Finding]:
    targets: dict[str, NodeCert | None] = {}
    if explicit:
        for ep in explicit:
            targets[ep] = auth.allow.server_for(endpoint_host(ep))
    elif base_port:
        for name in sorted(auth.allow.names() - {auth.me.name}):
            cert = auth.allow.named(name)
            for host in (cert.hosts if cert else ()):
                h = f"[{host}]" if ":" in host else host
                targets[f"tcp://{h}:{base_port}"] = cert
    if not targets:
        if not explicit and base_port == 0 and len(auth.allow.names()) > 1:
            return [Finding("peers", True, "base_port is 0 (ephemeral): the peers' ports are "
                            "unknown here; name them with --peer tcp://HOST:PORT")]
        return [Finding("peers", True, "no other node in the allowlist (single node)")]
    got = probe_peers(auth, list(targets), timeout_s)
    out = []
    for ep, cert in targets.items():
        who = cert.name if cert else ep
        if not got[ep]:
            out.append(Finding(f"peer {who}", True, f"{ep}: reachable, accepts this node's key"))
        elif cert is None:
            out.append(Finding(f"peer {ep}", False, got[ep],
                               f"put that node's public .key file into {dev.authorized_keys_dir}"))
        elif "refused this node's key" in got[ep]:
            out.append(Finding(f"peer {who}", False, f"{ep}: {got[ep]}",
                               f"copy {_public_of(dev)} into {who}'s authorized_keys_dir"))
        else:
            out.append(Finding(f"peer {who}", False, f"{ep}: {got[ep]}",
                               f"start kvpushd on {who}; check that it listens there "
                               "(peer_host, base_port) and that the firewall lets the port through"))
    return out


def gather(config: str | None, runtime_dir: str | None, sock: str | None,
           timeout_s: float) -> tuple[Facts, DeviceConfig | None]:
    f = Facts(config)
    try:
        f.node = load_config(config, {"runtime_dir": runtime_dir})
    except ConfigError as e:
        f.config_error = str(e)
        return f, None
    base = f.node
    try:  # the config's own runtime_dir, as kvpushd would use it (no --runtime-dir override)
        configured = load_config(config).runtime_dir
    except ConfigError:
        configured = base.runtime_dir
    if sock:
        sock = sock if "://" in sock else "ipc://" + os.path.abspath(sock)
        f.sockets = {base.devices[0].name if len(base.devices) == 1 else sock: sock}
        f.looked_in = os.path.dirname(naming.ipc_path(sock) or "")
    else:
        f.sockets = {d.name: d.ops_socket for d in base.devices}
        f.looked_in = base.runtime_dir
    if os.path.realpath(f.looked_in) != os.path.realpath(configured):
        base = load_config(config)  # the node as configured: where the daemons really are
        f.node = base
        live = sorted(glob.glob(os.path.join(glob.escape(configured), naming.OPS_SOCKET_GLOB)))
        answers = opsclient.ask(["ipc://" + p for p in live], proto.OpsRequest("status"), timeout_s)
        f.configured_live = [p for p, a in zip(live, answers, strict=True) if a.outcome == "ok"]
    names = list(f.sockets)
    for cmd in ("status", "peers"):
        answers = opsclient.ask([f.sockets[n] for n in names], proto.OpsRequest(cmd), timeout_s)
        for n, a in zip(names, answers, strict=True):
            if isinstance(a.reply, StatusReply):
                f.status[n] = a.reply
                env = _environ(a.reply.pid)
                if env is not None:
                    f.daemon_env[n] = env
            elif isinstance(a.reply, PeersReply):
                f.peers[n] = a.reply
            elif cmd == "status":
                f.down[n] = a.error or a.outcome
    return f, base.devices[0]


def run(config: str | None, runtime_dir: str | None, sock: str | None, peers: Sequence[str],
        timeout_s: float, out: TextIO, as_json: bool = False) -> int:
    facts, dev = gather(config, runtime_dir, sock, timeout_s)
    findings = check_config(facts)
    if dev is not None and facts.node is not None:
        keys, auth = check_keys(dev)
        findings += keys
        findings += check_daemons(facts)
        findings += check_engines(facts)
        if auth is not None:
            findings += check_peers(auth, dev, facts.node.devices[0].peer_port or 0, peers,
                                    max(timeout_s, PROBE_TIMEOUT_S))
        findings += check_peer_links(facts)
        findings += check_transport(facts)
    ok = all(x.ok for x in findings)
    if as_json:
        out.write(json.dumps({"command": "doctor", "ok": ok,
                              "findings": [dataclasses.asdict(x) for x in findings]}, indent=2) + "\n")
    else:
        out.write(render(findings) + "\n")
    return 0 if ok else 1
