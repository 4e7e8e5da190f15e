"""A recorded stand-in for ``libcuda.so.1``'s VMM calls, for machines without a GPU.

libcuda cannot run here, so :class:`kvpush.common.cuda_vmm.CudaVmm` is tested against this
object: the same function names, called with the same ctypes arguments (pointers it writes
through), returning ``CUDA_SUCCESS`` or an error code. It keeps the books a driver keeps and
refuses what the driver refuses: calls before ``cuInit`` or without a current context on the
calling thread, sizes off the granularity, a map onto a range not reserved or of the wrong
size, an export of an allocation not created with the POSIX-fd handle type, unknown handles.
Physical allocations are memfd files, so an exported descriptor is a real descriptor that
crosses a unix socket and imports as the same memory, and copies move real bytes.

Every call is recorded in :attr:`FakeLibcuda.calls` as ``(name, args)``; :attr:`fail` makes a
named call return a given code (once, or every time). The one assumption that only a GPU
can check: ``cuMemGetAddressRange`` of an address in a VMM mapping answers that mapping (not
the whole reservation); ``scripts/gpu_check.sh``'s ``vmm`` step checks it.
"""

from __future__ import annotations

import ctypes as C
import mmap
import os
import threading
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ERRORS", "FakeLibcuda"]

CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_OUT_OF_MEMORY, CUDA_ERROR_NOT_INITIALIZED = 1, 2, 3
CUDA_ERROR_INVALID_CONTEXT, CUDA_ERROR_NOT_SUPPORTED = 201, 801
ERRORS = {CUDA_ERROR_INVALID_VALUE: b"CUDA_ERROR_INVALID_VALUE", CUDA_ERROR_OUT_OF_MEMORY: b"CUDA_ERROR_OUT_OF_MEMORY",
          CUDA_ERROR_NOT_INITIALIZED: b"CUDA_ERROR_NOT_INITIALIZED",
          CUDA_ERROR_INVALID_CONTEXT: b"CUDA_ERROR_INVALID_CONTEXT",
          CUDA_ERROR_NOT_SUPPORTED: b"CUDA_ERROR_NOT_SUPPORTED"}
_NO_CONTEXT_NEEDED = {"cuGetErrorName", "cuInit", "cuDeviceGet", "cuDevicePrimaryCtxRetain",
                      "cuDevicePrimaryCtxRelease_v2", "cuCtxSetCurrent"}


@dataclass
class _Alloc:
    fd: int
    mm: mmap.mmap
    size: int
    exportable: bool


@dataclass
class FakeLibcuda:
    devices: int = 1
    granularity: int = 1 << 16
    calls: list[tuple[str, tuple[Any, ...]]] = field(default_factory=list)
    fail: dict[str, tuple[int, bool]] = field(default_factory=dict)  # name -> (code, every time)
    initialized: bool = False
    ctx_refs: int = 0
    handles: dict[int, _Alloc] = field(default_factory=dict)
    reserved: dict[int, int] = field(default_factory=dict)  # va -> size
    maps: dict[int, tuple[int, _Alloc]] = field(default_factory=dict)  # va -> (size, allocation)
    _next: int = 1
    _next_va: int = 0x7_0000_0000_0000
    _tls: threading.local = field(default_factory=threading.local)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    _CTX = 0xC0DE  # the primary context's handle

    def __getattribute__(self, name: str) -> Any:
        """Every ``cu*`` attribute is a recorded call that checks the driver's preconditions."""
        if not name.startswith("cu"):
            return object.__getattribute__(self, name)
        impl = object.__getattribute__(self, "_" + name)

        def call(*args: Any) -> int:
            with self._lock:
                self.calls.append((name, args))
                if name in self.fail:
                    code, always = self.fail[name]
                    if not always:
                        del self.fail[name]
                    return code
                if name not in ("cuGetErrorName", "cuInit") and not self.initialized:
                    return CUDA_ERROR_NOT_INITIALIZED
                if name not in _NO_CONTEXT_NEEDED and getattr(self._tls, "ctx", None) != self._CTX:
                    return CUDA_ERROR_INVALID_CONTEXT
                return impl(*args)

        return call

    # ---- helpers ----------------------------------------------------------------------------

    def _new_handle(self, a: _Alloc) -> int:
        h, self._next = self._next, self._next + 1
        self.handles[h] = a
        return h

    def _mapping_at(self, ptr: int) -> tuple[int, int, _Alloc] | None:
        for va, (size, a) in self.maps.items():
            if va <= ptr < va + size:
                return va, size, a
        return None

    def live_allocations(self) -> int:
        """Allocations some handle or mapping still holds (the driver frees the rest)."""
        return len({id(a) for a in self.handles.values()} | {id(a) for _, a in self.maps.values()})

    def _drop_unheld(self, a: _Alloc) -> None:
        if all(x is not a for x in self.handles.values()) and all(x is not a for _, x in self.maps.values()):
            a.mm.close()
            os.close(a.fd)

    # ---- the calls (ctypes arguments as CudaVmm passes them) ----------------------------------

    def _cuGetErrorName(self, rc: int, p: Any) -> int:
        if rc not in ERRORS:
            return CUDA_ERROR_INVALID_VALUE
        p.contents.value = ERRORS[rc]
        return 0

    def _cuInit(self, flags: int) -> int:
        if flags != 0:
            return CUDA_ERROR_INVALID_VALUE
        self.initialized = True
        return 0

    def _cuDeviceGet(self, p: Any, ordinal: int) -> int:
        if not 0 <= ordinal < self.devices:
            return CUDA_ERROR_INVALID_VALUE  # the real driver says CUDA_ERROR_INVALID_DEVICE
        p.contents.value = ordinal
        return 0

    def _cuDevicePrimaryCtxRetain(self, p: Any, dev: int) -> int:
        self.ctx_refs += 1
        p.contents.value = self._CTX
        return 0

    def _cuDevicePrimaryCtxRelease_v2(self, dev: int) -> int:
        if self.ctx_refs <= 0:
            return CUDA_ERROR_INVALID_CONTEXT
        self.ctx_refs -= 1
        return 0

    def _cuCtxSetCurrent(self, ctx: Any) -> int:
        value = ctx.value if isinstance(ctx, C.c_void_p) else ctx
        if value != self._CTX or self.ctx_refs <= 0:
            return CUDA_ERROR_INVALID_CONTEXT
        self._tls.ctx = value
        return 0

    def _cuCtxSynchronize(self) -> int:
        return 0

    def _cuMemGetAllocationGranularity(self, p: Any, prop: Any, option: int) -> int:
        if prop.contents.type != 1 or prop.contents.location.type != 1:
            return CUDA_ERROR_INVALID_VALUE
        p.contents.value = self.granularity
        return 0

    def _cuMemCreate(self, p: Any, size: int, prop: Any, flags: int) -> int:
        pr = prop.contents
        if size <= 0 or size % self.granularity or flags or pr.type != 1 or pr.location.type != 1:
            return CUDA_ERROR_INVALID_VALUE
        fd = os.memfd_create("fake-cumem")
        os.ftruncate(fd, size)
        p.contents.value = self._new_handle(_Alloc(fd, mmap.mmap(fd, size), size, pr.requestedHandleTypes & 1 == 1))
        return 0

    def _cuMemExportToShareableHandle(self, p: Any, h: int, kind: int, flags: int) -> int:
        a = self.handles.get(h)
        if a is None or kind != 1 or flags:
            return CUDA_ERROR_INVALID_VALUE
        if not a.exportable:
            return CUDA_ERROR_NOT_SUPPORTED
        p.contents.value = os.dup(a.fd)
        return 0

    def _cuMemImportFromShareableHandle(self, p: Any, fd: int, kind: int) -> int:
        if kind != 1 or not isinstance(fd, int):
            return CUDA_ERROR_INVALID_VALUE
        try:
            ino = os.fstat(fd).st_ino
        except OSError:
            return CUDA_ERROR_INVALID_VALUE
        held = [a for a in self.handles.values()] + [a for _, a in self.maps.values()]
        a = next((a for a in held if os.fstat(a.fd).st_ino == ino), None)
        if a is None:
            return CUDA_ERROR_INVALID_VALUE
        p.contents.value = self._new_handle(a)
        return 0

    def _cuMemRetainAllocationHandle(self, p: Any, ptr: int) -> int:
        m = self._mapping_at(ptr)
        if m is None:
            return CUDA_ERROR_INVALID_VALUE
        p.contents.value = self._new_handle(m[2])
        return 0

    def _cuMemGetAddressRange_v2(self, pbase: Any, psize: Any, ptr: int) -> int:
        m = self._mapping_at(ptr)
        if m is None:
            return CUDA_ERROR_INVALID_VALUE  # the real driver: CUDA_ERROR_NOT_FOUND
        pbase.contents.value, psize.contents.value = m[0], m[1]
        return 0

    def _cuMemRelease(self, h: int) -> int:
        a = self.handles.pop(h, None)
        if a is None:
            return CUDA_ERROR_INVALID_VALUE
        self._drop_unheld(a)
        return 0

    def _cuMemAddressReserve(self, p: Any, size: int, align: int, addr: int, flags: int) -> int:
        if size <= 0 or size % self.granularity or align % self.granularity or addr or flags:
            return CUDA_ERROR_INVALID_VALUE
        va, self._next_va = self._next_va, self._next_va + size + self.granularity
        self.reserved[va] = size
        p.contents.value = va
        return 0

    def _cuMemAddressFree(self, va: int, size: int) -> int:
        if self.reserved.get(va) != size or any(va <= m < va + size for m in self.maps):
            return CUDA_ERROR_INVALID_VALUE
        del self.reserved[va]
        return 0

    def _cuMemMap(self, va: int, size: int, offset: int, h: int, flags: int) -> int:
        a = self.handles.get(h)
        inside = any(r <= va and va + size <= r + n for r, n in self.reserved.items())
        if a is None or offset or flags or size != a.size or not inside or self._mapping_at(va) \
                or self._mapping_at(va + size - 1):
            return CUDA_ERROR_INVALID_VALUE
        self.maps[va] = (size, a)
        return 0

    def _cuMemUnmap(self, va: int, size: int) -> int:
        m = self.maps.get(va)
        if m is None or m[0] != size:
            return CUDA_ERROR_INVALID_VALUE
        del self.maps[va]
        self._drop_unheld(m[1])
        return 0

    def _cuMemSetAccess(self, va: int, size: int, desc: Any, count: int) -> int:
        d = desc.contents
        if count != 1 or d.location.type != 1 or not 0 <= d.location.id < self.devices or d.flags != 3:
            return CUDA_ERROR_INVALID_VALUE
        at = va
        while at < va + size:  # the whole range must be mapped
            m = self._mapping_at(at)
            if m is None:
                return CUDA_ERROR_INVALID_VALUE
            at = m[0] + m[1]
        return 0

    def _span(self, ptr: int, n: int) -> tuple[_Alloc, int] | None:
        m = self._mapping_at(ptr)
        if m is None or ptr + n > m[0] + m[1]:
            return None
        return m[2], ptr - m[0]

    def _cuMemcpyHtoD_v2(self, dst: int, src: bytes, n: int) -> int:
        s = self._span(dst, n)
        if s is None or len(src) < n:
            return CUDA_ERROR_INVALID_VALUE
        s[0].mm[s[1]:s[1] + n] = src[:n]
        return 0

    def _cuMemcpyDtoH_v2(self, dst: Any, src: int, n: int) -> int:
        s = self._span(src, n)
        if s is None:
            return CUDA_ERROR_INVALID_VALUE
        C.memmove(dst, s[0].mm[s[1]:s[1] + n], n)
        return 0
