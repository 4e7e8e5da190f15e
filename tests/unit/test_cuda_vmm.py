"""The CUDA driver behind the VMM export and import (kvpush.common.cuda_vmm) on a machine
without a GPU. libcuda cannot run here, so it is driven against a recorded fake libcuda
(kvpush_dev.fake_libcuda: the same function names and ctypes arguments, the driver's books
and refusals, memfd files as physical memory): what it calls, with what, in which order; each
failing call's CUresult named; and, with real descriptors over a real unix socket, the whole
``vmm`` step of scripts/gpu_check.sh (engine export, SCM_RIGHTS, daemon import and map) with
nothing left behind. The real driver is exercised only by that step on a GPU."""

from __future__ import annotations

import ctypes as C
import os
import socket
import threading

import pytest

from kvpush.common import cuda_vmm
from kvpush.common.cuda_vmm import SIGNATURES, CudaError, CudaVmm, load_libcuda
from kvpush.daemon.io.vmm_import import VmmImportError, map_regions, unmap_regions
from kvpush_dev.fake_libcuda import FakeLibcuda
from kvpush_dev.vmm_check import daemon_side, engine_side, pattern

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="memfd_create is Linux's")

G = 1 << 16  # the fake's granularity


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def names(lib: FakeLibcuda, start: int = 0) -> list[str]:
    return [n for n, _ in lib.calls[start:]]


def args_of(lib: FakeLibcuda, name: str) -> list[tuple]:
    return [a for n, a in lib.calls if n == name]


def test_structs_match_cuda_h():
    """cuda.h (CUDA 12/13, LP64): CUmemAllocationProp is 32 bytes with the pointer at 16 and
    allocFlags at 24; CUmemAccessDesc 12 bytes, flags at 8 (checked once with gcc against
    /usr/local/cuda-13.0/include/cuda.h)."""
    P, A = cuda_vmm.CUmemAllocationProp, cuda_vmm.CUmemAccessDesc
    assert (C.sizeof(P), P.location.offset, P.win32HandleMetaData.offset, P.allocFlags.offset) == (32, 8, 16, 24)
    assert (C.sizeof(A), A.flags.offset) == (12, 8)


def test_a_missing_driver_or_symbol_is_a_clear_error():
    with pytest.raises(CudaError, match="libkvpush-no-such.so.1 does not load.*no NVIDIA driver"):
        load_libcuda("libkvpush-no-such.so.1")
    with pytest.raises(CudaError, match="libc.so.6 has no cuGetErrorName"):
        load_libcuda("libc.so.6")  # a real library, not a driver


def test_construction_retains_the_primary_context_and_reads_the_granularity():
    lib = FakeLibcuda(devices=2)
    drv = CudaVmm(1, lib)
    assert names(lib) == ["cuInit", "cuDeviceGet", "cuDevicePrimaryCtxRetain", "cuCtxSetCurrent",
                          "cuMemGetAllocationGranularity"]
    assert drv.granularity == G and lib.ctx_refs == 1
    ((_, prop, option),) = args_of(lib, "cuMemGetAllocationGranularity")
    p = prop.contents
    assert (p.type, p.requestedHandleTypes, p.location.type, p.location.id, option) == (1, 1, 1, 1, 0)
    drv.close()
    drv.close()  # idempotent
    assert lib.ctx_refs == 0 and names(lib)[-1] == "cuDevicePrimaryCtxRelease_v2"
    with pytest.raises(CudaError, match="used after close"):
        drv.reserve(G)


def test_the_engine_and_daemon_call_sequences():
    lib = FakeLibcuda()
    drv = CudaVmm(0, lib)
    n0 = len(lib.calls)
    h = drv.create(2 * G)
    va = drv.reserve(2 * G)
    drv.map(va, 2 * G, h)
    drv.set_access(va, 2 * G, 0)
    drv.copy_in(va + 5, b"hello")
    fd = drv.export_fd(h)
    h2 = drv.import_fd(fd)
    os.close(fd)
    assert drv.copy_out(va + 5, 5) == b"hello"
    assert drv.mapped_range(va + G) == (va, 2 * G)
    h3 = drv.retain(va + 7)
    for x in (h3, h2):
        drv.release(x)
    drv.unmap(va, 2 * G)
    drv.free(va, 2 * G)
    drv.release(h)
    ops = [n for n in names(lib, n0) if n != "cuCtxSetCurrent"]
    assert ops == ["cuMemCreate", "cuMemAddressReserve", "cuMemMap", "cuMemSetAccess", "cuMemcpyHtoD_v2",
                   "cuCtxSynchronize", "cuMemExportToShareableHandle", "cuMemImportFromShareableHandle",
                   "cuMemcpyDtoH_v2", "cuMemGetAddressRange_v2", "cuMemRetainAllocationHandle",
                   "cuMemRelease", "cuMemRelease", "cuMemUnmap", "cuMemAddressFree", "cuMemRelease"]
    # every driver call is made with the context current first
    seq = names(lib, n0)
    assert all(seq[i - 1] == "cuCtxSetCurrent" for i, n in enumerate(seq)
               if n not in ("cuCtxSetCurrent", "cuCtxSynchronize"))
    ((_, size, prop, flags),) = args_of(lib, "cuMemCreate")
    assert (size, prop.contents.requestedHandleTypes, flags) == (2 * G, 1, 0)  # POSIX fd requested
    ((_, size, align, addr, flags),) = args_of(lib, "cuMemAddressReserve")
    assert (size, align, addr, flags) == (2 * G, G, 0, 0)
    assert args_of(lib, "cuMemMap") == [(va, 2 * G, 0, h, 0)]
    ((a_va, a_size, desc, count),) = args_of(lib, "cuMemSetAccess")
    d = desc.contents
    assert (a_va, a_size, d.location.type, d.location.id, d.flags, count) == (va, 2 * G, 1, 0, 3, 1)
    ((_, ex_h, ex_type, ex_flags),) = args_of(lib, "cuMemExportToShareableHandle")
    assert (ex_h, ex_type, ex_flags) == (h, 1, 0)
    ((_, im_fd, im_type),) = args_of(lib, "cuMemImportFromShareableHandle")
    assert (im_fd, im_type) == (fd, 1)  # the fd itself, not a pointer to it
    assert not lib.handles and not lib.maps and not lib.reserved
    drv.close()


def test_every_call_has_its_ctypes_signature_and_arity():
    """load_libcuda types exactly SIGNATURES; a call outside it would pass 64-bit addresses
    and sizes as 32-bit ints on the real driver."""
    lib = FakeLibcuda()
    drv = CudaVmm(0, lib)
    h = drv.create(G)
    va = drv.reserve(G)
    drv.map(va, G, h)
    drv.set_access(va, G, 0)
    drv.copy_in(va, b"x")
    drv.copy_out(va, 1)
    fd = drv.export_fd(h)
    drv.release(drv.import_fd(fd))
    os.close(fd)
    drv.release(drv.retain(va))
    drv.mapped_range(va)
    drv.unmap(va, G)
    drv.free(va, G)
    drv.release(h)
    drv.close()
    for name, args in lib.calls:
        assert name in SIGNATURES, name
        assert len(args) == len(SIGNATURES[name]), name
    assert {n for n, _ in lib.calls} == set(SIGNATURES) - {"cuGetErrorName"}


def test_each_failing_call_raises_with_its_cuda_error_name():
    lib = FakeLibcuda(fail={"cuInit": (3, False)})
    with pytest.raises(CudaError, match=r"^cuInit failed: CUDA_ERROR_NOT_INITIALIZED \(3\)$"):
        CudaVmm(0, lib)
    with pytest.raises(CudaError, match="cuDeviceGet failed: CUDA_ERROR_INVALID_VALUE"):
        CudaVmm(3, FakeLibcuda())
    lib = FakeLibcuda()
    drv = CudaVmm(0, lib)
    lib.fail["cuMemCreate"] = (2, False)
    with pytest.raises(CudaError, match=r"cuMemCreate failed: CUDA_ERROR_OUT_OF_MEMORY \(2\)") as ei:
        drv.create(G)
    assert (ei.value.call, ei.value.code, ei.value.name) == ("cuMemCreate", 2, "CUDA_ERROR_OUT_OF_MEMORY")
    lib.fail["cuMemExportToShareableHandle"] = (12345, False)
    h = drv.create(G)
    with pytest.raises(CudaError, match=r"cuMemExportToShareableHandle failed: CUresult 12345 \(unknown"):
        drv.export_fd(h)
    with pytest.raises(ValueError, match="multiples of the granularity"):
        drv.create(G + 1)
    with pytest.raises(CudaError, match="cuMemMap failed: CUDA_ERROR_INVALID_VALUE"):
        drv.map(0x1000, G, h)  # not reserved: the driver refuses, the error says so
    drv.release(h)
    drv.close()


def test_calls_from_another_thread_make_the_context_current():
    """Driver calls act on the calling thread's context; the daemon calls from its loop's
    thread, not necessarily the one that made the driver."""
    lib = FakeLibcuda()
    drv = CudaVmm(0, lib)
    out: list[object] = []
    t = threading.Thread(target=lambda: out.append(drv.create(G)))
    t.start()
    t.join(10)
    assert isinstance(out[0], int)
    drv.release(out[0])
    drv.close()


def test_vmm_import_over_the_ctypes_driver_unwinds_a_failed_map():
    before = open_fds()
    lib = FakeLibcuda()
    drv = CudaVmm(0, lib)
    hs = [drv.create(G) for _ in range(3)]
    fds = [drv.export_fd(h) for h in hs]
    lib.fail["cuMemSetAccess"] = (2, False)
    n0 = len(lib.calls)
    with pytest.raises(VmmImportError, match="cuMemSetAccess failed: CUDA_ERROR_OUT_OF_MEMORY"):
        map_regions(list(fds), [G] * 3, [0] * 3, 0, drv)
    ops = [n for n in names(lib, n0) if n not in ("cuCtxSetCurrent", "cuGetErrorName")]
    # a mapping whose access failed is unmapped before its range is freed (the driver frees
    # only unmapped ranges), then the import is released; the other two are never imported
    assert ops == ["cuMemImportFromShareableHandle", "cuMemAddressReserve", "cuMemMap", "cuMemSetAccess",
                   "cuMemUnmap", "cuMemAddressFree", "cuMemRelease"]
    assert not lib.maps and not lib.reserved and set(lib.handles) == set(hs)  # the import released
    fds = [drv.export_fd(h) for h in hs]
    mapped = map_regions(fds, [G] * 3, [0, 8, 16], 0, drv)
    assert [m.offset for m in mapped] == [0, 8, 16] and len(lib.maps) == 3
    unmap_regions(mapped, drv)
    for h in hs:
        drv.release(h)
    assert lib.live_allocations() == 0 and not lib.maps and not lib.reserved
    drv.close()
    assert open_fds() == before  # every descriptor closed, every memfd of the fake gone


def _run_step(lib: FakeLibcuda) -> tuple[str | BaseException, list[BaseException]]:
    """The vmm step's two sides as two threads over a socketpair, each with its own CudaVmm
    over one fake libcuda (one machine's driver)."""
    e, d = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    eng, dmn = CudaVmm(0, lib), CudaVmm(0, lib)
    errors: list[BaseException] = []

    def daemon() -> None:
        try:
            daemon_side(d, dmn)
        except BaseException as exc:  # the side must not raise: it answers the engine
            errors.append(exc)

    t = threading.Thread(target=daemon)
    t.start()
    try:
        result: str | BaseException = engine_side(e, eng)
    except Exception as exc:
        result = exc
    t.join(30)
    assert not t.is_alive()
    eng.close()
    dmn.close()
    return result, errors


def test_the_vmm_step_passes_end_to_end_and_leaves_nothing():
    before = open_fds()
    lib = FakeLibcuda()
    line, errors = _run_step(lib)
    assert not errors
    assert isinstance(line, str) and "offsets [0, 65536]" in line and "writes land" in line, line
    assert lib.live_allocations() == 0 and not lib.maps and not lib.reserved and lib.ctx_refs == 0
    assert names(lib).count("cuMemExportToShareableHandle") == 2
    assert names(lib).count("cuMemImportFromShareableHandle") == 2
    assert open_fds() == before


class _ReservationRange(FakeLibcuda):
    """A driver whose cuMemGetAddressRange answered the whole reserved range."""

    def _cuMemGetAddressRange_v2(self, pbase, psize, ptr):
        for va, size in self.reserved.items():
            if va <= ptr < va + size:
                pbase.contents.value, psize.contents.value = va, size
                return 0
        return 1


class _Scribbler(FakeLibcuda):
    """A driver whose import maps other memory (a fresh allocation): the bytes must catch it."""

    def _cuMemImportFromShareableHandle(self, p, fd, kind):
        return self._cuMemCreate(p, os.fstat(fd).st_size, C.pointer(_prop()), 0)


def _prop():
    p = cuda_vmm.CUmemAllocationProp()
    p.type, p.location.type = 1, 1
    return p


@pytest.mark.parametrize("lib, why", [
    (_ReservationRange(), "cuMemMap failed: CUDA_ERROR_INVALID_VALUE"),
    (_Scribbler(), "region 0 reads other bytes than the engine wrote"),
    (FakeLibcuda(fail={"cuMemImportFromShareableHandle": (2, False)}),
     "cuMemImportFromShareableHandle failed: CUDA_ERROR_OUT_OF_MEMORY"),
])
def test_the_vmm_step_fails_with_the_reason_and_leaves_nothing(lib, why):
    before = open_fds()
    result, errors = _run_step(lib)
    assert not errors
    assert isinstance(result, RuntimeError) and "daemon side" in str(result) and why in str(result), result
    assert lib.live_allocations() == 0 and not lib.maps and not lib.reserved
    assert open_fds() == before


def test_pattern_bytes_differ_per_region():
    assert pattern(0, 64) != pattern(1, 64) and len(pattern(7, 3)) == 3
