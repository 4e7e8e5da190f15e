"""``kvpushctl``: operator commands against a device daemon's ops socket (stub).

The command set is fixed here so scripts and docs can rely on it; the requests themselves
(OpsRequest over the ops socket) are filled in by a later change.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

COMMANDS = {
    "status": "daemon and device status",
    "pending": "rendezvous waiting for register or prefill, with ages",
    "peers": "peer daemons and their state",
    "transfers": "transfers in flight",
    "cancel": "cancel a transfer by id",
    "drain": "stop accepting new transfers, finish the current ones",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvpushctl", description="inspect and steer kvpushd")
    parser.add_argument("--device", default="all", help="device name (e.g. cuda0) or all")
    parser.add_argument("--runtime-dir", metavar="DIR", help="socket directory of kvpushd")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    sub = parser.add_subparsers(dest="cmd", metavar="{" + ",".join(COMMANDS) + "}")
    for name, text in COMMANDS.items():
        p = sub.add_parser(name, help=text)
        if name == "cancel":
            p.add_argument("transfer_id")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)  # unknown commands/flags: usage error, exit 2
    if ns.cmd is None:
        parser.print_help(sys.stderr)
        return 2
    print(f"kvpushctl: '{ns.cmd}' is not implemented yet", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
