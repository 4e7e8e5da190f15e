"""Where a node's daemons listen locally: socket names defined once.

kvpushd binds these, ``kvpushctl`` discovers them, the engine plugin's config template and
the test harnesses point at them; all of them spell the names through this module.
"""

from __future__ import annotations

ENGINE_SOCKET_TEMPLATE = "ipc://{runtime_dir}/engine-{index}.sock"
OPS_SOCKET_TEMPLATE = "ipc://{runtime_dir}/ops-{index}.sock"
OPS_SOCKET_GLOB = "ops-*.sock"  # in runtime_dir: every local daemon's ops socket
TEMPLATE_FIELDS = ("runtime_dir", "index", "name")  # placeholders a socket template may use


def engine_socket(runtime_dir: str, index: int) -> str:
    """The default engine socket of device ``index`` (the plugin's ``daemon`` key names it)."""
    return ENGINE_SOCKET_TEMPLATE.format(runtime_dir=runtime_dir, index=index)


def ops_socket(runtime_dir: str, index: int) -> str:
    """The default ops socket of device ``index`` (kvpushctl talks to it)."""
    return OPS_SOCKET_TEMPLATE.format(runtime_dir=runtime_dir, index=index)


def ipc_path(endpoint: str) -> str | None:
    """The filesystem path of an ``ipc://`` endpoint; None for any other scheme."""
    return endpoint[len("ipc://"):] if endpoint.startswith("ipc://") else None
