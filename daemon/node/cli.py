"""``kvpushd``: run the node supervisor, one device daemon alone, or show the config.

    kvpushd [--config FILE] [--devices all|cpu0,cpu1] [--runtime-dir DIR] [--base-port N]
            [--metrics-port N] [--backend UCX|LIBFABRIC] [--log-level LEVEL]
            [--log-format text|json]
    kvpushd worker --device cuda0 [same flags]    # one accelerator's daemon, foreground
    kvpushd print-config [--format toml|json] [same flags]
    kvpushd keygen --dir /etc/kvpush --host 10.0.0.5 [--host ...] [--name NODE] [--role prefill|decode ...]

Flags beat ``KVPUSH_*`` environment variables, which beat the TOML file (see daemon_config.py).
Exit codes: 0 clean stop, 1 runtime failure, 2 usage or configuration error.
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
from collections.abc import Sequence
from typing import Any

from kvpush.daemon.config import (
    BACKENDS,
    DEVICE_KINDS,
    KEY_DOCS,
    LOG_FORMATS,
    LOG_LEVELS,
    ConfigError,
    dump_json,
    dump_toml,
    load_config,
)
from kvpush.daemon.node import sdnotify
from kvpush.proto.buildinfo import version_line

log = logging.getLogger(__name__)

# flag dest -> config key (same names: the flags are the top-level config keys)
FLAG_KEYS = ("config", "devices", "count", "device_kind", "runtime_dir", "base_port",
             "peer_host", "advertise_host", "metrics_host", "metrics_port", "backend",
             "log_level", "log_format")


def _add_common(p: argparse.ArgumentParser) -> None:
    # SUPPRESS: a flag given before the subcommand is not reset by the subparser's default.
    # Help texts are the config schema's docs (the flags are its top-level keys).
    s = argparse.SUPPRESS
    p.add_argument("--config", metavar="FILE", default=s, help=KEY_DOCS["config"])
    p.add_argument("--devices", default=s, help=KEY_DOCS["devices"])
    p.add_argument("--count", type=int, default=s, help=KEY_DOCS["count"])
    p.add_argument("--device-kind", choices=("auto", *DEVICE_KINDS), default=s,
                   help=KEY_DOCS["device_kind"])
    p.add_argument("--runtime-dir", metavar="DIR", default=s, help=KEY_DOCS["runtime_dir"])
    p.add_argument("--base-port", type=int, default=s, help=KEY_DOCS["base_port"])
    p.add_argument("--peer-host", default=s, help=KEY_DOCS["peer_host"])
    p.add_argument("--advertise-host", default=s, help=KEY_DOCS["advertise_host"])
    p.add_argument("--metrics-host", default=s, help=KEY_DOCS["metrics_host"])
    p.add_argument("--metrics-port", type=int, default=s, help=KEY_DOCS["metrics_port"])
    p.add_argument("--backend", type=str.upper, choices=BACKENDS, default=s,
                   help=KEY_DOCS["backend"])
    p.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS, default=s,
                   help=KEY_DOCS["log_level"])
    p.add_argument("--log-format", choices=LOG_FORMATS, default=s, help=KEY_DOCS["log_format"])


def build_parser() -> argparse.ArgumentParser:
    # allow_abbrev=False: the parent parser sees every argument, and `--device` would be an
    # ambiguous abbreviation of --devices / --device-kind there.
    parser = argparse.ArgumentParser(
        prog="kvpushd", description="kvpush node daemon: one KV-push daemon per accelerator",
        allow_abbrev=False)
    parser.add_argument("--version", action="version", version=version_line("kvpushd"))
    _add_common(parser)
    sub = parser.add_subparsers(dest="cmd", metavar="{worker,print-config,keygen}")
    w = sub.add_parser("worker", help="run one accelerator's daemon in the foreground",
                       allow_abbrev=False)
    w.add_argument("--device", required=True, help="device name, e.g. cpu0 or cuda1")
    _add_common(w)
    pc = sub.add_parser("print-config", help="print the effective configuration",
                        allow_abbrev=False)
    pc.add_argument("--format", choices=("toml", "json"), default="toml")
    _add_common(pc)
    kg = sub.add_parser("keygen", help="make this node's peer key pair (CURVE certificates)",
                        allow_abbrev=False,
                        description="Writes DIR/NAME.key_secret (keep it, mode 0600: the config's "
                        "curve_secret_key_file) and DIR/NAME.key (public: copy it into every "
                        "allowed node's authorized_keys_dir, this node's included).")
    kg.add_argument("--dir", required=True, help="where to write the key pair")
    kg.add_argument("--host", action="append", required=True,
                    help="an address this node's daemons advertise (repeat for several)")
    kg.add_argument("--name", default=None, help="node name (default: the host name)")
    kg.add_argument("--role", action="append", choices=("prefill", "decode"), default=None,
                    help="what other nodes may use this node's daemons as (repeat for both; "
                    "default both): a decode daemon dials only nodes of the prefill role, a "
                    "prefill daemon takes Hellos only from nodes of the decode role")
    return parser


def keygen(ns: argparse.Namespace) -> int:
    import socket

    from kvpush.daemon.trust.peerauth import PeerAuthError
    from kvpush.daemon.trust.peerauth import keygen as make

    try:
        pub, sec = make(ns.dir, ns.name or socket.gethostname().split(".")[0], ns.host, ns.role)
    except PeerAuthError as e:
        print(f"kvpushd keygen: {e}", file=sys.stderr)
        return 2
    print(f"secret: {sec}\npublic: {pub}")
    return 0


class _ForegroundReady:
    """ready_event for `kvpushd worker`: tells systemd directly (no supervisor in between)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._event = threading.Event()

    def set(self) -> None:
        if not self._event.is_set():
            self._event.set()
            sdnotify.notify(f"READY=1\nSTATUS={self._name} up")
            log.info("%s is up", self._name)

    def is_set(self) -> bool:
        return self._event.is_set()


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    cmd = ns.cmd or "run"
    if cmd == "keygen":
        return keygen(ns)
    overrides: dict[str, Any] = {k: getattr(ns, k, None) for k in FLAG_KEYS}
    if cmd == "worker":
        overrides["devices"], overrides["count"] = [ns.device], None
    try:
        node = load_config(None, overrides)
    except ConfigError as e:
        print(f"kvpushd: configuration error: {e}", file=sys.stderr)
        return 2
    if cmd == "print-config":
        sys.stdout.write(dump_json(node) + "\n" if ns.format == "json" else dump_toml(node))
        return 0
    from kvpush.daemon.node.supervisor import Supervisor, configure_logging, ensure_runtime_dir
    from kvpush.daemon.trust.peerauth import PeerAuth, PeerAuthError

    configure_logging(node.log_level, node.log_format)
    try:  # fail at once with the reason, rather than crash-looping every worker on it
        for dev in node.devices:
            if not dev.insecure_peers:
                PeerAuth.load(dev.curve_secret_key_file, dev.authorized_keys_dir)
    except PeerAuthError as e:
        print(f"kvpushd: {e}", file=sys.stderr)
        return 2
    try:
        if cmd == "worker":
            cfg = node.devices[0]
            configure_logging(cfg.log_level, cfg.log_format)
            ensure_runtime_dir(cfg.runtime_dir, cfg.socket_mode)
            from kvpush.daemon.device_daemon import run_device_daemon

            return run_device_daemon(cfg, ready_event=_ForegroundReady(cfg.name))
        return Supervisor(node).run()
    except (RuntimeError, OSError, ValueError) as e:  # PeerAuthError: no keys, and not insecure
        log.error("%s", e)
        return 1


if __name__ == "__main__":
    sys.exit(main())
