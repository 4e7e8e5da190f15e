"""vLLM's plugin hook: ``"kv_connector": "KVPushConnector"`` without ``kv_connector_module_path``.

pyproject.toml names :func:`register` in vLLM's ``vllm.general_plugins`` entry-point group.
vLLM calls every such function once per process (API server, EngineCore, each worker) before it
builds a connector; registering by module path and class name keeps the hook cheap (the
connector, and torch behind it, load only when an engine actually asks for it). A
``kv_connector_module_path`` in the config still wins over the registry (vLLM's rule), so the
explicit form keeps working.
"""

from __future__ import annotations

from kvpush.engine_plugin.logs import plugin_logger

CONNECTOR_NAME = "KVPushConnector"
MODULE_PATH = "kvpush.engine_plugin.connector"

log = plugin_logger(__name__)


def register() -> None:
    """Register the connector with vLLM's factory (idempotent: plugins may load twice)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, MODULE_PATH, CONNECTOR_NAME)
    except ValueError:
        # Already registered: by an earlier call in this process, or by a vLLM that ships a
        # connector of this name (then vLLM's own wins, and we say so once).
        cls = KVConnectorFactory.get_connector_class_by_name(CONNECTOR_NAME)
        if cls.__module__ != MODULE_PATH:
            log.warning("vLLM already has a %s from %s; kvpush's is not registered",
                        CONNECTOR_NAME, cls.__module__)
