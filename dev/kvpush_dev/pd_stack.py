"""A local P/D serving stack: kvpushd, a prefill and a decode vLLM engine, the router.

Shared by the demo, the end-to-end tests and the benchmarks so that all of them
run exactly the same processes. Every process gets its own process group;
``stop()`` always cleans up.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpush.proto import naming
from kvpush_dev import vllm_env as ve
from kvpush_dev.keys import lab_keys
from kvpush_dev.procs import free_port, popen
from kvpush_dev.prom import by_label, fetch_text, parse

ROOT = ve.ROOT
__all__ = ["ROOT", "PDStack", "free_port", "kvpush_transfer_config", "popen", "prompt_tokens_by_source"]


def kvpush_transfer_config(role: str, engine_id: str, socket_path: str, *, by_name: bool = False,
                           **extra: Any) -> dict[str, Any]:
    """The engine's --kv-transfer-config. ``by_name``: no kv_connector_module_path (vLLM finds
    the connector through kvpush's vllm.general_plugins entry point)."""
    cfg = {
        "kv_connector": "KVPushConnector",
        "kv_connector_module_path": "kvpush.engine_plugin",
        "kv_role": role,
        "engine_id": engine_id,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"daemon": socket_path, **extra},
    }
    if by_name:
        del cfg["kv_connector_module_path"]
    return cfg


@dataclass
class PDStack:
    model: Path
    work: Path
    p_block_size: int | None = None
    d_block_size: int | None = None
    ucx_error_handling_mode: str = "none"
    insecure_peers: bool = False  # True only to measure what authentication costs
    keys_dir: Path | None = None  # where this run's node keys live (stacks that talk to each other share it)
    d_prefix_caching: bool = False
    with_router: bool = True
    plugin_extra: dict[str, Any] = field(default_factory=dict)
    engine_env: dict[str, str] = field(default_factory=dict)  # extra env for both engines
    engine_args: list[str] = field(default_factory=list)  # extra flags for both engines (GPU: memory share)
    d_engine_args: list[str] = field(default_factory=list)  # extra flags for the decode engine alone (last: they win)
    engine_python: str | None = None  # interpreter of the engines' venv (default: vllm_env's)
    by_name: frozenset[str] = frozenset()  # "prefill"/"decode": connector by name, no module path
    daemon_toml: str = ""  # extra kvpushd.toml lines (e.g. otlp_traces_endpoint)
    p_model: Path | None = None  # the prefill engine's own checkpoint (default: ``model``)
    router_args: list[str] = field(default_factory=list)  # extra kvpush-router flags
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    # Cores: each engine's whole process group on its own core; the router (and the kvpushd
    # supervisor) share the decode engine's core, each device daemon its own engine's
    # (daemons_beside_engines). On two cores the prefill engine's core is the one the
    # critical path needs (prefill compute); a router or daemon woken there preempts it
    # (measured: concurrency-4 TTFT 60 ms with the router on P's core, 38 ms on D's).
    p_cpus: str = "0"
    d_cpus: str = "1"
    aux_cpus: str | None = "1"  # daemons + router; None: wherever the kernel puts them
    router_cpus: str | None = None  # the router alone elsewhere (None: with the daemons, on aux_cpus)
    # Each device daemon beside its own engine (kvpushd's per-device ``cpus``): the prefill
    # daemon on the prefill engine's core, the decode daemon on the decode engine's, the
    # router and the supervisor on aux_cpus. False: every daemon on aux_cpus.
    daemons_beside_engines: bool = True
    # Added to the daemons' niceness. kvpushd.service runs them at Nice=-10 so that busy
    # engines cannot starve them; 0 keeps the benchmarks' measured setting.
    daemon_nice: int = 0

    def __post_init__(self) -> None:
        self.work.mkdir(parents=True, exist_ok=True)
        self.rt = self.work / "run"
        self.base_port = free_port()
        self.metrics_port = free_port()
        self.p_port, self.d_port, self.r_port = free_port(), free_port(), free_port()
        self.admin_port = free_port()

    # ------------------------------------------------------------------ urls
    @property
    def p_url(self) -> str:
        return f"http://127.0.0.1:{self.p_port}"

    @property
    def d_url(self) -> str:
        return f"http://127.0.0.1:{self.d_port}"

    @property
    def router_url(self) -> str:
        return f"http://127.0.0.1:{self.r_port}"

    @property
    def admin_url(self) -> str:
        """The router's operator endpoints (/router/*)."""
        return f"http://127.0.0.1:{self.admin_port}"

    @property
    def prefill_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.base_port}"

    def engine_socket(self, idx: int) -> str:
        return naming.engine_socket(str(self.rt), idx)

    def ops_socket(self, idx: int) -> str:
        return naming.ops_socket(str(self.rt), idx)

    # ------------------------------------------------------------------ lifecycle
    def start_daemons(self) -> None:
        cfg = self.work / "kvpushd.toml"
        # Authenticated peers (keys made for this stack) unless the stack is explicitly insecure.
        auth = "insecure_peers = true\n" if self.insecure_peers else "".join(
            f'{k} = "{v}"\n' for k, v in lab_keys(self.keys_dir or self.work).config().items())
        cfg.write_text(
            f'devices = ["cpu0", "cpu1"]\nruntime_dir = "{self.rt}"\nbase_port = {self.base_port}\n'
            f'metrics_port = {self.metrics_port}\nucx_error_handling_mode = "{self.ucx_error_handling_mode}"\n'
            + auth + self.daemon_toml
            + (f'[device.cpu0]\ncpus = "{self.p_cpus}"\n[device.cpu1]\ncpus = "{self.d_cpus}"\n'
               if self.daemons_beside_engines else "")
        )
        self.procs["kvpushd"] = popen([ve.vllm_python(), "-m", "kvpush.daemon.node.cli", "--config", str(cfg)],
                                      self.work / "kvpushd.log", cpus=self._aux(), nice=self.daemon_nice)

    def start(self, timeout: float = 900.0) -> PDStack:
        self.start_daemons()
        p_args = [*self.engine_args, *(["--block-size", str(self.p_block_size)] if self.p_block_size else [])]
        d_args = [*self.engine_args, *(["--block-size", str(self.d_block_size)] if self.d_block_size else [])]
        if not self.d_prefix_caching:
            d_args.append("--no-enable-prefix-caching")
        d_args += self.d_engine_args
        self.procs["prefill"] = ve.start_engine(
            self.p_model or self.model, self.p_port, self.work / "prefill.log", cpu_bind=self.p_cpus, extra_args=p_args,
            env_extra=self.engine_env, python=self.engine_python,
            kv_transfer_config=kvpush_transfer_config("kv_producer", "prefill", self.engine_socket(0),
                                                      by_name="prefill" in self.by_name,
                                                      **self.plugin_extra))
        self.procs["decode"] = ve.start_engine(
            self.model, self.d_port, self.work / "decode.log", cpu_bind=self.d_cpus, extra_args=d_args,
            env_extra=self.engine_env, python=self.engine_python,
            kv_transfer_config=kvpush_transfer_config("kv_consumer", "decode", self.engine_socket(1),
                                                      by_name="decode" in self.by_name,
                                                      **self.plugin_extra))
        if self.with_router:
            self.procs["router"] = popen(
                [ve.vllm_python(), "-m", "kvpush.router.cli", "--listen", f"127.0.0.1:{self.r_port}",
                 "--admin-listen", f"127.0.0.1:{self.admin_port}",
                 "--prefill", f"{self.p_url}=127.0.0.1:{self.base_port},tp=1", "--decode", self.d_url,
                 "--expose-transfer-id", *self.router_args],  # tests and benchmarks follow requests by ID
                self.work / "router.log", cpus=ve.parse_cpus(self.router_cpus) if self.router_cpus else self._aux())
        try:
            ve.wait_healthy(f"{self.p_url}/health", timeout, self.procs["prefill"])
            ve.wait_healthy(f"{self.d_url}/health", timeout, self.procs["decode"])
            if self.with_router:
                ve.wait_healthy(f"{self.router_url}/health", 120, self.procs["router"])
        except Exception:
            self.stop()
            raise
        return self

    def _aux(self) -> set[int] | None:
        return ve.parse_cpus(self.aux_cpus) if self.aux_cpus else None

    def stop(self) -> None:
        ve.stop_groups(self.procs, ("router", "decode", "prefill", "kvpushd"))

    def pids(self) -> dict[str, int]:
        return {k: v.pid for k, v in self.procs.items()}


def prompt_tokens_by_source(url: str) -> dict[str, float]:
    """vLLM's own counter of where the decode engine's prompt tokens came from."""
    return by_label(parse(fetch_text(f"{url}/metrics")), "vllm:prompt_tokens_by_source_total", "source")


def first_token_leg(router_url: str, attempt: Callable[[], Any]) -> tuple[str, Any]:
    """Run one streamed request through the router (``attempt``): which leg its first token
    came from, "prefill" or "decode", and what ``attempt`` returned. The leg is read off the
    router's ``kvpush_router_first_tokens_total`` (each streamed answer counted by exactly one
    leg). Which leg reaches the router first is a
    race: on a loaded machine the decode engine's stream may open before the prefill engine's
    answer arrives, and then the decode leg's token goes out (rightly)."""
    def counts() -> dict[str, float]:
        return by_label(parse(fetch_text(f"{router_url}/metrics")), "kvpush_router_first_tokens_total", "source")

    before = counts()
    result = attempt()
    after = counts()
    moved = {leg: after.get(leg, 0.0) - before.get(leg, 0.0) for leg in ("prefill", "decode")}
    assert sorted(moved.values()) == [0.0, 1.0], moved
    return max(moved, key=lambda leg: moved[leg]), result
