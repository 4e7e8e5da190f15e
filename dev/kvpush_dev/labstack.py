"""kvpush on the multi-host lab: per-host node keys, daemons that speak UCX over TCP across
the veths, and an XpYd serving stack (vLLM engines + kvpushd per host, router on its own).

Why a module of its own: :mod:`kvpush_dev.netlab` knows namespaces and faults only;
this one knows what a kvpush host needs there (its own CURVE key listing its address, an
allowlist of the other hosts, the daemon advertising its lab address, UCX kept off shared
memory) so that the lab tests, the lab demo and the lab benchmark start the same stack.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpush_dev import vllm_env as ve
from kvpush_dev.keys import LabKeys, allow, lab_keys
from kvpush_dev.netlab import Lab
from kvpush_dev.pd_stack import kvpush_transfer_config
from kvpush_dev.procs import shm_files
from kvpush_dev.prom import by_label, fetch_text, parse

# Namespaces share /dev/shm and the kernel, so UCX would call two lab hosts "intra-node" and
# move active messages through cma (seen in UCX_LOG_LEVEL=info: `am(tcp/eth0 cma/memory)`).
# With these, UCX's own log says `inter-node cfg#1 rma_am(tcp/eth0) ... am(tcp/eth0)`.
UCX_NETWORK_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0"}
UCX_LOG_ENV = {"UCX_LOG_LEVEL": "info"}
ENGINE_PORT = 8000
DAEMON_NICE = -10  # as scripts/systemd/kvpushd.service's Nice=: engines must not starve their daemons
ROUTER_PORT = 8000
BASE_PORT = 17500


def host_keys(lab: Lab, base: Path, hosts: list[str] | None = None) -> dict[str, LabKeys]:
    """One node key per lab host (its certificate lists the host's address); every host
    allowlists every other one."""
    names = list(hosts or lab.hosts)
    keys = {h: lab_keys(base / "keys" / h, h, (lab.addr(h),)) for h in names}
    for h, k in keys.items():
        allow(k, *(v for n, v in keys.items() if n != h))
    return keys


def lab_device_config(lab: Lab, host: str, tmp: Path, index: int, keys: dict[str, LabKeys],
                      **kw: Any) -> Any:
    """A harness daemon config for ``host``: binds and advertises the host's lab address."""
    from kvpush_dev.daemon_harness import device_config

    addr = lab.addr(host)
    return device_config(tmp, index, peer_host=addr, advertise_host=addr, **keys[host].config(), **kw)


def ucx_transports(log: Path) -> list[str]:
    """What UCX says it picked for each endpoint (``ucp_worker.c`` lines of UCX_LOG_LEVEL=info
    that name a peer kind), e.g. ``inter-node cfg#1 rma_am(tcp/eth0) ... am(tcp/eth0)``."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        if "ucp_worker.c" in line and ("inter-node" in line or "intra-node" in line):
            out.append(line.split("UCX  INFO", 1)[-1].strip())
    return out


@dataclass
class EngineSpec:
    host: str
    role: str  # "prefill" | "decode"
    cpus: str = "0"  # VLLM_CPU_OMP_THREADS_BIND: "0", or per TP rank "0|1"
    tp: int = 1


@dataclass
class LabStack:
    """XpYd across lab hosts: per engine host one vLLM engine and its kvpushd (one daemon per
    TP rank), the router on host ``router_host``. Clients run inside the router's host
    (:meth:`call`); nothing listens outside the lab."""

    lab: Lab
    model: Path
    work: Path
    engines: list[EngineSpec]
    router_host: str = "rt"
    aux_cpus: str = "1"
    ucx_log: bool = True
    plugin_extra: dict[str, Any] = field(default_factory=dict)
    daemon_extra: dict[str, Any] = field(default_factory=dict)  # kvpushd.toml keys for every host
    engine_args: list[str] = field(default_factory=list)  # extra vLLM flags for every engine
    router_args: list[str] = field(default_factory=list)  # extra kvpush-router flags
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.work.mkdir(parents=True, exist_ok=True)
        self.keys = host_keys(self.lab, self.work, [e.host for e in self.engines])

    # ---------------------------------------------------------------- addresses
    def url(self, host: str) -> str:
        return f"http://{self.lab.addr(host)}:{ENGINE_PORT}"

    @property
    def router_url(self) -> str:
        return f"http://{self.lab.addr(self.router_host)}:{ROUTER_PORT}"

    def endpoints(self, host: str) -> list[str]:
        spec = self.spec(host)
        return [f"tcp://{self.lab.addr(host)}:{BASE_PORT + r}" for r in range(spec.tp)]

    def spec(self, host: str) -> EngineSpec:
        return next(e for e in self.engines if e.host == host)

    def hosts(self, role: str) -> list[str]:
        return [e.host for e in self.engines if e.role == role]

    def rt(self, host: str) -> Path:
        return self.work / host / "run"

    # ---------------------------------------------------------------- lifecycle
    def daemon_env(self) -> dict[str, str]:
        return {**os.environ, **UCX_NETWORK_ENV, **(UCX_LOG_ENV if self.ucx_log else {})}

    def start_daemons(self, host: str) -> None:
        spec, addr = self.spec(host), self.lab.addr(host)
        (self.work / host).mkdir(parents=True, exist_ok=True)
        devices = ", ".join(f'"cpu{r}"' for r in range(spec.tp))
        extra = "".join(f"{k} = {_toml(v)}\n" for k, v in self.daemon_extra.items())
        cfg = self.work / host / "kvpushd.toml"
        cfg.write_text(
            f'devices = [{devices}]\nruntime_dir = "{self.rt(host)}"\nbase_port = {BASE_PORT}\n'
            f'peer_host = "{addr}"\nadvertise_host = "{addr}"\nmetrics_port = 0\n'
            'ucx_error_handling_mode = "none"\n'
            + "".join(f'{k} = "{v}"\n' for k, v in self.keys[host].config().items()) + extra)
        self.procs[f"kvpushd-{host}"] = self.lab.popen(
            host, [ve.vllm_python(), "-m", "kvpush.daemon.node.cli", "--config", str(cfg)],
            self.work / host / "kvpushd.log", env=self.daemon_env(), cpus=ve.parse_cpus(self.aux_cpus),
            nice=DAEMON_NICE)

    def start_engine(self, host: str) -> None:
        spec = self.spec(host)
        role = "kv_producer" if spec.role == "prefill" else "kv_consumer"
        args = [*self.engine_args, *(["--no-enable-prefix-caching"] if spec.role == "decode" else [])]
        if spec.tp > 1:
            args += ["--tensor-parallel-size", str(spec.tp)]
        from kvpush.proto import naming

        sock = naming.engine_socket(str(self.rt(host)), 0).replace("engine-0", "engine-{rank}")
        cmd = ve.engine_cmd(self.model, ENGINE_PORT, host=self.lab.addr(host), extra_args=args,
                            kv_transfer_config=kvpush_transfer_config(role, host, sock, **self.plugin_extra))
        self.procs[host] = self.lab.popen(host, cmd, self.work / host / "engine.log",
                                          env=ve.engine_env(spec.cpus),
                                          cpus=ve.parse_cpus(spec.cpus.replace("|", ",")))

    def start_router(self) -> None:
        argv = [ve.vllm_python(), "-m", "kvpush.router.cli", "--host", self.lab.addr(self.router_host),
                "--port", str(ROUTER_PORT)]
        for h in self.hosts("prefill"):
            argv += ["--prefill", f"{self.url(h)}={','.join(self.endpoints(h))}"]
        for h in self.hosts("decode"):
            argv += ["--decode", self.url(h)]
        argv += self.router_args
        self.procs["router"] = self.lab.popen(self.router_host, argv, self.work / "router.log",
                                              cpus=ve.parse_cpus(self.aux_cpus))

    def start(self, timeout: float = 900.0) -> LabStack:
        try:
            for e in self.engines:
                self.start_daemons(e.host)
            for e in self.engines:
                self.start_engine(e.host)
            self.start_router()
            for e in self.engines:
                self.wait_healthy(e.host, timeout)
            self.call(self.router_host, ve.wait_healthy, f"{self.router_url}/health", 120, self.procs["router"])
        except Exception:
            self.stop()
            raise
        return self

    def wait_healthy(self, host: str, timeout: float = 900.0) -> None:
        self.call(self.router_host, ve.wait_healthy, f"{self.url(host)}/health", timeout, self.procs[host])

    def call(self, host: str, fn: Any, *args: Any, timeout: float | None = None) -> Any:
        return self.lab.call(host, fn, *args, timeout=timeout)

    def client(self, fn: Any, *args: Any, timeout: float | None = 900) -> Any:
        """``fn(*args)`` from the router's host (the lab's client side)."""
        return self.lab.call(self.router_host, fn, *args, timeout=timeout)

    def stop(self) -> list[str]:
        """Stop every process; then remove the /dev/shm files they mapped that nothing maps any
        more (vLLM force-kills its workers: torch's KV exports and, with TP > 1, vLLM's own
        ``vllm_dist_*cpushm_*`` communicator segments are left behind)."""
        mapped = shm_files(self.procs)
        self._stop()
        self.lab.unlink_orphans(mapped)
        return sorted(p for p in mapped if os.path.exists(p))  # what is still there (should be none)

    def _stop(self) -> None:
        ve.stop_groups(self.procs, ["router", *(e.host for e in self.engines),
                                    *(f"kvpushd-{e.host}" for e in self.engines)])

    # ---------------------------------------------------------------- what the engines say
    def tokens_by_source(self, host: str) -> dict[str, float]:
        """vLLM's own counter of where ``host``'s prompt tokens came from."""
        text = self.client(fetch_text, f"{self.url(host)}/metrics", timeout=30)
        return by_label(parse(text), "vllm:prompt_tokens_by_source_total", "source")

    def router_status(self) -> dict[str, Any]:
        # The operator endpoints listen on the router host's loopback (client port + 1).
        return self.client(ve.get_json, f"http://127.0.0.1:{ROUTER_PORT + 1}/router/status", timeout=30)  # type: ignore[no-any-return]

    def transports(self) -> dict[str, list[str]]:
        """Per host, what UCX picked for its peers (from the daemons' logs)."""
        out = {}
        for e in self.engines:
            log = self.work / e.host / "kvpushd.log"
            with contextlib.suppress(OSError):
                out[e.host] = ucx_transports(log)
        return out


def _toml(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return f'"{v}"'
    return str(v)


def wait_until(pred: Any, timeout: float, poll: float = 0.2) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(poll)
    return bool(pred())
