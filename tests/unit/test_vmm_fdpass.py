"""The VMM export path of docs/gpu-memory.md on CPU, with a fake driver whose physical
allocations are memfd files (shared memory, as a VMM chunk is): the engine exports each KV
region as a descriptor, the descriptors ride with their frame over a unix socket (SCM_RIGHTS,
kvpush.proto.fdpass), the daemon maps them, and a byte written on one side is read on the
other. Every descriptor is accounted for: none leaks, on success or on any refusal."""

from __future__ import annotations

import json
import mmap
import os
import socket
from dataclasses import dataclass, field

import pytest

from kvpush.daemon.io.vmm_import import VmmImportError, map_regions, unmap_regions
from kvpush.engine_plugin.worker.vmm_export import VmmExportError, export_regions
from kvpush.proto.fdpass import MAX_FDS_PER_MSG, FdQueue, FdsMissing, recv_some, send_frame_with_fds
from kvpush.proto.stream import Deframer

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="memfd_create is Linux's")


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@dataclass
class Chunk:
    fd: int
    size: int
    mm: mmap.mmap
    base: int
    refs: int = 1


@dataclass
class FakeEngine:
    """Physical chunks mapped into the 'engine': cuMemCreate + cuMemMap, played by memfd + mmap."""

    chunks: list[Chunk] = field(default_factory=list)
    released: int = 0

    def create(self, size: int) -> Chunk:
        fd = os.memfd_create("kv-chunk")
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size)
        import ctypes

        c = Chunk(fd, size, mm, ctypes.addressof(ctypes.c_char.from_buffer(mm)))
        self.chunks.append(c)
        return c

    def retain(self, ptr: int) -> Chunk:
        for c in self.chunks:
            if c.base <= ptr < c.base + c.size:
                c.refs += 1
                return c
        raise RuntimeError("CUDA_ERROR_INVALID_VALUE")

    def mapped_range(self, ptr: int) -> tuple[int, int]:
        c = next(c for c in self.chunks if c.base <= ptr < c.base + c.size)
        return c.base, c.size

    def export_fd(self, h: Chunk) -> int:
        return os.dup(h.fd)

    def release(self, h: Chunk) -> None:
        h.refs -= 1
        self.released += 1

    def close(self) -> None:
        for c in self.chunks:
            c.mm.close()
            os.close(c.fd)


@dataclass
class FakeDaemonDriver:
    """cuMemImportFromShareableHandle / cuMemAddressReserve / cuMemMap, played by dup + mmap."""

    maps: dict[int, mmap.mmap] = field(default_factory=dict)
    handles: set[int] = field(default_factory=set)
    next_va: int = 0x7F00_0000_0000
    fail_map_at: int | None = None
    mapped: int = 0

    def import_fd(self, fd: int) -> int:
        h = os.dup(fd)  # the imported handle outlives the descriptor, as the driver's does
        self.handles.add(h)
        return h

    def reserve(self, size: int) -> int:
        va, self.next_va = self.next_va, self.next_va + (1 << 30)
        return va

    def map(self, va: int, size: int, h: int) -> None:
        if self.fail_map_at is not None and self.mapped == self.fail_map_at:
            raise RuntimeError("CUDA_ERROR_OUT_OF_MEMORY")
        self.maps[va] = mmap.mmap(h, size)
        self.mapped += 1

    def set_access(self, va: int, size: int, device: int) -> None:
        assert device == 0

    def unmap(self, va: int, size: int) -> None:
        self.maps.pop(va).close()

    def free(self, va: int, size: int) -> None:
        pass

    def release(self, h: int) -> None:
        self.handles.remove(h)
        os.close(h)


def receive(sock: socket.socket, fdq: FdQueue, frames: int) -> list[tuple[dict, list[int]]]:
    """The daemon's reader: bytes into frames, descriptors into the queue; each frame takes
    the count it declares once whole."""
    de = Deframer(1 << 20)
    got: list[tuple[dict, list[int]]] = []
    while len(got) < frames:
        data = recv_some(sock, 7, fdq)  # small reads: frames and descriptors split across them
        assert data, "peer closed"
        for f in de.feed(data):
            msg = json.loads(f)
            got.append((msg, fdq.take(msg["fds"])))
    return got


def test_regions_cross_as_descriptors_and_map_the_same_memory():
    before = open_fds()
    eng, drv = FakeEngine(), FakeDaemonDriver()
    a, b = eng.create(1 << 16), eng.create(1 << 16)
    regions = [(a.base, 1 << 16), (b.base + 4096, 1 << 15)]  # the second starts inside its chunk
    a.mm[:5] = b"layer"
    b.mm[4096:4101] = b"KVKVK"
    exported = export_regions(regions, eng)
    assert eng.released == 2 and all(c.refs == 1 for c in eng.chunks)  # retain's references dropped
    e, d = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    fdq = FdQueue(bound=64)
    try:
        attach = {"kind": "Attach", "fds": 2, "sizes": [r.size for r in exported],
                  "offsets": [r.offset for r in exported]}
        send_frame_with_fds(e, json.dumps({"kind": "Heartbeat", "fds": 0}).encode(), [])
        send_frame_with_fds(e, json.dumps(attach).encode(), [r.fd for r in exported])
        send_frame_with_fds(e, json.dumps({"kind": "Heartbeat", "fds": 0}).encode(), [])
        for r in exported:
            os.close(r.fd)  # the engine's copies, once sent
        (hb, none1), (msg, fds), (_, none2) = receive(d, fdq, 3)
        assert hb["kind"] == "Heartbeat" and none1 == none2 == [] and len(fds) == 2
        mapped = map_regions(fds, msg["sizes"], msg["offsets"], 0, drv)
        assert [m.offset for m in mapped] == [0, 4096]
        va0, va1 = mapped[0].va, mapped[1].va
        assert drv.maps[va0][:5] == b"layer" and drv.maps[va1][4096:4101] == b"KVKVK"
        drv.maps[va1][4096:4101] = b"WRITE"  # the daemon's WRITE lands in the engine's block
        assert b.mm[4096:4101] == b"WRITE"
        unmap_regions(mapped, drv)
        assert not drv.maps and not drv.handles and len(fdq) == 0
    finally:
        e.close()
        d.close()
        eng.close()
    assert open_fds() == before


def test_more_descriptors_than_one_message_carries():
    before = open_fds()
    src = os.memfd_create("one")
    fds = [os.dup(src) for _ in range(MAX_FDS_PER_MSG + 47)]
    e, d = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    fdq = FdQueue(bound=1024)
    try:
        send_frame_with_fds(e, json.dumps({"fds": len(fds)}).encode(), fds)
        for fd in fds:
            os.close(fd)
        ((_, got),) = receive(d, fdq, 1)
        assert len(got) == MAX_FDS_PER_MSG + 47
        for fd in got:
            os.close(fd)
    finally:
        e.close()
        d.close()
        os.close(src)
    assert open_fds() == before


def test_a_frame_short_of_its_descriptors_or_too_many_pending_is_refused_and_closed():
    before = open_fds()
    src = os.memfd_create("x")
    e, d = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        fdq = FdQueue(bound=64)
        send_frame_with_fds(e, json.dumps({"fds": 3}).encode(), [src, src])  # declares 3, sends 2
        with pytest.raises(FdsMissing, match="declared 3"):
            receive(d, fdq, 1)
        assert len(fdq) == 0
        fdq = FdQueue(bound=4)
        send_frame_with_fds(e, json.dumps({"fds": 0}).encode(), [src] * 5)  # a flood no frame takes
        with pytest.raises(FdsMissing, match="pending"):
            receive(d, fdq, 1)
        assert len(fdq) == 0
    finally:
        e.close()
        d.close()
        os.close(src)
    assert open_fds() == before


def test_a_region_over_two_chunks_is_refused_and_nothing_leaks():
    before = open_fds()
    eng = FakeEngine()
    a = eng.create(1 << 16)
    try:
        with pytest.raises(VmmExportError, match="more than one physical allocation"):
            export_regions([(a.base, 1 << 12), (a.base + 4096, 1 << 16)], eng)
        assert a.refs == 1  # every retain released, the first region's descriptor closed
    finally:
        eng.close()
    assert open_fds() == before


def test_a_failed_map_unwinds_and_closes_every_descriptor():
    before = open_fds()
    eng, drv = FakeEngine(), FakeDaemonDriver(fail_map_at=1)
    chunks = [eng.create(1 << 14) for _ in range(3)]
    try:
        exported = export_regions([(c.base, 1 << 14) for c in chunks], eng)
        with pytest.raises(VmmImportError, match="OUT_OF_MEMORY"):
            map_regions([r.fd for r in exported], [r.size for r in exported], [0, 0, 0], 0, drv)
        assert not drv.maps and not drv.handles  # the first mapping undone, the second's import released
        with pytest.raises(VmmImportError, match="2 descriptors for 3"):
            map_regions([os.dup(chunks[0].fd), os.dup(chunks[1].fd)], [1, 2, 3], [0, 0, 0], 0, drv)
    finally:
        eng.close()
    assert open_fds() == before
