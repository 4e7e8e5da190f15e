"""Real daemons and engine-side clients for integration tests.

Daemons run as separate processes (spawn), exactly as the supervisor starts
them; engines are DaemonClients in the test process that own KV tensors in
shared memory, as the vLLM plugin's worker half does.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvpush import proto
from kvpush.daemon import opsclient
from kvpush.daemon.config import DeviceConfig
from kvpush.engine_plugin.client import DaemonClient
from kvpush.engine_plugin.memory import export_cpu_tensor
from kvpush.proto import naming
from kvpush.proto.layout import KVLayout


def device_config(tmp: Path, index: int, **kw: Any) -> DeviceConfig:
    name = f"cpu{index}"
    cfg = DeviceConfig(
        index=index,
        name=name,
        runtime_dir=str(tmp),
        engine_socket=naming.engine_socket(str(tmp), index),
        ops_socket=naming.ops_socket(str(tmp), index),
        peer_host="127.0.0.1",
        peer_port=0,
        lease_s=10.0,
        register_timeout_s=10.0,
        write_timeout_s=5.0,
        peer_timeout_s=3.0,
    )
    return replace(cfg, **kw)


def _run(cfg: DeviceConfig, ready: Any) -> None:
    from kvpush.daemon.worker import run_worker

    raise SystemExit(run_worker(cfg, ready))


def ops_request(endpoint: str, cmd: str, arg: str = "", timeout_s: float = 5.0) -> opsclient.Answer:
    return opsclient.request(endpoint, proto.OpsRequest(cmd, arg), timeout_s)


_LIVE: list[Daemon] = []


def dump_all_daemons() -> None:
    """Ask every live daemon for a stack dump (faulthandler on SIGUSR1) before a test fails."""
    import signal

    for d in _LIVE:
        if d.proc.is_alive():
            os.kill(d.proc.pid, signal.SIGUSR1)
    time.sleep(0.5)


class Daemon:
    """One per-accelerator daemon process."""

    def __init__(self, cfg: DeviceConfig) -> None:
        self.cfg = cfg
        ctx = mp.get_context("spawn")
        self.ready = ctx.Event()
        self.proc = ctx.Process(target=_run, args=(cfg, self.ready), daemon=True)
        self.proc.start()
        if not self.ready.wait(60):
            self.proc.kill()
            raise RuntimeError(f"daemon {cfg.name} did not become ready")
        self.peer_endpoint = self.ops("status")["peer_endpoint"]
        _LIVE.append(self)

    def ops(self, cmd: str, arg: str = "") -> dict:
        reply = ops_request(self.cfg.ops_socket, cmd, arg)
        assert reply.ok, reply.error
        return reply.data

    def stop(self, timeout: float = 15.0) -> int | None:
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(timeout)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(5)
        return self.proc.exitcode

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(5)


class Engine:
    """An engine rank: KV memory in shared memory plus a client of its daemon."""

    def __init__(
        self, daemon: Daemon, layout: KVLayout, role: str, *, rank: int = 0, tp: int = 1,
        engine_id: str = "", fill: str = "random", seed: int = 0,
    ) -> None:
        self.layout = layout
        if fill == "random":
            g = torch.Generator().manual_seed(seed)
            self.kv = torch.randint(0, 256, (layout.region_size,), dtype=torch.uint8, generator=g)
        else:
            self.kv = torch.zeros(layout.region_size, dtype=torch.uint8)
        self.handle = export_cpu_tensor(self.kv)
        self.client = DaemonClient(daemon.cfg.engine_socket)
        self.inbox: list[Any] = []
        self.client.attach(
            proto.Attach(engine_id or f"{role}-{rank}", rank, tp, role, self.handle, layout)
        )
        self.wait_for(lambda m: isinstance(m, proto.AttachAck), 20)

    @property
    def bytes(self) -> np.ndarray:
        return self.kv.numpy()

    def send(self, msg: Any, timeout: float = 10.0) -> None:
        """Send and keep polling until the client has handed it to the daemon."""
        assert self.client.send(msg)
        end = time.monotonic() + timeout
        while self.client.queued and time.monotonic() < end:
            self.pump()
            time.sleep(0.001)
        assert not self.client.queued, "daemon did not take the message"

    def pump(self) -> list[Any]:
        got = self.client.poll()
        self.inbox.extend(got)
        return got

    def wait_for(self, pred: Any, timeout: float) -> Any:
        """Return (and remove) the first message matching pred, pumping until timeout."""
        end = time.monotonic() + timeout
        while True:
            self.pump()
            for i, m in enumerate(self.inbox):
                if pred(m):
                    return self.inbox.pop(i)
            if time.monotonic() > end:
                dump_all_daemons()
                raise TimeoutError(f"no matching message; inbox: {self.inbox[-5:]}")
            self.client.wait(0.005)  # wakes when a frame arrives (bench latencies stay exact)

    def result(self, tid: str, timeout: float = 20.0) -> Any:
        kinds = (proto.Received, proto.ReceiveFailed, proto.Sent, proto.SendFailed)
        return self.wait_for(lambda m: isinstance(m, kinds) and m.transfer_id == tid, timeout)

    def close(self) -> None:
        self.client.close()
