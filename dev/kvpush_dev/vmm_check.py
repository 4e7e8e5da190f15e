"""``gpu_check``'s ``vmm`` step: docs/gpu-memory.md's VMM path end to end, in two processes.

The engine's side (this process) lays out KV memory the way vLLM 0.34's extensible cache
does: one reserved range with two physical chunks mapped back to back (``cuMemCreate`` with
the POSIX-fd export type), bytes written into both, and two regions named by address: the
whole first chunk and a stretch starting inside the second. It exports them as the engine
would (``engine_plugin.worker.vmm_export.export_regions``: retain, the mapped range, export,
release) and sends the descriptors with one frame over a unix socket
(``proto.fdpass``). The daemon's side (a second process) takes them as the daemon would
(``FdQueue`` under a ``Deframer``), maps them with ``daemon.io.vmm_import.map_regions``,
compares each region's bytes with what the engine wrote, writes its own bytes (the daemon's
WRITE), optionally registers the mappings with NIXL, and unmaps on the engine's word once the
engine has read those bytes back from its own mapping.

A region starting inside the second chunk is the point: if ``cuMemGetAddressRange`` answered
the whole reservation instead of the mapping, the export would name the wrong offset and size,
and the map or the bytes would fail here rather than in a daemon.

Both sides take the driver as an argument: ``kvpush.common.cuda_vmm.CudaVmm`` on a GPU,
the same class over ``kvpush_dev.fake_libcuda`` in the unit tests (two threads).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
from collections.abc import Callable
from typing import Any

from kvpush.daemon.io.vmm_import import MappedRegion, map_regions, unmap_regions
from kvpush.engine_plugin.worker.vmm_export import export_regions
from kvpush.proto.fdpass import FdQueue, recv_some, send_frame_with_fds
from kvpush.proto.stream import Deframer

__all__ = ["daemon_side", "engine_side", "pattern"]

TIMEOUT_S = 120.0  # every receive is bounded: a dead peer fails the step, it does not hang it
WRITE_TAG = 100  # the daemon's bytes for region i are pattern(WRITE_TAG + i, n)


def pattern(tag: int, n: int) -> bytes:
    """``n`` bytes no two regions share (a shifted or swapped mapping reads the wrong ones)."""
    return hashlib.shake_128(b"kvpush-vmm-%d" % tag).digest(n)


def _first_difference(got: bytes, want: bytes) -> str:
    i = next((k for k, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
    return f"{len(got)} bytes read, {len(want)} expected, first difference at byte {i}"


class _Link:
    """One side's end of the socket: JSON frames, descriptors queued as they arrive."""

    def __init__(self, sock: socket.socket) -> None:
        sock.settimeout(TIMEOUT_S)
        self.sock, self.fdq, self.de = sock, FdQueue(bound=16), Deframer(1 << 16)
        self.frames: list[bytes] = []

    def send(self, msg: dict[str, Any], fds: list[int] | None = None) -> None:
        send_frame_with_fds(self.sock, json.dumps(msg).encode(), fds or [])

    def recv(self) -> tuple[dict[str, Any], list[int]]:
        while not self.frames:
            data = recv_some(self.sock, 1 << 16, self.fdq)
            if not data:
                raise RuntimeError("the other side closed the socket")
            self.frames += self.de.feed(data)
        msg = json.loads(self.frames.pop(0))
        return msg, self.fdq.take(int(msg.get("fds", 0)))

    def close(self) -> None:
        self.fdq.close_all()
        self.sock.close()


def engine_side(sock: socket.socket, drv: Any) -> str:
    """Allocate, fill, export and send; check what the daemon side read and wrote. Returns the
    step's line; raises with the reason otherwise."""
    link = _Link(sock)
    g = drv.granularity
    chunk = 2 * g
    handles: list[int] = []
    mapped: list[int] = []
    va = None
    try:
        for _ in range(2):
            handles.append(drv.create(chunk))
        va = drv.reserve(2 * chunk)
        for i, h in enumerate(handles):
            drv.map(va + i * chunk, chunk, h)
            mapped.append(va + i * chunk)
        drv.set_access(va, 2 * chunk, drv.device)
        regions = [(va, chunk), (va + chunk + g, g)]  # the second starts inside chunk 2
        for i, (ptr, n) in enumerate(regions):
            drv.copy_in(ptr, pattern(i, n))
        exported = export_regions(regions, drv)
        try:
            link.send({"kind": "Attach", "fds": len(exported), "sizes": [r.size for r in exported],
                       "offsets": [r.offset for r in exported], "nbytes": [n for _, n in regions],
                       "device": drv.device}, [r.fd for r in exported])
        finally:
            for r in exported:
                os.close(r.fd)  # the engine's copies, once sent
        reply, _ = link.recv()
        if "error" in reply:
            raise RuntimeError(f"daemon side: {reply['error']}")
        for i, (ptr, n) in enumerate(regions):
            got = drv.copy_out(ptr, n)
            if got != pattern(WRITE_TAG + i, n):
                raise RuntimeError(f"region {i}: the daemon side's write is not in the engine's memory "
                                   f"({_first_difference(got, pattern(WRITE_TAG + i, n))})")
        link.send({"kind": "Done"})
        bye, _ = link.recv()
        if "error" in bye:
            raise RuntimeError(f"daemon side at unmap: {bye['error']}")
        offsets = [r.offset for r in exported]
        return (f"2 chunks of {chunk} bytes (POSIX-fd export type) in one reserved range; regions at "
                f"offsets {offsets} of their chunks exported as descriptors, passed over a unix socket "
                f"(SCM_RIGHTS), imported and mapped in a second process: its reads equal the engine's "
                f"bytes and its writes land in the engine's memory; {reply['ok']}")
    finally:
        for m in mapped:
            drv.unmap(m, chunk)
        if va is not None:
            drv.free(va, 2 * chunk)
        for h in handles:
            drv.release(h)
        link.close()


def daemon_side(sock: socket.socket, drv: Any,
                register: Callable[[list[MappedRegion], int], str] | None = None) -> None:
    """Receive the Attach and its descriptors, map, compare, write, register (``register``:
    NIXL on a GPU), and unmap once the engine is done. A failure goes back as
    ``{"error": ...}`` instead of the next answer the engine waits for."""
    link = _Link(sock)
    mapped: list[MappedRegion] = []
    try:
        msg, fds = link.recv()
        # a field missing: a count mismatch, and map_regions closes every descriptor
        mapped = map_regions(fds, msg.get("sizes", []), msg.get("offsets", []), int(msg.get("device", 0)), drv)
        for i, (m, n) in enumerate(zip(mapped, msg["nbytes"], strict=True)):
            got, want = drv.copy_out(m.address, n), pattern(i, n)
            if got != want:
                raise RuntimeError(f"region {i} reads other bytes than the engine wrote "
                                   f"({_first_difference(got, want)})")
        for i, (m, n) in enumerate(zip(mapped, msg["nbytes"], strict=True)):
            drv.copy_in(m.address, pattern(WRITE_TAG + i, n))
        link.send({"ok": register(mapped, int(msg["device"])) if register else "NIXL registration not asked"})
        done, _ = link.recv()
        if done.get("kind") != "Done":
            raise RuntimeError(f"expected Done, got {done}")
        unmap_regions(mapped, drv)  # empties ``mapped``
        link.send({"unmapped": True})
    except Exception as e:
        try:
            link.send({"error": f"{type(e).__name__}: {e}"})
        except OSError:
            pass  # the engine side is gone; it reports its own failure
    finally:
        if mapped:  # a failure after mapping: undo what is left, best effort (reported above)
            try:
                unmap_regions(mapped, drv)
            except Exception:
                pass
        link.close()
