"""Start and stop one mode of the sweep: kvpush, vLLM's pull or push connector, or colocated.

Every mode runs its engines with the same flags and core pinning (kvpush_dev.vllm_env)
and hands the sweep a :class:`ModeStack`: front-end URL, the engines' URLs, process groups
for CPU accounting and /metrics URLs. A failed start stops whatever had started.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpush_dev import vllm_env as ve
from kvpush_dev.pd_stack import PDStack
from kvpush_dev.procs import free_port

MODES = ("kvpush", "pull", "vllm-push", "colocated")


@dataclass
class ModeStack:
    """What the sweep needs from a running mode: URLs, process groups, metrics endpoints."""

    mode: str
    front_url: str
    p_url: str
    d_url: str
    groups: dict[str, subprocess.Popen[bytes]]
    metrics: dict[str, str]  # role -> /metrics URL (prefill, decode, daemon)
    stop: Any  # () -> None


def nixl_transfer_config(connector: str, engine_id: str) -> dict[str, Any]:
    """vLLM's NIXL connectors as the baselines run them: CPU buffers, both roles, fixed engine id."""
    return {"kv_connector": connector, "kv_role": "kv_both", "kv_buffer_device": "cpu",
            "engine_id": engine_id, "kv_load_failure_policy": "recompute"}


def start_kvpush(model: Path, work: Path, logs: Path, startup_timeout: float) -> ModeStack:
    stack = PDStack(model, work)

    def stop() -> None:
        stack.stop()
        for log in work.glob("*.log"):
            shutil.copy(log, logs / log.name)

    try:
        stack.start(timeout=startup_timeout)
    except BaseException:
        stop()
        raise
    return ModeStack("kvpush", stack.router_url, stack.p_url, stack.d_url, dict(stack.procs),
                     {"prefill": f"{stack.p_url}/metrics", "decode": f"{stack.d_url}/metrics",
                      "daemon": f"http://127.0.0.1:{stack.metrics_port}/metrics"}, stop)


def start_colocated(model: Path, logs: Path, startup_timeout: float) -> ModeStack:
    """One engine on both cores, no connector: the non-disaggregated alternative."""
    port = free_port()
    proc = ve.start_engine(model, port, logs / "colocated.log", cpu_bind="0-1")

    def stop() -> None:
        ve.stop_group(proc, grace=10)

    url = f"http://127.0.0.1:{port}"
    try:
        ve.wait_healthy(f"{url}/health", startup_timeout, proc)
    except BaseException:
        stop()
        raise
    return ModeStack("colocated", url, url, url, {"engine": proc}, {"decode": f"{url}/metrics"}, stop)


def start_nixl(mode: str, model: Path, logs: Path, startup_timeout: float, request_timeout: float,
               engine_args: tuple[str, ...] = ()) -> ModeStack:
    """``engine_args``: extra flags for both engines (a model preset's, tiny_model.engine_args)."""
    connector = "NixlConnector" if mode == "pull" else "NixlPushConnector"
    p_port, d_port, px_port, p_side, d_side = (free_port() for _ in range(5))
    procs: dict[str, subprocess.Popen[bytes]] = {}

    def stop() -> None:
        ve.stop_groups(procs, ("proxy", "decode", "prefill"))

    side = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1"}
    try:
        procs["prefill"] = ve.start_engine(
            model, p_port, logs / "prefill.log", cpu_bind="0", extra_args=list(engine_args),
            kv_transfer_config=nixl_transfer_config(connector, "prefill"),
            env_extra={**side, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(p_side)})
        procs["decode"] = ve.start_engine(
            model, d_port, logs / "decode.log", cpu_bind="1", extra_args=[*engine_args, "--no-enable-prefix-caching"],
            kv_transfer_config=nixl_transfer_config(connector, "decode"),
            env_extra={**side, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(d_side)})
        p_url, d_url = f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{d_port}"
        cmd = [ve.vllm_python(), "-m", "kvpush_dev.baseline_proxy",
               "--mode", "pull" if mode == "pull" else "push", "--port", str(px_port),
               "--prefill", p_url, "--decode", d_url, "--prefill-engine-id", "prefill",
               "--prefill-side-port", str(p_side), "--request-timeout", str(request_timeout),
               "--prefill-timeout", str(request_timeout)]
        with open(logs / "proxy.log", "ab") as log:
            procs["proxy"] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL, start_new_session=True)
        ve.wait_healthy(f"{p_url}/health", startup_timeout, procs["prefill"])
        ve.wait_healthy(f"{d_url}/health", startup_timeout, procs["decode"])
        front = f"http://127.0.0.1:{px_port}"
        ve.wait_healthy(f"{front}/health", 120, procs["proxy"])
    except BaseException:
        stop()
        raise
    return ModeStack(mode, front, p_url, d_url, dict(procs),
                     {"prefill": f"{p_url}/metrics", "decode": f"{d_url}/metrics"}, stop)


def start_mode(mode: str, model: Path, work: Path, logs: Path, startup_timeout: float,
               request_timeout: float) -> ModeStack:
    """The stack of ``mode`` (one of :data:`MODES`), healthy."""
    if mode == "kvpush":
        return start_kvpush(model, work, logs, startup_timeout)
    if mode == "colocated":
        return start_colocated(model, logs, startup_timeout)
    return start_nixl(mode, model, logs, startup_timeout, request_timeout)
