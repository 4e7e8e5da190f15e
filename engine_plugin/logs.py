"""The plugin's loggers: vLLM's, so that its lines come out in the engine's format and level.

vLLM configures only its own ``vllm`` logger (with propagation off). A ``kvpush.*`` logger
inside an engine has no handler: its INFO lines are dropped and its warnings reach Python's
last-resort handler unformatted. A logger named under ``vllm.`` (``vllm.kvpush.<module>``),
made by ``vllm.logger.init_logger``, inherits vLLM's handler, format and
``VLLM_LOGGING_LEVEL``. Outside an engine (unit tests, the daemon's tools) vLLM is not
loaded, and importing it for a logger would cost seconds: a plain module logger then.
"""

from __future__ import annotations

import logging
import sys


def plugin_logger(module: str) -> logging.Logger:
    """The logger of plugin module ``module`` (its ``__name__``)."""
    short = module.rsplit(".", 1)[-1]
    if "vllm" in sys.modules:  # inside an engine: vLLM is loaded before any connector
        from vllm.logger import init_logger

        return init_logger(f"vllm.kvpush.{short}")
    return logging.getLogger(module)
