"""What this install is: the kvpush version, the wire protocol, the interpreter, NIXL's version.

Why here: the daemon, the router and every CLI report the same facts (``--version``,
``kvpush_build_info``), and proto/ is the one package all of them (the plugin included) may
import. NIXL's version is read from the installed distribution's metadata, never by importing
NIXL: the plugin must not import it, and a router node need not have it.
"""

from __future__ import annotations

import platform
from importlib import metadata

from kvpush.proto.messages import PROTOCOL_VERSION

DIST = "kvpush"
# NIXL ships as `nixl` (a meta package) over one CUDA build, `nixl-cu12` or `nixl-cu13`.
NIXL_DISTS = ("nixl", "nixl-cu12", "nixl-cu13")


def version() -> str:
    """The installed kvpush version ("0+unknown" when run from a tree that is not installed)."""
    try:
        return metadata.version(DIST)
    except metadata.PackageNotFoundError:
        return "0+unknown"


def nixl_version() -> str:
    """The installed NIXL's version, or "" when NIXL is not installed (plugin, router nodes)."""
    for dist in NIXL_DISTS:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return ""


def build_info() -> dict[str, str]:
    """The labels of ``kvpush_build_info`` (one series, value 1)."""
    return {
        "version": version(),
        "protocol": str(PROTOCOL_VERSION),
        "python": platform.python_version(),
        "nixl": nixl_version(),
    }


def version_line(prog: str) -> str:
    """What ``PROG --version`` prints."""
    info = build_info()
    nixl = f", nixl {info['nixl']}" if info["nixl"] else ", no nixl"
    return f"{prog} {info['version']} (protocol {info['protocol']}, python {info['python']}{nixl})"
