"""Raw two-process NIXL WRITE bandwidth, the ceiling kvpush's daemon is measured against.

One NIXL agent per process (DRAM, progress thread off, both sides polling), no kvpush code
on the data path. GB/s here means 1e9 bytes per second.

    python scripts/bench_raw_nixl.py [--sizes 1M,16M,256M] [--ucx-err-none] [--idle-cpu]

prints ``{size_bytes: {"raw_nixl_gbps", "raw_nixl_scattered_gbps", "scattered_descs",
"memcpy_gbps"}}`` (plus ``"idle_agent_cpu"`` with ``--idle-cpu``) as JSON.
Importable: :func:`raw_nixl_write_gbps`, :func:`memcpy_gbps`, :func:`idle_agent_cpu`.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time
from typing import Any

import numpy as np

PIECE_MIN, PIECE_MAX = 4 << 10, 64 << 10
_CALL_TIMEOUT_S = 300.0


def _agent(name: str, params: dict[str, str], prog_thread: bool = False) -> Any:
    from nixl._api import nixl_agent, nixl_agent_config

    a = nixl_agent(name, nixl_agent_config(enable_prog_thread=prog_thread,
                                           enable_listen_thread=False, backends=[]))
    a.create_backend("UCX", params)
    return a


SHM_ENV = "KVPUSH_BENCH_SHM"


def _buffer(size: int) -> np.ndarray:
    """Anonymous memory, or with $KVPUSH_BENCH_SHM=1 a /dev/shm mapping: the kind of memory
    kvpush moves (engines share their KV through /dev/shm), for a like-for-like baseline."""
    if os.environ.get(SHM_ENV) == "1":
        import mmap

        path = f"/dev/shm/kvpush-bench-{os.getpid()}-{time.monotonic_ns()}"
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            m = mmap.mmap(fd, size)
        finally:
            os.close(fd)
            os.unlink(path)
        buf = np.frombuffer(m, dtype=np.uint8)
    else:
        buf = np.empty(size, dtype=np.uint8)
    buf[:] = 1  # fault the pages in before registering / timing
    return buf


def _register(a: Any, buf: np.ndarray) -> Any:
    return a.register_memory(np.array([[buf.ctypes.data, buf.nbytes, 0]], dtype=np.uint64),
                             "DRAM")


def scattered_pieces(size: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(src_off, dst_off, lens): PIECE_MIN..PIECE_MAX pieces tiling ``size`` bytes, shuffled
    independently on each side so that no two descriptors can merge."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(PIECE_MIN, PIECE_MAX + 1, size // PIECE_MIN + 1)
    ends = np.cumsum(lens)
    lens = lens[: np.searchsorted(ends, size) + 1].copy()
    lens[-1] -= int(lens.sum()) - size  # trim the last piece to tile exactly

    def shuffled() -> np.ndarray:
        order = rng.permutation(len(lens))
        off = np.empty(len(lens), dtype=np.int64)
        off[order] = np.concatenate([[0], np.cumsum(lens[order])[:-1]])
        return off

    return shuffled(), shuffled(), lens


def _target(conn: Any, size: int, params: dict[str, str], poll_s: float) -> None:
    """Receiver: register a buffer, publish metadata, poll notifications until told to stop."""
    a = _agent("bench-target", params)
    buf = _buffer(size)
    reg = _register(a, buf)
    conn.send((a.get_agent_metadata(), buf.ctypes.data))
    notifs = 0
    while not conn.poll():
        for msgs in a.get_new_notifs().values():
            notifs += len(msgs)
        if poll_s:
            time.sleep(poll_s)
    conn.recv()
    conn.send(notifs)
    a.deregister_memory(reg)


def _initiator(conn: Any, size: int, scattered: bool, iters: int, params: dict[str, str],
               gap_s: float = 0.0, depth: int = 1) -> None:
    """``gap_s``: idle time before each timed WRITE (isolated transfers, as one request at a
    time sees them; the rate is then over the WRITEs' own time). ``depth``: WRITEs posted
    together, each to its own ``size`` bytes of the target (a loaded server's transfers
    overlap), all awaited before the next batch; the rate counts every byte of a batch."""
    a = _agent("bench-initiator", params)
    buf = _buffer(size * depth)
    reg = _register(a, buf)
    md, remote_base = conn.recv()
    peer = a.add_remote_agent(md)
    if scattered:
        src_off, dst_off, lens = scattered_pieces(size)
    else:
        src_off, dst_off, lens = np.array([0]), np.array([0]), np.array([size])
    n = len(lens)
    hs = []
    for j in range(depth):
        loc = np.stack([buf.ctypes.data + j * size + src_off, lens, np.zeros(n)], axis=1).astype(np.uint64)
        rem = np.stack([remote_base + j * size + dst_off, lens, np.zeros(n)], axis=1).astype(np.uint64)
        hs.append(a.initialize_xfer("WRITE", a.get_xfer_descs(loc, "DRAM"), a.get_xfer_descs(rem, "DRAM"),
                                    peer, b"w"))

    def once(i: int) -> float:
        if gap_s:
            time.sleep(gap_s)
        t = time.perf_counter()
        states = [a.transfer(h, f"w{i}.{j}".encode()) for j, h in enumerate(hs)]
        while "PROC" in states:
            states = [st if st != "PROC" else a.check_xfer_state(h) for h, st in zip(hs, states, strict=True)]
        if any(st != "DONE" for st in states):
            raise RuntimeError(f"WRITE failed: {states}")
        return time.perf_counter() - t

    for i in range(min(3, iters)):
        once(i)
    if gap_s:
        dt = sum(once(i) for i in range(iters))
    else:
        t0 = time.perf_counter()
        for i in range(iters):
            once(i)
        dt = time.perf_counter() - t0
    for h in hs:
        a.release_xfer_handle(h)
    a.remove_remote_agent(peer)
    a.deregister_memory(reg)
    conn.send((size * depth * iters / dt / 1e9, n))


def raw_nixl_write_gbps(size: int, scattered: bool, iters: int,
                        backend_params: dict[str, str] | None = None,
                        target_poll_s: float | None = None) -> float:
    """GB/s of back-to-back NIXL WRITEs of ``size`` bytes between two fresh processes.

    ``target_poll_s``: the receiver's sleep between polls. None picks the faster one for the
    mode: busy polling under UCX's default "peer" error handling (RMA is emulated with
    active messages over TCP, so every chunk needs the target's progress; a WRITE to a target
    that never polls never completes), 1 ms under ``ucx_error_handling_mode=none`` (one-sided
    CMA writes; a busy target only steals the initiator's CPU)."""
    return _raw(size, scattered, iters, backend_params or {}, target_poll_s)[0]


def _placed(netns: str | None, env: dict[str, str] | None, fn: Any, *args: Any) -> None:
    """Run ``fn`` inside a lab host (network namespace) with extra env, e.g. UCX_TLS."""
    if netns:
        from kvpush_dev.netlab import enter_netns

        enter_netns(netns)
    if env:
        os.environ.update(env)
    fn(*args)


def _raw(size: int, scattered: bool, iters: int, params: dict[str, str],
         target_poll_s: float | None = None, where: tuple[str | None, str | None] = (None, None),
         env: dict[str, str] | None = None, gap_s: float = 0.0, depth: int = 1) -> tuple[float, int]:
    """``where``: (target's, initiator's) network namespace (the multi-host lab), or None.
    ``gap_s`` and ``depth``: as :func:`_initiator` takes them."""
    if target_poll_s is None:
        target_poll_s = 0.001 if params.get("ucx_error_handling_mode") == "none" else 0.0
    ctx = mp.get_context("spawn")
    t_conn, t_child = ctx.Pipe()
    i_conn, i_child = ctx.Pipe()
    tgt = ctx.Process(target=_placed, args=(where[0], env, _target, t_child, size * depth, params, target_poll_s),
                      daemon=True)
    ini = ctx.Process(target=_placed, args=(where[1], env, _initiator, i_child, size, scattered, iters, params, gap_s,
                                            depth), daemon=True)
    tgt.start()
    ini.start()
    try:
        if not t_conn.poll(_CALL_TIMEOUT_S):
            raise TimeoutError("target did not start")
        i_conn.send(t_conn.recv())
        if not i_conn.poll(_CALL_TIMEOUT_S):
            raise TimeoutError("initiator did not finish")
        gbps, ndesc = i_conn.recv()
        t_conn.send("stop")
        t_conn.poll(30)
        return gbps, ndesc
    finally:
        for p in (ini, tgt):
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join()


def memcpy_gbps(size: int, iters: int) -> float:
    """GB/s of a single-threaded numpy copy of ``size`` bytes in one process (pages warm)."""
    src, dst = _buffer(size), _buffer(size)
    np.copyto(dst, src)
    t0 = time.perf_counter()
    for _ in range(iters):
        np.copyto(dst, src)
    return size * iters / (time.perf_counter() - t0) / 1e9


def _idle(conn: Any, seconds: float, prog_thread: bool, params: dict[str, str]) -> None:
    import psutil

    a = _agent(f"idle-{int(prog_thread)}", params, prog_thread)
    buf = _buffer(1 << 20)
    reg = _register(a, buf)
    time.sleep(0.5)
    me = psutil.Process()
    c0 = me.cpu_times()
    time.sleep(seconds)
    c1 = me.cpu_times()
    a.deregister_memory(reg)
    conn.send((c1.user - c0.user + c1.system - c0.system) / seconds)


def idle_agent_cpu(seconds: float = 5.0, prog_thread: bool = False,
                   backend_params: dict[str, str] | None = None) -> float:
    """CPU cores used by a process holding an idle agent with registered memory."""
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    p = ctx.Process(target=_idle, args=(child, seconds, prog_thread, backend_params or {}))
    p.start()
    try:
        if not conn.poll(seconds + 120):
            raise TimeoutError("idle agent did not report")
        return float(conn.recv())
    finally:
        p.join(30)


def _parse_size(s: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(s[:-1]) * mult[s[-1].upper()] if s[-1].upper() in mult else int(s)


def _iters(size: int) -> int:
    return max(3, min(200, (2 << 30) // size))  # ~2 GiB moved per measurement


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1M,16M,256M")
    ap.add_argument("--iters", type=int, default=0, help="0: about 2 GiB per size")
    ap.add_argument("--ucx-err-none", action="store_true",
                    help="ucx_error_handling_mode=none (lets UCX use shm transports for RMA)")
    ap.add_argument("--idle-cpu", action="store_true")
    args = ap.parse_args()
    params = {"ucx_error_handling_mode": "none"} if args.ucx_err_none else {}
    out: dict[str, Any] = {}
    for size in (_parse_size(s) for s in args.sizes.split(",")):
        iters = args.iters or _iters(size)
        contig, _ = _raw(size, False, iters, params)
        scat, ndesc = _raw(size, True, iters, params)
        out[str(size)] = {
            "raw_nixl_gbps": round(contig, 3),
            "raw_nixl_scattered_gbps": round(scat, 3),
            "scattered_descs": ndesc,
            "memcpy_gbps": round(memcpy_gbps(size, iters), 3),
            "iters": iters,
        }
    if args.idle_cpu:
        out["idle_agent_cpu"] = {
            "prog_thread_off_cores": round(idle_agent_cpu(5.0, False, params), 4),
            "prog_thread_on_cores": round(idle_agent_cpu(5.0, True, params), 4),
        }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
