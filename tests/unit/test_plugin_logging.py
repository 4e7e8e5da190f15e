"""The plugin logs through vLLM's logging: its lines come out in vLLM's format and level.

Run in a child process that configures logging the way a vLLM engine does
(``vllm.logger.configure_logging``), so the check sees exactly what an engine's log shows.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

ENGINE = """
from vllm.config.logging import LoggingConfig
from vllm.logger import configure_logging
configure_logging(LoggingConfig())
from kvpush.engine_plugin.link import client
from kvpush.engine_plugin.scheduler import half as scheduler_half
from kvpush.engine_plugin.worker import half as worker_half
for m in (worker_half, scheduler_half, client):
    m.log.info("kvpush: info from %s", m.__name__)
    m.log.debug("kvpush: debug from %s", m.__name__)
"""
VLLM_LINE = re.compile(r"^\(MainProcess pid=\d+\) (INFO|DEBUG) \d\d-\d\d \d\d:\d\d:\d\d \[[^\]]+:\d+\] kvpush: "
                       r"(info|debug) from kvpush\.engine_plugin\.[\w.]+$")


def _engine_log(level: str) -> list[str]:
    env = {**os.environ, "VLLM_LOGGING_LEVEL": level, "NO_COLOR": "1"}
    out = subprocess.run([sys.executable, "-c", ENGINE], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    return [ln for ln in (out.stdout + out.stderr).splitlines() if "kvpush:" in ln]


def test_plugin_info_lines_come_out_in_vllms_format_at_vllms_level() -> None:
    lines = _engine_log("INFO")
    assert len(lines) == 3, lines  # one INFO per module; DEBUG is below vLLM's level
    assert all(VLLM_LINE.match(ln) and " INFO " in ln for ln in lines), lines


def test_vllms_level_governs_the_plugin() -> None:
    lines = _engine_log("DEBUG")
    assert sum(" DEBUG " in ln for ln in lines) == 3 and all(VLLM_LINE.match(ln) for ln in lines), lines


def test_without_vllm_loaded_a_module_logger() -> None:
    code = ("import sys; from kvpush.engine_plugin.logs import plugin_logger; "
            "assert 'vllm' not in sys.modules; print(plugin_logger('kvpush.engine_plugin.link.client').name)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "kvpush.engine_plugin.link.client", out.stderr
