"""Mapping an engine's VMM KV memory from the descriptors it sent (designed; not enabled yet).

The daemon's half of docs/gpu-memory.md: each descriptor an Attach brought
(:mod:`kvpush.proto.fdpass`) is imported, mapped into a range this process reserves, and
given read-write access on the device; NIXL then registers that range as VRAM. Every
descriptor is closed once imported (the imported handle keeps the memory), and a failure
unwinds whatever was mapped. :class:`VmmImportDriver` is the CUDA driver API
(cuMemImportFromShareableHandle, cuMemAddressReserve, cuMemMap, cuMemSetAccess and their
inverses: :class:`kvpush.common.cuda_vmm.CudaVmm`, run on a GPU only by
``scripts/gpu_check.sh``'s ``vmm`` step); the unit tests use fakes whose allocations are
memfd files.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["MappedRegion", "VmmImportDriver", "VmmImportError", "map_regions", "unmap_regions"]


class VmmImportError(RuntimeError):
    """A descriptor could not be mapped: the Attach is refused."""


class VmmImportDriver(Protocol):
    def import_fd(self, fd: int) -> Any: ...
    def reserve(self, size: int) -> int: ...
    def map(self, va: int, size: int, handle: Any) -> None: ...
    def set_access(self, va: int, size: int, device: int) -> None: ...
    def unmap(self, va: int, size: int) -> None: ...
    def free(self, va: int, size: int) -> None: ...
    def release(self, handle: Any) -> None: ...


@dataclass
class MappedRegion:
    va: int  # where the allocation is mapped in this process
    size: int
    offset: int  # the region's start inside the allocation: its address is va + offset
    handle: Any

    @property
    def address(self) -> int:
        return self.va + self.offset


def map_regions(fds: list[int], sizes: list[int], offsets: list[int], device: int,
                driver: VmmImportDriver) -> list[MappedRegion]:
    """Map every descriptor (closing each); on any failure unmap what was mapped, close the
    rest, and raise."""
    if not (len(fds) == len(sizes) == len(offsets)):
        for fd in fds:
            os.close(fd)
        raise VmmImportError(f"{len(fds)} descriptors for {len(sizes)} regions")
    done: list[MappedRegion] = []
    try:
        for i, (fd, size, offset) in enumerate(zip(fds, sizes, offsets, strict=True)):
            try:
                h = driver.import_fd(fd)
            finally:
                os.close(fd)
                fds[i] = -1
            va, is_mapped = None, False
            try:
                va = driver.reserve(size)
                driver.map(va, size, h)
                is_mapped = True
                driver.set_access(va, size, device)
            except BaseException:  # undo in reverse: a range is freed only once unmapped
                if is_mapped:
                    driver.unmap(va, size)
                if va is not None:
                    driver.free(va, size)
                driver.release(h)
                raise
            done.append(MappedRegion(va, size, offset, h))
    except BaseException as e:
        for fd in fds:
            if fd >= 0:
                os.close(fd)
        unmap_regions(done, driver)
        if isinstance(e, VmmImportError):
            raise
        raise VmmImportError(f"mapping the engine's VMM memory failed: {e}") from e
    return done


def unmap_regions(regions: list[MappedRegion], driver: VmmImportDriver) -> None:
    """Detach: only once no WRITE reads them (the caller's fence)."""
    for r in reversed(regions):
        driver.unmap(r.va, r.size)
        driver.free(r.va, r.size)
        driver.release(r.handle)
    regions.clear()
