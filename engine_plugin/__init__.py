"""kvpush.engine_plugin: the thin vLLM side of kvpush.

``KVPushConnector`` is resolved lazily so that ``kvpush.engine_plugin.link.client``
(and the daemon's tests) import without vLLM installed.
"""

from typing import Any

__all__ = ["KVPushConnector"]


def __getattr__(name: str) -> Any:
    if name == "KVPushConnector":
        from kvpush.engine_plugin.connector import KVPushConnector

        return KVPushConnector
    raise AttributeError(name)
