"""The CUDA driver's virtual memory calls (VMM), through ctypes over ``libcuda.so.1``.

The real driver behind docs/gpu-memory.md's VMM path: :class:`CudaVmm` is both the engine's
export driver (``engine_plugin.worker.vmm_export.VmmExportDriver``) and the daemon's import
driver (``daemon.io.vmm_import.VmmImportDriver``), plus what a check needs to make and fill
such memory itself (create, copy in and out). It lives in ``common`` because both roles use
it; it imports no role and no torch. ``libcuda`` is loaded only when a :class:`CudaVmm` is
made, never at import, so CPU machines import this module freely.

Every failing call raises :class:`CudaError` naming the call and its CUresult (from
``cuGetErrorName``). Types and values follow cuda.h (CUDA 12/13, LP64): ``CUdeviceptr`` and
``CUmemGenericAllocationHandle`` are ``unsigned long long``, enums are ``int``, and the
``_v2`` symbols are the ones cuda.h's macros name. Built and tested on CPU against a
recorded fake libcuda; only ``scripts/gpu_check.sh``'s ``vmm`` step runs it on a driver.
"""

from __future__ import annotations

import ctypes as C
from typing import Any

__all__ = ["SIGNATURES", "CudaError", "CudaVmm", "load_libcuda"]

CUDA_SUCCESS = 0
CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 0x1
CU_MEM_ALLOCATION_TYPE_PINNED = 0x1
CU_MEM_LOCATION_TYPE_DEVICE = 0x1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 0x3
CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0x0


class CUmemLocation(C.Structure):
    _fields_ = [("type", C.c_int), ("id", C.c_int)]


class CUmemAllocFlags(C.Structure):
    _fields_ = [("compressionType", C.c_ubyte), ("gpuDirectRDMACapable", C.c_ubyte),
                ("usage", C.c_ushort), ("reserved", C.c_ubyte * 4)]


class CUmemAllocationProp(C.Structure):
    _fields_ = [("type", C.c_int), ("requestedHandleTypes", C.c_int), ("location", CUmemLocation),
                ("win32HandleMetaData", C.c_void_p), ("allocFlags", CUmemAllocFlags)]


class CUmemAccessDesc(C.Structure):
    _fields_ = [("location", CUmemLocation), ("flags", C.c_int)]


_u64, _sz, _p = C.c_ulonglong, C.c_size_t, C.POINTER

# Every symbol this module calls, with cuda.h's parameter types (ctypes would otherwise pass
# Python ints as 32-bit C ints and cut addresses and sizes).
SIGNATURES: dict[str, tuple[Any, ...]] = {
    "cuGetErrorName": (C.c_int, _p(C.c_char_p)),
    "cuInit": (C.c_uint,),
    "cuDeviceGet": (_p(C.c_int), C.c_int),
    "cuDevicePrimaryCtxRetain": (_p(C.c_void_p), C.c_int),
    "cuDevicePrimaryCtxRelease_v2": (C.c_int,),
    "cuCtxSetCurrent": (C.c_void_p,),
    "cuCtxSynchronize": (),
    "cuMemGetAllocationGranularity": (_p(_sz), _p(CUmemAllocationProp), C.c_int),
    "cuMemCreate": (_p(_u64), _sz, _p(CUmemAllocationProp), _u64),
    # void *shareableHandle: for a POSIX fd, an int the driver writes
    "cuMemExportToShareableHandle": (_p(C.c_int), _u64, C.c_int, _u64),
    # void *osHandle: for a POSIX fd, the fd itself cast to a pointer (not a pointer to it)
    "cuMemImportFromShareableHandle": (_p(_u64), C.c_void_p, C.c_int),
    "cuMemRetainAllocationHandle": (_p(_u64), C.c_void_p),
    "cuMemGetAddressRange_v2": (_p(_u64), _p(_sz), _u64),
    "cuMemRelease": (_u64,),
    "cuMemAddressReserve": (_p(_u64), _sz, _sz, _u64, _u64),
    "cuMemAddressFree": (_u64, _sz),
    "cuMemMap": (_u64, _sz, _sz, _u64, _u64),
    "cuMemUnmap": (_u64, _sz),
    "cuMemSetAccess": (_u64, _sz, _p(CUmemAccessDesc), _sz),
    "cuMemcpyHtoD_v2": (_u64, C.c_void_p, _sz),
    "cuMemcpyDtoH_v2": (C.c_void_p, _u64, _sz),
}


class CudaError(RuntimeError):
    """A driver call failed (or the driver is not there): ``call`` and the CUresult's name."""

    def __init__(self, call: str, code: int | None, name: str) -> None:
        self.call, self.code, self.name = call, code, name
        super().__init__(f"{call} failed: {name}" + ("" if code is None else f" ({code})"))


def load_libcuda(path: str = "libcuda.so.1") -> Any:
    """The driver library with every symbol of :data:`SIGNATURES` typed; a clear error if it
    does not load or lacks a symbol (VMM export needs a driver of CUDA 11.0 or newer)."""
    try:
        lib = C.CDLL(path)
    except OSError as e:
        raise CudaError("dlopen", None, f"{path} does not load ({e}): no NVIDIA driver here") from e
    for name, argtypes in SIGNATURES.items():
        try:
            fn = getattr(lib, name)
        except AttributeError as e:
            raise CudaError("dlsym", None, f"{path} has no {name} (a driver too old for VMM export)") from e
        fn.argtypes, fn.restype = list(argtypes), C.c_int
    return lib


class CudaVmm:
    """VMM allocations on one device, in this process, through the device's primary context
    (the one torch and the CUDA runtime use, so memory is shared with them).

    ``lib``: the driver (default :func:`load_libcuda`); tests pass a recorded fake."""

    def __init__(self, device: int = 0, lib: Any = None) -> None:
        self._lib = lib if lib is not None else load_libcuda()
        self.device = device
        self._call("cuInit", 0)
        dev = C.c_int()
        self._call("cuDeviceGet", C.pointer(dev), device)
        self._dev = dev.value
        self._ctx = C.c_void_p()
        self._call("cuDevicePrimaryCtxRetain", C.pointer(self._ctx), self._dev)
        self._closed = False
        g = _sz()
        self._current()
        self._call("cuMemGetAllocationGranularity", C.pointer(g), C.pointer(self._prop()),
                   CU_MEM_ALLOC_GRANULARITY_MINIMUM)
        self.granularity: int = g.value  # sizes and alignments of VMM allocations are multiples

    # ---- plumbing ---------------------------------------------------------------------------

    def _call(self, name: str, *args: Any) -> None:
        rc = getattr(self._lib, name)(*args)
        if rc != CUDA_SUCCESS:
            raise CudaError(name, rc, self._error_name(rc))

    def _error_name(self, rc: int) -> str:
        s = C.c_char_p()
        try:
            ok = self._lib.cuGetErrorName(rc, C.pointer(s)) == CUDA_SUCCESS and s.value
        except Exception:  # the name is a courtesy; the code is the fact
            ok = False
        return s.value.decode() if ok and s.value else f"CUresult {rc} (unknown to cuGetErrorName)"

    def _current(self) -> None:
        """Driver calls act on the calling thread's current context: make it ours."""
        if self._closed:
            raise CudaError("CudaVmm", None, "used after close()")
        self._call("cuCtxSetCurrent", self._ctx)

    def _prop(self) -> CUmemAllocationProp:
        p = CUmemAllocationProp()
        p.type = CU_MEM_ALLOCATION_TYPE_PINNED
        p.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        p.location.type = CU_MEM_LOCATION_TYPE_DEVICE
        p.location.id = self._dev
        return p

    def _aligned(self, size: int) -> None:
        if size <= 0 or size % self.granularity:
            raise ValueError(f"{size} bytes: VMM sizes are positive multiples of the granularity "
                             f"({self.granularity} bytes)")

    # ---- allocations (the engine's side; vLLM does this for its KV cache) ---------------------

    def create(self, size: int) -> int:
        """A physical allocation exportable as a POSIX fd (cuMemCreate); its handle."""
        self._aligned(size)
        self._current()
        h = _u64()
        self._call("cuMemCreate", C.pointer(h), size, C.pointer(self._prop()), 0)
        return h.value

    def export_fd(self, handle: int) -> int:
        """A new descriptor of the allocation, the caller's to send and close."""
        self._current()
        fd = C.c_int(-1)
        self._call("cuMemExportToShareableHandle", C.pointer(fd), handle,
                   CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)
        return fd.value

    def retain(self, ptr: int) -> int:
        """The allocation mapped at ``ptr`` (one more reference: :meth:`release` it)."""
        self._current()
        h = _u64()
        self._call("cuMemRetainAllocationHandle", C.pointer(h), ptr)
        return h.value

    def mapped_range(self, ptr: int) -> tuple[int, int]:
        """Start and size of the mapping ``ptr`` lies in (cuMemGetAddressRange)."""
        self._current()
        base, size = _u64(), _sz()
        self._call("cuMemGetAddressRange_v2", C.pointer(base), C.pointer(size), ptr)
        return base.value, size.value

    # ---- import and mapping (the daemon's side) ------------------------------------------------

    def import_fd(self, fd: int) -> int:
        """The allocation a descriptor names; the descriptor stays the caller's to close."""
        self._current()
        h = _u64()
        self._call("cuMemImportFromShareableHandle", C.pointer(h), fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        return h.value

    def reserve(self, size: int) -> int:
        """A free virtual range of ``size`` bytes, aligned to the granularity."""
        self._aligned(size)
        self._current()
        va = _u64()
        self._call("cuMemAddressReserve", C.pointer(va), size, self.granularity, 0, 0)
        return va.value

    def map(self, va: int, size: int, handle: int) -> None:
        """Map the allocation (from its first byte) at ``va``."""
        self._current()
        self._call("cuMemMap", va, size, 0, handle, 0)

    def set_access(self, va: int, size: int, device: int) -> None:
        """Read-write access from ``device`` (a mapping is inaccessible until this)."""
        self._current()
        d = CUmemAccessDesc()
        d.location.type = CU_MEM_LOCATION_TYPE_DEVICE
        d.location.id = device
        d.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._call("cuMemSetAccess", va, size, C.pointer(d), 1)

    def unmap(self, va: int, size: int) -> None:
        self._current()
        self._call("cuMemUnmap", va, size)

    def free(self, va: int, size: int) -> None:
        self._current()
        self._call("cuMemAddressFree", va, size)

    def release(self, handle: int) -> None:
        """Drop one reference; the memory goes once no handle and no mapping holds it."""
        self._current()
        self._call("cuMemRelease", handle)

    # ---- bytes in and out (checks) -----------------------------------------------------------

    def copy_in(self, va: int, data: bytes) -> None:
        """Write ``data`` at ``va``, complete on the device when this returns (a pageable
        host-to-device copy may return before its DMA ends: synchronize)."""
        self._current()
        self._call("cuMemcpyHtoD_v2", va, data, len(data))
        self._call("cuCtxSynchronize")

    def copy_out(self, va: int, n: int) -> bytes:
        self._current()
        buf = C.create_string_buffer(n)
        self._call("cuMemcpyDtoH_v2", buf, va, n)
        return buf.raw

    def close(self) -> None:
        """Release the primary context this object retained (idempotent)."""
        if not self._closed:
            self._closed = True
            self._call("cuDevicePrimaryCtxRelease_v2", self._dev)
